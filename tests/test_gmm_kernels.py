"""Grouped matmuls against the per-group reference, on every backend (Pallas in interpret mode).

Legend: M rows, K contraction, N output columns, E groups in group_sizes, G local groups,
D model width, F hidden half width, T forward tile per half.

Interpret mode is slow, so the Pallas cases are few and tiny; the XLA backend takes the
hypothesis-drawn group sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broken_variants import BROKEN, BROKEN_FUSED_COPIES, BROKEN_GMM_TPU, READER_VARIANTS
from hybridmoe.kernels import gmm as K
from hybridmoe.kernels.gmm import epilogue as epi
from hybridmoe.kernels.gmm import reference as R
from hybridmoe.kernels.gmm import tiling as tiling_module
from hybridmoe.kernels.gmm.tiling import Tiling, tile_problems

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # max |a - b| / max(|b|, 1)
TINY = Tiling(tm=8, tk=8, tn=8)
# The TPU interpreter running each DMA only when a wait asks for it (tests of the kernels that copy
# their own blocks: a copy waited for too late, or never, leaves its destination stale).
ON_WAIT = pltpu.InterpretParams(dma_execution_mode="on_wait")
PALLAS = ["pallas_tpu", "pallas_gpu"]
HYP = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))


def _kw(backend):
    if backend == "xla_row_tiles":  # the xla backend's CPU grouped matmul, 4-row tiles
        return dict(backend="xla", xla_impl="row_tiles", xla_tile_rows=4)
    return dict(backend=backend, interpret=backend != "xla", tiling=TINY)


def _err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1.0)) if b.size else 0.0


def _close(a, b, dtype, what=""):
    e = _err(a, b)
    assert e <= TOL[dtype], f"{what}: rel err {e:.3g} > {TOL[dtype]}"


def _data(seed, m, k, n, e, dtype):
    r = np.random.default_rng(seed)
    lhs = jnp.asarray(r.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(r.normal(size=(e, k, n)) / np.sqrt(k), dtype)
    return lhs, rhs


group_sizes_st = st.integers(1, 4).flatmap(
    lambda e: st.lists(st.integers(0, 9), min_size=e, max_size=e).filter(lambda s: sum(s) <= 24))


# ---------------------------------------------------------------------------------------------
# gmm forward and gradients


def _check_gmm(backend, sizes, dtype, offset=0, num_local=None, transpose=False, m=24, k=16,
               n=16, seed=0, tiling=None, interpret=None):
    e = len(sizes)
    num_local = e if num_local is None else num_local
    gs = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = _data(seed, m, k, n, num_local, dtype)
    if transpose:
        rhs = jnp.swapaxes(rhs, 1, 2)
    # Padding rows hold garbage: they must not leak into outputs or weight gradients.
    lhs = lhs.at[int(sum(sizes)):].set(jnp.nan) if sum(sizes) < m else lhs
    cot = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(m, n)), jnp.float32)

    def loss(fn, lhs, rhs):
        return jnp.sum(fn(lhs, rhs).astype(jnp.float32) * cot)

    kw = _kw(backend) | ({"tiling": tiling} if tiling else {}) | ({"interpret": interpret} if interpret else {})
    ours = lambda a, b: K.gmm(a, b, gs, transpose_rhs=transpose, group_offset=offset,  # noqa: E731
                              **kw)
    ref = lambda a, b: R.gmm(jnp.nan_to_num(a), b, gs, transpose_rhs=transpose,  # noqa: E731
                             group_offset=offset)
    out = ours(lhs, rhs)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, ref(lhs, rhs), dtype, "forward")
    assert not np.any(np.asarray(out[int(sum(sizes)):], np.float32)), "padding rows not zero"
    lhs0 = jnp.nan_to_num(lhs)
    g_ours = jax.grad(lambda a, b: loss(ours, a, b), (0, 1))(lhs0, rhs)
    g_ref = jax.grad(lambda a, b: loss(ref, a, b), (0, 1))(lhs0, rhs)
    _close(g_ours[0], g_ref[0], dtype, "dlhs")
    _close(g_ours[1], g_ref[1], dtype, "drhs")
    # Rows of foreign groups and padding rows get zero gradient; empty local groups zero weight
    # gradient.
    keep = np.asarray(R.group_row_masks(gs, m, offset, num_local).any(0))
    assert not np.any(np.asarray(g_ours[0], np.float32)[~keep])
    local = np.asarray(sizes)[offset:offset + num_local]
    assert not np.any(np.asarray(g_ours[1], np.float32)[local == 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@HYP
@given(sizes=group_sizes_st, transpose=st.booleans())
def test_gmm_xla(dtype, sizes, transpose):
    _check_gmm("xla", sizes, dtype, transpose=transpose)


@pytest.mark.parametrize("backend", ["xla", "xla_row_tiles"])
@HYP
# Group sizes sum to at most the 24 rows (a grouped matmul's groups partition its rows; [0, 7, 9, 9]
# asked for 25 rows of 24 and made the reference and the kernel disagree on rows that do not exist).
@given(sizes=st.lists(st.integers(0, 9), min_size=4, max_size=4).filter(lambda s: sum(s) <= 24), data=st.data())
def test_gmm_xla_group_offset(backend, sizes, data):
    num_local = data.draw(st.integers(1, 3))
    offset = data.draw(st.integers(0, 4 - num_local))
    _check_gmm(backend, sizes, jnp.float32, offset=offset, num_local=num_local,
               transpose=data.draw(st.booleans()))


PALLAS_CASES = [
    # (sizes, offset, num_local, transpose): zeros, one group with everything, padding rows,
    # a group straddling row tiles, expert-sharded groups.
    ([5, 0, 11, 3], 0, None, False),
    ([0, 24, 0], 0, None, True),
    ([3, 7, 0, 6], 1, 2, False),
]


@pytest.mark.parametrize("backend", PALLAS)
@pytest.mark.parametrize("case", PALLAS_CASES, ids=["zeros-pad", "one-group-T", "offset"])
def test_gmm_pallas(backend, case):
    sizes, offset, num_local, transpose = case
    _check_gmm(backend, sizes, jnp.float32, offset=offset, num_local=num_local,
               transpose=transpose)


# The Mosaic kernels' K loop at one K tile and at three; tm 8 over these sizes puts whole tiles inside
# a group beside tiles shared by two groups. With one K tile gmm and gmm_t fetch their weight a group
# ahead and tgmm writes its blocks a group behind (pallas_tpu_own_copies.py),
# here under the TPU interpreter's DMA model that runs a copy only when it is waited for (a slot
# reused before its copy is waited shows); "row chunks" runs them computing 4-row chunks of the 8-row
# tiles (tiling.CHUNK_ROWS; 128 on hardware), so a group edge falls inside a chunk and between chunks.
K_TILES = {"one K tile": (16, Tiling(tm=8, tk=16, tn=8), None), "three K tiles": (24, Tiling(tm=8, tk=8, tn=8), None),
           "row chunks": (16, Tiling(tm=8, tk=16, tn=8), 4)}


def _own_copies(monkeypatch, k_tiles):
    """The interpreter and chunk rows of a K_TILES entry (its tiling's kernels)."""
    k, tiling, chunk = K_TILES[k_tiles]
    if chunk:
        monkeypatch.setattr(tiling_module, "CHUNK_ROWS", chunk)
    return k, tiling
# Groups exactly one row off a tile's edge: group 1 starts one row into tile 0 (a mask one row wide of
# it would overwrite or drop a row there), group 2 ends one row before tile 1's end (its weight gradient
# would take group 3's row 15), group 3 fills tile 2.
EDGE_CASES = [([1, 7, 7, 9], 0, None, False), ([1, 7, 7, 9], 0, None, True)]


@pytest.mark.parametrize("k_tiles", list(K_TILES))
@pytest.mark.parametrize("case", PALLAS_CASES + EDGE_CASES,
                         ids=["zeros-pad", "one-group-T", "offset", "edges", "edges-T"])
def test_gmm_pallas_tpu_k_tiles(k_tiles, case, monkeypatch):
    sizes, offset, num_local, transpose = case
    k, tiling = _own_copies(monkeypatch, k_tiles)
    _check_gmm("pallas_tpu", sizes, jnp.float32, offset=offset, num_local=num_local, transpose=transpose,
               k=k, tiling=tiling, interpret=ON_WAIT)


@pytest.mark.parametrize("variant", sorted(BROKEN_GMM_TPU))
def test_broken_gmm_tpu_variant_caught(variant, monkeypatch):
    for target, name, broken in BROKEN_GMM_TPU[variant]():
        monkeypatch.setattr(target, name, broken)
    for k_tiles in K_TILES:
        k, tiling = _own_copies(monkeypatch, k_tiles)
        # The edges, and expert-sharded groups: foreign rows in shared tiles and a tile no local group touches.
        for sizes, offset, num_local, transpose in EDGE_CASES + PALLAS_CASES[2:]:
            try:
                _check_gmm("pallas_tpu", sizes, jnp.float32, offset=offset, num_local=num_local, transpose=transpose,
                           k=k, tiling=tiling, interpret=ON_WAIT)
            except AssertionError:
                return
    pytest.fail(f"{variant}: no k_tiles edge case caught it")


def test_the_chip_s_fp8_weight_case_matches_its_reference():
    # tools/chip_cases' moe_mlp_fp8 (what gather8's dequantization costs the MoE MLP on the chip), tiny
    # and interpreted: each arm's output and gradients (to the bfloat16 weights, gather8's
    # straight-through) within the MoE tolerance of the float32 reference on the codes' weights.
    from hybridmoe.tools import chip_cases as cc

    (case,) = cc.cases("tiny", interpret=True, families=["moe_mlp_fp8"]).values()
    reference, inputs = case.reference(), case.make_inputs()
    codes_i = inputs[0][4]
    assert codes_i.dtype == jnp.float8_e4m3fn and len(np.unique(np.asarray(inputs[0][5]))) > 3  # scales across binades
    # The case's rounding to the fp8 grid is fp8.quantize's (on this host's exact conversion), ties
    # and subnormals among the values.
    from hybridmoe.quant import fp8
    v = jnp.concatenate([jax.random.normal(jax.random.key(3), (4096,)) * 100, jnp.asarray(
        [448.0, -448.0, 0.0, 2.0 ** -6, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 1.0625, 1.1875, -3.0 * 2.0 ** -10])])
    np.testing.assert_array_equal(np.asarray(cc.on_e4m3_grid(v).astype(fp8.E4M3), np.float32),
                                  np.asarray(fp8.quantize(v, jnp.float32(1.0)), np.float32))
    assert sorted(case.backends) == ["pallas_tpu_fused_table", "pallas_tpu_table", "xla"]
    for name in case.backends:
        built = case.backends[name](inputs)
        fn, args = built.fwd_bwd
        got = jax.tree.map(lambda a: np.asarray(a, np.float32), case.view(fn(*args), backward=True))
        error = cc.relative_error(got, reference.fwd_bwd)
        assert error < 2e-2, f"{name}: {error:.2e} from the reference"


@pytest.mark.parametrize("k_tiles", list(K_TILES))
def test_pair_pallas_tpu_k_tiles(k_tiles, monkeypatch):
    # D 16: one K tile at tk 16, two at tk 8 (the middle tiles: test_gmm_pallas_tpu_k_tiles).
    k, tiling = _own_copies(monkeypatch, k_tiles)
    tiling = dataclasses.replace(tiling, tk=16 if k == 16 else 8)
    x, wi, wo, s, cot = _pair_data(jnp.float32)
    gs = jnp.asarray([5, 0, 11, 3], jnp.int32)
    y, g = _grads(fused_loss, x, wi, wo, s, gs, cot, backend="pallas_tpu", interpret=ON_WAIT, tiling=tiling)
    y_r, g_r = _grads(ref_loss, x, wi, wo, s, gs, cot)
    _close(y, y_r, jnp.float32, "y")
    for name, a, b in zip(["dx", "dwi", "dwo", "ds"], g, g_r):
        _close(a, b, jnp.float32, name)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole tiles", "row chunks"])
@pytest.mark.parametrize("case", [([5, 0, 11, 3], 0, 4), ([1, 7, 7, 9], 0, 4), ([3, 7, 0, 6], 1, 2)],
                         ids=["zeros-pad", "edges", "offset"])
def test_fused_forward_copying_its_weight_matches_the_reference(chunk, case, monkeypatch):
    """wi_fused_swiglu_prefetched (the fused up projection fetching a group's gate and up slabs a group
    ahead; not yet the default, no chip has timed it) under the interpreter's on-wait DMA model: h
    within float32 rounding of the reference, the stored pre-activations equal to the grid-pipelined
    kernel's (the same per-tile layout), every row outside the local groups zero."""
    from hybridmoe.kernels.gmm import pallas_tpu as P

    if chunk:
        monkeypatch.setattr(tiling_module, "CHUNK_ROWS", chunk)
    sizes, offset, num_local = case
    x, wi, _, _, _ = _pair_data(jnp.float32, e=num_local)
    gs = jnp.asarray(sizes, jnp.int32)
    kw = dict(group_offset=offset, sharded=False, tile_n_per_half=8, mode="float32",
              tiling=Tiling(tm=8, tk=x.shape[1], tn=8))
    h, pre = P.wi_fused_swiglu(x, wi, gs, interpret=ON_WAIT, grid_pipelined=False, **kw)
    h_grid, pre_grid = P.wi_fused_swiglu(x, wi, gs, interpret=True, **kw)
    pre_ref = R.gmm(x, wi, gs, group_offset=offset, out_dtype=jnp.float32)
    _close(h, R.swiglu(pre_ref), jnp.float32, "h")
    np.testing.assert_array_equal(np.asarray(pre), np.asarray(pre_grid))
    keep = np.asarray(R.group_row_masks(gs, x.shape[0], offset, num_local).any(0))
    assert not np.any(np.asarray(h)[~keep]) and not np.any(np.asarray(pre)[~keep])


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole tiles", "row chunks"])
@pytest.mark.parametrize("case", [([5, 0, 11, 3], 0, 4), ([1, 7, 7, 9], 0, 4), ([3, 7, 0, 6], 1, 2)],
                         ids=["zeros-pad", "edges", "offset"])
def test_fused_input_gradient_copying_its_weight_matches_the_grid_kernel(chunk, case, monkeypatch):
    """wo_fused_dswiglu_dlhs_prefetched (wo fetched a group ahead; not yet the default) under the
    on-wait DMA model, with the row scale: d[gate | up] equal to the grid-pipelined kernel's (the
    same products per row), the row dot within float32 summation order, rows outside the local
    groups zero."""
    from hybridmoe.kernels.gmm import pallas_tpu as P

    if chunk:
        monkeypatch.setattr(tiling_module, "CHUNK_ROWS", chunk)
    sizes, offset, num_local = case
    x, wi, wo, s, cot = _pair_data(jnp.float32, e=num_local)
    gs = jnp.asarray(sizes, jnp.int32)
    pre = jnp.asarray(np.random.default_rng(3).normal(size=(M, 2 * F)), jnp.float32)
    kw = dict(preact_tile_n_per_half=T, row_scale_M=s, out_tile_n_per_half=T, group_offset=offset, sharded=False,
              mode="float32", tiling=Tiling(tm=8, tk=D, tn=F))
    d, dot = P.wo_fused_dswiglu_dlhs(cot, wo, gs, pre, interpret=ON_WAIT, grid_pipelined=False, **kw)
    d_grid, dot_grid = P.wo_fused_dswiglu_dlhs(cot, wo, gs, pre, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(d), np.asarray(d_grid))
    _close(dot, dot_grid, jnp.float32, "row dot")
    keep = np.asarray(R.group_row_masks(gs, M, offset, num_local).any(0))
    assert np.any(np.asarray(d)[keep]) and not np.any(np.asarray(d)[~keep]) and not np.any(np.asarray(dot)[~keep])


@pytest.mark.parametrize("variant", sorted(BROKEN_FUSED_COPIES))
def test_broken_fused_copies_caught(variant, monkeypatch):
    for target, name, broken in BROKEN_FUSED_COPIES[variant]():
        monkeypatch.setattr(target, name, broken)
    check = (test_fused_input_gradient_copying_its_weight_matches_the_grid_kernel if "wo" in variant
             else test_fused_forward_copying_its_weight_matches_the_reference)
    with pytest.raises(AssertionError):
        check(4, ([1, 7, 7, 9], 0, 4), monkeypatch)


@pytest.mark.parametrize("backend", PALLAS)
def test_gmm_pallas_bf16(backend):
    _check_gmm(backend, [9, 0, 10], jnp.bfloat16, m=24)


def test_gmm_traced_offset():
    gs = jnp.asarray([4, 6, 5, 3], jnp.int32)
    lhs, rhs = _data(3, 24, 8, 8, 2, jnp.float32)
    f = jax.jit(lambda off: K.gmm(lhs, rhs, gs, group_offset=off))
    for off in (0, 1, 2):
        _close(f(jnp.int32(off)), R.gmm(lhs, rhs, gs, group_offset=off), jnp.float32, f"off {off}")


# ---------------------------------------------------------------------------------------------
# The fused SwiGLU pair


M, D, F, T, E = 24, 16, 16, 8, 4


def _pair_data(dtype, seed=0, e=E):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(M, D)), dtype)
    wi = jnp.asarray(r.normal(size=(e, D, 2 * F)) / np.sqrt(D), dtype)
    wo = jnp.asarray(r.normal(size=(e, F, D)) / np.sqrt(F), dtype)
    s = jnp.asarray(r.uniform(0.1, 1.0, size=(M,)), jnp.float32)
    cot = jnp.asarray(r.normal(size=(M, D)), jnp.float32)
    return x, wi, wo, s, cot


