"""Mosaic TPU Gated DeltaNet core: chunk-parallel work on the MXU inside a sequential walk over chunks.

One kernel per direction. A grid step holds one key head, every value head that reads it (the
group: H / G heads) and `chunks_per_step` chunks of C tokens. Per chunk it forms the key head's
q k^T and k k^T once, and per value head the gates' decays, the triangular inverse T, W, U, V_new,
the output and the end state (tpu_chunk.forward_step): all matmuls of [C, C], [C, K] and [K, V]
operands with the state in VMEM scratch, so nothing intra-chunk goes through HBM; only
the [K, V] state passes from one chunk to the next (to the next grid step through scratch). The
state-independent work of all the step's chunks and heads comes first, then the chain; each line
of the math runs over all chunk-heads before the next, so the MXU pipelines independent products
(docs/gdn.md section 2, "The Pallas TPU kernels": why, and why one kernel and not a
chunk-parallel kernel plus a state scan).

Grid (B, G, N / chunks_per_step): batch and key heads "parallel", the chunk axis "arbitrary"
(sequential; the backward walks it in reverse through its index maps). The forward for a gradient
also writes each chunk's start state and T (the backward's residuals: it recomputes the rest);
the plain forward writes neither.

Layouts (each key head appears once, never repeated per value head), by Settings.token_major:
  head-major (the wrapper's transposes): q, k [B, G, T, K] (Keys: the input's rows, bfloat16 for
  a bfloat16 input, and a float32 factor per row that normalises and scales them); v, o
  [B, G, H/G, T, V] in v's dtype; token-major (no transposes: the token-major arrays with their
  head and feature axes merged, a grid step's block the key head's columns): q, k [B, T, G K],
  v, o [B, T, H V], a value head's rows the lane-aligned columns [h V, (h + 1) V) of its key
  head's block. Either way the rows' factors [B, G, N, 1, C], log gates and beta [B, G, N, H/G, C]
  float32 (a document start's log
  gate is tpu_chunk.START_LOG_GATE); states [B, G, H/G, K, V] float32; residuals: start states
  [B, G, N H/G, K, V] and inverses [B, G, N H/G, C, C] float32 (chunk-major).

VMEM (kernels/gdn/limits.py models it; tests/test_vmem_tpu_compile.py checks the model against the
compiler): at Qwen3.5-397B's per-device cell (C 64, K = V 128, 4 value heads per key head, bf16 v)
and the default 2 chunks per step, the blocks double-buffered are 3.5 MiB (forward) and 4.1 MiB
(backward); with the body's values the v5e compiler needs 4.7 and 9.1 MiB, under its 16 MiB
default scoped limit. The kernels ask for `auto`'s limit for their modelled need (kernels/vmem.py:
the default for the forward; the backward's 10.9 MiB with the margin asks for more).

Dimension letters: B batch, T tokens, N chunks, G key heads, H value heads (Hg = H / G per key
head), C position in a chunk, K key dim, V value dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gdn import limits, tpu_chunk
from hybridmoe.kernels.gdn.limits import RESIDUALS_NAME, default_chunks_per_step
from hybridmoe.kernels.gdn.reference import initial_or_zeros, query_key_scales, starts_or_none
from hybridmoe.kernels.gdn.tpu_chunk import PRECISIONS, START_LOG_GATE, ChunkIn, chunk_macs
from hybridmoe.kernels.vmem import tpu_bytes, tpu_limit_bytes

_F32 = jnp.float32
# The kernels' names in the compiled program (program facts and the step-time model look for them).
KERNEL_NAMES = {"forward": limits.KERNELS[0], "backward": limits.KERNELS[1]}


class Settings(NamedTuple):
    """The static choices of one core call."""

    chunk_size: int
    chunks_per_step: int
    precision: str  # a key of tpu_chunk.PRECISIONS
    interpret: bool = False
    vmem_limit_mib: float = 0.0
    token_major: bool = False  # the layouts of q, k, v and o (the module's docstring)
    bfloat16_rows: bool = False  # q's and k's rows are bfloat16 values: the kernels read them as bfloat16


class Keys(NamedTuple):
    """q or k as the kernels take them: the input's rows and one float32 factor per row, the
    normalisation and the dk^-1/2 query scale (reference.query_key_scales). A bfloat16 input's rows
    stay exact, so every product with q or k splits only its other operand (tpu_chunk.mxu: two
    passes of three). rows: in the kernels' layout, float32 holding the input's values (the kernels
    read them in bfloat16 under Settings.bfloat16_rows; the cotangents stay float32); scale
    [B, G, N, 1, C] float32."""

    rows: jax.Array
    scale: jax.Array


def kernel_rows(keys: Keys, settings: Settings):
    """The rows as the kernels read them."""
    return keys.rows.astype(jnp.bfloat16) if settings.bfloat16_rows else keys.rows


def keys_cotangent(keys: Keys, d_normalised, settings: Settings) -> Keys:
    """Keys' cotangent from the normalised q's or k's (the kernels' dq, dk, in the rows' layout):
    rows * scale has d rows = scale * d and d scale = the rows' dot product with d."""
    batch, key_heads, chunks, _, size = keys.scale.shape
    scale = keys.scale.reshape(batch, key_heads, chunks * size)  # [B, G, T]
    if settings.token_major:  # rows [B, T, G K]
        scale = jnp.moveaxis(scale, 1, 2)[..., None]  # [B, T, G, 1]
        rows = keys.rows.reshape(*scale.shape[:3], -1)
        grad = d_normalised.reshape(rows.shape)
        d_scale = jnp.moveaxis(jnp.sum(rows * grad, axis=-1), 2, 1)
        d_rows = (grad * scale).reshape(keys.rows.shape)
    else:  # rows [B, G, T, K]
        d_rows = d_normalised * scale[..., None]
        d_scale = jnp.sum(keys.rows * d_normalised, axis=-1)
    return Keys(d_rows, d_scale.reshape(keys.scale.shape))


