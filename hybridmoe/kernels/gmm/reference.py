"""Slow, obviously correct grouped matmuls: a Python loop over the local groups, float32 math.

Legend: M rows (sorted by group), K contraction, N output columns, E groups in group_sizes
(global), G groups held locally (rhs's leading dim; groups [offset, offset + G) of the E),
D model width, F expert hidden width (one half of the fused [gate | up]).

Rows past sum(group_sizes) and rows of groups that are not held locally produce zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def group_row_masks(group_sizes_E, m: int, group_offset, num_local: int):
    """[G, M] bool: row r belongs to local group g (global group offset + g)."""
    ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
    starts_E = ends_E - group_sizes_E
    rows_M = jnp.arange(m, dtype=jnp.int32)
    masks = []
    for g in range(num_local):
        e = jnp.asarray(group_offset, jnp.int32) + g
        masks.append((rows_M >= starts_E[e]) & (rows_M < ends_E[e]))
    return jnp.stack(masks)


def gmm(lhs_MK, rhs_GKN, group_sizes_E, *, transpose_rhs=False, group_offset=0, out_dtype=None):
    """out[r] = lhs[r] @ rhs[group(r) - offset] (rhs [G, N, K] when transpose_rhs)."""
    out_dtype = out_dtype or lhs_MK.dtype
    if transpose_rhs:
        rhs_GKN = jnp.swapaxes(rhs_GKN, 1, 2)
    m = lhs_MK.shape[0]
    masks_GM = group_row_masks(group_sizes_E, m, group_offset, rhs_GKN.shape[0])
    lhs = lhs_MK.astype(jnp.float32)
    out = jnp.zeros((m, rhs_GKN.shape[2]), jnp.float32)
    for g in range(rhs_GKN.shape[0]):
        part = jnp.dot(lhs, rhs_GKN[g].astype(jnp.float32), precision=_HI)
        out = jnp.where(masks_GM[g][:, None], part, out)
    return out.astype(out_dtype)


def tgmm(lhs_MK, grad_MN, group_sizes_E, *, num_local: int, group_offset=0, out_dtype=None):
    """out[g] = lhs[rows of g]^T @ grad[rows of g]  -> [G, K, N] (zero for an empty group)."""
    out_dtype = out_dtype or lhs_MK.dtype
    m = lhs_MK.shape[0]
    masks_GM = group_row_masks(group_sizes_E, m, group_offset, num_local)
    outs = []
    for g in range(num_local):
        a = jnp.where(masks_GM[g][:, None], lhs_MK.astype(jnp.float32), 0.0)
        b = jnp.where(masks_GM[g][:, None], grad_MN.astype(jnp.float32), 0.0)
        outs.append(jnp.dot(a.T, b, precision=_HI))
    return jnp.stack(outs).astype(out_dtype)


def _halves(gate_up_M2F):
    # Sliced here, not through epilogue.py, so a broken epilogue patched in by a test never
    # reaches the reference.
    f = gate_up_M2F.shape[-1] // 2
    x = gate_up_M2F.astype(jnp.float32)
    return x[:, :f], x[:, f:]


def swiglu(gate_up_M2F):
    """silu(gate) * up in float32 on a contiguous [gate | up]."""
    gate, up = _halves(gate_up_M2F)
    return gate * jax.nn.sigmoid(gate) * up


def swiglu_vjp(gate_up_M2F, dh_MF):
    """d[gate | up] (contiguous, float32) of swiglu for the cotangent dh."""
    gate, up = _halves(gate_up_M2F)
    dh = dh_MF.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    d_gate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dh * gate * sig
    return jnp.concatenate([d_gate, d_up], axis=-1)


def moe_mlp(x_MD, wi_GD2F, wo_GFD, group_sizes_E, *, row_scale_M=None, group_offset=0):
    """y = (s * swiglu(x @ wi)) @ wo per group, all float32: the fused pair's reference."""
    pre = gmm(x_MD, wi_GD2F, group_sizes_E, group_offset=group_offset, out_dtype=jnp.float32)
    h = swiglu(pre)
    if row_scale_M is not None:
        h = h * row_scale_M.astype(jnp.float32)[:, None]
    return gmm(h, wo_GFD, group_sizes_E, group_offset=group_offset, out_dtype=jnp.float32)