def fused_loss(x, wi, wo, s, gs, cot, *, tile=T, offset=0, epilogue="float32", **kw):
    h, pre = K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=tile,
                          group_offset=offset, epilogue=epilogue, **kw)
    y = K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=tile, row_scale=s,
                      group_offset=offset, epilogue=epilogue, **kw)
    return jnp.sum(y.astype(jnp.float32) * cot), y


def unfused_loss(x, wi, wo, s, gs, cot, *, offset=0, **kw):
    """The unfused composition the match_unfused epilogue reproduces bit for bit."""
    pre = K.gmm(x, wi, gs, group_offset=offset, **kw)
    h = K.swiglu(pre)
    y = K.gmm(K.scale_rows(h, s), wo, gs, group_offset=offset, **kw)
    return jnp.sum(y.astype(jnp.float32) * cot), y


def ref_loss(x, wi, wo, s, gs, cot, *, offset=0):
    y = R.moe_mlp(x, wi, wo, gs, row_scale_M=s, group_offset=offset)
    return jnp.sum(y * cot), y


def _grads(fn, x, wi, wo, s, gs, cot, **kw):
    (_, y), g = jax.value_and_grad(lambda *a: fn(*a, gs, cot, **kw), (0, 1, 2, 3), has_aux=True)(
        x, wi, wo, s)
    return y, g