# ---------------------------------------------------------------------------------------------
# Kernels


def _walk_starts(step):
    """Whether grid step `step` begins a (batch, key head)'s walk over its chunks: the carried
    state (the backward: its cotangent) is set from the input there and carried after."""
    return step == 0


def carry(scratch_ref, values: list, out_ref):
    """Each head's carried value (state, product or cotangent) into the scratch for the walk's next
    grid step, and into out_ref at its last."""
    for h, x in enumerate(values):
        scratch_ref[h] = x

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        for h, x in enumerate(values):
            out_ref[h] = x


def head_rows(ref, h: int, rows, group: int):
    """The index of value head h's `rows` in a block of every value head of a key head: [Hg, T, V]
    (head-major) or [T, Hg V] (token-major: the head's V lane-aligned columns)."""
    if len(ref.shape) == 3:
        return h, rows, slice(None)
    width = ref.shape[1] // group
    return rows, pl.ds(h * width, width)


def chunks_of(q_refs, k_refs, v_ref, g_ref, beta_ref, size: int, per_step: int) -> list[ChunkIn]:
    """The grid step's chunks as tpu_chunk.ChunkIn, each a view of the blocks; q_refs and k_refs: the
    (rows, scale) refs of Keys (a kernel that reads no q or no v passes None: q None, v empty lists)."""
    group = g_ref.shape[1]
    out = []
    for c in range(per_step):
        rows = pl.ds(c * size, size)
        q, q_scale = (None, None) if q_refs is None else (q_refs[0][rows, :], q_refs[1][c, pl.ds(0, 1), :])
        out.append(ChunkIn(q, k_refs[0][rows, :],
                           [] if v_ref is None else [v_ref[head_rows(v_ref, h, rows, group)] for h in range(group)],
                           [g_ref[c, pl.ds(h, 1), :] for h in range(group)],
                           [beta_ref[c, pl.ds(h, 1), :] for h in range(group)], q_scale, k_refs[1][c, pl.ds(0, 1), :]))
    return out


