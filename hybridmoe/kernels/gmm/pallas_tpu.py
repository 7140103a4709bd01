"""Mosaic TPU backend: Pallas kernels with group metadata by scalar prefetch.

Legend: M rows (padded to a multiple of tm), K contraction, N output columns, G local groups,
D model width, F hidden half width, T forward tile per half; tm, tk, tn the tiles.

Grid of the row-tiled kernels: (N tiles, group steps, K tiles). The group steps (metadata.py)
visit row tiles in non-decreasing order, so an output block shared by two groups stays resident
and each group writes only its own rows (a row mask selects between the new rows and the
block's current content). The first step on a tile zeroes the rows outside its group, and the
kernels that write row-tiled outputs take one more step per tile no local group touches, which
writes zeros and fetches nothing (metadata.output_walk): padding and foreign rows come out exactly
zero from the kernel itself, with no masking pass over the output after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gmm import epilogue, metadata
from hybridmoe.kernels.gmm.tiling import Tiling, pick, resolve_tm, row_chunk, tpu_buffers
from hybridmoe.kernels.vmem import tpu_bytes, tpu_limit_bytes

_ROW_TILED = ("parallel", "arbitrary", "arbitrary")


def _params(t: Tiling, buffers: list, semantics=_ROW_TILED):
    """The kernel's compiler parameters: its VMEM limit is the configured one, or at 0 what its
    buffers (tiling.tpu_buffers) need where that passes the compiler's default (kernels/vmem.py)."""
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=tpu_limit_bytes(t.vmem_limit_mib, tpu_bytes(buffers)))


def _cost(flops: float, nbytes: float, transcendentals: float = 0) -> pl.CostEstimate:
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(nbytes))


def _local_rows(m: int, num_local: int, group_sizes_E) -> float:
    """The rows a kernel computes for its local groups, as the stated cost counts them: under
    expert parallelism a shard's m rows hold every expert's, and the grid visits only the local
    groups' tiles, so the balanced share m * num_local / E (the split itself is data)."""
    return m * num_local / group_sizes_E.shape[0]