def _check_pair(backend, dtype, sizes, offset=0, num_local=E, tile=T):
    x, wi, wo, s, cot = _pair_data(dtype, e=num_local)
    gs = jnp.asarray(sizes, jnp.int32)
    y, g = _grads(fused_loss, x, wi, wo, s, gs, cot, tile=tile, offset=offset, **_kw(backend))
    y_r, g_r = _grads(ref_loss, x, wi, wo, s, gs, cot, offset=offset)
    _close(y, y_r, dtype, "y")
    for name, a, b in zip(["dx", "dwi", "dwo", "ds"], g, g_r):
        _close(a, b, dtype, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@HYP
@given(sizes=st.lists(st.integers(0, 8), min_size=E, max_size=E), tile=st.sampled_from([8, 16]))
def test_pair_xla(dtype, sizes, tile):
    _check_pair("xla", dtype, sizes, tile=tile)


@pytest.mark.parametrize("backend", PALLAS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pair_pallas(backend, dtype):
    _check_pair(backend, dtype, [5, 0, 11, 3])


@pytest.mark.parametrize("backend", ["xla", "xla_row_tiles", *PALLAS])
def test_pair_group_offset(backend):
    _check_pair(backend, jnp.float32, [3, 7, 0, 6], offset=1, num_local=2)


def test_preact_layout_round_trip():
    r = np.random.default_rng(0)
    gate_up = jnp.asarray(r.normal(size=(5, 2 * F)), jnp.float32)
    for tile in (4, 8, 16):
        pre = K.contiguous_to_preact(gate_up, tile)
        assert np.array_equal(K.preact_to_contiguous(pre, F, tile), gate_up)
        gate, up = K.split_preact(pre, F, tile)
        assert np.array_equal(gate, gate_up[:, :F]) and np.array_equal(up, gate_up[:, F:])
        # block j of a row is [gate_j | up_j]
        assert np.array_equal(pre[:, tile:2 * tile], gate_up[:, F:F + tile])
    assert K.contiguous_to_preact(gate_up, F) is not None
    assert np.array_equal(K.contiguous_to_preact(gate_up, F), gate_up)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_kernel_stores_per_tile_layout(backend):
    x, wi, _, _, _ = _pair_data(jnp.float32)
    gs = jnp.asarray([6, 6, 6, 6], jnp.int32)
    h, pre = K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=T, **_kw(backend))
    gate_up = R.gmm(x, wi, gs)
    _close(pre, K.contiguous_to_preact(gate_up, T), jnp.float32, "preact layout")
    _close(h, R.swiglu(gate_up), jnp.float32, "h")


def test_activation_vjp_never_built():
    """Behind wo_fused_dswiglu, h's cotangent is a symbolic zero: one logistic in the forward, one
    in the fused DLHS epilogue, none for the activation's own VJP."""
    x, wi, wo, s, cot = _pair_data(jnp.float32)
    gs = jnp.asarray([6, 6, 6, 6], jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: fused_loss(*a, gs, cot)[0], (0, 1, 2, 3)))(
        x, wi, wo, s)
    assert str(jaxpr).count("logistic") == 2

    # Control: when h is also consumed directly, wi_fused_swiglu's backward does build the VJP.
    def leaky(x, wi, wo, s):
        h, pre = K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=T)
        y = K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=T, row_scale=s)
        return jnp.sum(y * cot) + jnp.sum(h)

    assert str(jax.make_jaxpr(jax.grad(leaky, (0, 1, 2, 3)))(x, wi, wo, s)).count("logistic") == 3


