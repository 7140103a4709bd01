"""Gated DeltaNet, chunked form (GDN.md section 2) as Pallas kernels, with the XLA core's backward contract.

Forward kernel: grid (B, H, N), the chunk axis innermost and sequential. Each step computes one
chunk of one (batch, value head) from the float32 [K, V] state carried in a VMEM scratch, writes
the chunk's output and the state at its start (the backward's only residual besides the inputs),
and at the last chunk the final state. Backward kernel: the same grid with the chunks visited in
reverse; each step replays its chunk from the saved start state and takes the chunk's vjp with the
cotangent of its end state (carried in scratch) and of its output: that one vjp gives dq, dk, dv,
dbeta, dg of the chunk and the cotangent of its start state, i.e. GDN.md section 2's adjoint
recurrence, and at chunk 0 dL/d(initial state). The per-chunk math is `chunk_step`, a plain 2D
jnp function the forward calls and the backward differentiates: one copy of the math.

Written for Mosaic TPU (`pallas_tpu`): every block's last two dims are full array dims ([C, K],
[C, V], [K, V], [C, 1], [1, C]); only 2D iotas, masked reductions and 2D matmuls run in the
body. The gates enter twice, as a column [C, 1] and as a row [1, C], so that prefix sums are masked
lane or sublane reductions and no vector is transposed in the kernel; their two cotangents are
summed outside. Triton (GPU) programs run in parallel and keep no scratch between grid steps, so
this sequential-grid kernel is not a GPU kernel; the validator refuses it on GPU.

On CPU the kernels run with interpret=True (kernels.interpret, as for the gmm Pallas backends).

Dimension letters as in xla.py: B batch, N chunks, H value heads, C position in a chunk (D the
second position axis), K key dim, V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gdn.xla import ChunkInputs, masked_exp, unit_lower_inverse_adjoint

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def _dot(a, b, contract):
    return lax.dot_general(a, b, (contract, ((), ())), precision=_HIGHEST, preferred_element_type=_F32)


def _mm(a_MK, b_KN):
    return _dot(a_MK, b_KN, ((1,), (0,)))


def _mm_nt(a_MK, b_NK):  # a @ b^T
    return _dot(a_MK, b_NK, ((1,), (1,)))


def _mm_tn(a_KM, b_KN):  # a^T @ b
    return _dot(a_KM, b_KN, ((0,), (0,)))


def _positions(size: int):
    """Row and column index of a [size, size] tile (2D iotas: what Mosaic lowers)."""
    return lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)


def _forward_substitution(strict_lower_CD):
    """(I + L)^-1 of a strictly lower-triangular [C, C] L, row by row: X_i = e_i - sum_j L_ij X_j.

    Each step reads row i of L as a column (one masked lane reduction of L^T) and forms the new row
    as a masked sublane reduction, so no matrix-vector product with a unit dim reaches the MXU.
    """
    size = strict_lower_CD.shape[-1]
    row, col = _positions(size)
    eye_CD = (row == col).astype(_F32)
    lower_t_DC = strict_lower_CD.T

    def substitute_row(i, inverse_CD):
        lower_row_D1 = jnp.sum(jnp.where(col == i, lower_t_DC, 0.0), axis=1, keepdims=True)
        new_row_1D = (col[:1] == i).astype(_F32) - jnp.sum(lower_row_D1 * inverse_CD, axis=0, keepdims=True)
        return jnp.where(row == i, new_row_1D, inverse_CD)

    return lax.fori_loop(1, size, substitute_row, eye_CD)


@jax.custom_vjp
def _unit_lower_inverse(strict_lower_CD):
    return _forward_substitution(strict_lower_CD)


def _inverse_fwd(strict_lower_CD):
    inverse_CD = _forward_substitution(strict_lower_CD)
    return inverse_CD, inverse_CD


_unit_lower_inverse.defvjp(_inverse_fwd, unit_lower_inverse_adjoint)


def chunk_step(q_CK, k_CK, v_CV, g_C1, g_1C, beta_C1, starts_C1, starts_1C, state_KV):
    """One chunk of one head from the state at its start: (o [C, V], the state at its end [K, V]).

    The same terms as xla.chunk_terms / chunk_outputs: decays as segment sums of g (no b_i - b_j
    cancellation), masked before exp; a document start (starts = 1) is a decay of exactly 0.
    g and starts come as a column and as the same values in a row.
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
    wy_CD = _unit_lower_inverse(lower_CD)
    w_CK = _mm(wy_CD, (beta_C1 * decay_from_start_C1) * k_CK)
    u_CV = _mm(wy_CD, beta_C1 * v_CV)
    v_new_CV = u_CV - _mm(w_CK, state_KV)
    o_CV = _mm(q_CK * decay_from_start_C1, state_KV) + _mm(_mm_nt(q_CK, k_CK) * gamma_CD, v_new_CV)
    end_KV = decay_chunk_11 * state_KV + _mm_tn(k_CK * decay_to_end_C1, v_new_CV)
    return o_CV, end_KV


