"""The grouped matmuls' tile rules, per-kernel tile wiring, VMEM buffers and grid/row-tile index
arithmetic (kernels/gmm/tiling.py, metadata.py, row_tiles.py), pinned to hand-worked figures at
tiny shapes (eager index arrays only: nothing compiles a kernel)."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from hybridmoe.kernels import vmem
from hybridmoe.kernels.gmm import metadata, row_tiles, tiling
from hybridmoe.kernels.gmm.tiling import KernelTiles, Tiling
from hybridmoe.kernels.vmem import MIB

# ---------------------------------------------------------------------------------------------
# tiling.py: resolution


def test_kernel_tiles_take_per_kernel_keys_over_the_shared_ones():
    t = tiling.kernel_tiles({"tm": 256, "tk": 512, "tn": 1024, "wo_dlhs_tk": 256, "wi_drhs_tm": 64,
                             "wi_fwd_tn": 0, "wi_fwd_rhs_buffer_count": 1, "vmem_limit_mib": 40})
    assert t.wi_fwd == Tiling(256, 512, 1024, rhs_buffer_count=1, vmem_limit_mib=40.0)
    assert t.wo_dlhs == Tiling(256, 256, 1024, vmem_limit_mib=40.0)   # its own tk
    assert t.wi_drhs == Tiling(64, 512, 1024, vmem_limit_mib=40.0)    # its own tm; depth only on wi_fwd
    assert t.wo_fwd == Tiling(256, 512, 1024, vmem_limit_mib=40.0)
    assert tiling.kernel_tiles({}) == KernelTiles()                   # absent: the defaults, 128 each
    assert KernelTiles().wo_drhs == Tiling(128, 128, 128)


@pytest.mark.parametrize("dim, preferred, expected", [(1024, 256, 256), (256, 256, 256), (1000, 256, 1000),
                                                      (128, 256, 128), (384, 256, 384)])
def test_pick_takes_the_preferred_tile_only_where_it_divides(dim, preferred, expected):
    assert tiling.pick(dim, preferred) == expected


@pytest.mark.parametrize("m, preferred, expected", [(5, 128, 8), (100, 128, 104), (128, 128, 128),
                                                    (129, 128, 128), (1, 4, 8), (16, 16, 16), (17, 32, 24)])
def test_resolve_tm_caps_at_rows_rounded_to_sublanes(m, preferred, expected):
    assert tiling.resolve_tm(m, preferred) == expected


def test_kernel_dims_contraction_and_output_per_kernel():
    assert tiling.kernel_dims(64, 48) == {
        "wi_fwd": (("D", 64), ("2F", 96)), "wi_dlhs": (("2F", 96), ("D", 64)), "wi_drhs": (("D", 64), ("2F", 96)),
        "wo_fwd": (("F", 48), ("D", 64)), "wo_dlhs": (("D", 64), ("F", 48)), "wo_drhs": (("F", 48), ("D", 64))}


# ---------------------------------------------------------------------------------------------
# tiling.py: rules


def test_aligned_tiles_have_no_problem():
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(8, 128, 128)) == []
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(8, 128, 128, rhs_buffer_count=2)) == []


def test_tm_must_be_a_multiple_of_8_on_hardware_only():
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(tm=12)) == ["tm=12 must be a positive multiple of 8"]
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(tm=12), hardware=False) == []
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(tm=0), hardware=False) == [
        "tm=0 must be a positive multiple of 8"]


def test_tk_off_the_lanes_is_named_once_per_dimension():
    # tk 64 divides D 256, 2F 512 and F 256 but is no multiple of 128: each dim's rule once, in
    # kernel order (wi_fwd over D, wi_dlhs over 2F, wo_fwd over F)
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(tk=64)) == [
        "tk (over D)=64 must be a multiple of 128 (TPU lanes) or span 256",
        "tk (over 2F)=64 must be a multiple of 128 (TPU lanes) or span 512",
        "tk (over F)=64 must be a multiple of 128 (TPU lanes) or span 256"]
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(tk=64), hardware=False) == []


def test_per_kernel_tiles_name_their_kernels():
    tiles = KernelTiles(wo_dlhs=Tiling(tk=64), wi_drhs=Tiling(tn=64))
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=tiles) == [
        "tn (over 2F)=64 must be a multiple of 128 (TPU lanes) or span 512 (wi_drhs)",
        "tk (over D)=64 must be a multiple of 128 (TPU lanes) or span 256 (wo_dlhs)"]


def test_fused_forward_tile_per_half_and_f_lane_rules():
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(), tile_n_per_half=192) == [
        "tile_n_per_half=192 must divide F=256"]
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(), tile_n_per_half=64) == [
        "tile_n_per_half=64 must be a multiple of 128"]
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(), tile_n_per_half=256) == []
    # F 192: the per-half tile falls back to all of F (pick(192, 128) = 192), off the lanes, and
    # the fused DLHS's one N tile spans F
    assert tiling.tile_problems(d_model=256, hidden=192, tiling=Tiling()) == [
        "tile_n_per_half=192 must be a multiple of 128", "F=192 must be a multiple of 128: the fused DLHS spans each half"]
    # the per-half tile replaces wi_fwd's tn rule: tn 64 over 2F would be named otherwise
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=KernelTiles(wi_fwd=Tiling(tn=64)),
                                tile_n_per_half=128) == []


def test_rhs_buffer_count_rules():
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(rhs_buffer_count=3)) == [
        "rhs_buffer_count=3: Mosaic TPU takes at most 2"]
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(rhs_buffer_count=3), hardware=False) == []
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(rhs_buffer_count=-1), hardware=False) == [
        "rhs_buffer_count=-1 must be 0 (the kernel default) or a depth >= 1"]


def test_triton_rules_want_powers_of_two_of_at_least_16():
    gpu = dict(d_model=256, hidden=256, backend="pallas_gpu")
    assert tiling.tile_problems(**gpu, tiling=Tiling(16, 128, 128)) == []
    assert tiling.tile_problems(**gpu, tiling=Tiling(tm=24)) == ["tm=24 must be a power of two >= 16 (Triton blocks)"]
    assert tiling.tile_problems(**gpu, tiling=Tiling(tm=8)) == ["tm=8 must be a power of two >= 16 (Triton blocks)"]
    # tk 64 is fine for Triton (not for Mosaic)
    assert tiling.tile_problems(**gpu, tiling=Tiling(16, 64, 64)) == []
    probs = tiling.tile_problems(d_model=256, hidden=192, backend="pallas_gpu", tiling=Tiling(16, 128, 128))
    assert "tile_n_per_half=192 must be a power of two >= 16" in probs
    assert "F=192 must be a power of two: the fused DLHS spans each half" in probs
    assert "tk (over F)=192 must be a power of two >= 16 (Triton blocks)" in probs


def test_check_raises_with_every_problem():
    tiling.check([])
    with pytest.raises(ValueError, match="^gmm tiling: a; b$"):
        tiling.check(["a", "b"])


# ---------------------------------------------------------------------------------------------
# tiling.py: VMEM buffers (bf16 inputs; every term a buffer's (sublane, 128-lane) tiled bytes x count)

LHS = 16 * 128 * 2 * 2        # [16, 64] bf16 -> (16, 128), 2 buffers
OUT = 16 * 128 * 2 * 2        # [16, 128] bf16, 2 buffers
ACC = 16 * 128 * 4            # [16, 128] float32 scratch


def test_gmm_and_gmm_t_buffers():
    # gmm: rhs [tk, tn] = [64, 128] -> (64, 128); gmm_t: rhs [tn, tk] = [128, 64] -> (128, 128)
    gmm = tiling.tpu_buffers("gmm", tm=16, tk=64, tn=128)
    assert vmem.tpu_bytes(gmm) == LHS + 64 * 128 * 2 * 2 + OUT + ACC
    assert vmem.tpu_bytes(tiling.tpu_buffers("gmm_t", tm=16, tk=64, tn=128)) == LHS + 128 * 128 * 2 * 2 + OUT + ACC
    # a float32 output doubles the out block only
    assert vmem.tpu_bytes(tiling.tpu_buffers("gmm", tm=16, tk=64, tn=128, out_itemsize=4)) == (
        LHS + 64 * 128 * 2 * 2 + 2 * OUT + ACC)


def test_tgmm_buffers_with_and_without_the_carried_accumulator():
    # lhs, grad [16, 128], out [64, 128] bf16 x 2, acc [64, 128] f32, the transposed lhs [64, 16] -> (64, 128) bf16
    base = LHS + OUT + 64 * 128 * 2 * 2 + 64 * 128 * 4 + 64 * 128 * 2
    assert vmem.tpu_bytes(tiling.tpu_buffers("tgmm", tm=16, tk=64, tn=128)) == base
    assert vmem.tpu_bytes(tiling.tpu_buffers("tgmm", tm=16, tk=64, tn=128, accumulate=True)) == base + 64 * 128 * 2 * 2


def test_fused_forward_buffers_and_weight_depth():
    # x, w_gate and w_up [64, 128] (depth copies), h [16, 128], preact [16, 256], two f32 accumulators,
    # silu(gate) f32 and h bf16 values
    def total(w):
        return LHS + 2 * 64 * 128 * 2 * w + OUT + 16 * 256 * 2 * 2 + 2 * ACC + 16 * 128 * 4 + 16 * 128 * 2
    assert vmem.tpu_bytes(tiling.tpu_buffers("wi_fused", tm=16, tk=64, tn=128)) == total(2)  # 0: Mosaic's 2
    assert vmem.tpu_bytes(tiling.tpu_buffers("wi_fused", tm=16, tk=64, tn=128, depth=1)) == total(1)


def test_fused_input_gradient_buffers_and_row_operands():
    # g [16, 64] -> (16, 128); wo [F=128, 64] -> (128, 128); preact and d_gate_up [16, 256]; row_dot
    # [16, 1] f32 -> (16, 128) x 2; acc [16, 128] f32; the epilogue's 4 float32 [16, 128] values
    base = LHS + 128 * 128 * 2 * 2 + 2 * (16 * 256 * 2 * 2) + 16 * 128 * 4 * 2 + ACC + 4 * 16 * 128 * 4
    kw = dict(tm=16, tk=64, tn=128, f=128)
    assert vmem.tpu_bytes(tiling.tpu_buffers("wo_fused_dlhs", **kw)) == base
    assert vmem.tpu_bytes(tiling.tpu_buffers("wo_fused_dlhs", **kw, row_scale=True)) == base + 16 * 128 * 4 * 2
    assert vmem.tpu_bytes(tiling.tpu_buffers("wo_fused_dlhs", **kw, with_h=True)) == base + OUT
    with pytest.raises(ValueError, match="unknown grouped-matmul kernel"):
        tiling.tpu_buffers("gmm_fused", **kw)


def _tiles():
    return KernelTiles(wi_fwd=Tiling(16, 128, 128), wi_dlhs=Tiling(24, 256, 128), wi_drhs=Tiling(32, 128, 256),
                       wo_fwd=Tiling(40, 512, 128), wo_dlhs=Tiling(48, 256, 128), wo_drhs=Tiling(56, 128, 256))


def test_layer_kernels_give_each_matmul_its_own_tiles_over_its_own_dims():
    # D 512, F 256 (2F 512): wo_fwd's tk 512 does not divide F 256 -> the whole F
    out = tiling.layer_kernels(d_model=512, hidden=256, tiles=_tiles(), wi_fused=False, wo_fused=False,
                               tile_n_per_half=None, row_scale=False)
    assert {k: (name, tiling.resolved_tiles(b)) for k, (name, b) in out.items()} == {
        "wi_fwd": ("gmm", (16, 128, 128)), "wi_dlhs": ("gmm_t", (24, 256, 128)), "wi_drhs": ("tgmm", (32, 128, 256)),
        "wo_fwd": ("gmm", (40, 256, 128)), "wo_dlhs": ("gmm_t", (48, 256, 128)), "wo_drhs": ("tgmm", (56, 128, 256))}
    # 20 routed rows cap every tm at 24 (20 rounded up to 8)
    out = tiling.layer_kernels(d_model=512, hidden=256, tiles=_tiles(), wi_fused=False, wo_fused=False,
                               tile_n_per_half=None, row_scale=False, rows=20)
    assert [tiling.resolved_tiles(b)[0] for _, b in out.values()] == [16, 24, 24, 24, 24, 24]


def test_layer_kernels_fused_pair_and_weight_depth_with_one_k_tile():
    tiles = KernelTiles(wi_fwd=Tiling(16, 512, 128, rhs_buffer_count=1), wo_dlhs=Tiling(48, 256, 128))
    out = tiling.layer_kernels(d_model=512, hidden=256, tiles=tiles, wi_fused=True, wo_fused=True,
                               tile_n_per_half=128, row_scale=True, accumulate_weight_grads=True)
    name, wi = out["wi_fwd"]
    assert name == "wi_fused_swiglu_fwd" and tiling.resolved_tiles(wi) == (16, 512, 128)
    assert {b.what: b.count for b in wi}["w_gate"] == 1       # tk 512 spans D: the depth applies
    name, wo = out["wo_dlhs"]
    assert name == "wo_fused_dswiglu_dlhs" and tiling.resolved_tiles(wo) == (48, 256, 256)  # one N tile spans F
    assert "row_scale" in {b.what for b in wo} and "h" not in {b.what for b in wo}
    assert "acc_in" in {b.what for b in out["wi_drhs"][1]} and "acc_in" in {b.what for b in out["wo_drhs"][1]}
    # two K tiles: the depth is dropped (Mosaic's 2); no tile_n_per_half: the per-half tile is all of F
    tiles = KernelTiles(wi_fwd=Tiling(16, 256, 128, rhs_buffer_count=1))
    out = tiling.layer_kernels(d_model=512, hidden=256, tiles=tiles, wi_fused=True, wo_fused=False,
                               tile_n_per_half=None, row_scale=False)
    assert {b.what: b.count for b in out["wi_fwd"][1]}["w_gate"] == 2
    assert tiling.resolved_tiles(out["wi_fwd"][1]) == (16, 256, 256)
    assert "acc_in" not in {b.what for b in out["wo_drhs"][1]}


def test_vmem_needs_name_kernel_and_pallas_call_against_the_limit():
    layer = dict(d_model=512, hidden=256, tiles=_tiles(), wi_fused=False, wo_fused=False, tile_n_per_half=None,
                 row_scale=False)
    needs = tiling.vmem_needs(30.0, **layer)
    assert needs["wo_drhs"].kernel == "wo_drhs (tgmm)"
    assert all(n.limit_bytes == 30 * MIB for n in needs.values())
    # wi_fwd: gmm at (16, 128, 128) bf16: lhs, rhs [128, 128], out x 2 buffers, acc f32
    assert needs["wi_fwd"].need_bytes == 16 * 128 * 2 * 2 + 128 * 128 * 2 * 2 + 16 * 128 * 2 * 2 + 16 * 128 * 4
    assert tiling.vmem_needs(0.0, **layer)["wi_fwd"].limit_bytes == 16 * MIB  # auto: fits the default


# ---------------------------------------------------------------------------------------------
# metadata.py: grid steps over (local group, row tile)

# 5 groups of [3, 0, 10, 5, 2] rows; local groups 1..3 (sizes 0, 10, 5: rows [3, 3), [3, 13), [13, 18));
# tm 8 over 24 padded rows: 3 row tiles, S = 3 + 3 - 1 = 5 steps at most.
SIZES = jnp.array([3, 0, 10, 5, 2])


def _ints(*xs):
    return [np.asarray(x).tolist() for x in xs]


def test_group_metadata_visits_an_empty_group_once_when_asked():
    lo, hi, group, tile, steps = metadata.group_metadata(SIZES, m=24, tm=8, group_offset=1, num_local=3,
                                                         visit_empty=True)
    assert _ints(lo, hi) == [[3, 3, 13], [3, 13, 18]]
    # group 0 (empty): 1 step at tile 3 // 8 = 0; group 1 [3, 13): tiles 0, 1; group 2 [13, 18): tiles 1, 2
    assert _ints(group, tile, steps) == [[0, 1, 1, 2, 2], [0, 0, 1, 1, 2], 5]


def test_group_metadata_skips_empty_groups_and_repeats_the_last_step():
    _, _, group, tile, steps = metadata.group_metadata(SIZES, m=24, tm=8, group_offset=1, num_local=3,
                                                       visit_empty=False)
    # 4 real steps; the fifth repeats the fourth
    assert _ints(group, tile, steps) == [[1, 1, 2, 2, 2], [0, 1, 1, 2, 2], 4]


def test_group_metadata_groups_on_tile_edges_share_no_step():
    # sizes 8, 8 at tm 8: each group exactly one tile; S = 2 + 2 - 1 = 3
    _, _, group, tile, steps = metadata.group_metadata(jnp.array([8, 8]), m=16, tm=8, group_offset=0, num_local=2,
                                                       visit_empty=False)
    assert _ints(group, tile, steps) == [[0, 1, 1], [0, 1, 1], 2]
    # sizes 9, 7: group 0 spans tiles 0, 1; group 1 [9, 16) tile 1 only
    _, _, group, tile, steps = metadata.group_metadata(jnp.array([9, 7]), m=16, tm=8, group_offset=0, num_local=2,
                                                       visit_empty=False)
    assert _ints(group, tile, steps) == [[0, 0, 1], [0, 1, 1], 3]
    with pytest.raises(ValueError, match="rows 20 must be padded to a multiple of tm=8"):
        metadata.group_metadata(SIZES, m=20, tm=8, group_offset=0, num_local=5, visit_empty=False)


def test_local_bounds_row_mask_and_kept_rows():
    assert _ints(*metadata.local_bounds(SIZES, 1, 3)) == [3, 18]
    assert _ints(*metadata.local_groups(SIZES, 2, 2)) == [[10, 5], [3, 13], [13, 18]]
    mask = np.asarray(metadata.row_mask(24, SIZES, 2, 2))
    assert mask.tolist() == [False] * 3 + [True] * 15 + [False] * 6
    out = metadata.keep_local_rows(jnp.ones((24, 2)), 20, SIZES, 3, 2)  # groups 3, 4: rows [13, 20)
    assert np.asarray(out)[:, 0].tolist() == [0.0] * 13 + [1.0] * 7


def test_row_tiling_and_padding():
    t, tm, m_pad = metadata.row_tiling(None, 20)
    assert (t, tm, m_pad) == (tiling.DEFAULT, 24, 24)       # tm 128 capped at 20 rounded up to 8
    assert metadata.row_tiling(Tiling(tm=16), 20)[1:] == (16, 32)
    assert metadata.row_tiling(Tiling(tm=16), 32)[1:] == (16, 32)  # on the edge: no padding
    assert metadata.row_tiling(Tiling(tm=16), 33)[1:] == (16, 48)
    x = jnp.arange(6.0).reshape(3, 2)
    assert np.asarray(metadata.pad_rows(x, 5)).tolist() == [[0, 1], [2, 3], [4, 5], [0, 0], [0, 0]]
    assert metadata.pad_rows(x, 3) is x
    scale, h = metadata.dlhs_row_operands(jnp.array([1.0, 2.0, 3.0], jnp.bfloat16), jnp.ones((3, 4)), 8)
    assert scale.shape == (8, 1) and scale.dtype == jnp.float32 and h.shape == (8, 4)
    assert metadata.dlhs_row_operands(None, None, 8) == []


# ---------------------------------------------------------------------------------------------
# row_tiles.py: the padded layout of the XLA backend


def test_row_tiles_layout_of_local_groups():
    # local groups 1..3 (sizes 0, 10, 5) of 20 rows, 4 rows a tile: padded sizes 0, 12, 8; tiles 5 + 3 = 8
    lay = row_tiles.row_tiles(SIZES, 20, group_offset=1, num_local=3, rows_per_tile=4)
    assert lay.num_tiles == 8 and lay.rows_per_tile == 4
    # positions 0..9 copy rows 3..12 (group 1), 12..16 rows 13..17 (group 2); the rest hold none
    assert np.asarray(lay.src_P).tolist() == [*range(3, 13), 0, 0, *range(13, 18)] + [0] * 15
    assert np.asarray(lay.real_P).tolist() == [True] * 10 + [False] * 2 + [True] * 5 + [False] * 15
    assert np.asarray(lay.dest_M).tolist() == [0, 0, 0, *range(0, 10), *range(12, 17), 0, 0]
    assert np.asarray(lay.keep_M).tolist() == [False] * 3 + [True] * 15 + [False] * 2
    assert np.asarray(lay.group_T).tolist() == [1, 1, 1, 2, 2, 2, 2, 2]


def test_routed_tiles_place_each_token_slot_row():
    # 3 tokens, k = 2: experts [[1, 0], [1, 1], [0, 2]]; sorted (stable) rows: expert 0: flat 1, 4;
    # expert 1: flat 0, 2, 3; expert 2: flat 5. 2 rows a tile: padded sizes 2, 4, 2 -> positions
    # expert 0: 0, 1; expert 1: 2, 3, 4 (5 padding); expert 2: 6
    r = row_tiles.routed_tiles(jnp.array([[1, 0], [1, 1], [0, 2]]), 3, 2)
    assert np.asarray(r.pos_Tk).tolist() == [[2, 0], [3, 4], [1, 6]]
    real = np.asarray(r.lay.real_P)
    assert np.asarray(r.token_P)[real].tolist() == [0, 2, 0, 1, 1, 2]   # flat // 2 for 1, 4, 0, 2, 3, 5
    assert np.asarray(r.slot_P)[real].tolist() == [1, 0, 0, 0, 1, 1]    # flat % 2
    assert real.tolist()[:8] == [True, True, True, True, True, False, True, False]


def test_row_tiles_bound_counts_a_partial_last_tile():
    # 11 rows in groups of 5 and 6, 4 rows a tile: ceil(11 / 4) + 2 = 5 tiles; padded sizes 8, 8
    lay = row_tiles.row_tiles(jnp.array([5, 6]), 11, group_offset=0, num_local=2, rows_per_tile=4)
    assert lay.num_tiles == 5
    assert np.asarray(lay.src_P).tolist() == [0, 1, 2, 3, 4, 0, 0, 0, *range(5, 11), 0, 0, 0, 0, 0, 0]
    assert np.asarray(lay.dest_M).tolist() == [0, 1, 2, 3, 4, *range(8, 14)]
    assert np.asarray(lay.group_T).tolist() == [0, 0, 1, 1, 1]


# ---------------------------------------------------------------------------------------------
# xla.py and ops.py: ragged_dot chunks, sharding, per-role tiles, entry checks


@pytest.mark.parametrize("num_local, sharded, platform, chunks", [
    (512, True, "cpu", [(0, 512)]),                    # no cap off TPU
    (256, False, "tpu", [(0, 256)]),                   # exactly the cap
    (255, True, "tpu", [(0, 255)]),                    # 255 + the zero group = 256
    (256, True, "tpu", [(0, 255), (255, 1)]),          # 257 groups: chunks of 255 + the zero group
    (257, False, "tpu", [(0, 255), (255, 2)]),
    (512, True, "tpu", [(0, 255), (255, 255), (510, 2)]),
])
def test_ragged_dot_group_chunks_under_the_tpu_cap(num_local, sharded, platform, chunks):
    from hybridmoe.kernels.gmm import xla

    assert xla.ragged_group_chunks(num_local, sharded, platform) == chunks


def test_sharded_means_fewer_groups_or_a_nonzero_offset():
    from hybridmoe.kernels.gmm import ops

    sizes = jnp.zeros((8,), jnp.int32)
    assert not ops._sharded(sizes, 8, 0)
    assert ops._sharded(sizes, 4, 0)
    assert ops._sharded(sizes, 8, 2)
    assert ops._sharded(sizes, 8, jnp.int32(0))  # a traced offset: not known to be 0


def test_each_role_takes_its_own_tiles_else_the_forwards():
    from hybridmoe.kernels.gmm import ops

    fwd, dlhs, drhs = Tiling(8), Tiling(16), Tiling(24)
    assert ops._role_kws("pallas_tpu", fwd, dlhs, drhs, True, "ragged_dot", 64) == (
        dict(tiling=fwd, interpret=True), dict(tiling=dlhs, interpret=True), dict(tiling=drhs, interpret=True))
    assert ops._role_kws("pallas_tpu", fwd, None, None, False, "ragged_dot", 64) == (
        dict(tiling=fwd, interpret=False),) * 3
    assert ops._role_kws("xla", fwd, dlhs, drhs, False, "row_tiles", 64) == (dict(impl="row_tiles", tile_rows=64),) * 3


def test_gmm_entry_checks():
    from hybridmoe.kernels.gmm import ops

    lhs, rhs, sizes = jnp.zeros((6, 4)), jnp.zeros((2, 4, 3)), jnp.array([3, 3], jnp.int32)
    ops._check(lhs, rhs, sizes, 1)
    with pytest.raises(ValueError, match="contraction mismatch"):
        ops._check(lhs, rhs, sizes, 2)
    with pytest.raises(ValueError, match="group_sizes must be int32"):
        ops._check(lhs, rhs, sizes.astype(jnp.float32), 1)
    with pytest.raises(ValueError, match="rhs holds 2 groups but group_sizes has 1"):
        ops._check(lhs, rhs, sizes[:1], 1)
    with pytest.raises(ValueError, match="unknown gmm backend"):
        ops.backend_module("triton")


def test_dlhs_plan_pads_rows_and_tiles_the_model_width():
    # g [20, D 256], wo [G 2, F 128, D 256]; tm 16 -> 32 padded rows; tk 256 tiles D (not F 128)
    g, wo, pre = jnp.ones((20, 256)), jnp.ones((2, 128, 256)), jnp.ones((20, 256), jnp.bfloat16)
    plan = metadata.dlhs_plan(g, wo, pre, jnp.ones((20,)), None, Tiling(tm=16, tk=256))
    assert (plan.m, plan.d, plan.f, plan.num_local, plan.tm, plan.m_pad, plan.tk) == (20, 256, 128, 2, 16, 32, 256)
    assert (plan.has_scale, plan.has_h, plan.pre_dtype) == (True, False, jnp.bfloat16)
    assert [a.shape for a in plan.args] == [(32, 256), (2, 128, 256), (32, 256), (32, 1)]
    assert plan.optional_refs(("s", "a", "b")) == ("s", None, ["a", "b"])
    plan = metadata.dlhs_plan(g, wo, pre, None, jnp.ones((20, 128)), None)  # default tiles: tm 128 -> 24
    assert (plan.tm, plan.m_pad, plan.tk, plan.has_scale, plan.has_h) == (24, 24, 128, False, True)
    assert plan.optional_refs(("h", "a")) == (None, "h", ["a"])