def _steps(m: int, tm: int, num_local: int, group_sizes_E, table_len: int) -> int:
    """The grid steps the stated bytes count: the local groups' rows are contiguous (sorted by
    group), so their tiles plus one boundary tile per group after the first, at the balanced
    share of the rows; at most the step table's length (its static bound)."""
    return min(table_len, -(-int(_local_rows(m, num_local, group_sizes_E)) // tm) + num_local - 1)


def _zero_bytes(m: int, num_local: int, group_sizes_E, row_bytes: int) -> float:
    """The bytes of zeros a kernel writes to the rows outside its local groups (metadata.output_walk),
    at the balanced share: under expert parallelism most of its output."""
    return (m - _local_rows(m, num_local, group_sizes_E)) * row_bytes


def _weight_fetches(stated_steps: int, num_local: int, tiles_k: int) -> int:
    """How many times the stated bytes count a group's weight slab (per N tile): with one K tile a
    step's weight block index is (group, 0, N tile), unchanged across a group's consecutive row tiles,
    and the grid pipeline fetches a block only when its index changes: once per local group (at the
    balanced share every local group has rows). With several K tiles the block changes every step."""
    return num_local if tiles_k == 1 else stated_steps


def _itemsize(x) -> int:
    return jnp.dtype(x.dtype).itemsize


def _rows_in_group(step, lo_ref, hi_ref, grp_ref, tile_ref, tm: int):
    """[tm, 1] bool: which rows of this step's row tile belong to this step's group."""
    g = grp_ref[step]
    rows = tile_ref[step] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    return (rows >= lo_ref[g]) & (rows < hi_ref[g])


def _first_on_tile(step, tile_ref):
    """Is this step the first to write its output row tile (the block's content not yet written)?"""
    return (step == 0) | (tile_ref[jnp.maximum(step - 1, 0)] != tile_ref[step])


def _computes(step, tile_ref, fetch_ref):
    """Does this step compute (metadata.output_walk): a zero step writes a tile it does not read."""
    return tile_ref[step] == fetch_ref[step]


def _merge(out_ref, mask, value, first, sl=slice(None), rows=slice(None)):
    """Write this group's rows of a resident output block (of its row window `rows`); the other rows
    keep what earlier steps on the tile wrote, or are zeroed by the tile's first step (a foreign
    group's or padding)."""
    kept = jnp.where(first, jnp.zeros((), out_ref.dtype), out_ref[rows, sl])
    out_ref[rows, sl] = jnp.where(mask, value.astype(out_ref.dtype), kept)


def _fetch_group_ahead(s, grp_ref, slot_ref, next_ref, copies):
    """The weight copies of a kernel that fetches its weight blocks a whole group ahead
    (weight_slots): a group's first step waits for its blocks and starts the next group's copies into
    the other slot; the first step of the walk starts its own first. copies(group, slot): the async
    copies of that group's blocks into that slot."""
    g, slot = grp_ref[s], slot_ref[s]
    starts = (s == 0) | (grp_ref[jnp.maximum(s - 1, 0)] != g)

    @pl.when(s == 0)
    def _():
        for c in copies(g, slot):
            c.start()

    @pl.when(starts)
    def _():
        for c in copies(g, slot):
            c.wait()
        nxt = next_ref[s]

        @pl.when(nxt >= 0)
        def _():
            for c in copies(nxt, 1 - slot):
                c.start()


def _by_row_chunks(s, tile_ref, lo, hi, computes, first, *, tm: int, chunk_rows: int, compute, zero):
    """A step of a row-tiled kernel chunk by chunk: compute(rows, mask) for each chunk_rows-row chunk
    of its tile that holds rows of its group [lo, hi) (mask: [chunk_rows, 1], which of them), and on
    a tile's first step zero(rows) for each chunk that holds none. A tile straddling a group edge
    then costs about its group's share of it, not the whole tile once per group."""
    for c in range(tm // chunk_rows):
        r0 = tile_ref[s] * tm + c * chunk_rows
        rows = pl.ds(c * chunk_rows, chunk_rows)
        hit = computes & (r0 < hi) & (r0 + chunk_rows > lo)

        @pl.when(hit)
        def _():
            r = r0 + jax.lax.broadcasted_iota(jnp.int32, (chunk_rows, 1), 0)
            compute(rows, (r >= lo) & (r < hi))

        @pl.when(jnp.logical_not(hit) & first)
        def _():
            zero(rows)


# ---------------------------------------------------------------------------------------------
# gmm


def gmm(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs, group_offset, sharded, out_dtype,
        tiling=None, interpret=False, grid_pipelined=False):
    """With one K tile the kernel fetches its weight itself, a group ahead (gmm_prefetched), unless
    grid_pipelined (the benchmarks time the two against each other)."""
    del sharded
    m, k = lhs_MK.shape
    num_local = rhs_GKN.shape[0]
    n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
    t, tm, m_pad, tk, tn = metadata.plain_tiles(tiling, "gmm_t" if transpose_rhs else "gmm", lhs_MK, n, num_local)
    if tk == k and not grid_pipelined:
        return gmm_prefetched(lhs_MK, rhs_GKN, group_sizes_E, transpose_rhs=transpose_rhs, group_offset=group_offset,
                              out_dtype=out_dtype, tm=tm, tn=tn, chunk_rows=row_chunk(tm),
                              vmem_limit_mib=t.vmem_limit_mib, interpret=interpret)
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    stated_steps = _steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])
    tiles_k = k // tk

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, lhs_ref, rhs_ref, out_ref, acc_ref):
        s, ki = pl.program_id(1), pl.program_id(2)
        computes = _computes(s, tile_ref, fetch_ref)

        @pl.when(computes & (ki == 0))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(computes)
        def _():
            contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
            acc_ref[...] += jax.lax.dot_general(lhs_ref[...], rhs_ref[...], contract,
                                                preferred_element_type=jnp.float32)

        @pl.when(ki == tiles_k - 1)
        def _():
            _merge(out_ref, _rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm), acc_ref[...],
                   _first_on_tile(s, tile_ref))

    def rhs_map(ni, s, ki, lo, hi, grp, tile, fetch):
        return (grp[s], ni, ki) if transpose_rhs else (grp[s], ki, ni)

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(n // tn, walk.num_steps, tiles_k),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda ni, s, ki, lo, hi, grp, tile, fetch: (fetch[s], ki)),
                pl.BlockSpec(rhs_block, rhs_map),
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda ni, s, ki, lo, hi, grp, tile, fetch: (tile[s], ni)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=_params(t, tpu_buffers("gmm_t" if transpose_rhs else "gmm", tm=tm, tk=tk, tn=tn,
                                               itemsize=_itemsize(lhs_MK), out_itemsize=jnp.dtype(out_dtype).itemsize)),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
        # The local groups' rows through their weights, 2 m k n over the balanced local share;
        # bytes as the grid fetches blocks: the lhs row tile once per N tile, the group's weight
        # slab once per step (once per group with one K tile: `_weight_fetches`), the output tile
        # once per step (steps at the balanced share: `_steps`), the other rows' zeros once.
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * k * n,
                            (n // tn) * stated_steps * tm * k * _itemsize(lhs_MK)
                            + _weight_fetches(stated_steps, num_local, tiles_k) * k * n * _itemsize(rhs_GKN)
                            + stated_steps * tm * n * jnp.dtype(out_dtype).itemsize
                            + _zero_bytes(m, num_local, group_sizes_E, n * jnp.dtype(out_dtype).itemsize)),
    )(*walk.scalars, metadata.pad_rows(lhs_MK, m_pad), rhs_GKN)
    return out[:m]


def group_ordinals(group_S):
    """int32 [S]: per step, its group's place in the walk's order of groups (0 for the first)."""
    starts = jnp.concatenate([jnp.ones((1,), bool), group_S[1:] != group_S[:-1]])
    return (jnp.cumsum(starts.astype(jnp.int32)) - 1).astype(jnp.int32)


def weight_slots(group_S):
    """For a kernel that fetches each group's weight itself, one group ahead: per step the slot (0 or
    1) of the two VMEM weight buffers its group's weight is in (groups alternate slots in walk order)
    and the next group in the walk (-1 past the last), whose fetch the step starts if it starts its
    group. int32 [S] arrays."""
    num = group_S.shape[0]
    steps = jnp.arange(num, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), group_S[1:] != group_S[:-1]])
    slot_S = group_ordinals(group_S) % 2
    first_start = jax.lax.cummin(jnp.where(starts, steps, num), reverse=True)  # the first start at or after s
    after = jnp.concatenate([first_start[1:], jnp.full((1,), num, jnp.int32)])
    next_S = jnp.where(after < num, group_S[jnp.minimum(after, num - 1)], -1).astype(jnp.int32)
    return slot_S, next_S


def _group_ahead_walk(m: int, tm: int, chunk_rows: int, group_sizes_E, *, group_offset, num_local: int):
    """(row tile, rows padded to whole tiles, the output walk, per step its weight slot and the next
    group (weight_slots), the stated steps) of a kernel that fetches its weight a group ahead."""
    tm = resolve_tm(m, tm)
    if tm % chunk_rows:
        raise ValueError(f"chunk_rows {chunk_rows} must divide the row tile {tm}")
    m_pad = -(-m // tm) * tm
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    slot_S, next_S = weight_slots(walk.group_S)
    return tm, m_pad, walk, slot_S, next_S, _steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])


