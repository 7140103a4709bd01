"""The cost each Mosaic grouped-matmul kernel states (kernels/gmm/pallas_tpu.py: flops, bytes
accessed, transcendentals), which the step-time model reads from the compiled program, pinned to
hand-worked figures at tiny shapes. Only traced (jax.make_jaxpr): no kernel runs or compiles.

Shapes: M 40 rows, E 4 groups of which G 2 are local (offset 2), tm 16 (M padded to 48: 3 row
tiles; the step table holds 3 + 2 - 1 = 4 steps). The local share is 40 * 2 / 4 = 20 rows, so the
stated steps are ceil(20 / 16) + 2 - 1 = 3 (a floor would give 2). Operands of different
itemsizes (bfloat16 2, float32 4) so that each term's dtype shows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.analysis.program import iter_eqns
from hybridmoe.kernels.gmm import pallas_tpu as gp
from hybridmoe.kernels.gmm import tpu_steps
from hybridmoe.kernels.gmm.tiling import Tiling

M, E, G, OFFSET = 40, 4, 2, 2
SIZES = jnp.array([10, 10, 10, 10], jnp.int32)
TILES = Tiling(tm=16, tk=128, tn=128)
STEPS = 3          # ceil(40 * 2 / 4 / 16) + 2 - 1
LOCAL_ROWS = 20    # 40 * 2 / 4
BF16, F32 = jnp.bfloat16, jnp.float32


def _estimate(fn):
    """(flops, bytes_accessed, transcendentals) of the one pallas_call fn traces."""
    found = [e.params["cost_estimate"] for e in iter_eqns(jax.make_jaxpr(fn)()) if e.primitive.name == "pallas_call"]
    assert len(found) == 1
    est = found[0]
    return est.flops, est.bytes_accessed, est.transcendentals


COMMON = dict(group_offset=OFFSET, sharded=True, tiling=TILES, interpret=True)


def test_stated_steps_are_the_local_share_in_row_tiles_plus_a_boundary_per_group():
    # 20 local rows at tm 16: 2 tiles + 1 boundary tile; table 4 is no bound here
    assert tpu_steps.stated_steps(40, 16, 2, SIZES, 4) == 3
    # 16 local rows (32 * 2 / 4) fill exactly one tile: 1 + 1
    assert tpu_steps.stated_steps(32, 16, 2, SIZES, 3) == 2
    # 17 local rows (34 * 2 / 4 = 17): two tiles + 1
    assert tpu_steps.stated_steps(34, 16, 2, SIZES, 9) == 3
    # every group local (40 rows, 4 groups): ceil(40 / 16) + 3 = 6; capped at a table of 5
    assert tpu_steps.stated_steps(40, 16, 4, SIZES, 9) == 6
    assert tpu_steps.stated_steps(40, 16, 4, SIZES, 5) == 5
    assert tpu_steps.local_rows(40, 2, SIZES) == 20.0
    assert tpu_steps.local_rows(40, 4, SIZES) == 40.0
    assert tpu_steps.local_rows(41, 1, SIZES) == 10.25   # a fractional share stays fractional
    # 41 * 3 / 4 = 30.75 rows: int() gives 30, 2 tiles of 16, + 2 boundaries
    assert tpu_steps.stated_steps(41, 16, 3, SIZES, 9) == 4


@pytest.mark.parametrize("tk, slabs", [(128, 3), (256, 2)])
def test_gmm_states_its_local_flops_and_the_blocks_each_step_fetches(tk, slabs):
    # lhs [40, K 256] bf16, rhs [2, 256, N 384] f32, out bf16; tn 128: 3 N tiles. The weight slab is
    # fetched per step (3) over two K tiles, once per local group (2) when one K tile spans K.
    lhs, rhs = jnp.ones((M, 256), BF16), jnp.ones((G, 256, 384), F32)
    kw = dict(COMMON, tiling=Tiling(tm=16, tk=tk, tn=128))
    flops, nbytes, trans = _estimate(lambda: gp.gmm(lhs, rhs, SIZES, transpose_rhs=False, out_dtype=BF16, **kw))
    assert flops == 2 * 20 * 256 * 384
    assert nbytes == (3 * 3 * 16 * 256 * 2      # the lhs row tile per N tile per step (bf16)
                      + slabs * 256 * 384 * 4   # the group's weight slab (f32)
                      + 3 * 16 * 384 * 2        # the output tile per step (bf16)
                      + 20 * 384 * 2)           # the zeros of the 20 rows outside the local groups, once
    assert trans == 0


def test_gmm_t_states_n_from_the_transposed_weight():
    # rhs [2, N 384, K 256] with transpose_rhs: N is its middle dim; out float32
    lhs, rhs = jnp.ones((M, 256), BF16), jnp.ones((G, 384, 256), BF16)
    flops, nbytes, _ = _estimate(lambda: gp.gmm(lhs, rhs, SIZES, transpose_rhs=True, out_dtype=F32, **COMMON))
    assert flops == 2 * 20 * 256 * 384
    assert nbytes == 3 * 3 * 16 * 256 * 2 + 3 * 256 * 384 * 2 + 3 * 16 * 384 * 4 + 20 * 384 * 4


@pytest.mark.parametrize("accumulate, tk", [(False, 128), (True, 128), (False, 256)])
def test_tgmm_states_both_row_operands_per_tile_and_the_output_once_or_twice(accumulate, tk):
    # lhs [40, K 256] bf16, grad [40, N 384] f32, out f32 [2, 256, 384]; k // tk 2 or 1, n // tn 3
    lhs, grad = jnp.ones((M, 256), BF16), jnp.ones((M, 384), F32)
    acc = jnp.zeros((G, 256, 384), F32) if accumulate else None
    kw = dict(COMMON, tiling=Tiling(tm=16, tk=tk, tn=128))
    flops, nbytes, trans = _estimate(lambda: gp.tgmm(lhs, grad, SIZES, num_local=G, out_dtype=F32, acc_GKN=acc,
                                                     **kw))
    assert flops == 2 * 20 * 256 * 384
    out = 2 * 256 * 384 * 4                       # the [G, K, N] float32 output written once
    assert nbytes == (3 * 16 * (3 * 256 * 2       # per step: the lhs row tile per N tile (bf16)
                                + (256 // tk) * 384 * 4)  # and the grad row tile per K tile (f32)
                      + (2 if accumulate else 1) * out)  # the carried accumulator read as well
    assert trans == 0


def test_fused_forward_states_both_halves_and_one_sigmoid_per_h_element():
    # x [40, D 256] bf16, wi [2, 256, 2F 512] f32, F 256 in tiles of 128 per half: 2 N tiles
    x, wi = jnp.ones((M, 256), BF16), jnp.ones((G, 256, 512), F32)
    flops, nbytes, trans = _estimate(lambda: gp.wi_fused_swiglu(x, wi, SIZES, tile_n_per_half=128, mode="float32",
                                                               **COMMON))
    assert flops == 2 * 20 * 256 * 512
    assert nbytes == (2 * 3 * 16 * 256 * 2      # x's row tile per N tile per step
                      + 3 * 256 * 512 * 4       # both weight halves per step (f32)
                      + 3 * 16 * 3 * 256 * 2    # h [tm, F] and the pre-activation [tm, 2F] per step
                      + 20 * 3 * 256 * 2)       # both outputs' zeros for the 20 foreign rows, once
    assert trans == 40 * 256                    # m * F (every row, as stated)


@pytest.mark.parametrize("scale, with_h", [(False, False), (True, False), (True, True)])
def test_fused_input_gradient_states_its_row_operands(scale, with_h):
    # g [40, D 256] bf16, wo [2, F 128, 256] f32, preact [40, 256] bf16; tk 128 over D
    g, wo, pre = jnp.ones((M, 256), BF16), jnp.ones((G, 128, 256), F32), jnp.ones((M, 256), BF16)
    s = jnp.ones((M,), F32) if scale else None
    h = jnp.ones((M, 128), F32) if with_h else None
    flops, nbytes, trans = _estimate(lambda: gp.wo_fused_dswiglu_dlhs(
        g, wo, SIZES, pre, preact_tile_n_per_half=128, row_scale_M=s, out_tile_n_per_half=128,
        mode="match_unfused" if with_h else "float32", h_MF=h, **COMMON))
    assert flops == 2 * 20 * 256 * 128
    per_step = (16 * 256 * 2                    # g's row tile (bf16)
                + 128 * 256 * 4                 # the group's [F, D] weight (f32)
                + 2 * 16 * 256 * 2              # the pre-activation read and its gradient written (bf16)
                + 16 * 4 * (2 if scale else 1)  # the float32 row dot, and the row scale
                + (16 * 128 * 4 if with_h else 0))  # the stored h (f32 here)
    assert nbytes == 3 * per_step + 20 * (2 * 128 * 2 + 4)  # + the 20 foreign rows' zeros (d and the dot)
    assert trans == 40 * 128


# ---------------------------------------------------------------------------------------------
# The fused forward's weight pipeline depth: applied (and named) only with one K tile


def _fused_call(module, tk):
    x, wi = jnp.ones((16, 32), F32), jnp.ones((2, 32, 64), F32)
    fn = lambda: module.wi_fused_swiglu(x, wi, jnp.array([8, 8], jnp.int32), group_offset=0, sharded=False,  # noqa: E731
                                        tile_n_per_half=16, mode="float32", tiling=Tiling(16, tk, 16),
                                        interpret=True, rhs_buffer_count=3 if module is not gp else 1)
    (eqn,) = [e for e in iter_eqns(jax.make_jaxpr(fn)()) if e.primitive.name == "pallas_call"]
    name = eqn.params.get("name") or eqn.params["name_and_src_info"].name
    return str(name), eqn.params["compiler_params"]


def test_triton_fused_forward_takes_the_depth_as_its_stage_count_with_one_k_tile_only():
    from hybridmoe.kernels.gmm import pallas_gpu

    name, params = _fused_call(pallas_gpu, 32)        # D 32 in one K tile: 3 stages
    assert name == "wi_fused_swiglu_fwd_stages3" and params.num_stages == 3
    name, params = _fused_call(pallas_gpu, 16)        # two K tiles: Triton's default
    assert name == "wi_fused_swiglu_fwd" and params.num_stages is None


def test_mosaic_fused_forward_buffers_the_weight_only_with_one_k_tile():
    from jax.experimental import pallas as pl

    assert gp.weight_pipeline(2, 1) == {"pipeline_mode": pl.Buffered(2)}
    assert gp.weight_pipeline(1, 1) == {"pipeline_mode": pl.Buffered(1)}
    assert gp.weight_pipeline(2, 2) == {} and gp.weight_pipeline(0, 1) == {}
    assert _fused_call(gp, 32)[0] == "wi_fused_swiglu_fwd_rhsbuf1"
    assert _fused_call(gp, 16)[0] == "wi_fused_swiglu_fwd"


# ---------------------------------------------------------------------------------------------
# The buffers each Mosaic kernel sizes its VMEM limit by: its own kind, tiles, itemsizes and flags


def _buffers(monkeypatch, fn):
    """{buffer: (shape, itemsize, count)} the one kernel fn traces passes to its compiler parameters."""
    seen = []
    real = tpu_steps.compiler_params
    monkeypatch.setattr(tpu_steps, "compiler_params", lambda t, buffers, *a: seen.append(buffers) or real(t, buffers, *a))
    jax.make_jaxpr(fn)()
    (buffers,) = seen
    return {b.what: (b.shape, b.itemsize, b.count) for b in buffers}


def test_gmm_kernels_size_their_vmem_by_their_own_blocks(monkeypatch):
    lhs = jnp.ones((M, 256), BF16)
    b = _buffers(monkeypatch, lambda: gp.gmm(lhs, jnp.ones((G, 256, 384), BF16), SIZES, transpose_rhs=False,
                                             out_dtype=F32, **COMMON))
    # lhs [tm 16, tk 128] bf16, rhs [tk, tn 128], out [tm, tn] float32
    assert (b["lhs"], b["rhs"], b["out"]) == (((16, 128), 2, 2), ((128, 128), 2, 2), ((16, 128), 4, 2))
    # tk 256 spans K 256 (one K tile: gmm_prefetched, the weight in two slots of its own), tn 128 tiles N 384
    b = _buffers(monkeypatch, lambda: gp.gmm(lhs, jnp.ones((G, 256, 384), BF16), SIZES, transpose_rhs=False,
                                             out_dtype=F32, **dict(COMMON, tiling=Tiling(16, 256, 128))))
    assert (b["lhs"], b["rhs_slots"], b["out"]) == (((16, 256), 2, 2), ((2, 256, 128), 2, 1), ((16, 128), 4, 2))
    assert "acc" not in b
    # transposed: the weight slab is [tn 128, tk 256]
    b = _buffers(monkeypatch, lambda: gp.gmm(lhs, jnp.ones((G, 384, 256), BF16), SIZES, transpose_rhs=True,
                                             out_dtype=BF16, **dict(COMMON, tiling=Tiling(16, 256, 128))))
    assert (b["lhs"], b["rhs_slots"], b["out"]) == (((16, 256), 2, 2), ((2, 128, 256), 2, 1), ((16, 128), 2, 2))
    # tgmm: the operands' promoted dtype (bf16 with f32: float32), the carried accumulator as a block
    b = _buffers(monkeypatch, lambda: gp.tgmm(lhs, jnp.ones((M, 384), F32), SIZES, num_local=G, out_dtype=BF16,
                                              acc_GKN=jnp.zeros((G, 256, 384), BF16), **COMMON))
    assert (b["lhs"], b["grad"], b["acc_in"], b["out"]) == (
        ((16, 128), 4, 2), ((16, 128), 4, 2), ((128, 128), 2, 2), ((128, 128), 2, 2))
    # without it: tgmm_written_behind, its output staged in two slots of the output's dtype
    b = _buffers(monkeypatch, lambda: gp.tgmm(lhs, jnp.ones((M, 384), F32), SIZES, num_local=G, out_dtype=BF16,
                                              **COMMON))
    assert (b["lhs"], b["grad"], b["out_slots"], b["acc"]) == (
        ((16, 128), 4, 2), ((16, 128), 4, 2), ((2, 128, 128), 2, 1), ((128, 128), 4, 1))


@pytest.mark.parametrize("tk, weight_buffers", [(256, 1), (128, 2)])
def test_fused_forward_sizes_its_weight_buffers_as_mosaic_pipelines_them(monkeypatch, tk, weight_buffers):
    # depth 1 applies with one K tile (D 256 = tk); over two K tiles Mosaic keeps its 2 buffers
    x, wi = jnp.ones((M, 256), BF16), jnp.ones((G, 256, 512), BF16)
    b = _buffers(monkeypatch, lambda: gp.wi_fused_swiglu(
        x, wi, SIZES, tile_n_per_half=128, mode="float32", rhs_buffer_count=1,
        **dict(COMMON, tiling=Tiling(tm=16, tk=tk, tn=128))))
    assert b["w_gate"] == b["w_up"] == ((tk, 128), 2, weight_buffers)
    assert b["x"] == ((16, tk), 2, 2)


def test_fused_input_gradient_sizes_its_vmem_with_its_row_operands(monkeypatch):
    g, wo, pre = jnp.ones((M, 256), BF16), jnp.ones((G, 128, 256), BF16), jnp.ones((M, 256), BF16)
    b = _buffers(monkeypatch, lambda: gp.wo_fused_dswiglu_dlhs(
        g, wo, SIZES, pre, preact_tile_n_per_half=128, row_scale_M=jnp.ones((M,), F32), out_tile_n_per_half=128,
        mode="float32", **COMMON))
    # one N tile spans F 128; the row scale as float32 [tm, 1]; no h
    assert (b["g"], b["wo"], b["preact"], b["row_scale"]) == (
        ((16, 128), 2, 2), ((128, 128), 2, 2), ((16, 256), 2, 2), ((16, 1), 4, 2))
    assert "h" not in b
