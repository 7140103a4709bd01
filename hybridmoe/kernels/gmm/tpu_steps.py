"""What every Mosaic grouped-matmul kernel step shares (pallas_tpu.py's grid-pipelined kernels and
pallas_tpu_own_copies.py's kernels that copy their own blocks): the compiler parameters and the
stated cost, the rows and steps the cost counts, and a step's row mask, tile and merge of its
group's rows into a resident output block. Kernels call these through the module (`tpu_steps.merge`),
so a test that patches one reaches every kernel.

Legend: M rows (padded to a multiple of tm), K contraction, N output columns, G local groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gmm.tiling import Tiling
from hybridmoe.kernels.vmem import tpu_bytes, tpu_limit_bytes

ROW_TILED = ("parallel", "arbitrary", "arbitrary")


def compiler_params(t: Tiling, buffers: list, semantics=ROW_TILED):
    """The kernel's compiler parameters: its VMEM limit is the configured one, or at 0 what its
    buffers (tiling.tpu_buffers) need where that passes the compiler's default (kernels/vmem.py)."""
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=tpu_limit_bytes(t.vmem_limit_mib, tpu_bytes(buffers)))


def cost(flops: float, nbytes: float, transcendentals: float = 0) -> pl.CostEstimate:
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(nbytes))


def local_rows(m: int, num_local: int, group_sizes_E) -> float:
    """The rows a kernel computes for its local groups, as the stated cost counts them: under
    expert parallelism a shard's m rows hold every expert's, and the grid visits only the local
    groups' tiles, so the balanced share m * num_local / E (the split itself is data)."""
    return m * num_local / group_sizes_E.shape[0]


def stated_steps(m: int, tm: int, num_local: int, group_sizes_E, table_len: int) -> int:
    """The grid steps the stated bytes count: the local groups' rows are contiguous (sorted by
    group), so their tiles plus one boundary tile per group after the first, at the balanced
    share of the rows; at most the step table's length (its static bound)."""
    return min(table_len, -(-int(local_rows(m, num_local, group_sizes_E)) // tm) + num_local - 1)


def zero_bytes(m: int, num_local: int, group_sizes_E, row_bytes: int) -> float:
    """The bytes of zeros a kernel writes to the rows outside its local groups (metadata.output_walk),
    at the balanced share: under expert parallelism most of its output."""
    return (m - local_rows(m, num_local, group_sizes_E)) * row_bytes


def weight_fetches(stated_steps: int, num_local: int, tiles_k: int) -> int:
    """How many times the stated bytes count a group's weight slab (per N tile): with one K tile a
    step's weight block index is (group, 0, N tile), unchanged across a group's consecutive row tiles,
    and the grid pipeline fetches a block only when its index changes: once per local group (at the
    balanced share every local group has rows). With several K tiles the block changes every step."""
    return num_local if tiles_k == 1 else stated_steps


def itemsize(x) -> int:
    return jnp.dtype(x.dtype).itemsize


def rows_in_group(step, lo_ref, hi_ref, grp_ref, tile_ref, tm: int):
    """[tm, 1] bool: which rows of this step's row tile belong to this step's group."""
    g = grp_ref[step]
    rows = tile_ref[step] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    return (rows >= lo_ref[g]) & (rows < hi_ref[g])


def first_on_tile(step, tile_ref):
    """Is this step the first to write its output row tile (the block's content not yet written)?"""
    return (step == 0) | (tile_ref[jnp.maximum(step - 1, 0)] != tile_ref[step])


def computes(step, tile_ref, fetch_ref):
    """Does this step compute (metadata.output_walk): a zero step writes a tile it does not read."""
    return tile_ref[step] == fetch_ref[step]


def merge(out_ref, mask, value, first, sl=slice(None), rows=slice(None)):
    """Write this group's rows of a resident output block (of its row window `rows`); the other rows
    keep what earlier steps on the tile wrote, or are zeroed by the tile's first step (a foreign
    group's or padding)."""
    kept = jnp.where(first, jnp.zeros((), out_ref.dtype), out_ref[rows, sl])
    out_ref[rows, sl] = jnp.where(mask, value.astype(out_ref.dtype), kept)
