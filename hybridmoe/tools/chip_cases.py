"""The kernel cases a TPU chip times and checks: each kernel family at named geometries, each of its
backends ready to run, time and compile, with its useful FLOPs and a float32 reference.

Used by benchmarks/tpu_kernels.py (times every backend on the chip), tests/test_chip.py (checks
every Pallas kernel on the chip against the XLA path and the reference) and `hybridmoe calibrate`
(the kernels' measured / modelled time).

    for case in cases("cell").values():
        ref = case.reference()                   # host float32: (forward, forward + backward)
        built = case.backends["pallas_tpu"]()    # its arrays on the device now, nothing before
        fn, args = built.fwd_bwd or built.fwd
        out = fn(*args); fn.lower(*args).compile().as_text()
        backward = built.fwd_bwd is not None
        relative_error(case.view(built.restore(out, backward), backward=backward), ref.fwd_bwd)

Families (one case per family and geometry, named `<family>_<geometry>`):
  gmm         a grouped matmul lhs [M, K] x rhs [G, K, N] over G groups of sorted rows:
              `ragged_dot` (kernels.gmm, backend xla, xla_impl ragged_dot: jax.lax.ragged_dot),
              `pallas_tpu` at the geometry's tiles, `pallas_tpu_128` (no tiles given: on a TPU the
              chip's rule, tile_table.TPU_RULE; the kernels' 128^3 default elsewhere; the name is the
              records'), `pallas_tpu_table` (each kernel at the tile table's entry for its shape,
              benchmarks/tpu_gmm_uneven.py's at the cell), `pallas_tpu_aligned_<A>` (the rows laid out
              as moe.group_align_rows=A lays them before anything is timed, each kernel at row tile A
              and the table's tk and tn; the results brought back after), `tokamax`
              (tokamax.ragged_dot, where the package imports);
  moe_mlp     the routed experts' MLP y = (s * swiglu(x @ wi)) @ wo per group, s the routing weight
              (model/moe.py's _expert_mlp with router_grad_from_wo_input): `xla`, `pallas_tpu`
              (unfused) and `pallas_tpu_fused` (wi_fused_swiglu + wo_fused_dswiglu), both Pallas
              arms at the seed's tiles (recipe qwen3.5-397b-a17b-v7x-128) where the geometry says
              "seed"; `pallas_tpu_table` (unfused, each kernel at the tile table's tiles);
              `pallas_tpu_fused_table` (the fused pair at the table's tiles of the kernels it replaces);
              `pallas_tpu_fused_aligned_<A>` (the fused pair on moe.group_align_rows=A's layout, every
              kernel at row tile A and the table's tk and tn);
  moe_mlp_fp8 moe_mlp with its weights as quant.fp8_fake_quant_hoist=gather8 hands them to the
              kernels: fp8 codes and a scale per expert and channel, dequantized to bfloat16 as an op
              of its own before the kernels: `xla`, `pallas_tpu_table`, `pallas_tpu_fused_table`
              (what gather8's dequantization costs the MoE MLP, against moe_mlp's bfloat16 weights);
  gdn         the Gated DeltaNet core (kernels/gdn/ops.py gated_delta_rule) over packed documents:
              `xla`, `pallas_tpu`, and the Mosaic core at other settings (GDN_SETTINGS: the bfloat16
              and bfloat16x3 precisions, chunk 128 with each; 16 chunk-heads per grid step; blocks of
              the token-major arrays);
  attention   causal flash attention over packed documents, positions restarting per document:
              `xla` (flash in XLA ops), `pallas_tpu` (default blocks), `pallas_tpu_256x512`,
              `splash` (jax's splash attention: causal by token index with segment ids, the same
              mask here), `tokamax` (where the package imports);
  gdn_cp      the core of sequence-sharded GDN (context_parallel.py) over `ranks` context ranks, each a
              shard of the geometry's gdn size, the ranks mapped onto one device by vmap (gdn's inputs
              and reference over the whole sequence): `xla` (the XLA core and scans),
              `pallas_tpu` (gdn.cp_terms_in_kernel: pass 1
              and the local state cotangent as Mosaic kernels on the core's layout) and
              `pallas_tpu_terms_in_xla` (chunk terms by XLA, both scans: the key off);
  cp_m_scan   a context shard's transition product M_r (kernels/gdn/context_parallel.py): `tree`
              (gdn.cp_m_scan=false) and `scan`;
  cp_dh_scan  its local state cotangent dS_loc: `tree` and `scan` (gdn.cp_dh_scan).

Forward + backward is the value and the gradients of sum(out * cot), cot a fixed random cotangent
in the output's dtype (no gradient is trivially zero, and XLA removes nothing: the output is
returned too). The CP scans have no backward.

References (float32, on the device, then kept on the host): gmm and moe_mlp by the family's
reference.py (a loop over groups at HIGHEST precision) on the rows and weights of the first
SAMPLE_GROUPS (chip_case_parts.py) groups (a row's output depends only on its group: the sample is an independent
problem; an empty group is among them); gdn by the token-by-token recurrence (reference.py's step,
scanned in segments that the backward replays, so its memory is not one state per token); attention
by reference.py's gradients (autodiff of the masked XLA core at HIGHEST precision) and that core's
output, one document and one query head at a time (exact: no attention crosses a document); the CP
scans by the recurrence:
M_r is the end state from the identity with v = 0 (S_end = M_r S_in + S_ext, S_ext = 0), dS_loc
the gradient of sum(o * do) with respect to the start state.

Useful FLOPs per call: gmm 2 M K N; moe_mlp 2 M (D 2F + F D); gdn the recurrence's 3 K V
multiply-adds per token and value head (analysis/flops.py); attention 4 N A per visible (query,
key) pair; forward + backward 3x the forward. CP: the scan form's matmuls (M: 2 C K^2 multiply-adds
per chunk and head; dS_loc: C^2 V + 3 C K V).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.tools.chip_case_parts import (Built, Case, OwnGradients, Reference, as_given, document_lengths,
                                             float32_copies, group_sizes, normal, packed_ids, reference_of,
                                             sampled_groups, tokamax_module, uniform, with_gradients)
from hybridmoe.tools.chip_layouts import LaidOut, aligned, aligned_moe_plan, fused_table_tiles, table_tiling

SEED_RECIPE = "qwen3.5-397b-a17b-v7x-128"
RECURRENCE_SEGMENT = 128  # tokens per rematerialised segment of the reference recurrence
F32 = jnp.float32
BF16 = jnp.bfloat16

# Per geometry, per family section, the shapes. cell: the seed cell's per-device shapes
# (Qwen3.5-397B-A17B on 128 v7x chips: 16,384 tokens per device, 128 local experts x top-10 rows);
# one_chip: recipe qwen3.5-35b-a3b-v5e-1 (8,192 tokens, 16 experts, top-8); edges: tests/test_chip.py's
# (every tile and block edge crossed, compiles in seconds); tiny: CPU, interpret mode.
GEOMETRIES: dict[str, dict[str, dict]] = {
    "cell": {
        "gmm": dict(rows=65536, k=4096, n=2048, groups=128, tiles=(512, 2048, 512), aligned=(64, 128)),
        "moe_mlp": dict(rows=65536, d=4096, f=1024, groups=128, tiles="seed", aligned=(128,)),
        "gdn": dict(tokens=16384, key_heads=16, value_heads=64, key_dim=128, value_dim=128, chunk=64, documents=4),
        "gdn_cp": dict(tokens=2 * 16384, ranks=2, key_heads=16, value_heads=64, key_dim=128, value_dim=128, chunk=64,
                       documents=4),
        "attention": dict(tokens=16384, heads=32, kv_heads=2, head_dim=256, documents=4),
        "cp": dict(tokens=16384, key_heads=16, value_heads=64, key_dim=128, value_dim=128, chunk=64),
    },
    "one_chip": {
        "gmm": dict(rows=65536, k=2048, n=1024, groups=16, tiles=(512, 2048, 512)),
        "moe_mlp": dict(rows=65536, d=2048, f=512, groups=16, tiles="seed"),
        "gdn": dict(tokens=8192, key_heads=16, value_heads=32, key_dim=128, value_dim=128, chunk=64, documents=4),
        "gdn_cp": dict(tokens=2 * 8192, ranks=2, key_heads=16, value_heads=32, key_dim=128, value_dim=128, chunk=64,
                       documents=4),
        "attention": dict(tokens=8192, heads=16, kv_heads=2, head_dim=256, documents=4),
        "cp": dict(tokens=8192, key_heads=16, value_heads=32, key_dim=128, value_dim=128, chunk=64),
    },
    "edges": {
        "gmm": dict(rows=1000, k=512, n=384, groups=6, tiles=(128, 256, 128), aligned=(128,)),
        "moe_mlp": dict(rows=1500, d=4096, f=1024, groups=4, tiles="seed", aligned=(128,)),
        "gdn": dict(tokens=1024, key_heads=2, value_heads=8, key_dim=128, value_dim=128, chunk=64, documents=3),
        "gdn_cp": dict(tokens=2 * 1024, ranks=2, key_heads=2, value_heads=8, key_dim=128, value_dim=128, chunk=64,
                       documents=3),
        "attention": dict(tokens=2048, heads=8, kv_heads=2, head_dim=256, documents=3),
        "cp": dict(tokens=1024, key_heads=2, value_heads=8, key_dim=128, value_dim=128, chunk=64),
    },
    "tiny": {
        "gmm": dict(rows=200, k=256, n=256, groups=5, tiles=(64, 128, 128), aligned=(16,)),
        "moe_mlp": dict(rows=200, d=256, f=128, groups=5,
                        tiles=dict(tm=64, tk=128, tn=128, wi_fwd_tile_n_per_half=64, wi_fwd_rhs_buffer_count=0),
                        aligned=(16,)),
        "gdn": dict(tokens=96, key_heads=1, value_heads=2, key_dim=16, value_dim=16, chunk=16, documents=3),
        "gdn_cp": dict(tokens=2 * 64, ranks=2, key_heads=1, value_heads=2, key_dim=16, value_dim=16, chunk=16, documents=3),
        "attention": dict(tokens=256, heads=4, kv_heads=2, head_dim=128, documents=3),
        "cp": dict(tokens=128, key_heads=1, value_heads=2, key_dim=16, value_dim=16, chunk=16),
    },
}


# ---------------------------------------------------------------------------------------------
# Families: inputs (args, cot), backends (name -> forward fn or the reason it is skipped), the
# differentiated arguments, useful forward FLOPs, the reference and the view it covers.


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    section: str  # the geometry's section
    make: Callable[[dict], tuple[tuple, Any]]
    backends: Callable[[dict, bool], dict[str, Callable | str]]
    argnums: tuple[int, ...] | None
    flops: Callable[[dict], float]
    reference: Callable[[dict], Reference]
    view: Callable[[dict, Any, bool], Any] = lambda g, out, backward: out


# gmm ----------------------------------------------------------------------------------------


def _gmm_make(g):
    m, k, n, groups = g["rows"], g["k"], g["n"], g["groups"]
    args = (normal(1, (m, k), BF16), normal(2, (groups, k, n), BF16, k ** -0.5), jnp.asarray(group_sizes(m, groups)))
    return args, normal(3, (m, n), BF16)


def _gmm_backends(g, interpret):
    from hybridmoe.kernels import gmm as K

    tm, tk, tn = g["tiles"]
    out: dict[str, Callable | str] = {
        "ragged_dot": functools.partial(K.gmm, backend="xla", xla_impl="ragged_dot"),
        "pallas_tpu": functools.partial(K.gmm, backend="pallas_tpu", tiling=K.Tiling(tm, tk, tn), interpret=interpret),
        "pallas_tpu_128": functools.partial(K.gmm, backend="pallas_tpu", interpret=interpret),
        # Each of the three kernels at the chip's measured tiles for its shape (kernels/gmm/tile_table.py;
        # the heuristic tiles where the table has no entry near it).
        "pallas_tpu_table": functools.partial(K.gmm, backend="pallas_tpu", tiling=K.Tiling(from_table=True),
                                              interpret=interpret),
        # moe.group_align_rows' layout: each group from a multiple of A rows, at row tile A and the table's
        # tk and tn for each kernel; no tile spans two groups.
        **{f"pallas_tpu_aligned_{a}": _gmm_aligned(g, a, interpret) for a in g.get("aligned", ())},
    }
    tokamax = tokamax_module()
    if tokamax is None:
        out["tokamax"] = "tokamax does not import on this host"
    else:
        impl = None if interpret else "mosaic"  # its Mosaic TPU kernel on the chip; its default elsewhere
        out["tokamax"] = lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation=impl)
    return out


def _gmm_aligned(g, align: int, interpret: bool) -> LaidOut:
    from hybridmoe.kernels import gmm as K

    m, k, n, groups = g["rows"], g["k"], g["n"], g["groups"]
    tiling = functools.partial(table_tiling, m=m, groups=groups, tm=align)
    fn = functools.partial(K.gmm, backend="pallas_tpu", interpret=interpret, tiling=tiling("gmm", k, n),
                           dlhs_tiling=tiling("gmm_t", n, k), drhs_tiling=tiling("tgmm", k, n))
    return aligned(fn, m, align, row_args=(0,), sizes_arg=2)  # (x, w, sizes)


def _gmm_reference(g):
    from hybridmoe.kernels.gmm import reference as R

    (x, w, sizes), cot = _gmm_make(g)
    s, rows = sampled_groups(np.asarray(sizes))
    fn = lambda x, w, sizes: R.gmm(x, w, sizes, out_dtype=F32)  # noqa: E731
    return reference_of(fn, (x[:rows], w[:s], sizes[:s]), cot[:rows], (0, 1))


def _gmm_view(g, out, backward):
    s, rows = sampled_groups(group_sizes(g["rows"], g["groups"]))
    if not backward:
        return out[:rows]
    y, (dx, dw) = out
    return y[:rows], (dx[:rows], dw[:s])


# moe_mlp -------------------------------------------------------------------------------------


def _moe_make(g):
    m, d, f, groups = g["rows"], g["d"], g["f"], g["groups"]
    args = (normal(11, (m, d), BF16), uniform(12, (m,), 0.05, 1.0), normal(13, (groups, d, 2 * f), BF16, d ** -0.5),
            normal(14, (groups, f, d), BF16, f ** -0.5), jnp.asarray(group_sizes(m, groups)))
    return args, normal(15, (m, d), BF16)


@functools.cache
def seed_gmm_keys() -> dict:
    """The seed recipe's kernels.gmm keys (its tiles, per-kernel tiles and VMEM limit)."""
    from hybridmoe.recipe import load_config

    return load_config(SEED_RECIPE, [], platform="tpu").kernels.gmm.model_dump()