@pytest.mark.parametrize("backend", ["xla", "xla_row_tiles", *PALLAS])
def test_fused_equals_unfused(backend):
    """match_unfused: bit-identical to the unfused path in bf16 (output and every gradient).
    float32 epilogue: output and wo gradient bit-identical, the rest within bf16 rounding."""
    x, wi, wo, s, cot = _pair_data(jnp.bfloat16)
    gs = jnp.asarray([5, 0, 11, 3], jnp.int32)
    kw = _kw(backend)
    y_u, g_u = _grads(unfused_loss, x, wi, wo, s, gs, cot, **kw)
    y_m, g_m = _grads(fused_loss, x, wi, wo, s, gs, cot, epilogue="match_unfused", **kw)
    assert np.array_equal(y_m, y_u)
    for name, a, b in zip(["dx", "dwi", "dwo", "ds"], g_m, g_u):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)), name
    # The real epilogue on the unfused forward (x -> pre by gmm): the down projection's output
    # and wo gradient stay bit-identical.
    pre = K.gmm(x, wi, gs, **kw)
    h = K.swiglu(pre)

    def down(h, wo, pre, s, epilogue):
        y = K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=F, row_scale=s,
                          epilogue=epilogue, **kw)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    (_, y_f), g_f = jax.value_and_grad(lambda *a: down(*a, "float32"), (1, 2, 3), has_aux=True)(
        h, wo, pre, s)
    (_, y_m2), g_m2 = jax.value_and_grad(lambda *a: down(*a, "match_unfused"), (1, 2, 3),
                                         has_aux=True)(h, wo, pre, s)
    assert np.array_equal(y_f, y_m2) and np.array_equal(g_f[0], g_m2[0])
    for a, b in zip(g_f[1:], g_m2[1:]):
        rel = np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32)) / max(
            np.linalg.norm(np.asarray(b, np.float32)), 1e-30)
        assert rel <= 1e-2, rel


