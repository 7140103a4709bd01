"""The routed-experts block with its gated shared expert.

Shape legend: T tokens (flattened batch x sequence, local to a shard), D model, E experts (global),
G experts held by this shard, F expert hidden, S shared hidden, k experts per token, M = T * k
routed rows, n the expert-parallel ranks a token set is gathered over.

Routing: softmax router in float32, top-k, optional renormalisation. The sparse path is
dropless sort-and-group: rows sorted by expert, grouped matmuls over contiguous groups, unsorted
and summed per token (a gather, not a scatter-add, so the sum order is fixed). The dense path runs
every expert on every token and is the reference (always with every expert weight gathered).

Three ways the sparse path runs, chosen once per trace from the config and the mesh:
- `sparse_experts`: the default program (no lever, no buffer, xla backend, one expert rank);
  the xla grouped matmul chosen per platform (jax.lax.ragged_dot on GPU/TPU; on CPU row tiles,
  where `tiled_experts` runs the same sums end to end in the tile layout), weights gathered to
  every shard. A CPU decode step (one token per row, a few routed rows per expert) runs
  `every_expert_rows` where it computes fewer rows than the tiles would.
- `grouped_experts`: the kernel family (hybridmoe.kernels.gmm) with the MoE levers, an optional
  per-expert buffer (moe.capacity_factor) and expert-sharded groups (group_offset).
- ring of experts (mesh's "exp" axes > 1): tokens, routing weights and expert ids are
  all-gathered over the expert axes the tokens are sharded on, each rank runs its G = E / n local
  experts on the gathered rows (the others' rows come out zero), and the partial outputs are
  reduce-scattered back (psum over expert axes the tokens are replicated on).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from hybridmoe.config.schema import GmmKernelConfig, KernelsConfig, ModelConfig, MoEConfig, QuantConfig
from hybridmoe.kernels import gmm as K
from hybridmoe.model import moe_align, scopes
from hybridmoe.parallel.rules import logical_to_spec, mesh_axes_of
from hybridmoe.quant.gmm_fp8 import gmm_fp8


def route(router_DE, x_TD, m: ModelConfig, replay_idx_Tk=None):
    """Top-k experts and their weights (float32) per token. With replay_idx_Tk (routing replay: the
    experts the sampler chose), those experts, weighted by the current router's probabilities of
    them (so the router still learns); without a flip, the same numbers as top-k gives."""
    logits_TE = jnp.einsum("td,de->te", x_TD, router_DE.astype(x_TD.dtype), preferred_element_type=jnp.float32)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    if replay_idx_Tk is None:
        w_Tk, idx_Tk = jax.lax.top_k(probs_TE, m.num_experts_per_tok)
    else:
        idx_Tk = replay_idx_Tk.astype(jnp.int32)
        w_Tk = jnp.take_along_axis(probs_TE, idx_Tk, axis=-1)
    if m.norm_topk_prob:
        w_Tk = w_Tk / jnp.sum(w_Tk, axis=-1, keepdims=True)
    return w_Tk, idx_Tk, probs_TE


def swiglu(h_M2F):
    gate, up = jnp.split(h_M2F, 2, axis=-1)
    gate = checkpoint_name(gate, "moe_gate")
    up = checkpoint_name(up, "moe_up")
    return jax.nn.silu(gate) * up


# The dispatch's two row moves: rows [R, D] of the tokens in expert order (buffer_R: the first R of
# order_M, the (token, slot) rows sorted by expert; R = M = T k unless a capacity drops some), and
# the combine, each token's k rows of the grouped MLP's [M, D] output read at inverse_M =
# argsort(order_M) and summed (moe_align.slot_sum). Autodiff makes each backward a scatter-add;
# moe.gather_backward writes both as gathers (docs/levers.md): the same sums, no scatter. Each is
# the other's backward.


def _token_rows(x_TD, buffer_R, inverse_M, k: int, gather_backward: bool):
    """x_TD[buffer_R // k]: each (token, slot) row of buffer_R, a copy of its token's row."""
    return _token_rows_gathered(x_TD, buffer_R, inverse_M, k) if gather_backward else x_TD[buffer_R // k]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_rows_gathered(x_TD, buffer_R, inverse_M, k):
    return x_TD[buffer_R // k]


def _token_rows_fwd(x_TD, buffer_R, inverse_M, k):
    return x_TD[buffer_R // k], (buffer_R, inverse_M)


def _token_rows_bwd(k, res, g_RD):
    # A token's gradient is the sum of its k rows' gradients: the rows put back in (token, slot)
    # order (dropped rows as zeros), then summed over the slots in float32.
    buffer_R, inverse_M = res
    M, (R, D) = inverse_M.shape[0], g_RD.shape
    if R < M:
        g_RD = jnp.concatenate([g_RD, jnp.zeros((M - R, D), g_RD.dtype)])
    return moe_align.slot_sum(g_RD, inverse_M, k), None, None


# Looked up when traced (tests/broken_variants.py patches them).
_token_rows_gathered.defvjp(lambda *a: _token_rows_fwd(*a), lambda *a: _token_rows_bwd(*a))


def _combine(y_MD, order_M, inverse_M, k: int, gather_backward: bool):
    """[T, D]: the expert-ordered rows' sums per token (moe_align.slot_sum: token t's slot j is
    y_MD[inverse_M[t k + j]])."""
    if gather_backward:
        return _combine_gathered(y_MD, order_M, inverse_M, k)
    return moe_align.slot_sum(y_MD, inverse_M, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_gathered(y_MD, order_M, inverse_M, k):
    return moe_align.slot_sum(y_MD, inverse_M, k)


def _combine_fwd(y_MD, order_M, inverse_M, k):
    return moe_align.slot_sum(y_MD, inverse_M, k), order_M


def _combine_bwd(k, order_M, g_TD):
    return g_TD[order_M // k], None, None  # row j of y is (token, slot) order[j]: dy[j] = g[order[j] // k]


_combine_gathered.defvjp(lambda *a: _combine_fwd(*a), lambda *a: _combine_bwd(*a))


def sparse_experts(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD, grouped_dot=jax.lax.ragged_dot, gather_backward=False):
    """Dropless sort-and-group dispatch through grouped matmuls (`grouped_dot(lhs, rhs, sizes)`)."""
    T, k = idx_Tk.shape
    E = wi_ED2F.shape[0]
    flat_e = idx_Tk.reshape(-1)
    order_M = jnp.argsort(flat_e, stable=True)
    inverse_M = jnp.argsort(order_M)
    group_sizes_E = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    x_MD = _token_rows(x_TD, order_M, inverse_M, k, gather_backward)
    dt = x_TD.dtype
    h_M2F = grouped_dot(x_MD, wi_ED2F.astype(dt), group_sizes_E)
    a_MF = swiglu(h_M2F)
    y_MD = grouped_dot(a_MF, wo_EFD.astype(dt), group_sizes_E)
    w_M = w_Tk.reshape(-1)[order_M]
    y_MD = (y_MD.astype(jnp.float32) * w_M[:, None]).astype(dt)
    return _combine(y_MD, order_M, inverse_M, k, gather_backward).astype(dt)


def tiled_experts(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD, tile_rows: int):
    """The default program where the grouped matmul is row tiles (CPU): `sparse_experts`' result,
    with the rows kept in the padded tile layout from the first matmul to the last and a backward
    of gathers and matmuls (kernels/gmm/row_tiles.routed_swiglu_mlp)."""
    dt = x_TD.dtype
    # Marked per-device like the grouped matmul's operands (see default_grouped_dot).
    x_TD, w_Tk, wi_ED2F, wo_EFD = _vary_alike(x_TD, w_Tk, wi_ED2F.astype(dt), wo_EFD.astype(dt))
    return K.routed_swiglu_mlp(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD, rows_per_tile=tile_rows)


def every_expert_rows(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD):
    """`sparse_experts`' result for a few tokens (a decode step): every expert on every token as two
    batched matmuls over the experts' weights in place (no sort, no gathered weights), then each
    token's k routed rows taken and combined as `sparse_experts` combines them (weighted in float32,
    summed over the k slots in order). Costs T * E rows of matmul; see `every_expert_is_cheaper`."""
    T, k = idx_Tk.shape
    dt = x_TD.dtype
    h_ET2F = jnp.einsum("td,edf->etf", x_TD, wi_ED2F.astype(dt))
    y_ETD = jnp.einsum("etf,efd->etd", swiglu(h_ET2F), wo_EFD.astype(dt))
    y_TkD = y_ETD[idx_Tk, jnp.arange(T, dtype=jnp.int32)[:, None]]
    y_TkD = (y_TkD.astype(jnp.float32) * w_Tk[..., None]).astype(dt)
    return jnp.sum(y_TkD.astype(jnp.float32), axis=1).astype(dt)


def every_expert_is_cheaper(num_tokens: int, k: int, num_experts: int, tile_rows: int) -> bool:
    """Whether `every_expert_rows` computes no more rows than the row-tile grouped matmul's padded
    layout (ceil(T k / R) + E tiles of R rows, each also gathering its expert's weights): true for
    the few tokens of a decode step. benchmarks/decode_moe.py times both at `small`'s MoE layer over
    8..512 tokens (record decode_moe.json, shown in docs/performance.md)."""
    tiles = -(-num_tokens * k // tile_rows) + num_experts
    return num_tokens * num_experts <= tiles * tile_rows


def dense_experts(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD):
    """Every expert on every token, weighted by the (mostly zero) dense routing matrix."""
    E = wi_ED2F.shape[0]
    dt = x_TD.dtype
    combine_TE = jnp.sum(jax.nn.one_hot(idx_Tk, E, dtype=jnp.float32) * w_Tk[..., None], axis=1)
    h_ET2F = jnp.einsum("td,edf->etf", x_TD, wi_ED2F.astype(dt))
    y_ETD = jnp.einsum("etf,efd->etd", swiglu(h_ET2F), wo_EFD.astype(dt))
    return jnp.einsum("etd,te->td", y_ETD.astype(jnp.float32), combine_TE).astype(dt)


def shared_expert(p, x_TD):
    dt = x_TD.dtype
    a = swiglu(x_TD @ p["shared_wi"].astype(dt))
    y = a @ p["shared_wo"].astype(dt)
    gate_T = jax.nn.sigmoid((x_TD @ p["shared_gate"].astype(dt)).astype(jnp.float32))
    return (y.astype(jnp.float32) * gate_T[:, None]).astype(dt)


@dataclasses.dataclass(frozen=True)
class GroupedPlan:
    """Static choices of the grouped-matmul path (from moe.* and kernels.gmm.*)."""

    num_experts: int
    capacity_factor: float = 0.0
    wi_fused_swiglu: bool = False
    wo_fused_dswiglu: bool = False
    router_grad_from_wo_input: bool = False
    backend: str = "xla"
    tiles: K.KernelTiles | None = None  # each grouped matmul's (explicit or auto tiling); None = the kernels' defaults
    interpret: bool = False
    epilogue: str = "float32"
    tile_n_per_half: int | None = None
    rhs_buffer_count: int = 0
    fp8: bool = False
    xla_impl: str = "ragged_dot"
    xla_tile_rows: int = 128
    token_chunks: int = 1
    gather_backward: bool = False
    align_rows: int = 0  # moe.group_align_rows: each local expert's rows padded to a multiple (moe_align.py)

    @classmethod
    def of(cls, m: ModelConfig, moe: MoEConfig, kernels: KernelsConfig | None,
           quant: QuantConfig | None = None, platform: str | None = None) -> GroupedPlan:
        """The plan of these keys; `platform` resolves xla_impl=auto (default: the traced program's)."""
        kern = kernels or KernelsConfig()
        g: GmmKernelConfig = kern.gmm
        explicit = g.tiling == "explicit"
        return cls(
            num_experts=m.num_experts, capacity_factor=moe.capacity_factor,
            wi_fused_swiglu=moe.wi_fused_swiglu, wo_fused_dswiglu=moe.wo_fused_dswiglu,
            router_grad_from_wo_input=moe.router_grad_from_wo_input, backend=g.backend,
            tiles=(K.kernel_tiles(g.model_dump()) if explicit else
                   K.KernelTiles.shared(K.Tiling(from_table=True, vmem_limit_mib=g.vmem_limit_mib))
                   if g.tiling == "auto" else None),
            interpret=kern.interpret, epilogue=g.epilogue,
            tile_n_per_half=(g.wi_fwd_tile_n_per_half or None) if explicit else None,
            rhs_buffer_count=g.wi_fwd_rhs_buffer_count, fp8=bool(quant and quant.fp8_gmm),
            xla_impl=K.xla_impl_for(g.xla_impl, platform), xla_tile_rows=g.xla_tile_rows, token_chunks=moe.token_chunks,
            gather_backward=moe.gather_backward, align_rows=moe.group_align_rows)

    @property
    def runs_row_tiles(self) -> bool:
        """The default program on row tiles (`tiled_experts`, CPU): no sort-and-group dispatch."""
        return self.is_default and self.xla_impl == "row_tiles"

    @property
    def is_default(self) -> bool:
        """No lever, no buffer, the xla backend: the default program (`sparse_experts`)."""
        return not (self.capacity_factor or self.wi_fused_swiglu or self.wo_fused_dswiglu
                    or self.router_grad_from_wo_input or self.backend != "xla" or self.fp8 or self.token_chunks > 1
                    or self.align_rows > 0)


def default_grouped_dot(kernels: KernelsConfig | None):
    """The default path's grouped matmul `(lhs, rhs, sizes) -> out`: the platform's xla choice."""
    g = (kernels or KernelsConfig()).gmm
    impl = K.xla_impl_for(g.xla_impl)
    if impl == "ragged_dot":
        return K.ragged_dot  # jax.lax.ragged_dot, in chunks of groups where the platform caps them

    def row_tiled(lhs_MK, rhs_EKN, group_sizes_E):
        # The weights are marked per-device here, so their gradient's reduction over the mesh
        # runs once per layer, after the grouped matmul (the custom VJP's cotangent varies).
        lhs_MK, rhs_EKN = _vary_alike(lhs_MK, rhs_EKN)
        return K.gmm(lhs_MK, rhs_EKN, group_sizes_E, xla_impl=impl, xla_tile_rows=g.xla_tile_rows)

    return row_tiled


def capacity_rows(num_rows: int, num_experts: int, capacity_factor: float) -> int:
    """Per-expert buffer: capacity_factor times the even share of the rows, at least one row."""
    return max(1, math.ceil(capacity_factor * num_rows / num_experts))


def within_capacity(position_M, cap: int):
    """Rows kept by an expert's buffer: those with fewer than `cap` rows of the expert before them."""
    return position_M < cap


def grouped_experts(x_TD, w_Tk, idx_Tk, wi_GD2F, wo_GFD, plan: GroupedPlan, group_offset=0):
    """(y_TD, dropped): the experts [offset, offset + G) of E on these tokens; others give zero.

    dropped: int32, the (token, expert) rows of the local experts that overflowed their buffer
    (always 0 when dropless). Rows are sorted by expert with a stable sort, so within an expert
    the earlier tokens keep their place and the later ones are dropped.

    moe.token_chunks = C > 1 (dropless; where C divides the tokens): `token_chunked_experts`. A token
    count C does not divide (a sampler's decode step: a few rows, no backward) runs as one chunk.
    """
    T = idx_Tk.shape[0]
    C = plan.token_chunks
    if C == 1 or T % C:
        return _grouped_rows(x_TD, w_Tk, idx_Tk, wi_GD2F, wo_GFD, plan, group_offset)
    return token_chunked_experts(x_TD, w_Tk, idx_Tk, wi_GD2F, wo_GFD, plan, group_offset)


def token_chunked_experts(x_TD, w_Tk, idx_Tk, wi_GD2F, wo_GFD, plan: GroupedPlan, group_offset=0):
    """grouped_experts over the tokens in C = plan.token_chunks chunks, one after another.

    Forward: a scan over the chunks that keeps nothing but its inputs. Backward (a custom VJP): a
    scan over the chunks that replays each chunk's forward and its VJP, so every [T k, D] row buffer
    is [T k / C, D]. Tokens are independent of each other, so outputs and the tokens' and routing
    weights' gradients are each chunk's own. The expert weights' gradients are carried through the
    backward scan and each chunk's weight-gradient kernel adds into them (the grouped matmuls'
    weight_out): one [G, K, N] accumulator per weight, no per-chunk gradient beside it, summed in the
    kernel's float32 accumulator and rounded once per chunk. The weights enter in the activation
    dtype, marked varying like the tokens, so what the scans carry keeps one type and the reduction
    of the weights' gradient over the mesh runs once, after the backward scan.
    """
    T = idx_Tk.shape[0]
    C = plan.token_chunks
    dt = x_TD.dtype
    wi_GD2F, wo_GFD = wi_GD2F.astype(dt), wo_GFD.astype(dt)
    static_offset = isinstance(group_offset, int)  # a literal offset reaches the chunks as itself
    x_TD, w_Tk, wi_GD2F, wo_GFD, off = _vary_alike(x_TD, w_Tk, wi_GD2F, wo_GFD, jnp.asarray(group_offset, jnp.int32))
    chunks = lambda a: a.reshape(C, T // C, *a.shape[1:])  # noqa: E731

    def one(x_tD, w_tk, idx_tk, wi, wo, off, weights_out=False):
        return _grouped_rows(x_tD, w_tk, idx_tk, wi, wo, plan, group_offset if static_offset else off,
                             weights_out=weights_out)

    @jax.custom_vjp
    def run(x_TD, w_Tk, idx_Tk, wi, wo, off):
        def chunk(_, xs):
            return None, one(*xs, wi, wo, off)

        _, (y_CtD, dropped_C) = jax.lax.scan(chunk, None, tuple(map(chunks, (x_TD, w_Tk, idx_Tk))))
        return y_CtD.reshape(T, -1), jnp.sum(dropped_C)

    def fwd(x_TD, w_Tk, idx_Tk, wi, wo, off):
        return run(x_TD, w_Tk, idx_Tk, wi, wo, off), (x_TD, w_Tk, idx_Tk, wi, wo, off)

    def bwd(res, cts):
        x_TD, w_Tk, idx_Tk, wi, wo, off = res
        ct_TD = cts[0]

        def chunk(acc, xs):
            x_tD, w_tk, idx_tk, ct_tD = xs
            replay = lambda x, w, wi, wo: one(x, w, idx_tk, wi, wo, off, weights_out=True)[::2]  # noqa: E731
            _, vjp = jax.vjp(replay, x_tD, w_tk, wi, wo)
            # The weights' cotangent is the carried sum: the chunk's weight gradients are added into it.
            dx, dw, dwi, dwo = vjp((ct_tD, acc))
            return (dwi, dwo), (dx, dw)

        # Last chunk first, as autodiff of a scan would run it.
        (dwi, dwo), (dx, dw) = jax.lax.scan(chunk, (jnp.zeros_like(wi), jnp.zeros_like(wo)),
                                            tuple(map(chunks, (x_TD, w_Tk, idx_Tk, ct_TD))), reverse=True)
        return dx.reshape(x_TD.shape), dw.reshape(w_Tk.shape), None, dwi, dwo, None

    run.defvjp(fwd, bwd)
    return run(x_TD, w_Tk, idx_Tk, wi_GD2F, wo_GFD, off)


def _grouped_rows(x_TD, w_Tk, idx_Tk, wi_GD2F, wo_GFD, plan: GroupedPlan, group_offset, weights_out=False):
    """grouped_experts on one set of tokens: sort the (token, expert) rows by expert, run the
    grouped MLP, combine each token's k rows. weights_out: (y, dropped, (wi, wo)), the weights
    passed through the grouped matmuls that use them (ops.py's weight_out)."""
    T, k = idx_Tk.shape
    E, G = plan.num_experts, wi_GD2F.shape[0]
    M = T * k
    dt = x_TD.dtype
    flat_e_M = idx_Tk.reshape(-1)
    order_M = jnp.argsort(flat_e_M, stable=True)
    group_sizes_E = jnp.bincount(flat_e_M, length=E).astype(jnp.int32)
    dropped = jnp.int32(0)
    rows = M
    if plan.capacity_factor > 0:
        cap = capacity_rows(M, E, plan.capacity_factor)
        starts_E = jnp.cumsum(group_sizes_E) - group_sizes_E
        e_sorted_M = flat_e_M[order_M]
        keep_M = within_capacity(jnp.arange(M, dtype=jnp.int32) - starts_E[e_sorted_M], cap)
        kept_E = jnp.minimum(group_sizes_E, cap)
        experts_E = jnp.arange(E, dtype=jnp.int32)
        local_E = (experts_E >= group_offset) & (experts_E < group_offset + G)
        dropped = jnp.sum(jnp.where(local_E, group_sizes_E - kept_E, 0)).astype(jnp.int32)
        # Kept rows first (still by expert), dropped rows after them: past the groups' sum
        # they are padding rows, which the grouped matmuls give zero output and zero gradient.
        order_M = order_M[jnp.argsort(jnp.where(keep_M, e_sorted_M, E), stable=True)]
        group_sizes_E = kept_E
        rows = min(M, E * cap)
    if plan.align_rows:
        # Each local expert from a multiple of align_rows, padded with zero rows (dropless only).
        buffer_A, inverse_M, group_sizes_E = moe_align.aligned_layout(
            flat_e_M, order_M, group_sizes_E, align=plan.align_rows, group_offset=group_offset, num_local=G)
        x_RD = moe_align.token_rows(x_TD, buffer_A, inverse_M, k, plan.gather_backward)
        w_R = moe_align.row_values(w_Tk.reshape(-1), buffer_A)
    else:
        buffer_R = order_M[:rows]
        inverse_M = jnp.argsort(order_M)
        x_RD = _token_rows(x_TD, buffer_R, inverse_M, k, plan.gather_backward)
        w_R = w_Tk.reshape(-1)[buffer_R]
    y_RD = _expert_mlp(x_RD, w_R, wi_GD2F.astype(dt), wo_GFD.astype(dt), group_sizes_E, plan,
                       group_offset, weights_out=weights_out)
    if weights_out:
        y_RD, weights = y_RD
    if plan.align_rows:
        y_TD = moe_align.combine(y_RD, buffer_A, inverse_M, k, plan.gather_backward)
    else:
        if rows < M:
            y_RD = jnp.concatenate([y_RD, jnp.zeros((M - rows, y_RD.shape[1]), dt)])
        y_TD = _combine(y_RD, order_M, inverse_M, k, plan.gather_backward)
    return (y_TD, dropped, weights) if weights_out else (y_TD, dropped)


def _vary_alike(*arrays):
    """The arrays marked as varying over every manual mesh axis any of them varies over.

    The grouped matmuls' custom VJPs return cotangents that vary like the whole computation
    (tokens, weights and the traced group offset together); each input must already carry that
    type. The transpose of the cast is the psum that autodiff inserts on its own around a plain
    matmul (a no-op outside shard_map).
    """
    want = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    out = []
    for a in arrays:
        missing = want - jax.typeof(a).manual_axis_type.varying
        out.append(jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a)
    return out


def _expert_mlp(x_MD, w_M, wi_GD2F, wo_GFD, group_sizes_E, plan: GroupedPlan, group_offset,
                weights_out: bool = False):
    """Routed rows through their experts: (w * swiglu(x @ wi)) @ wo, per the plan's levers.
    weights_out: (y, (wi, wo)), each weight passed through the grouped matmul that uses it, so its
    gradient is added into the cotangent given for it (ops.py's weight_out; fp8_gmm's matmuls have
    none: there autodiff adds the two)."""
    if isinstance(group_offset, int):
        # A literal offset (every expert local) keeps the kernels' unsharded path.
        x_MD, w_M, wi_GD2F, wo_GFD = _vary_alike(x_MD, w_M, wi_GD2F, wo_GFD)
    else:
        x_MD, w_M, wi_GD2F, wo_GFD, group_offset = _vary_alike(
            x_MD, w_M, wi_GD2F, wo_GFD, jnp.asarray(group_offset, jnp.int32))
    kw = dict(backend=plan.backend, interpret=plan.interpret, group_offset=group_offset, xla_impl=plan.xla_impl,
              xla_tile_rows=plan.xla_tile_rows)
    t = plan.tiles
    wi_tiles = dict(tiling=t.wi_fwd, dlhs_tiling=t.wi_dlhs, drhs_tiling=t.wi_drhs) if t else {}
    wo_tiles = dict(tiling=t.wo_fwd, dlhs_tiling=t.wo_dlhs, drhs_tiling=t.wo_drhs) if t else {}
    row_scale_M = w_M if plan.router_grad_from_wo_input else None
    # quant.fp8_gmm: the unfused grouped matmuls in fp8 (the fused levers are refused with it).
    if plan.fp8:
        fp8_mm = functools.partial(gmm_fp8, group_offset=group_offset, backend=plan.backend)
        # No weight_out of its own: the weight passed on unchanged, autodiff adds the two cotangents.
        mm = lambda lhs, rhs, sizes: (fp8_mm(lhs, rhs, sizes), rhs) if weights_out else fp8_mm(lhs, rhs, sizes)  # noqa: E731
    else:
        mm = functools.partial(K.gmm, **kw, weight_out=weights_out)

    def unpack(out):
        """(the op's own outputs, the weight it passed through; None without weights_out)."""
        if not weights_out:
            return out, None
        return (out[:-1] if len(out) > 2 else out[0]), out[-1]

    if plan.wi_fused_swiglu:
        out, wi_out = unpack(K.wi_fused_swiglu(x_MD, wi_GD2F, group_sizes_E, return_preact=plan.wo_fused_dswiglu,
                                               tile_n_per_half=plan.tile_n_per_half, epilogue=plan.epilogue,
                                               rhs_buffer_count=plan.rhs_buffer_count, weight_out=weights_out,
                                               **kw, **wi_tiles))
        h_MF, preact_M2F = out if plan.wo_fused_dswiglu else (out, None)
        preact_tile = plan.tile_n_per_half
    else:
        preact_M2F, wi_out = unpack(mm(x_MD, wi_GD2F, group_sizes_E, **({} if plan.fp8 else wi_tiles)))
        h_MF = swiglu(preact_M2F)
        preact_tile = None  # the unfused matmul stores contiguous [gate | up]
    if plan.wo_fused_dswiglu:
        y_MD, wo_out = unpack(K.wo_fused_dswiglu(h_MF, wo_GFD, group_sizes_E, preact=preact_M2F,
                                                 preact_tile_n_per_half=preact_tile, row_scale=row_scale_M,
                                                 epilogue=plan.epilogue, weight_out=weights_out, **kw, **wo_tiles))
    else:
        lhs_MF = h_MF if row_scale_M is None else K.scale_rows(h_MF, row_scale_M)
        y_MD, wo_out = unpack(mm(lhs_MF, wo_GFD, group_sizes_E, **({} if plan.fp8 else wo_tiles)))
    if row_scale_M is None:
        y_MD = (y_MD.astype(jnp.float32) * w_M[:, None]).astype(y_MD.dtype)
    return (y_MD, (wi_out, wo_out)) if weights_out else y_MD


def moe_local(p, x_TD, m: ModelConfig, moe: MoEConfig, kernels: KernelsConfig | None = None, *,
              return_dropped: bool = False, replay_Tk=None, return_routing: bool = False,
              quant: QuantConfig | None = None, decode_step: bool = False):
    """The block on the tokens a shard holds (every expert weight visible). replay_Tk: route by these
    experts (routing replay); return_routing: also the expert ids it routed by, int32 [T, k].
    decode_step: the tokens are one per row (a sampler's decode step): where the platform's grouped
    matmul is row tiles (CPU), the routed rows (T x k, a few per expert) take the cheaper of row
    tiles and `every_expert_rows`."""
    w_Tk, idx_Tk, _ = route(p["router"], x_TD, m, replay_Tk)
    plan = GroupedPlan.of(m, moe, kernels, quant)
    dropped = jnp.int32(0)
    # The scope names the routed experts' ops in the compiled program (analysis/hlo_cost.py's
    # "grouped matmuls"); jax keeps it in the backward's op names too.
    with jax.named_scope(scopes.GROUPED_MATMUL):
        if moe.impl == "dense":
            y = dense_experts(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"])
        elif (decode_step and plan.runs_row_tiles
              and every_expert_is_cheaper(x_TD.shape[0], m.num_experts_per_tok, m.num_experts, plan.xla_tile_rows)):
            y = every_expert_rows(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"])
        elif plan.runs_row_tiles:
            y = tiled_experts(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"], plan.xla_tile_rows)
        elif plan.is_default:
            y = sparse_experts(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"], default_grouped_dot(kernels), plan.gather_backward)
        else:
            y, dropped = grouped_experts(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"], plan)
    if "shared_wi" in p:
        y = y + shared_expert(p, x_TD)
    out = (y,) + ((dropped,) if return_dropped else ()) + ((idx_Tk,) if return_routing else ())
    return out if len(out) > 1 else y


def expert_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the rules shard experts over, those of size 1 left out."""
    return tuple(a for a in mesh_axes_of(logical_to_spec(("exp",))[0]) if mesh.shape[a] > 1)


def moe_layer(p, x_BTD, m: ModelConfig, moe: MoEConfig, kernels: KernelsConfig | None = None, *,
              return_dropped: bool = False, replay_BTk=None, return_routing: bool = False,
              quant: QuantConfig | None = None):
    """The block on a [B, T, D] batch, under the mesh in force (if any).

    One expert rank: tokens stay on their shard and expert weights are gathered to every shard
    (FSDP style). Experts sharded (the rules' "exp" axes > 1) and the sparse path: ring of
    experts (module docstring). With return_dropped, also the number of (token, expert) rows
    the per-expert buffers dropped in the whole batch (int32, 0 when dropless).
    replay_BTk / return_routing (moe.routing_replay): route by the given experts / also return the
    expert ids routed by, int32 [B, T, k] (then no dropped count); the default program only.
    """
    B, T, D = x_BTD.shape
    mesh = jax.sharding.get_abstract_mesh()
    decode_step = T == 1  # one new token per row: a sampler's decode step
    if replay_BTk is not None or return_routing:
        return _replayable_moe_layer(p, x_BTD, m, moe, kernels, replay_BTk, return_routing, mesh, quant)
    if mesh.empty:
        y, dropped = moe_local(p, x_BTD.reshape(B * T, D), m, moe, kernels, return_dropped=True, quant=quant,
                               decode_step=decode_step)
        y = y.reshape(B, T, D)
        return (y, dropped) if return_dropped else y
    token_spec = logical_to_spec(("batch", "seq", None))
    ep_axes = expert_axes(mesh) if moe.impl == "sparse" else ()
    replicated = jax.tree.map(lambda _: PartitionSpec(), p)
    plan = GroupedPlan.of(m, moe, kernels, quant)
    default = moe.impl == "dense" or plan.is_default
    if default and not ep_axes and not return_dropped:
        # The default program: the replicated block and nothing else in the shard_map.
        def plain(p, x_btd):
            b, t, _ = x_btd.shape
            return moe_local(p, x_btd.reshape(b * t, D), m, moe, kernels, decode_step=decode_step).reshape(b, t, D)

        return jax.shard_map(plain, in_specs=(replicated, token_spec), out_specs=token_spec)(p, x_BTD)

    token_axes = {a for entry in token_spec for a in mesh_axes_of(entry)}
    all_axes = tuple(mesh.axis_names)
    # Pallas kernels declare no varying-axes type on their outputs: trace them unchecked.
    check_vma = plan.backend == "xla"
    # Each (token shard, expert shard) pair counts its drops once: divide out the replicas.
    replicas = math.prod(mesh.shape[a] for a in all_axes if a not in token_axes and a not in ep_axes)
    if ep_axes:
        local = _ring_of_experts(plan, m, ep_axes, token_axes, all_axes, replicas, check_vma)
        ep_spec = PartitionSpec(tuple(a for a in mesh_axes_of(logical_to_spec(("exp",))[0]) if a in ep_axes))
        weight_specs = {k: ep_spec if k in ("wi", "wo") else PartitionSpec() for k in p}
    else:
        def local(p, x_btd):
            b, t, _ = x_btd.shape
            y, dropped = moe_local(p, x_btd.reshape(b * t, D), m, moe, kernels, return_dropped=True,
                                   quant=quant, decode_step=decode_step)
            return y.reshape(b, t, D), _count_once(dropped, all_axes, replicas, check_vma)

        weight_specs = replicated
    y, dropped = jax.shard_map(local, in_specs=(weight_specs, token_spec),
                               out_specs=(token_spec, PartitionSpec()), check_vma=check_vma)(p, x_BTD)
    return (y, dropped) if return_dropped else y


def _replayable_moe_layer(p, x_BTD, m: ModelConfig, moe: MoEConfig, kernels, replay_BTk, return_routing: bool,
                          mesh, quant: QuantConfig | None = None):
    """The default program's block with routing replay in and/or the routing ids out."""
    B, T, D = x_BTD.shape
    k = m.num_experts_per_tok
    if not mesh.empty and (moe.impl == "sparse" and expert_axes(mesh)
                           or not GroupedPlan.of(m, moe, kernels, quant).is_default):
        raise NotImplementedError("moe.routing_replay runs with the default MoE program only (no expert "
                                  "parallelism, no grouped-matmul lever, dropless)")

    def local(p, x_btd, *replay):
        b, t, _ = x_btd.shape
        replay_Tk = replay[0].reshape(b * t, k) if replay else None
        y, idx_Tk = moe_local(p, x_btd.reshape(b * t, D), m, moe, kernels, replay_Tk=replay_Tk, return_routing=True,
                              decode_step=T == 1)
        return y.reshape(b, t, D), idx_Tk.reshape(b, t, k)

    args = (p, x_BTD) + ((replay_BTk,) if replay_BTk is not None else ())
    if mesh.empty:
        y, idx_BTk = local(*args)
    else:
        token_spec = logical_to_spec(("batch", "seq", None))
        in_specs = (jax.tree.map(lambda _: PartitionSpec(), p), token_spec) + (token_spec,) * (len(args) - 2)
        y, idx_BTk = jax.shard_map(local, in_specs=in_specs, out_specs=(token_spec, token_spec))(*args)
    return (y, idx_BTk) if return_routing else y


def _count_once(dropped, all_axes, replicas: int, check_vma: bool):
    """The mesh-wide total of a per-shard count that `replicas` shards compute identically."""
    missing = set(all_axes) - jax.typeof(dropped).manual_axis_type.varying
    if check_vma and missing:
        dropped = jax.lax.pcast(dropped, tuple(sorted(missing)), to="varying")
    return jax.lax.psum(dropped, all_axes) // replicas


def local_expert_offset(exp_axes, num_local: int):
    """The first global expert this rank holds (experts are split in rank order)."""
    return jax.lax.axis_index(exp_axes) * num_local


def _ring_of_experts(plan: GroupedPlan, m: ModelConfig, ep_axes, token_axes, all_axes,
                     replicas: int, check_vma: bool):
    """The per-shard body of the ring: gather tokens over the expert axes, local experts, scatter."""
    # Gather over the expert axes the tokens are split on; where the tokens are replicated
    # (cp_as_ep's context x expert with tokens on context only) every rank already holds them
    # and the partial outputs are summed instead.
    exp_spec_axes = mesh_axes_of(logical_to_spec(("exp",))[0])
    gather_axes = tuple(a for a in exp_spec_axes if a in ep_axes and a in token_axes)
    sum_axes = tuple(a for a in exp_spec_axes if a in ep_axes and a not in token_axes)

    def local(p, x_btd):
        b, t, D = x_btd.shape
        x_TD = x_btd.reshape(b * t, D)
        w_Tk, idx_Tk, _ = route(p["router"], x_TD, m)
        x_nTD, w_nTk, idx_nTk = x_TD, w_Tk, idx_Tk
        if gather_axes:
            x_nTD, w_nTk, idx_nTk = (jax.lax.all_gather(a, gather_axes, axis=0, tiled=True)
                                     for a in (x_TD, w_Tk, idx_Tk))
        num_local = p["wi"].shape[0]
        offset = local_expert_offset(tuple(a for a in exp_spec_axes if a in ep_axes), num_local)
        y_nTD, dropped = grouped_experts(x_nTD, w_nTk, idx_nTk, p["wi"], p["wo"], plan, offset)
        y_TD = y_nTD
        if gather_axes:
            y_TD = jax.lax.psum_scatter(y_nTD, gather_axes, scatter_dimension=0, tiled=True)
        if sum_axes:
            y_TD = jax.lax.psum(y_TD, sum_axes)
        if "shared_wi" in p:
            y_TD = y_TD + shared_expert(p, x_TD)
        return y_TD.reshape(b, t, D), _count_once(dropped, all_axes, replicas, check_vma)

    return local