def moe_plans(g, interpret: bool) -> dict:
    """The MoE MLP's arms as model/moe.py's GroupedPlan: xla, pallas_tpu (unfused), pallas_tpu_fused,
    those two at the geometry's tiles ("seed": the seed recipe's; its tile per half clamped to F), and
    pallas_tpu_table (unfused, at the tile table's tiles)."""
    from hybridmoe.kernels.gmm import KernelTiles, Tiling, kernel_tiles
    from hybridmoe.model.moe import GroupedPlan

    keys = seed_gmm_keys() if g["tiles"] == "seed" else g["tiles"]
    tiles = kernel_tiles(keys)
    per_half = min(int(keys.get("wi_fwd_tile_n_per_half") or g["f"]), g["f"])
    common = dict(num_experts=g["groups"], router_grad_from_wo_input=True, xla_impl="ragged_dot")
    pallas = dict(common, backend="pallas_tpu", tiles=tiles, interpret=interpret)
    fused = dict(wi_fused_swiglu=True, wo_fused_dswiglu=True)
    table_tiles, table_per_half = fused_table_tiles(g)
    return {"xla": GroupedPlan(**common, backend="xla"),
            "pallas_tpu": GroupedPlan(**pallas),
            # Each of the six unfused kernels at the tile table's tiles for its shape (at the cell: those
            # benchmarks/tpu_gmm_uneven.py found at uneven groups).
            "pallas_tpu_table": GroupedPlan(**dict(pallas, tiles=KernelTiles.shared(Tiling(from_table=True)))),
            "pallas_tpu_fused": GroupedPlan(**pallas, **fused, tile_n_per_half=per_half,
                                            rhs_buffer_count=int(keys.get("wi_fwd_rhs_buffer_count", 0))),
            # The fused pair where the unfused table arm runs its kernels: the fused up projection at the
            # wi forward's table tiles (its N tile both halves), the fused input gradient at the wo input
            # gradient's, the other four as the table arm.
            "pallas_tpu_fused_table": GroupedPlan(**dict(pallas, tiles=table_tiles), **fused,
                                                  tile_n_per_half=table_per_half)}


