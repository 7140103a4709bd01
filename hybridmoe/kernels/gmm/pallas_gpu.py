"""Triton (Pallas GPU) backend.

Legend: M rows (padded to a multiple of tm), K contraction, N output columns, G local groups,
D model width, F hidden half width, T forward tile per half; tm, tk, tn the tiles.

Triton programs run in parallel and keep nothing resident between grid steps, so the layout
differs from the TPU kernels: the grid is (N tiles, group steps) with a static number of steps
(metadata.py's bound tiles_m + G - 1; steps past the real count store nothing), each program loops
over K itself (the loop the `num_stages` software pipeline overlaps), and a row tile shared by
two groups is written by two programs with disjoint masked row stores. Rows no local group owns
are never written; the wrapper masks the result to the local rows. The transposed matmul runs
one program per (group, K tile, N tile) that loops over the group's row tiles.

Triton blocks want power-of-two shapes >= 16 on hardware (tiling.tile_problems checks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hybridmoe.kernels.gmm import epilogue, metadata
from hybridmoe.kernels.gmm.tiling import pick


def _step_rows(s, lo_ref, hi_ref, grp_ref, tile_ref, nsteps_ref, tm: int):
    """(row-tile start, [tm] bool: rows of this step's tile in this step's group)."""
    g = grp_ref[s]
    start = tile_ref[s] * tm
    rows = start + jnp.arange(tm, dtype=jnp.int32)
    live = s < nsteps_ref[0]
    return start, g, (rows >= lo_ref[g]) & (rows < hi_ref[g]) & live


def _store_rows(ref_at, value, mask_rows):
    plgpu.store(ref_at, value.astype(ref_at.dtype),
                mask=jnp.broadcast_to(mask_rows[:, None], value.shape))


def _meta(group_sizes_E, m_pad, tm, group_offset, num_local, visit_empty):
    lo, hi, grp, tile, steps = metadata.group_metadata(
        group_sizes_E, m=m_pad, tm=tm, group_offset=group_offset, num_local=num_local,
        visit_empty=visit_empty)
    return (lo, hi, grp, tile, steps[None]), grp.shape[0]


def _params(num_stages: int = 0):
    return plgpu.CompilerParams(num_stages=num_stages or None)


# ---------------------------------------------------------------------------------------------


def gmm(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs, group_offset, sharded, out_dtype,
        tiling=None, interpret=False):
    del sharded
    m, k = lhs_MK.shape
    num_local = rhs_GKN.shape[0]
    n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
    t, tm, m_pad, tk, tn = metadata.plain_tiles(tiling, "gmm_t" if transpose_rhs else "gmm", lhs_MK, n, num_local)
    meta, s_max = _meta(group_sizes_E, m_pad, tm, group_offset, num_local, False)

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, ns_ref, lhs_ref, rhs_ref, out_ref):
        ni, s = pl.program_id(0), pl.program_id(1)
        start, g, mask = _step_rows(s, lo_ref, hi_ref, grp_ref, tile_ref, ns_ref, tm)
        cols = pl.ds(ni * tn, tn)

        def body(ki, acc):
            a = lhs_ref[pl.ds(start, tm), pl.ds(ki * tk, tk)]
            if transpose_rhs:
                b = rhs_ref[g, cols, pl.ds(ki * tk, tk)].T
            else:
                b = rhs_ref[g, pl.ds(ki * tk, tk), cols]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k // tk, body, jnp.zeros((tm, tn), jnp.float32))
        _store_rows(out_ref.at[pl.ds(start, tm), cols], acc, mask)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        grid=(n // tn, s_max),
        compiler_params=_params(),
        interpret=interpret,
        name="gmm_t" if transpose_rhs else "gmm",
    )(*meta, metadata.pad_rows(lhs_MK, m_pad), rhs_GKN)
    return metadata.keep_local_rows(out, m, group_sizes_E, group_offset, num_local)


def tgmm(lhs_MK, grad_MN, group_sizes_E, *, num_local, group_offset, sharded, out_dtype,
         tiling=None, interpret=False, acc_GKN=None):
    """acc_GKN: add the result into this [G, K, N] array in place (its buffer is the output's)."""
    del sharded
    m, k = lhs_MK.shape
    n = grad_MN.shape[1]
    t, tm, m_pad, tk, tn = metadata.plain_tiles(tiling, "tgmm", lhs_MK, n, num_local)
    (lo, hi, *_), _ = _meta(group_sizes_E, m_pad, tm, group_offset, num_local, True)
    in_dtype = jnp.promote_types(lhs_MK.dtype, grad_MN.dtype)

    accumulate = acc_GKN is not None

    def kernel(lo_ref, hi_ref, lhs_ref, grad_ref, *refs):
        init_ref, out_ref = refs if accumulate else (None, *refs)
        ni, ki, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        lo_r, hi_r = lo_ref[g], hi_ref[g]

        def body(mt, acc):
            rows = mt * tm + jnp.arange(tm, dtype=jnp.int32)
            keep = ((rows >= lo_r) & (rows < hi_r))[:, None]
            # Mask both operands: padding rows may hold anything (0 * nan is nan).
            a = jnp.where(keep, lhs_ref[pl.ds(mt * tm, tm), pl.ds(ki * tk, tk)], 0)
            b = jnp.where(keep, grad_ref[pl.ds(mt * tm, tm), pl.ds(ni * tn, tn)], 0)
            return acc + jnp.dot(a.T.astype(in_dtype), b.astype(in_dtype),
                                 preferred_element_type=jnp.float32)

        first = lo_r // tm
        last = jnp.where(hi_r > lo_r, (hi_r + tm - 1) // tm, first)
        block = (g, pl.ds(ki * tk, tk), pl.ds(ni * tn, tn))
        acc0 = init_ref[block].astype(jnp.float32) if accumulate else jnp.zeros((tk, tn), jnp.float32)
        acc = jax.lax.fori_loop(first, last, body, acc0)
        out_ref[block] = acc.astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_local, k, n), out_dtype),
        grid=(n // tn, k // tk, num_local),
        compiler_params=_params(),
        interpret=interpret,
        name="tgmm",
        input_output_aliases={4: 0} if accumulate else {},  # the accumulator (after lo, hi, lhs, grad)
    )(lo, hi, metadata.pad_rows(lhs_MK, m_pad), metadata.pad_rows(grad_MN, m_pad),
      *([acc_GKN.astype(out_dtype)] if accumulate else []))


