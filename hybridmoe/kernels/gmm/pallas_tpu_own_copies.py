"""Mosaic grouped matmuls with one K tile that copy their own blocks (pallas_tpu.py dispatches to them).

Mosaic's grid pipeline fetches a block one step ahead, so with one K tile a group's [K, tn] weight
slab starts to arrive only during the step before the group's first: at a 128-row tile on a v5e that
step computes in about a third of the slab's transfer time, and the kernel stalls at every group's
start; a weight gradient's [tk, tn] block is likewise written back during one step (docs/tpu.md).
Here the kernels keep those blocks in HBM (memory space ANY) and two VMEM slots of their own:

- gmm_prefetched (gmm, gmm_t), wi_fused_swiglu_prefetched, wo_fused_dswiglu_dlhs_prefetched: a
  group's first step waits for its weight and starts the next group's copy into the other slot
  (weight_slots, _fetch_group_ahead), so a copy has a whole group's compute to arrive in;
- tgmm_written_behind: a finished group's float32 sum is staged in one of two slots and copied out
  while the following groups compute.

All compute a tile that straddles a group edge by row chunks (_by_row_chunks; tiling.CHUNK_ROWS),
only the chunks holding the group's rows. The fused pair's two are not yet defaults (no chip has
timed them: benchmarks/tpu_gmm_prefetch.py).

Legend as pallas_tpu.py's; S grid steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gmm import epilogue, metadata
from hybridmoe.kernels.gmm import tpu_steps
from hybridmoe.kernels.gmm.tiling import Tiling, resolve_tm, row_chunk, tpu_buffers


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
    return tm, m_pad, walk, slot_S, next_S, tpu_steps.stated_steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])


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
        first = tpu_steps.first_on_tile(s, tile_ref)

        def compute(rows, mask):
            value = jax.lax.dot_general(lhs_ref[rows, :], w_ref[slot], contract, preferred_element_type=jnp.float32)
            tpu_steps.merge(out_ref, mask, value, first, rows=rows)

        def zero(rows):
            out_ref[rows, :] = jnp.zeros((chunk_rows, tn), out_ref.dtype)

        _by_row_chunks(s, tile_ref, lo_ref[g], hi_ref[g], tpu_steps.computes(s, tile_ref, fetch_ref), first, tm=tm,
                       chunk_rows=chunk_rows, compute=compute, zero=zero)

    buffers = tpu_buffers("gmm_t" if transpose_rhs else "gmm", tm=tm, tk=k, tn=tn, itemsize=tpu_steps.itemsize(lhs_MK),
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
        compiler_params=tpu_steps.compiler_params(Tiling(vmem_limit_mib=vmem_limit_mib), buffers, ("parallel", "arbitrary")),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * k * n,
                            (n // tn) * stated_steps * tm * k * tpu_steps.itemsize(lhs_MK)
                            + num_local * k * n * tpu_steps.itemsize(rhs_GKN)
                            + stated_steps * tm * n * jnp.dtype(out_dtype).itemsize
                            + tpu_steps.zero_bytes(m, num_local, group_sizes_E, n * jnp.dtype(out_dtype).itemsize)),
    )(*walk.scalars, slot_S, next_S, metadata.pad_rows(lhs_MK, m_pad), rhs_GKN)
    return out[:m]


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
    ordinal_S = group_ordinals(grp)  # a group's staging slot is its ordinal's parity
    stated_steps = tpu_steps.stated_steps(m, tm, num_local, group_sizes_E, grp.shape[0])
    in_dtype = jnp.promote_types(lhs_MK.dtype, grad_MN.dtype)

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, ord_ref, lhs_ref, grad_ref, out_hbm, acc_ref, stage_ref,
               sem):
        ni, ki, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        last = pl.num_programs(2) - 1
        g, ordinal = grp_ref[s], ord_ref[s]
        slot = ordinal % 2
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
            num_scalar_prefetch=5,
            grid=(n // tn, k // tk, steps),
            in_specs=[
                pl.BlockSpec((tm, tk), lambda ni, ki, s, lo, hi, grp, tile, o: (tile[s], ki)),
                pl.BlockSpec((tm, tn), lambda ni, ki, s, lo, hi, grp, tile, o: (tile[s], ni)),
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32), pltpu.VMEM((2, tk, tn), out_dtype),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        compiler_params=tpu_steps.compiler_params(Tiling(vmem_limit_mib=vmem_limit_mib), buffers),
        interpret=interpret,
        name="tgmm",
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * k * n,
                            stated_steps * tm * ((n // tn) * k * tpu_steps.itemsize(lhs_MK) + (k // tk) * n * tpu_steps.itemsize(grad_MN))
                            + num_local * k * n * jnp.dtype(out_dtype).itemsize),
    )(lo, hi, grp, tile, ordinal_S, metadata.pad_rows(lhs_MK, m_pad), metadata.pad_rows(grad_MN, m_pad))


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
        first = tpu_steps.first_on_tile(s, tile_ref)

        def compute(rows, mask):
            xb = x_ref[rows, :]
            gate = jnp.dot(xb, wg_ref[slot], preferred_element_type=jnp.float32)
            up = jnp.dot(xb, wu_ref[slot], preferred_element_type=jnp.float32)
            tpu_steps.merge(h_ref, mask, epilogue.swiglu_fwd(gate, up, out_dtype, mode), first, rows=rows)
            tpu_steps.merge(pre_ref, mask, gate, first, slice(0, tn), rows)
            tpu_steps.merge(pre_ref, mask, up, first, slice(tn, 2 * tn), rows)

        def zero(rows):
            h_ref[rows, :] = jnp.zeros((chunk_rows, tn), h_ref.dtype)
            pre_ref[rows, :] = jnp.zeros((chunk_rows, 2 * tn), pre_ref.dtype)

        _by_row_chunks(s, tile_ref, lo_ref[g], hi_ref[g], tpu_steps.computes(s, tile_ref, fetch_ref), first, tm=tm,
                       chunk_rows=chunk_rows, compute=compute, zero=zero)

    itemsize = tpu_steps.itemsize(x_MD)
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
        compiler_params=tpu_steps.compiler_params(Tiling(vmem_limit_mib=vmem_limit_mib), buffers, ("parallel", "arbitrary")),
        interpret=interpret,
        name="wi_fused_swiglu_fwd",
        # As wi_fused_swiglu's, the weight slabs once per group and N tile.
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * d * 2 * f,
                            nt * stated_steps * tm * d * itemsize + num_local * d * 2 * f * tpu_steps.itemsize(wi_GD2F)
                            + stated_steps * tm * 3 * f * itemsize
                            + tpu_steps.zero_bytes(m, num_local, group_sizes_E, 3 * f * itemsize), m * f),
    )(*walk.scalars, slot_S, next_S, metadata.pad_rows(x_MD, m_pad), wi_GD2F)
    return h[:m], pre[:m]


def wo_fused_dswiglu_dlhs_prefetched(plan, group_sizes_E, *, preact_tile_n_per_half, out_tile_n_per_half, group_offset,
                                     mode, interpret=False):
    """The fused down-projection input gradient with one K tile, wo [G, F, D] fetched a whole group
    ahead into two VMEM slots as gmm_prefetched fetches its weight, a tile across a group edge
    computed by row chunks (each chunk: u = g @ wo^T, then the SwiGLU VJP epilogue on its rows)."""
    m, d, f, num_local, tm, m_pad = plan.m, plan.d, plan.f, plan.num_local, plan.tm, plan.m_pad
    has_scale, has_h, pre_dtype = plan.has_scale, plan.has_h, plan.pre_dtype
    chunk_rows = row_chunk(tm)
    _, _, walk, slot_S, next_S, stated_steps = _group_ahead_walk(
        m, tm, chunk_rows, group_sizes_E, group_offset=group_offset, num_local=num_local)
    g_MD, wo_GFD = plan.args[0], plan.args[1]

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, slot_ref, next_ref, g_ref, wo_hbm, pre_ref, *rest):
        s_ref, h_ref, (d_ref, dot_ref, wo_ref, sem) = plan.optional_refs(rest)
        s = pl.program_id(0)
        grp, slot = grp_ref[s], slot_ref[s]
        _fetch_group_ahead(s, grp_ref, slot_ref, next_ref,
                           lambda group, to: [pltpu.make_async_copy(wo_hbm.at[group], wo_ref.at[to], sem.at[to])])
        first = tpu_steps.first_on_tile(s, tile_ref)

        def compute(rows, mask):
            u = jax.lax.dot_general(g_ref[rows, :], wo_ref[slot], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            epilogue.dswiglu_store(
                u, pre_ref[rows, :], s_ref[rows, :] if has_scale else None, h_ref[rows, :] if has_h else None,
                mode=mode, pre_dtype=pre_dtype, f=f, tile_in=preact_tile_n_per_half, tile_out=out_tile_n_per_half,
                store_d=lambda v, at: tpu_steps.merge(d_ref, mask, v, first, slice(at, at + out_tile_n_per_half), rows),
                store_dot=lambda dot: tpu_steps.merge(dot_ref, mask, dot, first, rows=rows))

        def zero(rows):
            d_ref[rows, :] = jnp.zeros((chunk_rows, 2 * f), d_ref.dtype)
            dot_ref[rows, :] = jnp.zeros((chunk_rows, 1), dot_ref.dtype)

        _by_row_chunks(s, tile_ref, lo_ref[grp], hi_ref[grp], tpu_steps.computes(s, tile_ref, fetch_ref), first, tm=tm,
                       chunk_rows=chunk_rows, compute=compute, zero=zero)

    fetch_map = lambda s, lo, hi, grp, tile, fetch, slot, nxt: (fetch[s], 0)  # noqa: E731
    out_map = lambda s, lo, hi, grp, tile, fetch, slot, nxt: (tile[s], 0)  # noqa: E731
    in_specs = [pl.BlockSpec((tm, d), fetch_map), pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((tm, 2 * f), fetch_map)]
    if has_scale:
        in_specs.append(pl.BlockSpec((tm, 1), fetch_map))
    if has_h:
        in_specs.append(pl.BlockSpec((tm, f), fetch_map))
    buffers = tpu_buffers("wo_fused_dlhs", tm=tm, tk=d, tn=f, f=f, itemsize=tpu_steps.itemsize(g_MD), row_scale=has_scale,
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
        compiler_params=tpu_steps.compiler_params(plan.tiling, buffers, ("arbitrary",)),
        interpret=interpret,
        name="wo_fused_dswiglu_dlhs",
        # As wo_fused_dswiglu_dlhs's, wo once per group.
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * d * f,
                            stated_steps * (tm * d * tpu_steps.itemsize(g_MD) + 2 * tm * 2 * f * jnp.dtype(pre_dtype).itemsize
                                            + tm * 4 * (1 + has_scale) + (tm * f * tpu_steps.itemsize(plan.args[-1]) if has_h else 0))
                            + num_local * f * d * tpu_steps.itemsize(wo_GFD)
                            + tpu_steps.zero_bytes(m, num_local, group_sizes_E, 2 * f * jnp.dtype(pre_dtype).itemsize + 4),
                            m * f),
    )(*walk.scalars, slot_S, next_S, *plan.args)
    return d_out[:m], dot[:m, 0]