def _moe_backends(g, interpret):
    from hybridmoe.model.moe import _expert_mlp

    def run(plan):
        return functools.partial(lambda x, w, wi, wo, sizes, plan: _expert_mlp(x, w, wi, wo, sizes, plan, 0), plan=plan)

    return {**{name: run(plan) for name, plan in moe_plans(g, interpret).items()},
            # (x, w, wi, wo, sizes): the rows and their routing weights laid out
            **{f"pallas_tpu_fused_aligned_{a}": aligned(run(aligned_moe_plan(g, a, interpret)), g["rows"], a,
                                                        row_args=(0, 1), sizes_arg=4)
               for a in g.get("aligned", ())}}


def _moe_reference(g):
    from hybridmoe.kernels.gmm import reference as R

    (x, w, wi, wo, sizes), cot = _moe_make(g)
    s, rows = sampled_groups(np.asarray(sizes))
    fn = lambda x, w, wi, wo, sizes: R.moe_mlp(x, wi, wo, sizes, row_scale_M=w)  # noqa: E731
    return reference_of(fn, (x[:rows], w[:rows], wi[:s], wo[:s], sizes[:s]), cot[:rows], (0, 1, 2, 3))


def _moe_view(g, out, backward):
    s, rows = sampled_groups(group_sizes(g["rows"], g["groups"]))
    if not backward:
        return out[:rows]
    y, (dx, dw, dwi, dwo) = out
    return y[:rows], (dx[:rows], dw[:rows], dwi[:s], dwo[:s])


