"""Group metadata for the Pallas kernels: which (local group, row tile) each grid step works on.

Legend: E groups in group_sizes, G local groups, S grid steps (a static upper bound).

Rows are sorted by group, so walking the local groups in order and, inside each group, its row
tiles in order gives a sequence of (group, tile) steps whose row tile never decreases: a row tile
shared by two groups is visited on consecutive steps, which lets a TPU kernel keep that output
block resident and merge the groups' rows into it with a row mask.

A group spanning rows [lo, hi) touches tiles floor(lo / tm) .. ceil(hi / tm) - 1. An empty group
touches none; with visit_empty it still gets one step (the transposed matmul must write its zero
weight gradient). The total is bounded by tiles_m + G - 1: each group adds at most one tile shared
with its predecessor, and an empty group's one step replaces that share.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hybridmoe.kernels.gmm.tiling import DEFAULT, Tiling, pick, resolve_tm


def group_metadata(group_sizes_E, *, m: int, tm: int, group_offset, num_local: int,
                   visit_empty: bool):
    """Per local group its row bounds, per grid step its group and row tile, and the step count.

    Returns (lo_G, hi_G, step_group_S, step_tile_S, num_steps): int32 arrays; S = tiles_m + G - 1;
    steps at and past num_steps repeat the last real step's indices (no new block is fetched).
    """
    if m % tm:
        raise ValueError(f"rows {m} must be padded to a multiple of tm={tm}")
    tiles_m = m // tm
    sizes_G, lo_G, hi_G = local_groups(group_sizes_E, group_offset, num_local)

    first_G = lo_G // tm
    span_G = (hi_G + tm - 1) // tm - first_G
    steps_G = jnp.where(sizes_G > 0, span_G, 1 if visit_empty else 0)
    cum_G = jnp.cumsum(steps_G)
    num_steps = cum_G[-1]

    s_max = tiles_m + num_local - 1
    step_S = jnp.minimum(jnp.arange(s_max, dtype=jnp.int32), jnp.maximum(num_steps - 1, 0))
    group_S = jnp.searchsorted(cum_G, step_S, side="right").astype(jnp.int32)
    group_S = jnp.minimum(group_S, num_local - 1)
    before_S = (cum_G - steps_G)[group_S]
    tile_S = jnp.clip(first_G[group_S] + step_S - before_S, 0, tiles_m - 1).astype(jnp.int32)
    return lo_G, hi_G, group_S, tile_S, num_steps.astype(jnp.int32)


class OutputWalk(NamedTuple):
    """The steps of a kernel that writes a row-tiled [M, N] output (output_walk): int32 arrays."""

    lo_G: jax.Array
    hi_G: jax.Array
    group_S: jax.Array  # the group whose weight the step reads
    tile_S: jax.Array  # the output row tile the step writes
    fetch_S: jax.Array  # the row tile its row operands are read from
    num_steps: jax.Array  # how many steps run (the grid's dynamic length)

    @property
    def scalars(self) -> tuple:
        """The scalar-prefetch operands, in the order the kernels' refs take them."""
        return self.lo_G, self.hi_G, self.group_S, self.tile_S, self.fetch_S


def output_walk(group_sizes_E, *, m: int, tm: int, group_offset, num_local: int) -> OutputWalk:
    """group_metadata's steps (empty groups get none), then one step per row tile that no local
    group touches, so that the kernel itself writes every row of its output: a group's rows its
    product, every other row (a foreign group's, padding) zero. No pass over the output after it.

    A step computes where its output tile is the tile it reads (fetch == tile); a zero step reads
    the last computing step's row tile and group (the blocks already resident: nothing fetched) and
    writes a tile of zeros. Unvisited tiles number tiles_m minus the visited ones, and the visiting
    steps are at most the visited tiles plus G - 1, so both fit the static bound tiles_m + G - 1.
    """
    lo_G, hi_G, group_S, tile_S, visits = group_metadata(group_sizes_E, m=m, tm=tm, group_offset=group_offset,
                                                         num_local=num_local, visit_empty=False)
    tiles_m = m // tm
    steps_S = jnp.arange(group_S.shape[0], dtype=jnp.int32)
    visited_T = jnp.zeros((tiles_m,), jnp.int32).at[tile_S].max((steps_S < visits).astype(jnp.int32))
    unvisited_T = jnp.argsort(visited_T, stable=True).astype(jnp.int32)  # the unvisited tiles first, in order
    zero_steps = tiles_m - jnp.sum(visited_T)
    last = jnp.maximum(visits - 1, 0)
    zero_tile_S = unvisited_T[jnp.clip(steps_S - visits, 0, tiles_m - 1)]
    is_visit_S = steps_S < visits
    fetch_S = jnp.where(is_visit_S, tile_S, tile_S[last])
    return OutputWalk(lo_G, hi_G, group_S, jnp.where(is_visit_S, tile_S, zero_tile_S), fetch_S,
                      (visits + zero_steps).astype(jnp.int32))