def _forward_kernel(q_ref, q_scale_ref, k_ref, k_scale_ref, v_ref, g_ref, beta_ref, initial_ref, *refs,
                    settings: Settings, save: bool):
    if save:
        o_ref, final_ref, starts_ref, inverses_ref, state_scratch = refs
    else:
        o_ref, final_ref, state_scratch = refs
    size, group, per_step = settings.chunk_size, g_ref.shape[1], settings.chunks_per_step
    step = pl.program_id(2)

    @pl.when(_walk_starts(step))
    def _():
        state_scratch[...] = initial_ref[...]

    chunks = chunks_of((q_ref, q_scale_ref), (k_ref, k_scale_ref), v_ref, g_ref, beta_ref, size, per_step)
    outs, inverses, starts, states = tpu_chunk.forward_step(
        chunks, [state_scratch[h] for h in range(group)], PRECISIONS[settings.precision])
    for c in range(per_step):
        for h in range(group):
            o_ref[head_rows(o_ref, h, pl.ds(c * size, size), group)] = outs[c][h].astype(o_ref.dtype)
            if save:
                starts_ref[c * group + h] = starts[c][h]
                inverses_ref[c * group + h] = inverses[c][h]
    carry(state_scratch, states, final_ref)


def _backward_kernel(q_ref, q_scale_ref, k_ref, k_scale_ref, v_ref, g_ref, beta_ref, starts_ref, inverses_ref,
                     do_ref, d_final_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_initial_ref, d_state_scratch, *,
                     settings: Settings):
    size, group, per_step = settings.chunk_size, g_ref.shape[1], settings.chunks_per_step
    step = pl.program_id(2)  # the step-th block from the end

    @pl.when(_walk_starts(step))
    def _():
        d_state_scratch[...] = d_final_ref[...]

    rows = [pl.ds(c * size, size) for c in range(per_step)]
    dq, dk, grads, d_states = tpu_chunk.backward_step(
        chunks_of((q_ref, q_scale_ref), (k_ref, k_scale_ref), v_ref, g_ref, beta_ref, size, per_step),
        [[starts_ref[c * group + h] for h in range(group)] for c in range(per_step)],
        [[inverses_ref[c * group + h] for h in range(group)] for c in range(per_step)],
        [[do_ref[head_rows(do_ref, h, rows[c], group)] for h in range(group)] for c in range(per_step)],
        [d_state_scratch[h] for h in range(group)], PRECISIONS[settings.precision])
    for c in range(per_step):
        dq_ref[rows[c], :] = dq[c]
        dk_ref[rows[c], :] = dk[c]
        for h, grad in enumerate(grads[c]):
            dv_ref[head_rows(dv_ref, h, rows[c], group)] = grad.v.astype(dv_ref.dtype)
            dg_ref[c, pl.ds(h, 1), :] = grad.g
            dbeta_ref[c, pl.ds(h, 1), :] = grad.beta
    carry(d_state_scratch, d_states, d_initial_ref)


# ---------------------------------------------------------------------------------------------
# pallas_calls


class Dims(NamedTuple):
    batch: int
    key_heads: int
    group: int
    chunks: int
    chunk: int
    key_dim: int
    value_dim: int
    per_step: int
    token_major: bool = False

    @property
    def steps(self) -> int:
        return self.chunks // self.per_step


def dims_of(keys: Keys, v, g_BGNHC, settings: Settings) -> Dims:
    """The grid's dimensions from q's (or k's) rows, v's (or dO's) and the gates' layouts: head-major q
    [B, G, T, K] and v [B, G, Hg, T, V], or token-major [B, T, G K] and [B, T, H V]."""
    q = keys.rows
    batch, key_heads, _, group, _ = g_BGNHC.shape
    if settings.token_major:
        tokens, key_dim, value_dim = q.shape[1], q.shape[2] // key_heads, v.shape[2] // (key_heads * group)
    else:
        tokens, key_dim, value_dim = q.shape[2], q.shape[3], v.shape[-1]
    return Dims(batch, key_heads, group, tokens // settings.chunk_size, settings.chunk_size, key_dim, value_dim,
                settings.chunks_per_step, settings.token_major)