# moe_mlp_fp8 ---------------------------------------------------------------------------------


def _moe_fp8_make(g):
    """moe_mlp's rows, routing weights, cotangent and group sizes; its weights as gather8 leaves them
    after the gather: fp8 codes with a power-of-two scale per expert and output channel (so the
    channels span many binades), and the bfloat16 weights those codes stand for, which the gradients
    go to (gather8's straight-through backward) and the reference reads (they equal the dequantized
    codes bit for bit)."""
    from hybridmoe.quant import fp8

    (x, w, wi, wo, sizes), cot = _moe_make(g)

    def coded(seed, weight):
        channel = 2.0 ** jax.random.randint(jax.random.key(seed), (weight.shape[0], 1, weight.shape[2]), -3, 4)
        amax = fp8.absmax(weight.astype(F32) * channel, 1)
        scale = fp8.scale_from_absmax(amax)
        codes = on_e4m3_grid(weight.astype(F32) * channel / scale).astype(fp8.E4M3)
        return fp8.dequantize(codes, scale, BF16), codes, scale

    wi, codes_i, scale_i = coded(16, wi)
    wo, codes_o, scale_o = coded(17, wo)
    return (x, w, wi, wo, codes_i, scale_i, codes_o, scale_o, sizes), cot


def on_e4m3_grid(x):
    """x (float32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in float32
    arithmetic: fp8.quantize's rounding, but with its conversion to fp8 then exact. The inputs and the
    reference of a case are made by two compiled programs, and a TPU program's float32 -> fp8
    conversion of an inexact value can round differently from another's (the cell's reference then
    read weights an fp8 step away from the timed arms' at some elements: 9.5e-2 relative error for
    every arm, 20x the bfloat16 case's)."""
    m, e = jnp.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    step = jnp.ldexp(jnp.float32(1.0), jnp.maximum(e, -5) - 4)  # 3 mantissa bits; below 2^-6 the subnormals' 2^-9
    return jnp.round(x / step) * step


@jax.custom_vjp
def _dequantized(weight, codes, scale):
    """The codes' weight (gather8's dequantization after the gather) in the forward; the gradient
    to `weight`, the bfloat16 weight the codes were made from (gather8's straight-through)."""
    from hybridmoe.quant.expert_fp8 import dequantize_gathered

    return dequantize_gathered(codes, scale, weight.dtype)


_dequantized.defvjp(lambda weight, codes, scale: (_dequantized(weight, codes, scale), None),
                    lambda _, ct: (ct, None, None))


def _moe_fp8_backends(g, interpret):
    """The XLA path, the unfused kernels and the fused pair at the table's tiles, each after the
    dequantization as an op of its own (writing the bfloat16 weight the kernels read)."""
    from hybridmoe.model.moe import _expert_mlp

    plans = moe_plans(g, interpret)

    def run(plan):
        def fn(x, w, wi, wo, codes_i, scale_i, codes_o, scale_o, sizes):
            return _expert_mlp(x, w, _dequantized(wi, codes_i, scale_i), _dequantized(wo, codes_o, scale_o),
                               sizes, plan, 0)
        return fn

    return {name: run(plans[name]) for name in ("xla", "pallas_tpu_table", "pallas_tpu_fused_table")}


