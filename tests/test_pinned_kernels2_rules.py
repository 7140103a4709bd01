"""Edges of the grouped-matmul and Gated DeltaNet kernels' rules and index arithmetic that the other
pinned tests leave open: each limit at exactly its value, and index tables at awkward shapes (a group
ending on a tile edge, an empty last group, a fractional chunk). Eager index arrays and pure
Python only: nothing compiles a kernel."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from hybridmoe.kernels.gmm import tiling
from hybridmoe.kernels.gmm.tiling import Tiling

# ---------------------------------------------------------------------------------------------
# tiling.py: the Triton rules at exactly 16


def test_triton_takes_tiles_of_exactly_16_and_refuses_8():
    gpu = dict(d_model=256, hidden=256, backend="pallas_gpu")
    assert tiling.tile_problems(**gpu, tiling=Tiling(16, 16, 16), tile_n_per_half=16) == []
    # 8 divides every dim and is a power of two, but under 16: each dim's tk / tn and the per-half tile
    assert tiling.tile_problems(**gpu, tiling=Tiling(16, 8, 8), tile_n_per_half=8) == [
        "tk (over D)=8 must be a power of two >= 16 (Triton blocks)",
        "tk (over 2F)=8 must be a power of two >= 16 (Triton blocks)",
        "tn (over D)=8 must be a power of two >= 16 (Triton blocks)",
        "tn (over 2F)=8 must be a power of two >= 16 (Triton blocks)",
        "tk (over F)=8 must be a power of two >= 16 (Triton blocks)",
        "tn (over F)=8 must be a power of two >= 16 (Triton blocks)",
        "tile_n_per_half=8 must be a power of two >= 16"]
    # F 16: every tile spanning it is a power of two of exactly 16
    assert tiling.tile_problems(d_model=256, hidden=16, backend="pallas_gpu", tiling=Tiling(16, 16, 16)) == []


def test_a_zero_tile_per_half_is_refused_not_divided_by():
    assert tiling.tile_problems(d_model=256, hidden=256, tiling=Tiling(16, 128, 128), tile_n_per_half=0,
                                hardware=False) == ["tile_n_per_half=0 must divide F=256"]


def test_a_tile_per_half_of_a_lane_multiple_that_spans_f_off_the_lanes_is_refused():
    # F 136 = 128 + 8: the per-half tile spans F (it divides) yet is no multiple of 128, and the
    # fused DLHS's one N tile spans F; tn 136 over 2F 272 divides it but is neither 128k nor 272
    assert tiling.tile_problems(d_model=256, hidden=136, tiling=Tiling(8, 128, 136), tile_n_per_half=136) == [
        "tn (over 2F)=136 must be a multiple of 128 (TPU lanes) or span 272",
        "tile_n_per_half=136 must be a multiple of 128",
        "F=136 must be a multiple of 128: the fused DLHS spans each half"]


def test_is_pow2_refuses_zero_and_non_powers():
    assert [x for x in range(-2, 40) if tiling._is_pow2(x)] == [1, 2, 4, 8, 16, 32]


# ---------------------------------------------------------------------------------------------
# metadata.py: grid steps at awkward shapes (rows [lo, hi) of a group touch tiles lo // tm ..
# ceil(hi / tm) - 1; S = tiles_m + G - 1 steps, those past the real ones repeat the last)


def _ints(*xs):
    return [np.asarray(x).tolist() for x in xs]


def _steps(sizes, m, tm, visit_empty, offset=0, num_local=None):
    from hybridmoe.kernels.gmm import metadata

    sizes = jnp.asarray(sizes, jnp.int32)
    _, _, group, tile, steps = metadata.group_metadata(
        sizes, m=m, tm=tm, group_offset=offset, num_local=num_local or sizes.shape[0], visit_empty=visit_empty)
    return _ints(group, tile, steps)


def test_steps_skip_an_empty_group_on_a_tile_edge_between_full_tiles():
    # sizes 8, 0, 8, 5 of 24 rows at tm 8: rows [0, 8) [8, 8) [8, 16) [16, 21); one tile each but the
    # empty one; S = 3 + 4 - 1 = 6, the last real step (group 3, tile 2) repeated
    assert _steps([8, 0, 8, 5], 24, 8, visit_empty=False) == [[0, 2, 3, 3, 3, 3], [0, 1, 2, 2, 2, 2], 3]
    # visited: the empty group takes one step at tile 8 // 8 = 1
    assert _steps([8, 0, 8, 5], 24, 8, visit_empty=True) == [[0, 1, 2, 3, 3, 3], [0, 1, 1, 2, 2, 2], 4]


def test_an_empty_last_group_past_every_row_is_clipped_to_the_last_tile():
    # sizes 16, 0 of 16 rows at tm 8: the empty group sits at row 16, tile 2, past the 2 tiles: its
    # visit is clipped to tile 1
    assert _steps([16, 0], 16, 8, visit_empty=True) == [[0, 0, 1], [0, 1, 1], 3]


def test_no_rows_at_all_gives_zero_steps_that_point_at_the_last_group():
    # both groups empty, not visited: 0 real steps; the S = 1 + 2 - 1 = 2 table entries repeat step 0,
    # clamped to the last group, tile 0
    assert _steps([0, 0], 8, 8, visit_empty=False) == [[1, 1], [0, 0], 0]


def test_steps_of_one_local_group_in_the_middle_of_the_rows():
    # sizes 5, 11, 8 of 24 rows, local group 1 alone: rows [5, 16) touch tiles 0 and 1 at tm 8;
    # S = 3 + 1 - 1 = 3
    assert _steps([5, 11, 8], 24, 8, visit_empty=False, offset=1, num_local=1) == [[0, 0, 0], [0, 1, 1], 2]


# ---------------------------------------------------------------------------------------------
# row_tiles.py: an empty last group behind a group ending on a tile edge


def test_row_tiles_after_a_group_ending_on_a_tile_edge_belong_to_the_next_group():
    from hybridmoe.kernels.gmm import row_tiles

    # sizes 4, 0 at 4 rows a tile: padded sizes 4, 0 (ends 4, 4); 1 + 2 = 3 tiles; positions from 4
    # on lie at or past both ends: the last group's, holding nothing
    lay = row_tiles.row_tiles(jnp.array([4, 0]), 4, group_offset=0, num_local=2, rows_per_tile=4)
    assert np.asarray(lay.group_T).tolist() == [0, 1, 1]
    assert np.asarray(lay.src_P).tolist() == [0, 1, 2, 3] + [0] * 8
    assert np.asarray(lay.real_P).tolist() == [True] * 4 + [False] * 8
    assert np.asarray(lay.dest_M).tolist() == [0, 1, 2, 3]
