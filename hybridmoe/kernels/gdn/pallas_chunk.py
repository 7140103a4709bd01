"""Gated DeltaNet, one chunk of one (batch, value head) for the Triton kernels (pallas_gpu.py; docs/gdn.md section 2).

`chunk_step` is the chunk's math as a plain 2D jnp function: the forward kernel calls it, the
backward kernel differentiates it (one jax.vjp per chunk gives the chunk's input cotangents and
its start state's), so the math exists once. `forward_chunk` / `backward_chunk` are the per-chunk
bodies the driver runs on refs viewing one chunk. (The Mosaic TPU kernels run tpu_chunk.py's math:
several value heads and chunks per grid step, the adjoint written by hand.)

Only what Triton lowers runs here: 2D iotas, masked reductions, 2D matmuls of square or [C, K]-like
operands (no matrix-vector product with a unit dim). The gates enter twice,
as a column [C, 1] and as a row [1, C], so that prefix sums are masked lane or sublane reductions
and no vector is transposed in the kernel; their two cotangents are summed outside.

Dimension letters as in xla.py: C position in a chunk (D the second position axis), K key dim,
V value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybridmoe.kernels.gdn.xla import masked_exp, with_inverse_adjoint

# Imported here for the step-time model (analysis/hlo_cost.py) and the cost tests, which read the
# Mosaic kernels' names and count from this module: the MACs of the Mosaic (pallas_tpu) kernels'
# chunk math as tpu_chunk writes it, every bfloat16 pass counted.
from hybridmoe.kernels.gdn.tpu_chunk import chunk_macs  # noqa: E402, F401
from hybridmoe.kernels.gdn.tpu_chunk import positions as _positions  # noqa: E402

_HIGHEST = lax.Precision.HIGHEST
# The kernels' names in the compiled program (what program facts look for): the Triton kernels here
# and the Mosaic kernels of pallas_tpu.py carry the same two names.
KERNEL_NAMES = {"_forward_kernel": "gdn_chunk_forward", "_backward_kernel": "gdn_chunk_backward"}
_F32 = jnp.float32
# MXU passes per FLOP a Mosaic GDN kernel states (the step-time model reads only Mosaic calls): 1,
# since pallas_tpu's kernels state every bfloat16 pass they run (tpu_chunk.mxu writes the float32
# products out as passes). The Triton math below runs its matmuls at HIGHEST precision.
MXU_PASSES = 1


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), precision=_HIGHEST, preferred_element_type=_F32)


def _mm(a_MK, b_KN):
    return _dot(a_MK, b_KN, ((1,), (0,)))


def _mm_nt(a_MK, b_NK):  # a @ b^T
    return _dot(a_MK, b_NK, ((1,), (1,)))


def _mm_tn(a_KM, b_KN):  # a^T @ b
    return _dot(a_KM, b_KN, ((0,), (0,)))


def _forward_substitution(strict_lower_CD):
    """(I + L)^-1 of a strictly lower-triangular [C, C] L, row by row: X_i = e_i - sum_j L_ij X_j.

    Each step reads row i of L as a column (one masked lane reduction of L^T) and forms the new row
    as a masked sublane reduction, so no matrix-vector product with a unit dim reaches the MXU.
    """
    size = strict_lower_CD.shape[-1]
    row, col = _positions(size)
    eye_CD = (row == col).astype(_F32)
    lower_t_DC = strict_lower_CD.T
    col_1D = lax.broadcasted_iota(jnp.int32, (1, size), 1)

    def substitute_row(i, inverse_CD):
        lower_row_D1 = jnp.sum(jnp.where(col == i, lower_t_DC, 0.0), axis=1, keepdims=True)
        new_row_1D = (col_1D == i).astype(_F32) - jnp.sum(lower_row_D1 * inverse_CD, axis=0, keepdims=True)
        return jnp.where(row == i, new_row_1D, inverse_CD)

    return lax.fori_loop(1, size, substitute_row, eye_CD)


# Looked up at each call, so that a patched substitution reaches the backward's inverse too.
_unit_lower_inverse = with_inverse_adjoint(lambda strict_lower_CD: _forward_substitution(strict_lower_CD))


def chunk_step(q_CK, k_CK, v_CV, g_C1, g_1C, beta_C1, starts_C1, starts_1C, state_KV, inverse=None):
    """One chunk of one head from the state at its start: (o [C, V], the state at its end [K, V]).

    The same terms as xla.chunk_terms / chunk_outputs: decays as segment sums of g (no b_i - b_j
    cancellation), masked before exp; a document start (starts = 1) is a decay of exactly 0.
    g and starts come as a column and as the same values in a row. inverse: (I + L)^-1 of the
    strictly lower L; by default the substitution with the closed-form adjoint (what jax.vjp needs).
    """
    size = q_CK.shape[0]
    row, col = _positions(size)
    causal_CD, strictly_causal_CD = row >= col, row > col
    causal_ones_CD = causal_CD.astype(_F32)

    def segment_sum(x_C1):  # [i, j]: sum of x over (j, i]
        return _mm(causal_ones_CD, jnp.where(strictly_causal_CD, x_C1, 0.0))

    def through(x_1C):  # [i]: sum of x over [0, i]
        return jnp.sum(jnp.where(causal_CD, x_1C, 0.0), axis=1, keepdims=True)

    def after(x_1C):  # [i]: sum of x over (i, C)
        return jnp.sum(jnp.where(col > row, x_1C, 0.0), axis=1, keepdims=True)

    gamma_CD = masked_exp(segment_sum(g_C1), causal_CD & (segment_sum(starts_C1) == 0.0))
    decay_from_start_C1 = masked_exp(through(g_1C), through(starts_1C) == 0.0)
    decay_to_end_C1 = masked_exp(after(g_1C), after(starts_1C) == 0.0)
    decay_chunk_11 = masked_exp(jnp.sum(g_1C, axis=1, keepdims=True),
                                jnp.sum(starts_1C, axis=1, keepdims=True) == 0.0)

    lower_CD = jnp.where(strictly_causal_CD, beta_C1 * _mm_nt(k_CK, k_CK) * gamma_CD, 0.0)
    wy_CD = (inverse or _unit_lower_inverse)(lower_CD)
    w_CK = _mm(wy_CD, (beta_C1 * decay_from_start_C1) * k_CK)
    u_CV = _mm(wy_CD, beta_C1 * v_CV)
    v_new_CV = u_CV - _mm(w_CK, state_KV)
    o_CV = _mm(q_CK * decay_from_start_C1, state_KV) + _mm(_mm_nt(q_CK, k_CK) * gamma_CD, v_new_CV)
    end_KV = decay_chunk_11 * state_KV + _mm_tn(k_CK * decay_to_end_C1, v_new_CV)
    return o_CV, end_KV


def forward_chunk(chunk_refs, state_KV, o_ref, chunk_start_ref):
    """Store the chunk's start state and output; return its end state."""
    chunk_start_ref[...] = state_KV
    # The plain substitution: nothing differentiates the forward kernel, and Triton does not lower a
    # custom_vjp call.
    o_CV, end_KV = chunk_step(*(r[...] for r in chunk_refs), state_KV, inverse=_forward_substitution)
    o_ref[...] = o_CV
    return end_KV


def backward_chunk(chunk_refs, chunk_start_ref, do_ref, d_end_KV, grad_refs):
    """Store the chunk's input cotangents (q, k, v, g column, g row, beta); return its start state's."""
    q_CK, k_CK, v_CV, g_C1, g_1C, beta_C1, starts_C1, starts_1C = (r[...] for r in chunk_refs)
    step = lambda q, k, v, g_c, g_r, beta, state: chunk_step(q, k, v, g_c, g_r, beta, starts_C1, starts_1C, state)
    _, chunk_vjp = jax.vjp(step, q_CK, k_CK, v_CV, g_C1, g_1C, beta_C1, chunk_start_ref[...])
    *grads, d_start_KV = chunk_vjp((do_ref[...], d_end_KV))
    for ref, grad in zip(grad_refs, grads):
        ref[...] = grad
    return d_start_KV