# ---------------------------------------------------------------------------------------------
# weight_out: the weight passed through, its gradient added into the cotangent given for it


def _binades(shape, seed):
    """float32 values whose channels (last dim) span 2^-8 .. 2^8."""
    r = np.random.default_rng(seed)
    return jnp.asarray(r.normal(size=shape) * 2.0 ** r.integers(-8, 9, size=shape[-1]), jnp.float32)


@pytest.mark.parametrize("backend", ["xla", "xla_row_tiles", *PALLAS])
def test_weight_out_adds_the_weight_gradient_into_its_cotangent(backend, add_weight_grad=None):
    """Every grouped matmul with a weight (gmm plain and transposed, the fused pair): with
    weight_out and a cotangent acc for the passed weight, the weight's gradient is acc plus the
    gradient without weight_out (float32), the inputs' gradients unchanged; on expert-sharded groups
    with an empty local group, which keeps acc exactly."""
    x, wi, wo, s, cot = _pair_data(jnp.float32, e=2)
    gs = jnp.asarray([3, 7, 0, 6], jnp.int32)  # local groups 1 (7 rows) and 2 (empty)
    kw = dict(group_offset=1, **_kw(backend))

    def pair(x, wi, wo, weight_out):
        h, pre, *wi_out = K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=T,
                                            weight_out=weight_out, **kw)
        y, *wo_out = (K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=T, row_scale=s,
                                         weight_out=weight_out, **kw),)
        return (y[0], (wi_out[0], y[1])) if weight_out else (y, ())

    def plain(x, rhs, weight_out, transpose=False):
        out = K.gmm(x, rhs, gs, transpose_rhs=transpose, weight_out=weight_out, **kw)
        return (out[0], (out[1],)) if weight_out else (out, ())

    cases = {"fused pair": (pair, (x, wi, wo), (1, 2)), "gmm": (plain, (x, wo[:, :, :D]), (1,)),
             "gmm transposed": (functools.partial(plain, transpose=True), (x, jnp.swapaxes(wo, 1, 2)), (1,))}
    for name, (fn, args, weights) in cases.items():
        y, vjp = jax.vjp(lambda *a: fn(*a, weight_out=False)[0], *args)
        (y_out, passed), vjp_out = jax.vjp(lambda *a: fn(*a, weight_out=True), *args)
        assert np.array_equal(y, y_out), name
        assert [p.shape for p in passed] == [args[i].shape for i in weights], name
        cot_y = cot[:, :y.shape[1]]
        accs = tuple(_binades(p.shape, seed) for seed, p in enumerate(passed))
        base = vjp(cot_y)
        with_acc = vjp_out((cot_y, accs))
        for i, (a, b) in enumerate(zip(with_acc, base)):
            if i not in weights:
                assert np.array_equal(a, b), (name, i)
        for (i, acc) in zip(weights, accs):
            got = np.asarray(with_acc[i])
            want = np.asarray(acc) + np.asarray(base[i])
            # acc's own rows where the gradient is zero; a lost or doubled gradient shows elsewhere
            _close(got, want, jnp.float32, f"{name}: weight {i}")
            assert np.array_equal(got[1], np.asarray(acc)[1]), f"{name}: the empty local group lost acc"
            assert np.abs(np.asarray(base[i])[0]).max() > 0.1, name