# ---------------------------------------------------------------------------------------------
# Kernel-side layouts: the gates and document starts as columns [B, N, H, C, 1] and rows
# [B, N, H, 1, C]; every other operand keeps xla.py's chunk layout.


def _gate_layouts(x: ChunkInputs, starts_BNC):
    """g as column and row, beta as column, the document starts (float 0 / 1, no head axis) as both."""
    starts_BNC = starts_BNC.astype(_F32)
    column = lambda a: a[..., :, None]
    row = lambda a: a[..., None, :]
    return column(x.g), row(x.g), column(x.beta), column(starts_BNC), row(starts_BNC)


def _chunk_spec(block_tail, reverse: bool, num_chunks: int, per_head: bool = True):
    """One chunk of one (batch, head): block (1, 1, 1, *tail) of a [B, N, H, ...] array
    (per_head=False: (1, 1, *tail) of a [B, N, ...] array that every head reads)."""
    chunk = (lambda n: num_chunks - 1 - n) if reverse else (lambda n: n)
    zeros = (0,) * len(block_tail)
    if not per_head:
        return pl.BlockSpec((None, None, *block_tail), lambda b, h, n: (b, chunk(n), *zeros))
    return pl.BlockSpec((None, None, None, *block_tail), lambda b, h, n: (b, chunk(n), h, *zeros))


def _state_spec(key_dim: int, value_dim: int):
    """The [K, V] state of one (batch, head), the same block for every chunk (resident)."""
    return pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _input_specs(x: ChunkInputs, reverse: bool):
    num_chunks, chunk_size, key_dim, value_dim = x.q.shape[1], x.q.shape[3], x.q.shape[4], x.v.shape[4]
    spec = functools.partial(_chunk_spec, reverse=reverse, num_chunks=num_chunks)
    return [spec((chunk_size, key_dim)), spec((chunk_size, key_dim)), spec((chunk_size, value_dim)),
            spec((chunk_size, 1)), spec((1, chunk_size)), spec((chunk_size, 1)),
            spec((chunk_size, 1), per_head=False), spec((1, chunk_size), per_head=False)], spec


def _load_chunk(refs):
    return tuple(r[...] for r in refs)


def _forward_kernel(q, k, v, g_col, g_row, beta, starts_col, starts_row, initial,
                    o_out, chunk_start_out, final_out, state_scratch):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_scratch[...] = initial[...]

    state_KV = state_scratch[...]
    chunk_start_out[...] = state_KV
    o_CV, end_KV = chunk_step(*_load_chunk((q, k, v, g_col, g_row, beta, starts_col, starts_row)), state_KV)
    o_out[...] = o_CV
    state_scratch[...] = end_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_out[...] = end_KV


def _backward_kernel(q, k, v, g_col, g_row, beta, starts_col, starts_row, chunk_start, do, d_final,
                     dq_out, dk_out, dv_out, dg_col_out, dg_row_out, dbeta_out, d_initial_out, d_state_scratch):
    n = pl.program_id(2)  # n-th chunk from the end

    @pl.when(n == 0)
    def _():
        d_state_scratch[...] = d_final[...]

    q_CK, k_CK, v_CV, g_C1, g_1C, beta_C1, starts_C1, starts_1C = _load_chunk(
        (q, k, v, g_col, g_row, beta, starts_col, starts_row))
    step = lambda q, k, v, g_c, g_r, beta, state: chunk_step(q, k, v, g_c, g_r, beta, starts_C1, starts_1C, state)
    _, chunk_vjp = jax.vjp(step, q_CK, k_CK, v_CV, g_C1, g_1C, beta_C1, chunk_start[...])
    dq_CK, dk_CK, dv_CV, dg_C1, dg_1C, dbeta_C1, d_start_KV = chunk_vjp((do[...], d_state_scratch[...]))
    dq_out[...], dk_out[...], dv_out[...] = dq_CK, dk_CK, dv_CV
    dg_col_out[...], dg_row_out[...], dbeta_out[...] = dg_C1, dg_1C, dbeta_C1
    d_state_scratch[...] = d_start_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        d_initial_out[...] = d_start_KV