def _moe_fp8_reference(g):
    from hybridmoe.kernels.gmm import reference as R

    # Made in one program, as the case's own inputs are: made op by op, the weights' float32 temporaries
    # are 4.3 GB each at the cell (this reference's first run on the chip failed, its error cut to JAX's
    # note on the traceback).
    (x, w, wi, wo, *_, sizes), cot = jax.jit(functools.partial(_moe_fp8_make, g))()
    s, rows = sampled_groups(np.asarray(sizes))
    fn = lambda x, w, wi, wo, sizes: R.moe_mlp(x, wi, wo, sizes, row_scale_M=w)  # noqa: E731
    return reference_of(fn, (x[:rows], w[:rows], wi[:s], wo[:s], sizes[:s]), cot[:rows], (0, 1, 2, 3))


# gdn -----------------------------------------------------------------------------------------


def _gdn_raw(g, seed: int = 21):
    t, hk, hv, kd, vd = g["tokens"], g["key_heads"], g["value_heads"], g["key_dim"], g["value_dim"]
    # Gates that keep a memory of tens of tokens, so chunks really interact (tests/test_gdn_kernel.py's).
    return (normal(seed, (1, t, hk, kd), BF16), normal(seed + 1, (1, t, hk, kd), BF16),
            normal(seed + 2, (1, t, hv, vd), BF16), jnp.log(uniform(seed + 3, (1, t, hv), 0.7, 1.0)),
            uniform(seed + 4, (1, t, hv), 0.05, 1.0))


def _gdn_make(g):
    segment_ids = jnp.asarray(packed_ids(g["tokens"], g["documents"])[1])
    return (*_gdn_raw(g), segment_ids), normal(26, (1, g["tokens"], g["value_heads"], g["value_dim"]), BF16)


# The Mosaic GDN core's settings beside its defaults (chunk 64, the bfloat16x3_bf16_inverse precision,
# about limits.HEAD_CHUNKS_PER_STEP chunk-heads per grid step, the transposed layouts): name -> (chunk
# size, precision of kernels/gdn/tpu_chunk.PRECISIONS, chunk-heads per grid step: chunks per step x the
# value heads of a key head, so one arm means the same step size at every geometry; the kernels' blocks
# of the token-major arrays, pallas_tpu.gated_delta_rule's token_major).
GDN_SETTINGS = {"pallas_tpu_bf16": (None, "bfloat16", None, False),
                "pallas_tpu_bf16x3": (None, "bfloat16x3", None, False),
                "pallas_tpu_token_major": (None, None, None, True),
                "pallas_tpu_c128": (128, None, None, False),
                "pallas_tpu_c128_bf16": (128, "bfloat16", None, False),
                "pallas_tpu_c128_bf16x3": (128, "bfloat16x3", None, False),
                "pallas_tpu_c128_token_major": (128, None, None, True),
                "pallas_tpu_c128_bf16_token_major": (128, "bfloat16", None, True),
                "pallas_tpu_chunk_heads_16": (None, None, 16, False),
                "pallas_tpu_bf16_chunk_heads_16": (None, "bfloat16", 16, False)}


def _gdn_backends(g, interpret):
    from hybridmoe.kernels.gdn import gated_delta_rule
    from hybridmoe.kernels.gdn import pallas_tpu

    def rule(backend):
        return lambda q, k, v, gate, beta, seg: gated_delta_rule(
            q, k, v, gate, beta, segment_ids=seg, chunk_size=g["chunk"], backend=backend, interpret=interpret)[0]

    group = g["value_heads"] // g["key_heads"]

    def settings(chunk, precision, chunk_heads, token_major):
        per_step = max(1, chunk_heads // group) if chunk_heads else None
        return lambda q, k, v, gate, beta, seg: pallas_tpu.gated_delta_rule(
            q, k, v, gate, beta, segment_ids=seg, chunk_size=chunk or g["chunk"], precision=precision,
            chunks_per_step=per_step, interpret=interpret, token_major=token_major)[0]

    return {"xla": rule("xla"), "pallas_tpu": rule("pallas_tpu"),
            **{name: settings(*arm) for name, arm in GDN_SETTINGS.items()}}


def _gdn_cp_backends(g, interpret):
    """Sequence-sharded GDN's core with the sequence over g["ranks"] context ranks, the ranks mapped
    by vmap onto one device (jax.vmap with the axis name: the cross-rank prefix's collectives act
    along the mapped axis), each rank a shard of the cell's per-device size. One rank alone would time
    nothing of pass 1 or the local state cotangent: its prefix is zero and XLA removes both (the first
    chip run of this case, at 0ca81d2, timed pass 2 alone)."""
    from hybridmoe.kernels.gdn.context_parallel import gated_delta_rule_context_parallel

    ranks = g["ranks"]

    def rule(backend="pallas_tpu", **keys):
        def rank(q, k, v, gate, beta, seg):
            return gated_delta_rule_context_parallel(q, k, v, gate, beta, segment_ids=seg, axis_name="context",
                                                     chunk_size=g["chunk"], backend=backend, interpret=interpret,
                                                     **keys)

        def rank_with_gradients(q, k, v, gate, beta, seg, cot):  # the vjp inside the vmap: its backward's
            out, vjp = jax.vjp(lambda *d: rank(*d, seg), q, k, v, gate, beta)  # collectives see the axis
            return out, vjp(cot)

        shards = lambda a: jnp.moveaxis(a.reshape(a.shape[0], ranks, -1, *a.shape[2:]), 1, 0)  # noqa: E731
        sequence = lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1, *a.shape[3:])  # noqa: E731
        over_ranks = lambda fn, *args: jax.tree.map(  # noqa: E731
            sequence, jax.vmap(fn, axis_name="context")(*map(shards, args)))
        return OwnGradients(lambda *args: over_ranks(rank, *args),
                            lambda *args_and_cot: over_ranks(rank_with_gradients, *args_and_cot))

    return {"xla": rule("xla", cp_m_scan=True, cp_dh_scan=True), "pallas_tpu": rule(terms_in_kernel=True),
            "pallas_tpu_token_major": rule(terms_in_kernel=True, token_major=True),
            "pallas_tpu_terms_in_xla": rule(cp_m_scan=True, cp_dh_scan=True)}