# ---------------------------------------------------------------------------------------------
# Broken variants: each must be caught by the reference comparison of the fused pair.


@pytest.mark.parametrize("backend", ["xla", "xla_row_tiles", "pallas_tpu"])
@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variant_caught(backend, variant, monkeypatch):
    if backend.startswith("pallas") and variant not in READER_VARIANTS:
        pytest.skip("the epilogue math is shared; the Pallas kernels differ in their readers")
    name, fn = BROKEN[variant]
    monkeypatch.setattr(epi, name, fn)
    with pytest.raises(AssertionError):
        _check_pair(backend, jnp.float32, [5, 2, 11, 3], tile=4)


# ---------------------------------------------------------------------------------------------
# Tile rules


def test_tile_problems():
    ok = Tiling(tm=512, tk=1024, tn=256)
    assert tile_problems(d_model=2048, hidden=512, tiling=ok, tile_n_per_half=256) == []
    probs = tile_problems(d_model=2048, hidden=512, tiling=Tiling(tm=12, rhs_buffer_count=3),
                          tile_n_per_half=96)
    joined = " ".join(probs)
    assert "tm=12" in joined and "tile_n_per_half=96" in joined and "rhs_buffer_count=3" in joined
    # Depth 1 frees the VMEM of one weight block and Mosaic takes it (tests/test_gmm_tpu_compile.py).
    assert tile_problems(d_model=2048, hidden=512, tiling=Tiling(tm=512, tk=1024, tn=256, rhs_buffer_count=1),
                         tile_n_per_half=256) == []
    assert tile_problems(d_model=16, hidden=16, tiling=TINY, tile_n_per_half=8,
                         hardware=False) == []
    assert any("power of two" in p for p in tile_problems(
        d_model=2048, hidden=384, tiling=Tiling(tm=64, tk=128, tn=128), tile_n_per_half=128,
        backend="pallas_gpu"))


def test_bad_arguments():
    x, wi, wo, s, _ = _pair_data(jnp.float32)
    gs = jnp.asarray([6, 6, 6, 6], jnp.int32)
    with pytest.raises(ValueError, match="tile_n_per_half"):
        K.wi_fused_swiglu(x, wi, gs, tile_n_per_half=5)
    with pytest.raises(ValueError, match="int32"):
        K.gmm(x, wi, gs.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.float32))
    with pytest.raises(ValueError, match="with_row_dot"):
        K.wo_fused_dswiglu(x[:, :F], wo, gs, preact=jnp.zeros((M, 2 * F)), preact_tile_n_per_half=F,
                      with_row_dot=True)
    with pytest.raises(ValueError, match="backend"):
        K.gmm(x, wi, gs, backend="cuda")