def core_forward(x: ChunkInputs, starts_BNC, initial_BHKV, *, interpret: bool):
    """(o [B, N, H, C, V], final state) and the residuals (inputs, the state at every chunk start)."""
    batch, num_chunks, heads, chunk_size, key_dim = x.q.shape
    value_dim = x.v.shape[-1]
    gates = _gate_layouts(x, starts_BNC)
    in_specs, spec = _input_specs(x, reverse=False)
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, _F32)
    o_BNHCV, states_BNHKV, final_BHKV = pl.pallas_call(
        _forward_kernel,
        grid=(batch, heads, num_chunks),
        in_specs=in_specs + [_state_spec(key_dim, value_dim)],
        out_specs=[spec((chunk_size, value_dim)), spec((key_dim, value_dim)), _state_spec(key_dim, value_dim)],
        out_shape=[shape(batch, num_chunks, heads, chunk_size, value_dim),
                   shape(batch, num_chunks, heads, key_dim, value_dim), shape(batch, heads, key_dim, value_dim)],
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), _F32)],
        compiler_params=_compiler_params(),
        interpret=interpret,
    )(x.q, x.k, x.v, *gates, initial_BHKV)
    return (o_BNHCV, final_BHKV), (x, starts_BNC, states_BNHKV)


def core_backward(residuals, do_BNHCV, d_final_BHKV, *, interpret: bool):
    """Cotangents of (ChunkInputs, initial state) by one reverse pass over the chunks."""
    x, starts_BNC, states_BNHKV = residuals
    batch, num_chunks, heads, chunk_size, key_dim = x.q.shape
    value_dim = x.v.shape[-1]
    gates = _gate_layouts(x, starts_BNC)
    in_specs, spec = _input_specs(x, reverse=True)
    like = lambda a: jax.ShapeDtypeStruct(a.shape, _F32)
    dq, dk, dv, dg_col, dg_row, dbeta, d_initial_BHKV = pl.pallas_call(
        _backward_kernel,
        grid=(batch, heads, num_chunks),
        in_specs=in_specs + [spec((key_dim, value_dim)), spec((chunk_size, value_dim)),
                             _state_spec(key_dim, value_dim)],
        out_specs=in_specs[:5] + [in_specs[5], _state_spec(key_dim, value_dim)],
        out_shape=[like(x.q), like(x.k), like(x.v), like(gates[0]), like(gates[1]), like(gates[2]),
                   like(d_final_BHKV)],
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), _F32)],
        compiler_params=_compiler_params(),
        interpret=interpret,
    )(x.q, x.k, x.v, *gates, states_BNHKV, do_BNHCV, d_final_BHKV)
    dx = ChunkInputs(dq, dk, dv, dg_col[..., 0] + dg_row[..., 0, :], dbeta[..., 0])
    return dx, d_initial_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_core(x: ChunkInputs, starts_BNC, initial_BHKV, interpret: bool = False):
    """The chunked recurrence on prepared chunk-layout inputs: (o [B, N, H, C, V], final state)."""
    return core_forward(x, starts_BNC, initial_BHKV, interpret=interpret)[0]


def _core_fwd(x, starts_BNC, initial_BHKV, interpret):
    return core_forward(x, starts_BNC, initial_BHKV, interpret=interpret)


def _core_bwd(interpret, residuals, cotangents):
    dx, d_initial_BHKV = core_backward(residuals, *cotangents, interpret=interpret)
    return dx, None, d_initial_BHKV


chunked_core.defvjp(_core_fwd, _core_bwd)