def block_specs(d: Dims, reverse: bool):
    """Block specs by layout: tokens [T, X] of a key head, per value head [Hg, T, X] (token-major:
    [T, Hg X], the key head's columns), per chunk [N, Hg, ...], per value head's state [Hg, K, V]
    (the same block at every step)."""
    block = (lambda j: d.steps - 1 - j) if reverse else (lambda j: j)
    tokens = d.per_step * d.chunk
    if d.token_major:
        columns = lambda width: pl.BlockSpec((None, tokens, width), lambda b, g, j: (b, block(j), g))  # noqa: E731
        token_blocks = {"tokens": columns, "heads": lambda width: columns(d.group * width)}
    else:
        token_blocks = {
            "tokens": lambda width: pl.BlockSpec((None, None, tokens, width), lambda b, g, j: (b, g, block(j), 0)),
            "heads": lambda width: pl.BlockSpec((None, None, d.group, tokens, width),
                                                lambda b, g, j: (b, g, 0, block(j), 0))}
    return {
        **token_blocks,
        "chunks": lambda *tail: pl.BlockSpec((None, None, d.per_step, d.group, *tail),
                                             lambda b, g, j: (b, g, block(j), 0, *(0,) * len(tail))),
        # Per chunk, one row for the key head (Keys.scale [B, G, N, 1, C]).
        "row_per_chunk": pl.BlockSpec((None, None, d.per_step, 1, d.chunk), lambda b, g, j: (b, g, block(j), 0, 0)),
        # Per (chunk, value head), the two flattened (chunk-major): [N Hg, ...] (5-D arrays).
        "items": lambda *tail: pl.BlockSpec((None, None, d.per_step * d.group, *tail),
                                            lambda b, g, j: (b, g, block(j), *(0,) * len(tail))),
        "state": pl.BlockSpec((None, None, d.group, d.key_dim, d.value_dim), lambda b, g, j: (b, g, 0, 0, 0)),
    }


def cost(kernel: str, d: Dims, precision: str, operands, results) -> pl.CostEstimate:
    """What a kernel does: the MACs of its chunk math as written (tpu_chunk.chunk_macs: every bfloat16
    pass counted, so the FLOPs are the MXU's), one exp per decay entry, every operand and result
    moved once (the state blocks stay resident)."""
    per_chunk = chunk_macs(kernel, d.chunk, d.key_dim, d.value_dim, d.group, precision)
    chunks = d.batch * d.key_heads * d.chunks
    exps = d.group * (d.chunk * d.chunk + 2 * d.chunk + 1)
    nbytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in (*operands, *results))
    return pl.CostEstimate(flops=int(2 * per_chunk * chunks), transcendentals=int(exps * chunks),
                           bytes_accessed=int(nbytes))


def compiler_params(name: str, d: Dims, settings: Settings, itemsize: int):
    """The grid's semantics, and the scoped VMEM limit: the configured one, else `auto`'s for the
    modelled need of the kernel `name` (limits.KERNELS or CP_KERNELS; kernels/vmem.py: the compiler's
    default where the need with its margin fits the smallest generation's)."""
    need = tpu_bytes(limits.tpu_buffers(name, chunk_size=d.chunk, key_dim=d.key_dim,
                                        value_dim=d.value_dim, group=d.group, chunks_per_step=d.per_step,
                                        itemsize=itemsize))
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                vmem_limit_bytes=tpu_limit_bytes(settings.vmem_limit_mib, need))