def gmm_prefetched(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs, group_offset, out_dtype, tm, tn,
                   chunk_rows, vmem_limit_mib=0.0, interpret=False):
    """gmm with one K tile whose weight the kernel fetches itself, a whole group ahead.

    Mosaic's grid pipeline fetches a block one step ahead, so with one K tile a group's [K, tn]
    weight slab starts to arrive only during the step before the group's first: at a 128-row tile
    on a v5e that step computes in about a third of the slab's transfer time, and the kernel stalls
    at every group's start. Here the weight stays in HBM (memory space ANY); two VMEM slots hold
    the current group's slab and the next one's, whose copy starts when the current group starts
    (weight_slots), so it has the whole group's compute to arrive in.

    Row chunks: each step computes only the chunk_rows-row chunks of its tile that hold rows of its
    group, so a tile that straddles a group edge computes about its group's share instead of the
    whole tile twice; the tile (tm) sets the per-step overhead, the chunk the waste at the edges.
    """
    m, k = lhs_MK.shape
    num_local = rhs_GKN.shape[0]
    n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
    if n % tn:
        raise ValueError(f"tn {tn} must divide N {n}")
    tm, m_pad, walk, slot_S, next_S, stated_steps = _group_ahead_walk(
        m, tm, chunk_rows, group_sizes_E, group_offset=group_offset, num_local=num_local)
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    slab = (tn, k) if transpose_rhs else (k, tn)

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, slot_ref, next_ref, lhs_ref, rhs_hbm, out_ref,
               w_ref, sem):
        j, s = pl.program_id(0), pl.program_id(1)
        g, slot = grp_ref[s], slot_ref[s]

        def copies(group, to):
            cols = pl.ds(pl.multiple_of(j * tn, tn), tn)
            src = rhs_hbm.at[group, cols, :] if transpose_rhs else rhs_hbm.at[group, :, cols]
            return [pltpu.make_async_copy(src, w_ref.at[to], sem.at[to])]

        _fetch_group_ahead(s, grp_ref, slot_ref, next_ref, copies)
        first = _first_on_tile(s, tile_ref)

        def compute(rows, mask):
            value = jax.lax.dot_general(lhs_ref[rows, :], w_ref[slot], contract, preferred_element_type=jnp.float32)
            _merge(out_ref, mask, value, first, rows=rows)

        def zero(rows):
            out_ref[rows, :] = jnp.zeros((chunk_rows, tn), out_ref.dtype)

        _by_row_chunks(s, tile_ref, lo_ref[g], hi_ref[g], _computes(s, tile_ref, fetch_ref), first, tm=tm,
                       chunk_rows=chunk_rows, compute=compute, zero=zero)

    buffers = tpu_buffers("gmm_t" if transpose_rhs else "gmm", tm=tm, tk=k, tn=tn, itemsize=_itemsize(lhs_MK),
                          out_itemsize=jnp.dtype(out_dtype).itemsize, whole_k=True)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(n // tn, walk.num_steps),
            in_specs=[
                pl.BlockSpec((tm, k), lambda j, s, lo, hi, grp, tile, fetch, slot, nxt: (fetch[s], 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=pl.BlockSpec((tm, tn), lambda j, s, lo, hi, grp, tile, fetch, slot, nxt: (tile[s], j)),
            scratch_shapes=[pltpu.VMEM((2, *slab), rhs_GKN.dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=_params(Tiling(vmem_limit_mib=vmem_limit_mib), buffers, ("parallel", "arbitrary")),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * k * n,
                            (n // tn) * stated_steps * tm * k * _itemsize(lhs_MK)
                            + num_local * k * n * _itemsize(rhs_GKN)
                            + stated_steps * tm * n * jnp.dtype(out_dtype).itemsize
                            + _zero_bytes(m, num_local, group_sizes_E, n * jnp.dtype(out_dtype).itemsize)),
    )(*walk.scalars, slot_S, next_S, metadata.pad_rows(lhs_MK, m_pad), rhs_GKN)
    return out[:m]


# ---------------------------------------------------------------------------------------------
# tgmm: [G, K, N] per-group lhs^T @ grad


def tgmm(lhs_MK, grad_MN, group_sizes_E, *, num_local, group_offset, sharded, out_dtype,
         tiling=None, interpret=False, acc_GKN=None, grid_pipelined=False):
    """acc_GKN: add the result into this [G, K, N] array in place (its buffer is the output's):
    each output block's float32 accumulator starts from the block's value instead of zero, so a
    group with no rows keeps it. Without it the kernel writes its output blocks itself, a group
    behind (tgmm_written_behind), unless grid_pipelined (the benchmarks time the two)."""
    del sharded
    m, k = lhs_MK.shape
    n = grad_MN.shape[1]
    t, tm, m_pad, tk, tn = metadata.plain_tiles(tiling, "tgmm", lhs_MK, n, num_local)
    if acc_GKN is None and not grid_pipelined:
        return tgmm_written_behind(lhs_MK, grad_MN, group_sizes_E, num_local=num_local, group_offset=group_offset,
                                   out_dtype=out_dtype, tm=tm, tk=tk, tn=tn, chunk_rows=row_chunk(tm),
                                   vmem_limit_mib=t.vmem_limit_mib, interpret=interpret)
    lo, hi, grp, tile, steps = metadata.group_metadata(
        group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local,
        visit_empty=True)
    stated_steps = _steps(m, tm, num_local, group_sizes_E, grp.shape[0])
    in_dtype = jnp.promote_types(lhs_MK.dtype, grad_MN.dtype)
    out_block = pl.BlockSpec((None, tk, tn), lambda ni, ki, s, lo, hi, grp, tile: (grp[s], ki, ni))

    accumulate = acc_GKN is not None

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, lhs_ref, grad_ref, *refs):
        init_ref, out_ref, acc_ref = refs if accumulate else (None, *refs)
        s = pl.program_id(2)
        last = pl.num_programs(2) - 1
        g = grp_ref[s]
        new_group = (s == 0) | (grp_ref[jnp.maximum(s - 1, 0)] != g)
        ends_group = (s == last) | (grp_ref[jnp.minimum(s + 1, last)] != g)

        @pl.when(new_group)
        def _():
            if accumulate:
                acc_ref[...] = init_ref[...].astype(jnp.float32)
            else:
                acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(hi_ref[g] > lo_ref[g])
        def _():
            mask = _rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm)
            # Mask both operands: padding rows may hold anything (0 * nan is nan).
            a = jnp.where(mask, lhs_ref[...].astype(jnp.float32), 0.0)
            b = jnp.where(mask, grad_ref[...].astype(jnp.float32), 0.0)
            acc_ref[...] += jnp.dot(a.T.astype(in_dtype), b.astype(in_dtype),
                                    preferred_element_type=jnp.float32)

        @pl.when(ends_group)
        def _():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_local, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(n // tn, k // tk, steps),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda ni, ki, s, lo, hi, grp, tile: (tile[s], ki)),
                pl.BlockSpec((tm, tn), lambda ni, ki, s, lo, hi, grp, tile: (tile[s], ni)),
            ] + [out_block] * accumulate,
            out_specs=out_block,
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=_params(t, tpu_buffers("tgmm", tm=tm, tk=tk, tn=tn, itemsize=jnp.dtype(in_dtype).itemsize,
                                               out_itemsize=jnp.dtype(out_dtype).itemsize, accumulate=accumulate)),
        interpret=interpret,
        name="tgmm",
        # The accumulator (operand 6, after the four scalar-prefetch arrays and the two row operands)
        # is the output's buffer.
        input_output_aliases={6: 0} if accumulate else {},
        # lhs^T @ grad over the local groups' rows: 2 m k n over the balanced local share; each
        # step fetches a row tile of both operands per (N tile, K tile); the [G, K, N] output is
        # written once.
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * k * n,
                            stated_steps * tm * ((n // tn) * k * _itemsize(lhs_MK)
                                                         + (k // tk) * n * _itemsize(grad_MN))
                            + (1 + accumulate) * num_local * k * n * jnp.dtype(out_dtype).itemsize),
    )(lo, hi, grp, tile, metadata.pad_rows(lhs_MK, m_pad), metadata.pad_rows(grad_MN, m_pad),
      *([acc_GKN.astype(out_dtype)] if accumulate else []))
    return out


def tgmm_written_behind(lhs_MK, grad_MN, group_sizes_E, *, num_local, group_offset, out_dtype, tm, tk, tn,
                        chunk_rows, vmem_limit_mib=0.0, interpret=False):
    """tgmm whose per-group [tk, tn] output blocks the kernel writes to HBM itself, a group behind.

    In the grid pipeline a group's output block is written back while the next step runs and
    waited for a step later, so at a 128-row tile the copy of a [4096, 1024] block outlasts the
    steps it overlaps and every group's end stalls. Here the output stays in HBM (memory space
    ANY): a finished group's float32 sum is cast into one of two VMEM staging slots and copied out
    while the following groups compute; a slot is waited for only when its group two later reuses
    it, and the last ones at the end of each (N tile, K tile) pass.

    Row chunks: a tile inside its group is one contraction over its tm rows; a tile that straddles
    a group edge contracts only its chunks holding rows of the group, their other rows masked, so
    its cost follows the group's share of the tile.
    """
    m, k = lhs_MK.shape
    n = grad_MN.shape[1]
    tm = resolve_tm(m, tm)
    if tm % chunk_rows or k % tk or n % tn:
        raise ValueError(f"chunk_rows {chunk_rows} must divide the row tile {tm}; tk {tk} divide K {k}; tn {tn} divide N {n}")
    m_pad = -(-m // tm) * tm
    lo, hi, grp, tile, steps = metadata.group_metadata(
        group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local, visit_empty=True)
    slot_S, _ = weight_slots(grp)
    ordinal_S = group_ordinals(grp)
    stated_steps = _steps(m, tm, num_local, group_sizes_E, grp.shape[0])
    in_dtype = jnp.promote_types(lhs_MK.dtype, grad_MN.dtype)

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, slot_ref, ord_ref, lhs_ref, grad_ref, out_hbm, acc_ref, stage_ref,
               sem):
        ni, ki, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        last = pl.num_programs(2) - 1
        g, slot, ordinal = grp_ref[s], slot_ref[s], ord_ref[s]
        new_group = (s == 0) | (grp_ref[jnp.maximum(s - 1, 0)] != g)
        ends_group = (s == last) | (grp_ref[jnp.minimum(s + 1, last)] != g)

        def copy(group, at):
            dst = out_hbm.at[group, pl.ds(pl.multiple_of(ki * tk, tk), tk), pl.ds(pl.multiple_of(ni * tn, tn), tn)]
            return pltpu.make_async_copy(stage_ref.at[at], dst, sem.at[at])

        @pl.when(new_group)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        lo_g, hi_g = lo_ref[g], hi_ref[g]
        r0 = tile_ref[s] * tm
        inside = (r0 >= lo_g) & (r0 + tm <= hi_g)

        def contract(a, b):
            acc_ref[...] += jnp.dot(a.T.astype(in_dtype), b.astype(in_dtype), preferred_element_type=jnp.float32)

        @pl.when(inside)
        def _():
            contract(lhs_ref[...], grad_ref[...])

        def masked(rows, mask):
            # Mask both operands: padding rows may hold anything (0 * nan is nan).
            contract(jnp.where(mask, lhs_ref[rows, :].astype(jnp.float32), 0.0),
                     jnp.where(mask, grad_ref[rows, :].astype(jnp.float32), 0.0))

        # A tile across a group edge: its chunks holding the group's rows (no output rows to zero).
        _by_row_chunks(s, tile_ref, lo_g, hi_g, jnp.logical_not(inside), jnp.bool_(False), tm=tm,
                       chunk_rows=chunk_rows, compute=masked, zero=lambda rows: None)

        @pl.when(ends_group)
        def _():
            @pl.when(ordinal >= 2)  # the slot's copy from two groups back
            def _():
                copy(g, slot).wait()

            stage_ref[slot] = acc_ref[...].astype(stage_ref.dtype)
            copy(g, slot).start()

        @pl.when(s == last)
        def _():
            copy(g, slot).wait()

            @pl.when(ordinal >= 1)
            def _():
                copy(g, 1 - slot).wait()

    buffers = tpu_buffers("tgmm", tm=tm, tk=tk, tn=tn, itemsize=jnp.dtype(in_dtype).itemsize,
                          out_itemsize=jnp.dtype(out_dtype).itemsize, written_behind=True)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_local, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(n // tn, k // tk, steps),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda ni, ki, s, lo, hi, grp, tile, slot, o: (tile[s], ki)),
                pl.BlockSpec((tm, tn), lambda ni, ki, s, lo, hi, grp, tile, slot, o: (tile[s], ni)),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32), pltpu.VMEM((2, tk, tn), out_dtype),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=_params(Tiling(vmem_limit_mib=vmem_limit_mib), buffers),
        interpret=interpret,
        name="tgmm",
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * k * n,
                            stated_steps * tm * ((n // tn) * k * _itemsize(lhs_MK) + (k // tk) * n * _itemsize(grad_MN))
                            + num_local * k * n * jnp.dtype(out_dtype).itemsize),
    )(lo, hi, grp, tile, slot_S, ordinal_S, metadata.pad_rows(lhs_MK, m_pad), metadata.pad_rows(grad_MN, m_pad))


# ---------------------------------------------------------------------------------------------
# Fused up projection: h = silu(gate) * up, preact stored per tile


def weight_pipeline(rhs_buffer_count: int, tiles_k: int) -> dict:
    """BlockSpec keywords for the fused forward's weight: the depth only with one K tile (the
    weight block then changes only with the group, and the depth decides how many groups'
    blocks are in flight); {} keeps Mosaic's default (2 buffers in JAX 0.10.2)."""
    if rhs_buffer_count and tiles_k == 1:
        return dict(pipeline_mode=pl.Buffered(rhs_buffer_count))
    return {}


def wi_fused_swiglu(x_MD, wi_GD2F, group_sizes_E, *, group_offset, sharded, tile_n_per_half, mode,
                    tiling=None, interpret=False, rhs_buffer_count=0, grid_pipelined=True):
    """(h [M, F], preact [M, 2F] per-tile). One N tile = T gate columns + the matching T up ones.

    grid_pipelined=False with one K tile runs wi_fused_swiglu_prefetched (the weight fetched a group
    ahead, row chunks at group edges), which no chip has timed yet: benchmarks/tpu_gmm_prefetch.py
    times the two."""
    del sharded
    m, d = x_MD.shape
    num_local, f = wi_GD2F.shape[0], wi_GD2F.shape[2] // 2
    tn = tile_n_per_half
    nt = f // tn
    t, tm, m_pad = metadata.row_tiling(tiling, m)
    tk = pick(d, t.tk)
    if tk == d and not grid_pipelined:
        return wi_fused_swiglu_prefetched(x_MD, wi_GD2F, group_sizes_E, group_offset=group_offset,
                                          tile_n_per_half=tn, mode=mode, tm=tm, chunk_rows=row_chunk(tm),
                                          vmem_limit_mib=t.vmem_limit_mib, interpret=interpret)
    tiles_k = d // tk
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    stated_steps = _steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])
    out_dtype = x_MD.dtype

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, x_ref, wg_ref, wu_ref, h_ref, pre_ref,
               accg_ref, accu_ref):
        s, ki = pl.program_id(1), pl.program_id(2)
        computes = _computes(s, tile_ref, fetch_ref)

        @pl.when(computes & (ki == 0))
        def _():
            accg_ref[...] = jnp.zeros_like(accg_ref)
            accu_ref[...] = jnp.zeros_like(accu_ref)

        @pl.when(computes)
        def _():
            xb = x_ref[...]
            accg_ref[...] += jnp.dot(xb, wg_ref[...], preferred_element_type=jnp.float32)
            accu_ref[...] += jnp.dot(xb, wu_ref[...], preferred_element_type=jnp.float32)

        @pl.when(ki == tiles_k - 1)
        def _():
            mask = _rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm)
            first = _first_on_tile(s, tile_ref)
            gate, up = accg_ref[...], accu_ref[...]
            _merge(h_ref, mask, epilogue.swiglu_fwd(gate, up, out_dtype, mode), first)
            _merge(pre_ref, mask, gate, first, slice(0, tn))
            _merge(pre_ref, mask, up, first, slice(tn, 2 * tn))

    mode_kw = weight_pipeline(rhs_buffer_count, tiles_k)
    gate_spec = pl.BlockSpec((None, tk, tn), lambda j, s, ki, lo, hi, grp, tile, fetch: (grp[s], ki, j),
                             **mode_kw)
    up_spec = pl.BlockSpec((None, tk, tn),
                           lambda j, s, ki, lo, hi, grp, tile, fetch: (grp[s], ki, nt + j), **mode_kw)
    name = "wi_fused_swiglu_fwd" + (f"_rhsbuf{rhs_buffer_count}" if mode_kw else "")
    h, pre = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m_pad, f), out_dtype),
                   jax.ShapeDtypeStruct((m_pad, 2 * f), out_dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(nt, walk.num_steps, tiles_k),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda j, s, ki, lo, hi, grp, tile, fetch: (fetch[s], ki)),
                gate_spec,
                up_spec,
            ],
            out_specs=(
                pl.BlockSpec((tm, tn), lambda j, s, ki, lo, hi, grp, tile, fetch: (tile[s], j)),
                pl.BlockSpec((tm, 2 * tn), lambda j, s, ki, lo, hi, grp, tile, fetch: (tile[s], j)),
            ),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32), pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        # The depth only where the weight is pipelined with it (one K tile), as layer_kernels counts it.
        compiler_params=_params(t, tpu_buffers("wi_fused", tm=tm, tk=tk, tn=tn, itemsize=_itemsize(x_MD),
                                               depth=rhs_buffer_count if mode_kw else 0)),
        interpret=interpret,
        name=name,
        # x @ [gate | up]: 2 m d 2f over the local share of the rows, one sigmoid per h element;
        # x's row tile once per N tile, the two weight slabs once per step (once per group with one
        # K tile), h and the pre-activations written per step, the other rows' zeros once.
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * d * 2 * f,
                            nt * stated_steps * tm * d * _itemsize(x_MD)
                            + _weight_fetches(stated_steps, num_local, tiles_k) * d * 2 * f * _itemsize(wi_GD2F)
                            + stated_steps * tm * 3 * f * _itemsize(x_MD)
                            + _zero_bytes(m, num_local, group_sizes_E, 3 * f * _itemsize(x_MD)), m * f),
    )(*walk.scalars, metadata.pad_rows(x_MD, m_pad), wi_GD2F, wi_GD2F)
    return h[:m], pre[:m]


