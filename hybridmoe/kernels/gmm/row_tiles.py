"""A grouped matmul as one batched matmul over group-aligned row tiles (the xla backend on CPU).

Legend: M rows (sorted by group), K contraction, N output columns, E groups in group_sizes
(global), G local groups (the weight's leading dim: groups [offset, offset + G)), R rows per
tile, T tiles (a static bound), P = T * R padded positions.

On CPU, `jax.lax.ragged_dot` computes every group for every row and masks (at 16 groups XLA
counts 13x the useful FLOPs). Here the local groups' rows are copied once into a padded layout
in which each group starts on a tile boundary, so every R-row tile belongs to one group, and one
batched matmul [T, R, K] x [T, K, N] runs every tile against its group's weight (gathered per
tile). T = ceil(M / R) + G bounds the tiles of any split of M rows into G groups (each group
adds at most one partial tile); tiles past the last group's end hold zeros.

Everything is a gather: rows -> padded positions (forward operands), padded positions -> rows
(results). The weight gradient (`tgmm`) multiplies per tile and sums each group's tiles with a
one-hot [G, T] matmul, so neither direction needs a scatter-add, and no loop runs (inside a
shard_map nothing here can put a collective into a loop). Padding, foreign-group rows and empty
groups give exact zeros. Float32 sums run per tile, so results match ragged_dot to rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybridmoe.kernels.gmm.metadata import local_groups


class RowTiles(NamedTuple):
    """Where each row goes in the padded layout, and back (int32 / bool index arrays)."""

    src_P: jax.Array      # the row each padded position copies (0 where it holds none)
    real_P: jax.Array     # the padded position holds a row of a local group
    dest_M: jax.Array     # the padded position of each row (0 where it has none)
    keep_M: jax.Array     # the row belongs to a local group
    group_T: jax.Array    # the local group of each tile
    rows_per_tile: int

    @property
    def num_tiles(self) -> int:
        return self.group_T.shape[0]


def _group_of(ends_G, positions):
    """The local group whose [start, end) holds each position (clamped to the last group).

    A comparison against every end (G is small): no searchsorted loop in the program.
    """
    idx = jnp.sum(positions[:, None] >= ends_G[None, :], axis=1, dtype=jnp.int32)
    return jnp.minimum(idx, ends_G.shape[0] - 1)


def row_tiles(group_sizes_E, m: int, *, group_offset, num_local: int, rows_per_tile: int) -> RowTiles:
    """The padded layout of the local groups [offset, offset + G) of M rows sorted by group."""
    R = rows_per_tile
    tiles = -(-m // R) + num_local
    sizes_G, starts_G, ends_G = local_groups(group_sizes_E, group_offset, num_local)
    padded_G = (sizes_G + R - 1) // R * R
    padded_ends_G = jnp.cumsum(padded_G)
    padded_starts_G = padded_ends_G - padded_G

    p_P = jnp.arange(tiles * R, dtype=jnp.int32)
    g_P = _group_of(padded_ends_G, p_P)
    offset_P = p_P - padded_starts_G[g_P]
    real_P = (offset_P < sizes_G[g_P]) & (p_P < padded_ends_G[-1])
    src_P = jnp.where(real_P, starts_G[g_P] + offset_P, 0)

    r_M = jnp.arange(m, dtype=jnp.int32)
    g_M = _group_of(ends_G, r_M)
    keep_M = (r_M >= starts_G[0]) & (r_M < ends_G[-1])
    dest_M = jnp.where(keep_M, padded_starts_G[g_M] + r_M - starts_G[g_M], 0)
    return RowTiles(src_P, real_P, dest_M, keep_M, g_P.reshape(tiles, R)[:, 0], R)


def to_tiles(x_MK, lay: RowTiles):
    """[T, R, K]: the rows in the padded layout (zeros where no local row sits)."""
    x_PK = jnp.where(lay.real_P[:, None], x_MK[lay.src_P], jnp.zeros((), x_MK.dtype))
    return x_PK.reshape(lay.num_tiles, lay.rows_per_tile, x_MK.shape[1])


def from_tiles(y_TRN, lay: RowTiles):
    """[M, N]: each row's result from the padded layout (zero for rows of no local group)."""
    y_PN = y_TRN.reshape(-1, y_TRN.shape[-1])
    return jnp.where(lay.keep_M[:, None], y_PN[lay.dest_M], jnp.zeros((), y_PN.dtype))


def gmm_f32(lhs_MK, rhs_GKN, lay: RowTiles, *, transpose_rhs: bool):
    """float32 [M, N]: out[r] = lhs[r] @ rhs[group(r) - offset] (rhs [G, N, K] when transposed)."""
    w_T = rhs_GKN[lay.group_T]
    spec = "trk,tnk->trn" if transpose_rhs else "trk,tkn->trn"
    y_TRN = jnp.einsum(spec, to_tiles(lhs_MK, lay), w_T, preferred_element_type=jnp.float32)
    return from_tiles(y_TRN, lay)


def tgmm_f32(lhs_MK, grad_MN, lay: RowTiles, *, num_local: int):
    """float32 [G, K, N]: per local group, lhs[rows]^T @ grad[rows]."""
    d_TKN = jnp.einsum("trk,trn->tkn", to_tiles(lhs_MK, lay), to_tiles(grad_MN, lay),
                       preferred_element_type=jnp.float32)
    # Each group's tiles summed by a one-hot matmul (exact 0/1 weights; a gather-free segment sum).
    onehot_GT = (jnp.arange(num_local, dtype=jnp.int32)[:, None] == lay.group_T[None, :])
    return jnp.einsum("gt,tkn->gkn", onehot_GT.astype(jnp.float32), d_TKN,
                      preferred_element_type=jnp.float32)


def row_tiled_dot(lhs_MK, rhs_GKN, group_sizes_G, *, tile_rows: int = 128, preferred_element_type=None):
    """jax.lax.ragged_dot's contract (every group local, rows sorted by group), computed by row tiles.

    Differentiable through the grouped matmul's custom VJP (ops.gmm), so its backward is the same
    gathers and matmuls.
    """
    from hybridmoe.kernels.gmm import ops

    return ops.gmm(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), xla_impl="row_tiles",
                   xla_tile_rows=tile_rows, preferred_element_type=preferred_element_type)
