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
from jax.ad_checkpoint import checkpoint_name

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


# ---------------------------------------------------------------------------------------------
# The whole routed expert MLP in the padded layout (the default MoE program on CPU).


class RoutedTiles(NamedTuple):
    """Where each (token, slot) row sits in the padded layout of M = T * k rows sorted by expert."""

    lay: RowTiles
    token_P: jax.Array    # the token each padded position copies (0 where it holds none)
    slot_P: jax.Array     # the routed slot (0..k-1) of that row (0 where none)
    pos_Tk: jax.Array     # the padded position of each (token, slot) row


def routed_tiles(idx_Tk, num_experts: int, rows_per_tile: int) -> RoutedTiles:
    """The layout of the rows (token t, slot j) -> expert idx[t, j], sorted by expert (stable)."""
    T, k = idx_Tk.shape
    flat_M = idx_Tk.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)  # sorted row r holds flat row order_M[r] = t * k + j
    sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    lay = row_tiles(sizes_E, T * k, group_offset=0, num_local=num_experts, rows_per_tile=rows_per_tile)
    flat_P = order_M[lay.src_P]
    # Every row is local (all experts held), so each flat row has a position: an int scatter of M
    # indices inverts the permutation (no second sort).
    pos_M = jnp.zeros((T * k,), jnp.int32).at[order_M].set(lay.dest_M, unique_indices=True)
    # rows_per_tile leaves the tuple: it crosses the custom VJP as an array (the shapes keep it).
    return RoutedTiles(lay._replace(rows_per_tile=None), jnp.where(lay.real_P, flat_P // k, 0),
                       jnp.where(lay.real_P, flat_P % k, 0), pos_M.reshape(T, k))


def _batched(a_PK, w_EKN, lay: RowTiles, spec: str):
    """One batched matmul of every tile against its expert's weight, float32 out, [P, N]."""
    a_TRK = a_PK.reshape(lay.num_tiles, -1, a_PK.shape[-1])
    y = jnp.einsum(spec, a_TRK, w_EKN[lay.group_T], preferred_element_type=jnp.float32)
    return y.reshape(-1, y.shape[-1])


def _expert_sums(a_PK, b_PN, lay: RowTiles, num_experts: int):
    """float32 [E, K, N]: per expert, a[its rows]^T @ b[its rows] (per tile, then the one-hot sum)."""
    tiles = lay.num_tiles
    d_TKN = jnp.einsum("trk,trn->tkn", a_PK.reshape(tiles, -1, a_PK.shape[-1]), b_PN.reshape(tiles, -1, b_PN.shape[-1]),
                       preferred_element_type=jnp.float32)
    onehot_ET = (jnp.arange(num_experts, dtype=jnp.int32)[:, None] == lay.group_T[None, :])
    return jnp.einsum("et,tkn->ekn", onehot_ET.astype(jnp.float32), d_TKN, preferred_element_type=jnp.float32)


def silu_grad(x):
    sig = jax.nn.sigmoid(x)
    return sig * (1.0 + x * (1.0 - sig))


def row_cotangents(d32_TD, w_Tk, r: RoutedTiles, dt):
    """[P, D]: each real padded row's output cotangent, its routing weight times its token's (0 elsewhere)."""
    w_P = w_Tk[r.token_P, r.slot_P]
    return jnp.where(r.lay.real_P[:, None], (d32_TD[r.token_P] * w_P[:, None]).astype(dt), jnp.zeros((), dt))


def _forward(x_TD, w_Tk, wi_ED2F, wo_EFD, r: RoutedTiles):
    dt = x_TD.dtype
    lay = r.lay
    x_PD = jnp.where(lay.real_P[:, None], x_TD[r.token_P], jnp.zeros((), dt))
    h_P2F = _batched(x_PD, wi_ED2F, lay, "trk,tkn->trn").astype(dt)
    gate, up = jnp.split(h_P2F, 2, axis=-1)
    # The names remat.save knows for the expert MLP's pre-activations (model/moe.py's swiglu).
    gate, up = checkpoint_name(gate, "moe_gate"), checkpoint_name(up, "moe_up")
    a_PF = jax.nn.silu(gate) * up  # padding rows: silu(0) * 0 = 0
    y_PD = _batched(a_PF, wo_EFD, lay, "trk,tkn->trn").astype(dt)
    y_TkD = y_PD[r.pos_Tk]
    out = jnp.sum((y_TkD.astype(jnp.float32) * w_Tk[..., None]).astype(dt).astype(jnp.float32), axis=1)
    return out.astype(dt), (x_PD, h_P2F, a_PF, y_TkD)


@jax.custom_vjp
def _routed_mlp(x_TD, w_Tk, wi_ED2F, wo_EFD, r: RoutedTiles):
    return _forward(x_TD, w_Tk, wi_ED2F, wo_EFD, r)[0]


def _routed_mlp_fwd(x_TD, w_Tk, wi_ED2F, wo_EFD, r):
    out, (x_PD, h_P2F, a_PF, y_TkD) = _forward(x_TD, w_Tk, wi_ED2F, wo_EFD, r)
    return out, (x_PD, h_P2F, a_PF, y_TkD, w_Tk, wi_ED2F, wo_EFD, r)


def _routed_mlp_bwd(res, d_TD):
    x_PD, h_P2F, a_PF, y_TkD, w_Tk, wi_ED2F, wo_EFD, r = res
    dt, E, lay = x_PD.dtype, wi_ED2F.shape[0], r.lay
    d32_TD = d_TD.astype(jnp.float32)
    d_w_Tk = jnp.sum(y_TkD.astype(jnp.float32) * d32_TD[:, None, :], axis=-1)
    d_y_PD = row_cotangents(d32_TD, w_Tk, r, dt)
    d_a_PF = _batched(d_y_PD, wo_EFD, lay, "trn,tkn->trk").astype(dt)
    d_wo = _expert_sums(a_PF, d_y_PD, lay, E).astype(wo_EFD.dtype)
    gate, up = (t.astype(jnp.float32) for t in jnp.split(h_P2F, 2, axis=-1))
    d_a32 = d_a_PF.astype(jnp.float32)
    d_h_P2F = jnp.concatenate([d_a32 * up * silu_grad(gate), d_a32 * jax.nn.silu(gate)], axis=-1).astype(dt)
    d_x_PD = _batched(d_h_P2F, wi_ED2F, lay, "trn,tkn->trk").astype(dt)
    d_wi = _expert_sums(x_PD, d_h_P2F, lay, E).astype(wi_ED2F.dtype)
    # A token's input cotangent: the sum over its k rows, gathered from their padded positions.
    d_x_TD = jnp.sum(d_x_PD[r.pos_Tk].astype(jnp.float32), axis=1).astype(dt)
    return d_x_TD, d_w_Tk.astype(w_Tk.dtype), d_wi, d_wo, None


_routed_mlp.defvjp(_routed_mlp_fwd, _routed_mlp_bwd)


def routed_swiglu_mlp(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD, *, rows_per_tile: int = 128):
    """[T, D]: sum_j w[t, j] * (swiglu(x[t] @ wi[e]) @ wo[e]) with e = idx[t, j], every expert local.

    The same tiles, matmuls and float32 sums as sorting the rows, `gmm_f32` through wi, SwiGLU,
    `gmm_f32` through wo, weighting and unsorting (so the forward is bit-identical to that), but
    the rows stay in the padded layout from the first matmul to the last, and the backward is its
    own: gathers and batched matmuls only (a token's input cotangent is a gather-sum of its k rows,
    where autodiff of the row gathers would scatter-add), each padded array made once.
    """
    r = routed_tiles(idx_Tk, wi_ED2F.shape[0], rows_per_tile)
    return _routed_mlp(x_TD, w_Tk, wi_ED2F, wo_EFD, r)