def local_groups(group_sizes_E, group_offset, num_local: int):
    """(sizes, first rows, one-past-last rows) [G] int32 of the local groups [offset, offset + G) of
    rows sorted by group."""
    sizes_E = group_sizes_E.astype(jnp.int32)
    off = jnp.asarray(group_offset, jnp.int32)
    sizes_G = jax.lax.dynamic_slice_in_dim(sizes_E, off, num_local)
    ends_G = jax.lax.dynamic_slice_in_dim(jnp.cumsum(sizes_E), off, num_local)
    return sizes_G, ends_G - sizes_G, ends_G


def local_bounds(group_sizes_E, group_offset, num_local: int):
    """(first row, one past the last row) of the local groups [offset, offset + G)."""
    ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
    starts_E = ends_E - group_sizes_E
    off = jnp.asarray(group_offset, jnp.int32)
    return starts_E[off], ends_E[off + num_local - 1]


def row_mask(m: int, group_sizes_E, group_offset, num_local: int):
    """[M] bool: the row belongs to one of the local groups (not padding, not a foreign group)."""
    lo, hi = local_bounds(group_sizes_E, group_offset, num_local)
    rows = jnp.arange(m, dtype=jnp.int32)
    return (rows >= lo) & (rows < hi)


def keep_local_rows(out, m: int, group_sizes_E, group_offset, num_local: int):
    """A kernel's padded output cut to its M rows, zero outside the local groups' rows."""
    keep = row_mask(out.shape[0], group_sizes_E, group_offset, num_local)
    return jnp.where(keep[:, None], out, jnp.zeros((), out.dtype))[:m]


def dlhs_row_operands(row_scale_M, h_MF, m_pad: int) -> list:
    """The fused down-projection DLHS kernel's optional row operands, padded to m_pad rows: the
    routing weight as float32 [M, 1] (router_grad_from_wo_input) and the stored h [M, F] (read only
    by the match_unfused stand-in), each present when given."""
    out = []
    if row_scale_M is not None:
        out.append(pad_rows(row_scale_M.astype(jnp.float32)[:, None], m_pad))
    if h_MF is not None:
        out.append(pad_rows(h_MF, m_pad))
    return out


@dataclasses.dataclass(frozen=True)
class DlhsPlan:
    """The fused down-projection DLHS (wo_fused_dswiglu_dlhs) as both Pallas backends set it up:
    sizes, the row tile and K tile, which optional row operands are present, and the operands
    padded to whole row tiles (g, wo, the pre-activations, then the row scale and h where given)."""
    m: int
    d: int
    f: int
    num_local: int
    tiling: Tiling
    tm: int
    m_pad: int
    tk: int
    has_scale: bool
    has_h: bool  # only the match_unfused stand-in reads the stored h
    pre_dtype: Any
    args: list

    def optional_refs(self, refs: tuple) -> tuple[Any, Any, list]:
        """(row scale ref or None, h ref or None, the refs after them) of a kernel's trailing refs."""
        rest = list(refs)
        s_ref = rest.pop(0) if self.has_scale else None
        h_ref = rest.pop(0) if self.has_h else None
        return s_ref, h_ref, rest


def dlhs_plan(g_MD, wo_GFD, preact_M2F, row_scale_M, h_MF, tiling: Tiling | None) -> DlhsPlan:
    m, d = g_MD.shape
    num_local, f = wo_GFD.shape[0], wo_GFD.shape[1]
    t, tm, m_pad = row_tiling(tiling, m)
    args = [pad_rows(g_MD, m_pad), wo_GFD, pad_rows(preact_M2F, m_pad), *dlhs_row_operands(row_scale_M, h_MF, m_pad)]
    return DlhsPlan(m, d, f, num_local, t, tm, m_pad, pick(d, t.tk), row_scale_M is not None, h_MF is not None,
                    preact_M2F.dtype, args)


def row_tiling(tiling: Tiling | None, m: int):
    """(tiling, row tile tm, rows padded to whole tiles) of the Pallas kernels."""
    t = tiling or DEFAULT
    tm = resolve_tm(m, t.tm)
    return t, tm, -(-m // tm) * tm


def plain_tiles(tiling: Tiling | None, kind: str, lhs_MK, n: int, num_local: int):
    """(tiling, tm, rows padded to whole tiles, tk, tn) of a plain grouped matmul (kind gmm, gmm_t or
    tgmm) over lhs [M, K] to N columns: the measured tiles where the tiling asks for the table
    (tile_table.py), else its own, each clipped to its dimension."""
    from hybridmoe.kernels.gmm import tile_table

    m, k = lhs_MK.shape
    tiling = tile_table.resolve(tiling, kind, m=m, k=k, n=n, groups=num_local, itemsize=lhs_MK.dtype.itemsize)
    t, tm, m_pad = row_tiling(tiling, m)
    return t, tm, m_pad, pick(k, t.tk), pick(n, t.tn)


def pad_rows(x, m_pad: int):
    if x is None or x.shape[0] == m_pad:
        return x
    return jnp.pad(x, [(0, m_pad - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