def wi_fused_swiglu(x_MD, wi_GD2F, group_sizes_E, *, group_offset, sharded, tile_n_per_half, mode,
                    tiling=None, interpret=False, rhs_buffer_count=0):
    """(h [M, F], preact [M, 2F] per-tile); rhs_buffer_count -> the Triton stage count."""
    del sharded
    m, d = x_MD.shape
    num_local, f = wi_GD2F.shape[0], wi_GD2F.shape[2] // 2
    tn = tile_n_per_half
    t, tm, m_pad = metadata.row_tiling(tiling, m)
    tk = pick(d, t.tk)
    tiles_k = d // tk
    meta, s_max = _meta(group_sizes_E, m_pad, tm, group_offset, num_local, False)
    out_dtype = x_MD.dtype

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, ns_ref, x_ref, w_ref, h_ref, pre_ref):
        j, s = pl.program_id(0), pl.program_id(1)
        start, g, mask = _step_rows(s, lo_ref, hi_ref, grp_ref, tile_ref, ns_ref, tm)

        def body(ki, accs):
            acc_g, acc_u = accs
            a = x_ref[pl.ds(start, tm), pl.ds(ki * tk, tk)]
            wg = w_ref[g, pl.ds(ki * tk, tk), pl.ds(j * tn, tn)]
            wu = w_ref[g, pl.ds(ki * tk, tk), pl.ds(f + j * tn, tn)]
            return (acc_g + jnp.dot(a, wg, preferred_element_type=jnp.float32),
                    acc_u + jnp.dot(a, wu, preferred_element_type=jnp.float32))

        zero = jnp.zeros((tm, tn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, tiles_k, body, (zero, zero))
        rows = pl.ds(start, tm)
        _store_rows(h_ref.at[rows, pl.ds(j * tn, tn)],
                    epilogue.swiglu_fwd(gate, up, out_dtype, mode), mask)
        _store_rows(pre_ref.at[rows, pl.ds(2 * tn * j, tn)], gate, mask)
        _store_rows(pre_ref.at[rows, pl.ds(2 * tn * j + tn, tn)], up, mask)

    stages = rhs_buffer_count if (rhs_buffer_count and tiles_k == 1) else 0
    h, pre = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m_pad, f), out_dtype),
                   jax.ShapeDtypeStruct((m_pad, 2 * f), out_dtype)),
        grid=(f // tn, s_max),
        compiler_params=_params(stages),
        interpret=interpret,
        name="wi_fused_swiglu_fwd" + (f"_stages{stages}" if stages else ""),
    )(*meta, metadata.pad_rows(x_MD, m_pad), wi_GD2F)
    return (metadata.keep_local_rows(h, m, group_sizes_E, group_offset, num_local),
            metadata.keep_local_rows(pre, m, group_sizes_E, group_offset, num_local))