def wi_fused_swiglu_prefetched(x_MD, wi_GD2F, group_sizes_E, *, group_offset, tile_n_per_half, mode, tm, chunk_rows,
                               vmem_limit_mib=0.0, interpret=False):
    """The fused up projection with one K tile, its weight fetched a whole group ahead as
    gmm_prefetched fetches it: two VMEM slots each for the N tile's gate columns and its up columns
    (wi [G, D, 2F]: gate j at columns j T, up j at F + j T), a group's first step waiting for its
    slabs and starting the next group's; a tile across a group edge computed by row chunks."""
    m, d = x_MD.shape
    num_local, f = wi_GD2F.shape[0], wi_GD2F.shape[2] // 2
    tn = tile_n_per_half
    nt = f // tn
    if f % tn:
        raise ValueError(f"the tile per half {tn} must divide F {f}")
    tm, m_pad, walk, slot_S, next_S, stated_steps = _group_ahead_walk(
        m, tm, chunk_rows, group_sizes_E, group_offset=group_offset, num_local=num_local)
    out_dtype = x_MD.dtype

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, slot_ref, next_ref, x_ref, w_hbm, h_ref, pre_ref,
               wg_ref, wu_ref, sem):
        j, s = pl.program_id(0), pl.program_id(1)
        g, slot = grp_ref[s], slot_ref[s]

        def copies(group, to):
            gate = pl.ds(pl.multiple_of(j * tn, tn), tn)
            up = pl.ds(pl.multiple_of(f + j * tn, tn), tn)
            return [pltpu.make_async_copy(w_hbm.at[group, :, gate], wg_ref.at[to], sem.at[0, to]),
                    pltpu.make_async_copy(w_hbm.at[group, :, up], wu_ref.at[to], sem.at[1, to])]

        _fetch_group_ahead(s, grp_ref, slot_ref, next_ref, copies)
        first = _first_on_tile(s, tile_ref)

        def compute(rows, mask):
            xb = x_ref[rows, :]
            gate = jnp.dot(xb, wg_ref[slot], preferred_element_type=jnp.float32)
            up = jnp.dot(xb, wu_ref[slot], preferred_element_type=jnp.float32)
            _merge(h_ref, mask, epilogue.swiglu_fwd(gate, up, out_dtype, mode), first, rows=rows)
            _merge(pre_ref, mask, gate, first, slice(0, tn), rows)
            _merge(pre_ref, mask, up, first, slice(tn, 2 * tn), rows)

        def zero(rows):
            h_ref[rows, :] = jnp.zeros((chunk_rows, tn), h_ref.dtype)
            pre_ref[rows, :] = jnp.zeros((chunk_rows, 2 * tn), pre_ref.dtype)

        _by_row_chunks(s, tile_ref, lo_ref[g], hi_ref[g], _computes(s, tile_ref, fetch_ref), first, tm=tm,
                       chunk_rows=chunk_rows, compute=compute, zero=zero)

    itemsize = _itemsize(x_MD)
    buffers = tpu_buffers("wi_fused", tm=tm, tk=d, tn=tn, itemsize=itemsize, whole_k=True)
    h, pre = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m_pad, f), out_dtype), jax.ShapeDtypeStruct((m_pad, 2 * f), out_dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(nt, walk.num_steps),
            in_specs=[
                pl.BlockSpec((tm, d), lambda j, s, lo, hi, grp, tile, fetch, slot, nxt: (fetch[s], 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=(
                pl.BlockSpec((tm, tn), lambda j, s, lo, hi, grp, tile, fetch, slot, nxt: (tile[s], j)),
                pl.BlockSpec((tm, 2 * tn), lambda j, s, lo, hi, grp, tile, fetch, slot, nxt: (tile[s], j)),
            ),
            scratch_shapes=[pltpu.VMEM((2, d, tn), wi_GD2F.dtype), pltpu.VMEM((2, d, tn), wi_GD2F.dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        compiler_params=_params(Tiling(vmem_limit_mib=vmem_limit_mib), buffers, ("parallel", "arbitrary")),
        interpret=interpret,
        name="wi_fused_swiglu_fwd",
        # As wi_fused_swiglu's, the weight slabs once per group and N tile.
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * d * 2 * f,
                            nt * stated_steps * tm * d * itemsize + num_local * d * 2 * f * _itemsize(wi_GD2F)
                            + stated_steps * tm * 3 * f * itemsize
                            + _zero_bytes(m, num_local, group_sizes_E, 3 * f * itemsize), m * f),
    )(*walk.scalars, slot_S, next_S, metadata.pad_rows(x_MD, m_pad), wi_GD2F)
    return h[:m], pre[:m]


# ---------------------------------------------------------------------------------------------
# Fused down-projection DLHS: u = g @ wo^T (one N tile = F), SwiGLU VJP in the epilogue


def wo_fused_dswiglu_dlhs(g_MD, wo_GFD, group_sizes_E, preact_M2F, *, preact_tile_n_per_half, row_scale_M,
                          out_tile_n_per_half, group_offset, sharded, mode, h_MF=None, tiling=None,
                          interpret=False, grid_pipelined=True):
    """(d[gate | up] [M, 2F] in the layout of out_tile_n_per_half, row_dot [M] float32).

    grid_pipelined=False with one K tile runs the kernel that fetches wo a group ahead
    (wo_fused_dswiglu_dlhs_prefetched), which no chip has timed yet."""
    del sharded
    plan = metadata.dlhs_plan(g_MD, wo_GFD, preact_M2F, row_scale_M, h_MF, tiling)
    m, d, f, num_local, t, tm, m_pad, tk = plan.m, plan.d, plan.f, plan.num_local, plan.tiling, plan.tm, plan.m_pad, plan.tk
    has_scale, has_h, pre_dtype = plan.has_scale, plan.has_h, plan.pre_dtype
    if tk == d and not grid_pipelined:
        return wo_fused_dswiglu_dlhs_prefetched(plan, group_sizes_E, preact_tile_n_per_half=preact_tile_n_per_half,
                                                out_tile_n_per_half=out_tile_n_per_half, group_offset=group_offset,
                                                mode=mode, interpret=interpret)
    tiles_k = d // tk
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    stated_steps = _steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, g_ref, wo_ref, pre_ref, *rest):
        s_ref, h_ref, (d_ref, dot_ref, acc_ref) = plan.optional_refs(rest)
        s, ki = pl.program_id(0), pl.program_id(1)
        computes = _computes(s, tile_ref, fetch_ref)

        @pl.when(computes & (ki == 0))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(computes)
        def _():
            acc_ref[...] += jax.lax.dot_general(g_ref[...], wo_ref[...], (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32)

        @pl.when(ki == tiles_k - 1)
        def _():
            mask = _rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm)
            first = _first_on_tile(s, tile_ref)
            epilogue.dswiglu_store(
                acc_ref[...], pre_ref[...], s_ref[...] if has_scale else None, h_ref[...] if has_h else None,
                mode=mode, pre_dtype=pre_dtype, f=f, tile_in=preact_tile_n_per_half, tile_out=out_tile_n_per_half,
                store_d=lambda v, at: _merge(d_ref, mask, v, first, slice(at, at + out_tile_n_per_half)),
                store_dot=lambda dot: _merge(dot_ref, mask, dot, first))

    # Row operands are read from the step's fetch tile (a zero step's: the last computing step's, resident),
    # the outputs written to its tile.
    fetch_map = lambda s, ki, lo, hi, grp, tile, fetch: (fetch[s], 0)  # noqa: E731
    out_map = lambda s, ki, lo, hi, grp, tile, fetch: (tile[s], 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((tm, tk), lambda s, ki, lo, hi, grp, tile, fetch: (fetch[s], ki)),
        pl.BlockSpec((None, f, tk), lambda s, ki, lo, hi, grp, tile, fetch: (grp[s], 0, ki)),
        pl.BlockSpec((tm, 2 * f), fetch_map),
    ]
    args = plan.args
    if has_scale:
        in_specs.append(pl.BlockSpec((tm, 1), fetch_map))
    if has_h:
        in_specs.append(pl.BlockSpec((tm, f), fetch_map))
    d_out, dot = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m_pad, 2 * f), pre_dtype),
                   jax.ShapeDtypeStruct((m_pad, 1), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(walk.num_steps, tiles_k),
            in_specs=in_specs,
            out_specs=(pl.BlockSpec((tm, 2 * f), out_map), pl.BlockSpec((tm, 1), out_map)),
            scratch_shapes=[pltpu.VMEM((tm, f), jnp.float32)],
        ),
        compiler_params=_params(t, tpu_buffers("wo_fused_dlhs", tm=tm, tk=tk, tn=f, f=f, itemsize=_itemsize(g_MD),
                                               row_scale=has_scale, with_h=has_h), ("arbitrary", "arbitrary")),
        interpret=interpret,
        name="wo_fused_dswiglu_dlhs",
        # g @ wo^T: 2 m d f over the local share of the rows (the SwiGLU VJP epilogue is
        # elementwise, one sigmoid per gate element);
        # per step a row tile of g and the group's [F, D] weight (once per group with one K tile);
        # the pre-activations read and their gradient written per step (plus the row scale and h
        # where given), the other rows' zeros once.
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * d * f,
                            stated_steps * (tm * d * _itemsize(g_MD) + 2 * tm * 2 * f * jnp.dtype(pre_dtype).itemsize
                                            + tm * 4 * (1 + has_scale) + (tm * f * _itemsize(h_MF) if has_h else 0))
                            + _weight_fetches(stated_steps, num_local, tiles_k) * f * d * _itemsize(wo_GFD)
                            + _zero_bytes(m, num_local, group_sizes_E, 2 * f * jnp.dtype(pre_dtype).itemsize + 4),
                            m * f),
    )(*walk.scalars, *args)
    return d_out[:m], dot[:m, 0]



