"""fp8 grouped matmul: out = lhs @ rhs[group] with the forward and both gradients in fp8
(quant.fp8_gmm), over the grouped-matmul backends of kernels/gmm.

Legend as in kernels/gmm/ops.py: M rows (sorted by group), K contraction, N output columns, E groups in
group_sizes (global), G groups held locally.

Every operand of each of the three matmuls is quantized with scales along its NON-contracting
dims only, so each scale factors out of the sum and is applied to the float32 accumulator:
- forward   out[m, n]   = sum_k x[m, k] w[g, k, n]:  x e4m3 per row m, w e4m3 per (g, n);
- input grad dx[m, k]   = sum_n d[m, n] w[g, k, n]:  d * s_w (the weight scale moved onto the
  gradient, since n is contracted here) in e5m2 per row m, times the forward's weight codes;
- weight grad dw[g,k,n] = sum_m x[m, k] d[m, n]:     d * s_x (the row scale moved onto the
  gradient, since m is contracted) in e5m2 per (g, n) over the group's rows, times the forward's
  row codes.
The backward reuses the forward's codes (no second quantization of x or w), as qwix's quantized
ragged_dot does; here the weight gradient's scale is per expert and column, not per column.
Products of fp8 codes are exact in float32 and the accumulation is float32 (codes are fed to
the backend's grouped matmul as bfloat16, which holds every e4m3 and e5m2 value exactly; on fp8
hardware a native kernel would take the codes as they are).
Scales are powers of two (quant/fp8.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.kernels.gmm.metadata import row_mask
from hybridmoe.kernels.gmm.ops import backend_module
from hybridmoe.quant import fp8

CODES_COMPUTE = jnp.bfloat16  # exact for every fp8 code


def local_group_of_rows(m: int, group_sizes_E, group_offset, num_local: int):
    """[M] int32: each row's group as an index into the local weight (clipped for rows outside)."""
    ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
    gid_M = jnp.searchsorted(ends_E, jnp.arange(m, dtype=jnp.int32), side="right")
    return jnp.clip(gid_M - group_offset, 0, num_local - 1).astype(jnp.int32)


def weight_scale_of_rows(s_w_G1N, g_M):
    """[M, N]: each row's weight scales (those of its group)."""
    return s_w_G1N[g_M, 0, :]


def fold_scale(d, scale):
    """A scale of the contracted dim moved onto the other operand, before it is quantized."""
    return d * scale


def gmm_fp8(lhs_MK, rhs_GKN, group_sizes_E, *, group_offset=0, backend: str = "xla",
            grad_dtype=fp8.E5M2):
    """[M, N] in lhs's dtype: the grouped matmul with fp8 forward, input and weight gradients.

    Same contract as ops.gmm (rows sorted by group, padding and foreign rows zero, local groups
    [offset, offset + G)), without transpose_rhs.
    """
    be = backend_module(backend)
    G = rhs_GKN.shape[0]
    sharded = group_sizes_E.shape[0] != G or not (isinstance(group_offset, int) and group_offset == 0)
    out_dtype, rhs_dtype = lhs_MK.dtype, rhs_GKN.dtype

    def mm(a, b, sizes, off, transpose):
        return be.gmm(a.astype(CODES_COMPUTE), b.astype(CODES_COMPUTE), sizes, transpose_rhs=transpose,
                      group_offset=off, sharded=sharded, out_dtype=jnp.float32)

    def quantize(lhs, rhs, sizes, off):
        x_codes, s_x = fp8.quantize_rows(lhs, axis=1)                   # [M, K], [M, 1]
        w_codes, s_w = fp8.quantize_rows(rhs, axis=1)                   # [G, K, N], [G, 1, N]
        g_M = local_group_of_rows(lhs.shape[0], sizes, off, G)
        return x_codes, s_x, w_codes, s_w, g_M

    @jax.custom_vjp
    def f(lhs, rhs, sizes, off):
        return fwd(lhs, rhs, sizes, off)[0]

    def fwd(lhs, rhs, sizes, off):
        x_codes, s_x, w_codes, s_w, g_M = quantize(lhs, rhs, sizes, off)
        acc = mm(x_codes, w_codes, sizes, off, False)
        out = (acc * s_x * weight_scale_of_rows(s_w, g_M)).astype(out_dtype)
        return out, (x_codes, s_x, w_codes, s_w, g_M, sizes, off)

    def bwd(res, d_MN):
        x_codes, s_x, w_codes, s_w, g_M, sizes, off = res
        d = d_MN.astype(jnp.float32)
        # Input gradient: the weight scale (per contracted column n) onto the gradient rows.
        d_codes, s_d = fp8.quantize_rows(fold_scale(d, weight_scale_of_rows(s_w, g_M)), axis=1, dtype=grad_dtype)
        dx = (mm(d_codes, w_codes, sizes, off, True) * s_d).astype(out_dtype)
        # Weight gradient: the row scale (per contracted row m) onto the gradient; one scale per
        # (local group, column) from the group's rows only.
        d_rows = fold_scale(d, s_x)
        keep_M = row_mask(d.shape[0], sizes, off, G)
        amax_GN = jax.ops.segment_max(jnp.where(keep_M[:, None], jnp.abs(d_rows), 0.0), g_M, num_segments=G)
        s_GN = fp8.scale_from_absmax(jnp.maximum(amax_GN, 0.0), grad_dtype)
        dg_codes = fp8.quantize(d_rows, s_GN[g_M], grad_dtype)
        dw = be.tgmm(x_codes.astype(CODES_COMPUTE), dg_codes.astype(CODES_COMPUTE), sizes, num_local=G,
                     group_offset=off, sharded=sharded, out_dtype=jnp.float32)
        dw = (dw * s_GN[:, None, :]).astype(rhs_dtype)
        return dx, dw, None, None

    f.defvjp(fwd, bwd)
    return f(lhs_MK, rhs_GKN, group_sizes_E, jnp.asarray(group_offset, jnp.int32))