def forward(q: Keys, k: Keys, v, g_BGNHC, beta_BGNHC, initial_BGHKV, settings: Settings, *, save: bool):
    """q, k (Keys), v in the layouts of settings.token_major (the module's docstring) -> (o in v's layout,
    final state [B, G, Hg, K, V]) and, with save, the residuals: the state
    at every chunk's start [B, G, N Hg, K, V] and every chunk's T [B, G, N Hg, C, C] (per chunk and
    value head, chunk-major)."""
    d = dims_of(q, v, g_BGNHC, settings)
    s = block_specs(d, reverse=False)
    shape = lambda *dims, dtype=_F32: jax.ShapeDtypeStruct(dims, dtype)  # noqa: E731
    out_shape = [shape(*v.shape, dtype=v.dtype), shape(*initial_BGHKV.shape)]
    out_specs = [s["heads"](d.value_dim), s["state"]]
    if save:
        out_shape += [shape(d.batch, d.key_heads, d.chunks * d.group, d.key_dim, d.value_dim),
                      shape(d.batch, d.key_heads, d.chunks * d.group, d.chunk, d.chunk)]
        out_specs += [s["items"](d.key_dim, d.value_dim), s["items"](d.chunk, d.chunk)]
    operands = (kernel_rows(q, settings), q.scale, kernel_rows(k, settings), k.scale, v, g_BGNHC, beta_BGNHC,
                initial_BGHKV)
    keys = [s["tokens"](d.key_dim), s["row_per_chunk"]] * 2
    return pl.pallas_call(
        functools.partial(_forward_kernel, settings=settings, save=save),
        name=KERNEL_NAMES["forward"], grid=(d.batch, d.key_heads, d.steps),
        in_specs=[*keys, s["heads"](d.value_dim), s["chunks"](d.chunk), s["chunks"](d.chunk), s["state"]],
        out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((d.group, d.key_dim, d.value_dim), _F32)],
        compiler_params=compiler_params(KERNEL_NAMES["forward"], d, settings, jnp.dtype(v.dtype).itemsize),
        cost_estimate=cost("forward", d, settings.precision, operands, out_shape),
        interpret=settings.interpret,
    )(*operands)