def wo_fused_dswiglu_dlhs(g_MD, wo_GFD, group_sizes_E, preact_M2F, *, preact_tile_n_per_half, row_scale_M,
                          out_tile_n_per_half, group_offset, sharded, mode, h_MF=None, tiling=None,
                          interpret=False):
    """(d[gate | up] [M, 2F] in the layout of out_tile_n_per_half, row_dot [M] float32)."""
    del sharded
    plan = metadata.dlhs_plan(g_MD, wo_GFD, preact_M2F, row_scale_M, h_MF, tiling)
    m, d, f, num_local, tm, m_pad, tk = plan.m, plan.d, plan.f, plan.num_local, plan.tm, plan.m_pad, plan.tk
    meta, s_max = _meta(group_sizes_E, m_pad, tm, group_offset, num_local, False)
    t_out = out_tile_n_per_half

    def kernel(lo_ref, hi_ref, grp_ref, tile_ref, ns_ref, g_ref, wo_ref, pre_ref, *rest):
        s_ref, h_ref, (d_ref, dot_ref) = plan.optional_refs(rest)
        s = pl.program_id(0)
        start, g, mask = _step_rows(s, lo_ref, hi_ref, grp_ref, tile_ref, ns_ref, tm)
        rows = pl.ds(start, tm)

        def body(ki, acc):
            a = g_ref[rows, pl.ds(ki * tk, tk)]
            b = wo_ref[g, :, pl.ds(ki * tk, tk)]
            return acc + jnp.dot(a, b.T, preferred_element_type=jnp.float32)

        u = jax.lax.fori_loop(0, d // tk, body, jnp.zeros((tm, f), jnp.float32))
        epilogue.dswiglu_store(
            u, pre_ref[rows, :], s_ref[rows, :] if plan.has_scale else None, h_ref[rows, :] if plan.has_h else None,
            mode=mode, pre_dtype=plan.pre_dtype, f=f, tile_in=preact_tile_n_per_half, tile_out=t_out,
            store_d=lambda v, at: _store_rows(d_ref.at[rows, pl.ds(at, t_out)], v, mask),
            store_dot=lambda dot: _store_rows(dot_ref.at[rows, :], dot, mask))

    d_out, dot = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m_pad, 2 * f), plan.pre_dtype),
                   jax.ShapeDtypeStruct((m_pad, 1), jnp.float32)),
        grid=(s_max,),
        compiler_params=_params(),
        interpret=interpret,
        name="wo_fused_dswiglu_dlhs",
    )(*meta, *plan.args)
    return (metadata.keep_local_rows(d_out, m, group_sizes_E, group_offset, num_local),
            metadata.keep_local_rows(dot, m, group_sizes_E, group_offset, num_local)[:, 0])