def wo_fused_dswiglu_dlhs_prefetched(plan, group_sizes_E, *, preact_tile_n_per_half, out_tile_n_per_half, group_offset,
                                     mode, interpret=False):
    """The fused down-projection input gradient with one K tile, wo [G, F, D] fetched a whole group
    ahead into two VMEM slots as gmm_prefetched fetches its weight, a tile across a group edge
    computed by row chunks (each chunk: u = g @ wo^T, then the SwiGLU VJP epilogue on its rows)."""
    m, d, f, num_local, tm, m_pad = plan.m, plan.d, plan.f, plan.num_local, plan.tm, plan.m_pad
    has_scale, has_h, pre_dtype = plan.has_scale, plan.has_h, plan.pre_dtype
    chunk_rows = row_chunk(tm)
    _, _, walk, slot_S, next_S, stated_steps = _group_ahead_walk(
        m_pad, tm, chunk_rows, group_sizes_E, group_offset=group_offset, num_local=num_local)
    stated_steps = _steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])
    g_MD, wo_GFD = plan.args[0], plan.args[1]

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, slot_ref, next_ref, g_ref, wo_hbm, pre_ref, *rest):
        s_ref, h_ref, (d_ref, dot_ref, wo_ref, sem) = plan.optional_refs(rest)
        s = pl.program_id(0)
        grp, slot = grp_ref[s], slot_ref[s]
        _fetch_group_ahead(s, grp_ref, slot_ref, next_ref,
                           lambda group, to: [pltpu.make_async_copy(wo_hbm.at[group], wo_ref.at[to], sem.at[to])])
        first = _first_on_tile(s, tile_ref)

        def compute(rows, mask):
            u = jax.lax.dot_general(g_ref[rows, :], wo_ref[slot], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            epilogue.dswiglu_store(
                u, pre_ref[rows, :], s_ref[rows, :] if has_scale else None, h_ref[rows, :] if has_h else None,
                mode=mode, pre_dtype=pre_dtype, f=f, tile_in=preact_tile_n_per_half, tile_out=out_tile_n_per_half,
                store_d=lambda v, at: _merge(d_ref, mask, v, first, slice(at, at + out_tile_n_per_half), rows),
                store_dot=lambda dot: _merge(dot_ref, mask, dot, first, rows=rows))

        def zero(rows):
            d_ref[rows, :] = jnp.zeros((chunk_rows, 2 * f), d_ref.dtype)
            dot_ref[rows, :] = jnp.zeros((chunk_rows, 1), dot_ref.dtype)

        _by_row_chunks(s, tile_ref, lo_ref[grp], hi_ref[grp], _computes(s, tile_ref, fetch_ref), first, tm=tm,
                       chunk_rows=chunk_rows, compute=compute, zero=zero)

    fetch_map = lambda s, lo, hi, grp, tile, fetch, slot, nxt: (fetch[s], 0)  # noqa: E731
    out_map = lambda s, lo, hi, grp, tile, fetch, slot, nxt: (tile[s], 0)  # noqa: E731
    in_specs = [pl.BlockSpec((tm, d), fetch_map), pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((tm, 2 * f), fetch_map)]
    if has_scale:
        in_specs.append(pl.BlockSpec((tm, 1), fetch_map))
    if has_h:
        in_specs.append(pl.BlockSpec((tm, f), fetch_map))
    buffers = tpu_buffers("wo_fused_dlhs", tm=tm, tk=d, tn=f, f=f, itemsize=_itemsize(g_MD), row_scale=has_scale,
                          with_h=has_h, whole_k=True)
    d_out, dot = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m_pad, 2 * f), pre_dtype), jax.ShapeDtypeStruct((m_pad, 1), jnp.float32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(walk.num_steps,),
            in_specs=in_specs,
            out_specs=(pl.BlockSpec((tm, 2 * f), out_map), pl.BlockSpec((tm, 1), out_map)),
            scratch_shapes=[pltpu.VMEM((2, f, d), wo_GFD.dtype), pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=_params(plan.tiling, buffers, ("arbitrary",)),
        interpret=interpret,
        name="wo_fused_dswiglu_dlhs",
        # As wo_fused_dswiglu_dlhs's, wo once per group.
        cost_estimate=_cost(2 * _local_rows(m, num_local, group_sizes_E) * d * f,
                            stated_steps * (tm * d * _itemsize(g_MD) + 2 * tm * 2 * f * jnp.dtype(pre_dtype).itemsize
                                            + tm * 4 * (1 + has_scale) + (tm * f * _itemsize(plan.args[-1]) if has_h else 0))
                            + num_local * f * d * _itemsize(wo_GFD)
                            + _zero_bytes(m, num_local, group_sizes_E, 2 * f * jnp.dtype(pre_dtype).itemsize + 4),
                            m * f),
    )(*walk.scalars, slot_S, next_S, *plan.args)
    return d_out[:m], dot[:m, 0]