def backward(residuals, do, d_final_BGHKV, settings: Settings):
    """Cotangents of (the normalised q and k in their rows' layout, v, log gates, beta, initial state)
    (dv in v's dtype; input_cotangents turns the first two into Keys')."""
    q, k, v, g_BGNHC, beta_BGNHC, starts, inverses = residuals
    d = dims_of(q, v, g_BGNHC, settings)
    s = block_specs(d, reverse=True)
    like = lambda a, dtype=_F32: jax.ShapeDtypeStruct(a.shape, dtype)  # noqa: E731
    out_shape = [like(q.rows), like(k.rows), like(v, v.dtype), like(g_BGNHC), like(beta_BGNHC),
                 like(d_final_BGHKV)]
    operands = (kernel_rows(q, settings), q.scale, kernel_rows(k, settings), k.scale, v, g_BGNHC, beta_BGNHC,
                starts, inverses, do, d_final_BGHKV)
    return pl.pallas_call(
        functools.partial(_backward_kernel, settings=settings),
        name=KERNEL_NAMES["backward"], grid=(d.batch, d.key_heads, d.steps),
        in_specs=[*[s["tokens"](d.key_dim), s["row_per_chunk"]] * 2, s["heads"](d.value_dim), s["chunks"](d.chunk),
                  s["chunks"](d.chunk), s["items"](d.key_dim, d.value_dim), s["items"](d.chunk, d.chunk),
                  s["heads"](d.value_dim), s["state"]],
        out_specs=[s["tokens"](d.key_dim), s["tokens"](d.key_dim), s["heads"](d.value_dim), s["chunks"](d.chunk),
                   s["chunks"](d.chunk), s["state"]],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((d.group, d.key_dim, d.value_dim), _F32)],
        compiler_params=compiler_params(KERNEL_NAMES["backward"], d, settings, jnp.dtype(v.dtype).itemsize),
        cost_estimate=cost("backward", d, settings.precision, operands, out_shape),
        interpret=settings.interpret,
    )(*operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def core(q, k, v, g_BGNHC, beta_BGNHC, initial_BGHKV, settings: Settings):
    """The chunked recurrence on kernel-layout inputs: (o in v's layout, final state [B, G, Hg, K, V])."""
    return forward(q, k, v, g_BGNHC, beta_BGNHC, initial_BGHKV, settings, save=False)


def _core_fwd(q, k, v, g_BGNHC, beta_BGNHC, initial_BGHKV, settings):
    o, final, starts, inverses = forward(q, k, v, g_BGNHC, beta_BGNHC, initial_BGHKV, settings,
                                         save=True)
    # Named for remat.save: kept with the layer's gdn_core_out, a remat's backward needs no second
    # run of this forward kernel (docs/levers.md, the minimal policy's save list).
    starts, inverses = (checkpoint_name(r, RESIDUALS_NAME) for r in (starts, inverses))
    return (o, final), (q, k, v, g_BGNHC, beta_BGNHC, starts, inverses)


def input_cotangents(q: Keys, k: Keys, grads, settings: Settings):
    """backward's cotangents with those of the normalised q and k as the Keys' (keys_cotangent)."""
    dq, dk, *rest = grads
    return (keys_cotangent(q, dq, settings), keys_cotangent(k, dk, settings), *rest)


def _core_bwd(settings, residuals, cotangents):
    do, d_final_BGHKV = cotangents
    return input_cotangents(*residuals[:2], backward(residuals, do, d_final_BGHKV, settings), settings)


core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------------------------
# Layouts


def split_value_heads(x, axis: int, key_heads: int):
    """The value-head axis H -> (G, Hg): value head h = g Hg + j reads key head g = h // Hg
    (docs/gdn.md section 4: the key heads are repeated, not tiled)."""
    return x.reshape(*x.shape[:axis], key_heads, x.shape[axis] // key_heads, *x.shape[axis + 1:])


def merge_value_heads(x, axis: int):
    """(G, Hg) at axis, axis + 1 -> H: the inverse of split_value_heads."""
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def kernel_layout(q_BTGK, q_scale_BTG, k_BTGK, k_scale_BTG, v_BTHV, g_BTH, beta_BTH, starts_BT, initial_BHKV,
                  settings: Settings):
    """Token-major inputs (q, k as rows float32 and their rows' factors: reference.query_key_scales)
    -> the kernels' layouts (q, k as Keys), padded to whole grid steps with tokens that leave the
    state alone (g = 0, beta = 0, k = 0); a document start's log gate is START_LOG_GATE."""
    key_heads = q_BTGK.shape[2]
    pad = -q_BTGK.shape[1] % (settings.chunks_per_step * settings.chunk_size)
    pad_time = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731

    def gates(x_BTH):  # [B, T, H] -> [B, G, N, Hg, C]
        x = split_value_heads(pad_time(x_BTH.astype(_F32)), 2, key_heads)  # [B, T, G, Hg]
        x = x.reshape(x.shape[0], -1, settings.chunk_size, *x.shape[2:])  # [B, N, C, G, Hg]
        return jnp.transpose(x, (0, 3, 1, 4, 2))

    log_gates_BTH = jnp.where(starts_BT[..., None], START_LOG_GATE, g_BTH.astype(_F32))
    if settings.token_major:  # heads and features merged: reshapes, no transposes
        q, k, v = (pad_time(a).reshape(*a.shape[:1], -1, a.shape[2] * a.shape[3]) for a in (q_BTGK, k_BTGK, v_BTHV))
    else:
        q, k = (jnp.moveaxis(pad_time(a), 1, 2) for a in (q_BTGK, k_BTGK))
        v = jnp.moveaxis(split_value_heads(pad_time(v_BTHV), 2, key_heads), 1, 3)
    return (Keys(q, gates(q_scale_BTG)), Keys(k, gates(k_scale_BTG)), v, gates(log_gates_BTH), gates(beta_BTH),
            split_value_heads(initial_BHKV, 1, key_heads))


def settings_for(chunk_size: int, group: int, chunks: int, dtype, *, precision=None, chunks_per_step=None,
                 interpret=False, vmem_limit_mib=0.0, token_major=False, bfloat16_rows=False) -> Settings:
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"gdn pallas_tpu: unknown precision {precision!r}; choices: {', '.join(PRECISIONS)}")
    if chunks_per_step is not None and chunks_per_step < 1:
        raise ValueError(f"gdn pallas_tpu: chunks_per_step must be positive; got {chunks_per_step}")
    per_step = chunks_per_step or default_chunks_per_step(chunk_size, group, chunks)
    return Settings(chunk_size, per_step, precision or tpu_chunk.precision_name(dtype), interpret, vmem_limit_mib,
                    token_major, bfloat16_rows)


def prepared(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, initial_BHKV, *, chunk_size: int,
             normalize_qk: bool, interpret: bool, precision=None, chunks_per_step=None, vmem_limit_mib: float = 0.0,
             token_major: bool = False):
    """(Settings, the kernels' inputs in their layouts) from token-major inputs (q, k as given, each key
    head once: the kernels normalise and scale them by row factors) and the document starts [B, T]
    (bool or None); token_major: the kernels read q, k, v and write o in place of the transposed layouts."""
    tokens, heads = v_BTHV.shape[1:3]
    key_heads = q_BTGK.shape[2]
    if token_major and (why := limits.token_major_blocks_fit(key_heads, heads // key_heads, q_BTGK.shape[3],
                                                      v_BTHV.shape[3], interpret)):
        raise ValueError(f"gdn pallas_tpu: token-major blocks need lane-aligned columns per key head: {why}")
    settings = settings_for(chunk_size, heads // key_heads, -(-tokens // chunk_size), v_BTHV.dtype, precision=precision,
                            chunks_per_step=chunks_per_step, interpret=interpret, vmem_limit_mib=vmem_limit_mib,
                            token_major=token_major,
                            bfloat16_rows=jnp.dtype(q_BTGK.dtype) == jnp.bfloat16 == jnp.dtype(k_BTGK.dtype))
    q_BTGK, k_BTGK, q_scale_BTG, k_scale_BTG = query_key_scales(q_BTGK, k_BTGK, normalize_qk, _F32)  # no repeat
    return settings, kernel_layout(q_BTGK, q_scale_BTG, k_BTGK, k_scale_BTG, v_BTHV, g_BTH, beta_BTH, starts_BT,
                                   initial_BHKV, settings)


def output_BTHV(o, tokens: int, value_dim: int):
    """The kernels' output, [B, G, Hg, T', V] or token-major [B, T', H V] (T' padded) -> [B, T, H, V]."""
    if o.ndim == 3:
        return o.reshape(o.shape[0], o.shape[1], -1, value_dim)[:, :tokens]
    return merge_value_heads(jnp.moveaxis(o, 3, 1), 2)[:, :tokens]


def gated_delta_rule(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, *, segment_ids=None, initial_state=None,
                     chunk_size: int = 64, normalize_qk: bool = True, interpret: bool = False, precision=None,
                     chunks_per_step=None, vmem_limit_mib: float = 0.0, token_major: bool = False):
    """ops.gated_delta_rule on the Mosaic kernels: (o [B, T, H, V] in v's dtype, final state float32).

    precision: a key of tpu_chunk.PRECISIONS (default: float32 for float32 inputs,
    bfloat16x3_bf16_inverse else); chunks_per_step: chunks per grid step (default_chunks_per_step);
    token_major: the kernels' blocks read and write the token-major arrays (no layout transposes)."""
    batch, tokens, heads, value_dim = v_BTHV.shape
    key_dim = q_BTGK.shape[3]
    initial_BHKV = initial_or_zeros(initial_state, (batch, heads, key_dim, value_dim), _F32)
    settings, inputs = prepared(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_or_none(segment_ids, batch, tokens),
                                initial_BHKV, chunk_size=chunk_size, normalize_qk=normalize_qk, interpret=interpret,
                                precision=precision, chunks_per_step=chunks_per_step, vmem_limit_mib=vmem_limit_mib,
                                token_major=token_major)
    o, final_BGHKV = core(*inputs, settings)
    return output_BTHV(o, tokens, value_dim), merge_value_heads(final_BGHKV, 1)


# ---------------------------------------------------------------------------------------------
# The chunk-layout API of pallas.core_forward / core_backward (the context-parallel pass 2): float32
# ChunkInputs whose q and k are already repeated per value head (a group of one).


def chunk_inputs_forward(x, starts_BNC, initial_BHKV, *, interpret: bool, precision: str = "float32"):
    """(o [B, N, H, C, V], final state) and the residuals of `chunk_inputs_backward`."""
    batch, chunks, heads, size, key_dim = x.q.shape
    settings = settings_for(size, 1, chunks, x.v.dtype, precision=precision, interpret=interpret)
    pad = -chunks % settings.chunks_per_step
    pad_chunks = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    tokens = lambda a: jnp.moveaxis(pad_chunks(a), 2, 1).reshape(batch, heads, -1, a.shape[-1])  # noqa: E731
    log_gates = jnp.where(starts_BNC[:, :, None, :], START_LOG_GATE, x.g)
    gates = lambda a: jnp.moveaxis(pad_chunks(a), 2, 1)[:, :, :, None, :]  # noqa: E731
    unit = gates(jnp.ones_like(x.beta))  # q and k come normalised and scaled: a factor of 1 per row
    args = (Keys(tokens(x.q), unit), Keys(tokens(x.k), unit), tokens(x.v)[:, :, None], gates(log_gates),
            gates(x.beta), initial_BHKV[:, :, None])
    o, final, states, inverses = forward(*args, settings, save=True)
    o_BNHCV = jnp.moveaxis(o[:, :, 0].reshape(batch, heads, -1, size, o.shape[-1]), 1, 2)[:, :chunks]
    return (o_BNHCV, final[:, :, 0]), (args[:5] + (states, inverses), starts_BNC)


def chunk_inputs_backward(residuals, do_BNHCV, d_final_BHKV, *, interpret: bool, precision: str = "float32"):
    """Cotangents of (ChunkInputs, initial state) from `chunk_inputs_forward`'s residuals."""
    from hybridmoe.kernels.gdn.xla import ChunkInputs

    kernel_residuals, starts_BNC = residuals
    batch, chunks, heads, size, value_dim = do_BNHCV.shape
    settings = settings_for(size, 1, chunks, do_BNHCV.dtype, precision=precision, interpret=interpret)
    pad = kernel_residuals[3].shape[2] - chunks
    do = jnp.moveaxis(jnp.pad(do_BNHCV, [(0, 0), (0, pad), (0, 0), (0, 0), (0, 0)]), 2, 1)
    dq, dk, dv, dg, dbeta, d_initial = backward(
        kernel_residuals, do.reshape(batch, heads, 1, -1, value_dim), d_final_BHKV[:, :, None], settings)
    chunked = lambda a: jnp.moveaxis(a.reshape(batch, heads, -1, size, a.shape[-1]), 1, 2)[:, :chunks]  # noqa: E731
    gate = lambda a: jnp.moveaxis(a[:, :, :, 0], 1, 2)[:, :chunks]  # noqa: E731
    # A start's log gate is the constant START_LOG_GATE: no cotangent reaches its g.
    dg_BNHC = jnp.where(starts_BNC[:, :, None, :], 0.0, gate(dg))
    return ChunkInputs(chunked(dq), chunked(dk), chunked(dv[:, :, 0]), dg_BNHC, gate(dbeta)), d_initial[:, :, 0]