def recurrence(q, k, v, gate, beta, *, segment_ids=None, initial_state=None, segment: int = RECURRENCE_SEGMENT):
    """(o, final state): the token-by-token recurrence of kernels/gdn/reference.py (its input
    preparation and step), scanned in segments of `segment` tokens, each replayed by the backward
    (jax.checkpoint): it keeps one state per segment, not one per token. float32."""
    from hybridmoe.kernels.gdn.reference import prepare_query_key, recurrence_step, starts_or_none

    batch, tokens, heads, vd = v.shape
    kd = q.shape[-1]
    q, k = prepare_query_key(q, k, heads, True, F32)
    starts = starts_or_none(segment_ids, batch, tokens)
    state = jnp.zeros((batch, heads, kd, vd), F32) if initial_state is None else initial_state.astype(F32)
    size = segment if tokens % segment == 0 else tokens

    def step(state, token):
        q_t, k_t, v_t, g_t, b_t, start = token
        state = jnp.where(start[:, None, None, None], 0.0, state)
        o_t, state = recurrence_step(state, q_t, k_t, v_t, g_t, b_t)
        return state, o_t

    @jax.checkpoint
    def one_segment(state, tokens_of_segment):
        return jax.lax.scan(step, state, tokens_of_segment)

    def segments(a):  # [B, T, ...] -> [T / size, size, B, ...]
        a = jnp.moveaxis(a, 1, 0)
        return a.reshape(tokens // size, size, *a.shape[1:])

    xs = jax.tree.map(segments, (q, k, v.astype(F32), gate.astype(F32), beta.astype(F32), starts))
    state, o = jax.lax.scan(one_segment, state, xs)
    return jnp.moveaxis(o.reshape(tokens, *o.shape[2:]), 0, 1), state


def _gdn_reference(g):
    args, cot = _gdn_make(g)
    fn = lambda q, k, v, gate, beta, seg: recurrence(q, k, v, gate, beta, segment_ids=seg)[0]  # noqa: E731
    return reference_of(fn, args, cot, (0, 1, 2, 3, 4))


# attention -----------------------------------------------------------------------------------


def _attention_make(g):
    t, n, kv, a = g["tokens"], g["heads"], g["kv_heads"], g["head_dim"]
    pos, seg = packed_ids(t, g["documents"])
    args = (normal(31, (1, t, n, a), BF16), normal(32, (1, t, kv, a), BF16), normal(33, (1, t, kv, a), BF16),
            jnp.asarray(pos), jnp.asarray(seg))
    return args, normal(34, (1, t, n, a), BF16)


def flash(backend: str, block_q: int = 0, block_k: int = 0, *, interpret: bool = False):
    """(q, k, v, pos, seg) -> o: kernels/attention's flash attention, blocks fitted to the length
    (0: the backend's default)."""
    from hybridmoe.kernels.attention import flash_attention, limits

    def run(q, k, v, pos, seg):
        rule, (dq, dk) = limits.block_rule(backend, not interpret), limits.DEFAULT_BLOCKS[backend]
        bq, bk = limits.fit_block(block_q or dq, q.shape[1], rule), limits.fit_block(block_k or dk, k.shape[1], rule)
        return flash_attention(q, k, v, q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg,
                               scale=q.shape[-1] ** -0.5, backend=backend, block_q=bq, block_k=bk, interpret=interpret)
    return run


def _splash(g, interpret):
    """jax's splash attention (causal by token index, segment ids: within a document that is
    causality by position): one MQA kernel per kv head (vmapped), q scaled first."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    t, n, kv = g["tokens"], g["heads"], g["kv_heads"]
    b = min(512, t)
    kernel = sa.make_splash_mqa_single_device(
        sa.MultiHeadMask([sa.CausalMask((t, t))] * (n // kv)),
        block_sizes=sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b),
        interpret=interpret)

    def run(q, k, v, pos, seg):
        del pos
        batch, _, _, a = q.shape
        q_BGRTA = (q * a ** -0.5).astype(q.dtype).reshape(batch, t, kv, n // kv, a).transpose(0, 2, 3, 1, 4)
        k_BGTA, v_BGTA = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        per_head = jax.vmap(lambda q_, k_, v_, s: kernel(q_, k_, v_, segment_ids=sa.SegmentIds(s, s)),
                            in_axes=(0, 0, 0, None))
        o = jax.vmap(per_head)(q_BGRTA, k_BGTA, v_BGTA, seg)
        return o.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    return run


def _attention_backends(g, interpret):
    out: dict[str, Callable | str] = {
        "xla": flash("xla"), "pallas_tpu": flash("pallas_tpu", interpret=interpret),
        "pallas_tpu_256x512": flash("pallas_tpu", 256, 512, interpret=interpret),
        "splash": _splash(g, interpret)}
    tokamax = tokamax_module()
    if tokamax is None:
        out["tokamax"] = "tokamax does not import on this host"
    else:
        def run(q, k, v, pos, seg):
            same_document = (seg[:, :, None] == seg[:, None, :])[:, None]
            return tokamax.dot_product_attention(q, k, v, mask=same_document, is_causal=True,
                                                 scale=q.shape[-1] ** -0.5,
                                                 implementation=None if interpret else "mosaic")
        out["tokamax"] = run
    return out


def _attention_reference(g):
    """Per document (attention never crosses one) and per query head (one head's [L, L] scores on
    the device at a time): reference.py's gradients (autodiff of the masked XLA core in float32 at
    HIGHEST precision) and the masked core's output."""
    from hybridmoe.kernels.attention.reference import attention_reference_grads
    from hybridmoe.kernels.attention.xla import attention

    (q, k, v, pos, seg), cot = float32_copies(_attention_make(g))
    heads, group = g["heads"], g["heads"] // g["kv_heads"]
    scale = g["head_dim"] ** -0.5

    @jax.jit
    def document(q, k, v, do, pos, seg):
        def head(n):
            qn, don = (jax.lax.dynamic_slice_in_dim(a, n, 1, axis=2) for a in (q, do))
            kg, vg = (jax.lax.dynamic_slice_in_dim(a, n // group, 1, axis=2) for a in (k, v))
            ids = dict(q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=scale)
            with jax.default_matmul_precision("highest"):
                o = attention(qn, kg, vg, **ids)
            return o, attention_reference_grads(qn, kg, vg, don, pos, pos, seg, seg, scale)

        o, (dq, dk, dv) = jax.lax.map(head, jnp.arange(heads))  # [N, 1, L, 1, A] each
        per_kv = lambda d: d[:, :, :, 0].reshape(g["kv_heads"], group, *d.shape[1:3], -1).sum(1)  # noqa: E731
        as_heads = lambda d: jnp.moveaxis(d[:, :, :, 0], 0, 2)  # noqa: E731
        return as_heads(o), (as_heads(dq), jnp.moveaxis(per_kv(dk), 0, 2), jnp.moveaxis(per_kv(dv), 0, 2))

    parts, start = [], 0
    for n in document_lengths(g["tokens"], g["documents"]):
        rows = slice(start, start + n)
        parts.append(jax.device_get(document(*(a[:, rows] for a in (q, k, v, cot, pos, seg)))))
        start += n
    o = np.concatenate([p[0] for p in parts], axis=1)
    grads = tuple(np.concatenate([p[1][i] for p in parts], axis=1) for i in range(3))
    return Reference(o, (o, grads))


def visible_pairs(tokens: int, documents: int) -> int:
    return sum(n * (n + 1) // 2 for n in document_lengths(tokens, documents))


# context-parallel scans ------------------------------------------------------------------------


def _cp_raw(g):
    """float32 inputs of one shard (one document) whose transition product stays well inside float32:
    total decay about e^-1 and each key direction shrunk by about e^-4 over the shard."""
    t, hk, hv, kd, vd = g["tokens"], g["key_heads"], g["value_heads"], g["key_dim"], g["value_dim"]
    if kd != vd:
        raise ValueError(f"cp cases: the reference needs key_dim == value_dim (M_r from the identity state); got {g}")
    beta_max = min(1.0, 8.0 * kd / t)
    return (normal(41, (1, t, hk, kd), F32), normal(42, (1, t, hk, kd), F32), normal(43, (1, t, hv, vd), F32),
            -uniform(44, (1, t, hv), 0.0, 2.0 / t), uniform(45, (1, t, hv), 0.0, beta_max),
            normal(46, (1, t, hv, vd), F32))


def _on_host():
    """Where a scan case's oracle runs: the host's CPU (float32 ops exact to their rounding), so that
    on a chip it is no party to the error measured. The chip's first run found the scans 1.4e-3 from
    a recurrence run on the chip, while the tree and the scan agreed to 1e-6."""
    return jax.default_device(jax.devices("cpu")[0])


def _cp_terms(q, k, v, gate, beta, chunk):
    """The chunk terms the scans take, at HIGHEST precision: the cases test the scans, and a TPU's
    default precision (one bfloat16 pass) would put 3e-3 of error into their inputs alike."""
    from hybridmoe.kernels.gdn.xla import chunk_terms, prepare_chunks

    with jax.default_matmul_precision("highest"):
        x, starts = prepare_chunks(q, k, v, gate, beta, jnp.zeros(q.shape[:2], bool), chunk, True)
        return chunk_terms(x, starts)


def _cp_make(with_do: bool):
    def make(g):
        from hybridmoe.kernels.gdn.xla import to_chunks

        q, k, v, gate, beta, do = _cp_raw(g)
        terms = _cp_terms(q, k, v, gate, beta, g["chunk"])
        return ((terms, to_chunks(do, g["chunk"])) if with_do else (terms,)), None
    return make


def _cp_backends(kind):
    def backends(g, interpret):
        from hybridmoe.kernels.gdn import context_parallel as cp

        if kind == "m":
            return {"tree": cp.cp_m_tree_product, "scan": cp.cp_m_scan_product}
        return {"tree": cp.cp_dh_tree_cotangent, "scan": cp.cp_dh_scan_cotangent}
    return backends


def _cp_reference(kind):
    def reference(g):
        q, k, v, gate, beta, do = _cp_raw(g)
        with _on_host(), jax.default_matmul_precision("highest"):
            if kind == "m":  # S_end = M S_in when v = 0: M from the identity start state
                eye = jnp.broadcast_to(jnp.eye(g["key_dim"], dtype=F32), (1, g["value_heads"], g["key_dim"], g["key_dim"]))
                m = jax.jit(lambda *a: recurrence(*a, initial_state=eye)[1])(q, k, jnp.zeros_like(v), gate, beta)
                return Reference(jax.device_get(m), None)
            start = jnp.zeros((1, g["value_heads"], g["key_dim"], g["value_dim"]), F32)
            loss = lambda s: jnp.sum(recurrence(q, k, v, gate, beta, initial_state=s)[0] * do)  # noqa: E731
            return Reference(jax.device_get(jax.jit(jax.grad(loss))(start)), None)
    return reference


def _cp_m_flops(g):
    chunks = g["tokens"] // g["chunk"]
    return 4.0 * g["chunk"] * g["key_dim"] ** 2 * chunks * g["value_heads"]


def _cp_dh_flops(g):
    c, kd, vd = g["chunk"], g["key_dim"], g["value_dim"]
    return 2.0 * (g["tokens"] // c) * g["value_heads"] * (c * c * vd + 3 * c * kd * vd)


FAMILIES = (
    Family("gmm", "gmm", _gmm_make, _gmm_backends, (0, 1), lambda g: 2.0 * g["rows"] * g["k"] * g["n"],
           _gmm_reference, _gmm_view),
    Family("moe_mlp", "moe_mlp", _moe_make, _moe_backends, (0, 1, 2, 3),
           lambda g: 6.0 * g["rows"] * g["d"] * g["f"], _moe_reference, _moe_view),
    Family("moe_mlp_fp8", "moe_mlp", _moe_fp8_make, _moe_fp8_backends, (0, 1, 2, 3),
           lambda g: 6.0 * g["rows"] * g["d"] * g["f"], _moe_fp8_reference, _moe_view),
    Family("gdn", "gdn", _gdn_make, _gdn_backends, (0, 1, 2, 3, 4),
           lambda g: 6.0 * g["key_dim"] * g["value_dim"] * g["tokens"] * g["value_heads"], _gdn_reference),
    Family("gdn_cp", "gdn_cp", _gdn_make, _gdn_cp_backends, (0, 1, 2, 3, 4),
           lambda g: 6.0 * g["key_dim"] * g["value_dim"] * g["tokens"] * g["value_heads"], _gdn_reference),
    Family("cp_m_scan", "cp", _cp_make(False), _cp_backends("m"), None, _cp_m_flops, _cp_reference("m")),
    Family("cp_dh_scan", "cp", _cp_make(True), _cp_backends("dh"), None, _cp_dh_flops, _cp_reference("dh")),
    Family("attention", "attention", _attention_make, _attention_backends, (0, 1, 2),
           lambda g: 4.0 * g["heads"] * g["head_dim"] * visible_pairs(g["tokens"], g["documents"]),
           _attention_reference),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


# ---------------------------------------------------------------------------------------------
# Cases


def _case(family: Family, geometry: str, g: dict, interpret: bool) -> Case:
    make_inputs = jax.jit(lambda: family.make(g))
    fns = family.backends(g, interpret)

    def builder(fn):
        def build(inputs=None) -> Built:
            args, cot = make_inputs() if inputs is None else inputs
            run, restore = fn, as_given
            if isinstance(fn, LaidOut):
                args, cot, restore = fn.lay(args, cot)
                run = fn.fn
            fwd = (jax.jit(run.fn if isinstance(run, OwnGradients) else run), args)
            if family.argnums is None:
                return Built(fwd, None, restore)
            fwd_bwd = run.fwd_bwd if isinstance(run, OwnGradients) else with_gradients(run, family.argnums)
            return Built(fwd, (jax.jit(fwd_bwd), (*args, cot)), restore)
        return build

    flops = family.flops(g)
    return Case(name=f"{family.name}_{geometry}", family=family.name, geometry=geometry, shape=dict(g),
                flops=(flops, None if family.argnums is None else 3.0 * flops), make_inputs=make_inputs,
                backends={n: builder(fn) for n, fn in fns.items() if not isinstance(fn, str)},
                skipped={n: why for n, why in fns.items() if isinstance(why, str)},
                reference=functools.partial(family.reference, g),
                view=lambda out, backward: family.view(g, out, backward))


def cases(geometry: str, *, interpret: bool | None = None, families=None) -> dict[str, Case]:
    """{case name: Case} of every family (or those named) at `geometry` (a GEOMETRIES key).
    interpret: run the Pallas kernels interpreted (default: unless JAX's backend is a TPU)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown kernel geometry {geometry!r}; choose one of {', '.join(GEOMETRIES)}")
    unknown = set(families or ()) - set(FAMILY_NAMES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; choose from {', '.join(FAMILY_NAMES)}")
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    return {f"{f.name}_{geometry}": _case(f, geometry, GEOMETRIES[geometry][f.section], interpret)
            for f in FAMILIES if families is None or f.name in families}


def relative_error(actual, expected) -> float:
    """max over leaves of max |actual - expected| / max |expected| (expected: host float32; each
    leaf compared on the actual leaf's device)."""
    errors = []
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if a.shape != e.shape:
            raise ValueError(f"compared arrays differ in shape: {a.shape} vs {e.shape}")
        e = jax.device_put(np.asarray(e, np.float32), getattr(a, "sharding", None))
        diff, scale = _max_abs_pair(a, e)
        errors.append(float(diff) / max(float(scale), 1e-30))
    return max(errors)


@jax.jit
def _max_abs_pair(actual, expected):
    return jnp.max(jnp.abs(actual.astype(F32) - expected)), jnp.max(jnp.abs(expected))
