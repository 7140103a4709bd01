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
from hybridmoe.kernels.gmm import pallas_tpu_own_copies as own
from hybridmoe.kernels.gmm import tpu_steps
from hybridmoe.kernels.gmm.tiling import pick, row_chunk, tpu_buffers

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
        return own.gmm_prefetched(lhs_MK, rhs_GKN, group_sizes_E, transpose_rhs=transpose_rhs, group_offset=group_offset,
                              out_dtype=out_dtype, tm=tm, tn=tn, chunk_rows=row_chunk(tm),
                              vmem_limit_mib=t.vmem_limit_mib, interpret=interpret)
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    stated_steps = tpu_steps.stated_steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])
    tiles_k = k // tk

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, lhs_ref, rhs_ref, out_ref, acc_ref):
        s, ki = pl.program_id(1), pl.program_id(2)
        computes = tpu_steps.computes(s, tile_ref, fetch_ref)

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
            tpu_steps.merge(out_ref, tpu_steps.rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm), acc_ref[...],
                   tpu_steps.first_on_tile(s, tile_ref))

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
        compiler_params=tpu_steps.compiler_params(t, tpu_buffers("gmm_t" if transpose_rhs else "gmm", tm=tm, tk=tk, tn=tn,
                                               itemsize=tpu_steps.itemsize(lhs_MK), out_itemsize=jnp.dtype(out_dtype).itemsize)),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
        # The local groups' rows through their weights, 2 m k n over the balanced local share;
        # bytes as the grid fetches blocks: the lhs row tile once per N tile, the group's weight
        # slab once per step (once per group with one K tile: `tpu_steps.weight_fetches`), the output tile
        # once per step (steps at the balanced share: `tpu_steps.stated_steps`), the other rows' zeros once.
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * k * n,
                            (n // tn) * stated_steps * tm * k * tpu_steps.itemsize(lhs_MK)
                            + tpu_steps.weight_fetches(stated_steps, num_local, tiles_k) * k * n * tpu_steps.itemsize(rhs_GKN)
                            + stated_steps * tm * n * jnp.dtype(out_dtype).itemsize
                            + tpu_steps.zero_bytes(m, num_local, group_sizes_E, n * jnp.dtype(out_dtype).itemsize)),
    )(*walk.scalars, metadata.pad_rows(lhs_MK, m_pad), rhs_GKN)
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
        return own.tgmm_written_behind(lhs_MK, grad_MN, group_sizes_E, num_local=num_local, group_offset=group_offset,
                                   out_dtype=out_dtype, tm=tm, tk=tk, tn=tn, chunk_rows=row_chunk(tm),
                                   vmem_limit_mib=t.vmem_limit_mib, interpret=interpret)
    lo, hi, grp, tile, steps = metadata.group_metadata(
        group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local,
        visit_empty=True)
    stated_steps = tpu_steps.stated_steps(m, tm, num_local, group_sizes_E, grp.shape[0])
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
            mask = tpu_steps.rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm)
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
        compiler_params=tpu_steps.compiler_params(t, tpu_buffers("tgmm", tm=tm, tk=tk, tn=tn, itemsize=jnp.dtype(in_dtype).itemsize,
                                               out_itemsize=jnp.dtype(out_dtype).itemsize, accumulate=accumulate)),
        interpret=interpret,
        name="tgmm",
        # The accumulator (operand 6, after the four scalar-prefetch arrays and the two row operands)
        # is the output's buffer.
        input_output_aliases={6: 0} if accumulate else {},
        # lhs^T @ grad over the local groups' rows: 2 m k n over the balanced local share; each
        # step fetches a row tile of both operands per (N tile, K tile); the [G, K, N] output is
        # written once.
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * k * n,
                            stated_steps * tm * ((n // tn) * k * tpu_steps.itemsize(lhs_MK)
                                                         + (k // tk) * n * tpu_steps.itemsize(grad_MN))
                            + (1 + accumulate) * num_local * k * n * jnp.dtype(out_dtype).itemsize),
    )(lo, hi, grp, tile, metadata.pad_rows(lhs_MK, m_pad), metadata.pad_rows(grad_MN, m_pad),
      *([acc_GKN.astype(out_dtype)] if accumulate else []))
    return out


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
        return own.wi_fused_swiglu_prefetched(x_MD, wi_GD2F, group_sizes_E, group_offset=group_offset,
                                          tile_n_per_half=tn, mode=mode, tm=tm, chunk_rows=row_chunk(tm),
                                          vmem_limit_mib=t.vmem_limit_mib, interpret=interpret)
    tiles_k = d // tk
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    stated_steps = tpu_steps.stated_steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])
    out_dtype = x_MD.dtype

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, x_ref, wg_ref, wu_ref, h_ref, pre_ref,
               accg_ref, accu_ref):
        s, ki = pl.program_id(1), pl.program_id(2)
        computes = tpu_steps.computes(s, tile_ref, fetch_ref)

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
            mask = tpu_steps.rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm)
            first = tpu_steps.first_on_tile(s, tile_ref)
            gate, up = accg_ref[...], accu_ref[...]
            tpu_steps.merge(h_ref, mask, epilogue.swiglu_fwd(gate, up, out_dtype, mode), first)
            tpu_steps.merge(pre_ref, mask, gate, first, slice(0, tn))
            tpu_steps.merge(pre_ref, mask, up, first, slice(tn, 2 * tn))

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
        compiler_params=tpu_steps.compiler_params(t, tpu_buffers("wi_fused", tm=tm, tk=tk, tn=tn, itemsize=tpu_steps.itemsize(x_MD),
                                               depth=rhs_buffer_count if mode_kw else 0)),
        interpret=interpret,
        name=name,
        # x @ [gate | up]: 2 m d 2f over the local share of the rows, one sigmoid per h element;
        # x's row tile once per N tile, the two weight slabs once per step (once per group with one
        # K tile), h and the pre-activations written per step, the other rows' zeros once.
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * d * 2 * f,
                            nt * stated_steps * tm * d * tpu_steps.itemsize(x_MD)
                            + tpu_steps.weight_fetches(stated_steps, num_local, tiles_k) * d * 2 * f * tpu_steps.itemsize(wi_GD2F)
                            + stated_steps * tm * 3 * f * tpu_steps.itemsize(x_MD)
                            + tpu_steps.zero_bytes(m, num_local, group_sizes_E, 3 * f * tpu_steps.itemsize(x_MD)), m * f),
    )(*walk.scalars, metadata.pad_rows(x_MD, m_pad), wi_GD2F, wi_GD2F)
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
        return own.wo_fused_dswiglu_dlhs_prefetched(plan, group_sizes_E, preact_tile_n_per_half=preact_tile_n_per_half,
                                                out_tile_n_per_half=out_tile_n_per_half, group_offset=group_offset,
                                                mode=mode, interpret=interpret)
    tiles_k = d // tk
    walk = metadata.output_walk(group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local)
    stated_steps = tpu_steps.stated_steps(m, tm, num_local, group_sizes_E, walk.group_S.shape[0])

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, fetch_ref, g_ref, wo_ref, pre_ref, *rest):
        s_ref, h_ref, (d_ref, dot_ref, acc_ref) = plan.optional_refs(rest)
        s, ki = pl.program_id(0), pl.program_id(1)
        computes = tpu_steps.computes(s, tile_ref, fetch_ref)

        @pl.when(computes & (ki == 0))
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(computes)
        def _():
            acc_ref[...] += jax.lax.dot_general(g_ref[...], wo_ref[...], (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32)

        @pl.when(ki == tiles_k - 1)
        def _():
            mask = tpu_steps.rows_in_group(s, lo_ref, hi_ref, grp_ref, tile_ref, tm)
            first = tpu_steps.first_on_tile(s, tile_ref)
            epilogue.dswiglu_store(
                acc_ref[...], pre_ref[...], s_ref[...] if has_scale else None, h_ref[...] if has_h else None,
                mode=mode, pre_dtype=pre_dtype, f=f, tile_in=preact_tile_n_per_half, tile_out=out_tile_n_per_half,
                store_d=lambda v, at: tpu_steps.merge(d_ref, mask, v, first, slice(at, at + out_tile_n_per_half)),
                store_dot=lambda dot: tpu_steps.merge(dot_ref, mask, dot, first))

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
        compiler_params=tpu_steps.compiler_params(t, tpu_buffers("wo_fused_dlhs", tm=tm, tk=tk, tn=f, f=f, itemsize=tpu_steps.itemsize(g_MD),
                                               row_scale=has_scale, with_h=has_h), ("arbitrary", "arbitrary")),
        interpret=interpret,
        name="wo_fused_dswiglu_dlhs",
        # g @ wo^T: 2 m d f over the local share of the rows (the SwiGLU VJP epilogue is
        # elementwise, one sigmoid per gate element);
        # per step a row tile of g and the group's [F, D] weight (once per group with one K tile);
        # the pre-activations read and their gradient written per step (plus the row scale and h
        # where given), the other rows' zeros once.
        cost_estimate=tpu_steps.cost(2 * tpu_steps.local_rows(m, num_local, group_sizes_E) * d * f,
                            stated_steps * (tm * d * tpu_steps.itemsize(g_MD) + 2 * tm * 2 * f * jnp.dtype(pre_dtype).itemsize
                                            + tm * 4 * (1 + has_scale) + (tm * f * tpu_steps.itemsize(h_MF) if has_h else 0))
                            + tpu_steps.weight_fetches(stated_steps, num_local, tiles_k) * f * d * tpu_steps.itemsize(wo_GFD)
                            + tpu_steps.zero_bytes(m, num_local, group_sizes_E, 2 * f * jnp.dtype(pre_dtype).itemsize + 4),
                            m * f),
    )(*walk.scalars, *args)
    return d_out[:m], dot[:m, 0]


