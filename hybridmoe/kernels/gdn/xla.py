"""Gated DeltaNet, chunked form (docs/gdn.md section 2) in plain XLA ops, with its own backward.

Within a chunk everything is batched matmuls (the WY form); only the [K, V] state crosses chunks,
carried by a `lax.scan`. All of it runs in float32 with HIGHEST matmul precision: the state is
a long product of chunk transitions and a bf16 pass anywhere in it compounds over the sequence.

The backward (`vjp="custom"`, the default) saves the prepared inputs, the state at every chunk
start ([B, N, H, K, V]) and each chunk's inverse T ([B, N, H, C, D]): less than autodiff's
per-chunk residuals of the scan and of the inverse's substitution loop. It recomputes the other
intra-chunk terms, runs one reverse scan for the state cotangent (docs/gdn.md section 2's adjoint
recurrence) and then takes every chunk's adjoint at once, by hand (`local_chunks_backward`), with
the state at its start and end fixed; T's adjoint is the closed form dL = -T^T dT T^T.
`vjp="autodiff"` differentiates the same forward by autodiff (the benchmark's comparison).

Dimension letters:
  B batch, T tokens, N chunks, C position in a chunk (D: a second position axis, the key / source
  side of a [C, C] matrix), G key heads (Hk), H value heads (Hv), K key dim (dk), V value dim (dv).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from hybridmoe.kernels.gdn.reference import initial_or_zeros, prepare_query_key, starts_or_none

_HIGHEST = lax.Precision.HIGHEST

# Diagonal blocks of (I + L) are inverted by forward substitution at this size, then merged.
INVERSE_BLOCK_SIZE = 16


def matmul_highest(subscripts, *operands):
    """einsum at HIGHEST precision (full float32 products on every backend)."""
    return jnp.einsum(subscripts, *operands, precision=_HIGHEST)



def _forward_substitution_inverse(strict_lower_Acd):
    """(I + L)^-1 of small unit lower-triangular blocks [..., c, c], all blocks at once.

    Row i of the inverse X is e_i - sum_{j<i} L_ij X_j. A fori_loop rather than an unrolled
    Python loop: the same arithmetic, a fraction of the compile time (and of its autodiff).
    """
    size = strict_lower_Acd.shape[-1]
    row_axis = strict_lower_Acd.ndim - 2
    eye = jnp.eye(size, dtype=strict_lower_Acd.dtype)

    def substitute_row(row, inverse_Acd):
        # Rows >= `row` of the inverse are still identity rows, but L[row, j >= row] = 0 drops them.
        lower_row_Ac = lax.dynamic_index_in_dim(strict_lower_Acd, row, row_axis, keepdims=False)
        new_row_Ad = eye[row] - matmul_highest("...j,...jd->...d", lower_row_Ac, inverse_Acd)
        return lax.dynamic_update_index_in_dim(inverse_Acd, new_row_Ad, row, row_axis)

    return lax.fori_loop(1, size, substitute_row, jnp.broadcast_to(eye, strict_lower_Acd.shape))


def unit_lower_inverse(strict_lower_CD, block_size: int = INVERSE_BLOCK_SIZE):
    """(I + L)^-1 for a strictly lower-triangular L [..., C, C] (the result is unit lower triangular).

    1. The diagonal blocks (I + L_aa), block_size wide, are inverted by forward substitution.
    2. Merge: with Dinv the block-diagonal of those inverses and N = Dinv L_offdiag (strictly block
       lower, so N^(C / block_size) = 0), (I + L)^-1 = (I + N)^-1 Dinv, and the finite Neumann
       series (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... takes log2(C / block_size) matmul steps.
    No division occurs (the diagonal is exactly 1); all in the input dtype (float32 here).
    A C that block_size does not divide is solved as one block.
    """
    size = strict_lower_CD.shape[-1]
    if size % block_size:
        block_size = size
    num_blocks = size // block_size
    lead = strict_lower_CD.shape[:-2]
    dtype = strict_lower_CD.dtype

    # [..., A, c, B, d] -> the diagonal blocks [..., A, c, d].
    blocked = strict_lower_CD.reshape(*lead, num_blocks, block_size, num_blocks, block_size)
    diag_blocks_Acd = jnp.moveaxis(jnp.diagonal(blocked, axis1=-4, axis2=-2), -1, -3)
    diag_inverse_Acd = _forward_substitution_inverse(diag_blocks_Acd)
    # The block diagonal by a broadcast product with the identity, not a matmul: an einsum of float32
    # at default precision is one bfloat16 pass on a TPU, which rounded every inverse block to 8 bits.
    eye_blocks = jnp.eye(num_blocks, dtype=dtype)
    diag_inverse_CD = (diag_inverse_Acd[..., :, :, None, :] * eye_blocks[:, None, :, None]).reshape(strict_lower_CD.shape)

    block_of = jnp.arange(size) // block_size
    off_diagonal_CD = jnp.where(block_of[:, None] > block_of[None, :], strict_lower_CD, 0.0)
    neg_n_CD = -matmul_highest("...ce,...ed->...cd", diag_inverse_CD, off_diagonal_CD)
    eye = jnp.eye(size, dtype=dtype)
    series_CD, power_CD, reach = eye + neg_n_CD, neg_n_CD, 2
    while reach < num_blocks:  # series_CD holds the terms (-N)^n for n < reach
        power_CD = matmul_highest("...ce,...ed->...cd", power_CD, power_CD)
        series_CD = matmul_highest("...ce,...ed->...cd", series_CD, eye + power_CD)
        reach *= 2
    return matmul_highest("...ce,...ed->...cd", series_CD, diag_inverse_CD)


def unit_lower_inverse_adjoint(inverse_CD, d_inverse_CD):
    """The adjoint of a matrix inverse restricted to L's strictly lower part: dL = strict_lower(-T^T dT T^T)."""
    size = inverse_CD.shape[-1]
    strictly_lower = jnp.arange(size)[:, None] > jnp.arange(size)[None, :]
    d_lower = -matmul_highest("...ec,...ef,...df->...cd", inverse_CD, d_inverse_CD, inverse_CD)
    return (jnp.where(strictly_lower, d_lower, 0.0),)


def with_inverse_adjoint(inverse):
    """`inverse` (strictly lower L -> (I + L)^-1) with the closed-form adjoint instead of autodiff
    through its substitution; the Pallas kernels wrap their own substitution the same way."""
    wrapped = jax.custom_vjp(lambda strict_lower_CD: inverse(strict_lower_CD))

    def forward(strict_lower_CD):
        inverse_CD = inverse(strict_lower_CD)
        return inverse_CD, inverse_CD

    wrapped.defvjp(forward, unit_lower_inverse_adjoint)
    return wrapped


unit_lower_inverse_closed_form_vjp = with_inverse_adjoint(unit_lower_inverse)


def masked_exp(log_x, keep):
    """exp(log_x) where keep, else exactly 0, with the mask applied to the exponent BEFORE exp.

    Masked entries may hold large positive log values (the upper triangle of a segment sum,
    decay across a document start); exponentiating them first would give inf and then
    0 * inf = NaN in the products and in the gradient. exp(-inf) = 0 has a zero derivative.
    """
    return jnp.exp(jnp.where(keep, log_x, -jnp.inf))


def to_chunks(x_BT, chunk_size: int):
    """[B, N*C, H, ...] -> [B, N, H, C, ...] (heads ahead of positions for the per-chunk matmuls)."""
    num_chunks = x_BT.shape[1] // chunk_size
    chunked = x_BT.reshape(x_BT.shape[0], num_chunks, chunk_size, *x_BT.shape[2:])
    return jnp.moveaxis(chunked, 2, 3)


def from_chunks(x_BNHC):
    """[B, N, H, C, ...] -> [B, N*C, H, ...]."""
    x_BNCH = jnp.moveaxis(x_BNHC, 3, 2)
    return x_BNCH.reshape(x_BNCH.shape[0], -1, *x_BNCH.shape[3:])


class ChunkInputs(NamedTuple):
    """Prepared float32 inputs in chunk layout: q, k [B, N, H, C, K] (normalised, scaled, grouped),
    v [B, N, H, C, V], g, beta [B, N, H, C]."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


class ChunkTerms(NamedTuple):
    """What the chunk-to-chunk recurrence reads, per chunk (docs/gdn.md section 2, "Outputs and the next state"):
    V_new = U - W S;  O = Q_dec S + A_qk V_new;  S_next = decay S + K_bwd^T V_new."""

    w: jax.Array  # [B, N, H, C, K]
    u: jax.Array  # [B, N, H, C, V]
    attn: jax.Array  # A_qk [B, N, H, C, D]
    q_decayed: jax.Array  # [B, N, H, C, K]
    k_to_end: jax.Array  # K_bwd [B, N, H, C, K]
    decay: jax.Array  # [B, N, H]


class ChunkFactors(NamedTuple):
    """The intra-chunk factors behind ChunkTerms, kept for the hand-written backward.

    gamma [B, N, H, C, D]: exp(segment sum of g over (j, i]) on the causal same-document part, else 0;
    decay_from_start, decay_to_end [B, N, H, C] and decay (chunk) [B, N, H]: the masked decays;
    kk [B, N, H, C, D] = K K^T; wy [B, N, H, C, D] = T = (I + L)^-1; k_scaled = diag(beta * decay_from_start) K;
    v_scaled = diag(beta) V.
    """

    gamma: jax.Array
    decay_from_start: jax.Array
    decay_to_end: jax.Array
    decay: jax.Array
    kk: jax.Array
    wy: jax.Array
    k_scaled: jax.Array
    v_scaled: jax.Array


def chunk_factors(x: ChunkInputs, starts_BNC, inverse=unit_lower_inverse_closed_form_vjp, wy_BNHCD=None) -> ChunkFactors:
    """Every chunk's decays and WY factors at once; a document start (starts_BNC) is a decay of exactly 0.

    wy_BNHCD: T as the forward computed it (the backward passes the saved one instead of inverting again).
    """
    chunk_size = x.g.shape[-1]
    # Document index of each position within its chunk: 0 for the document the chunk starts in.
    doc_BNC = jnp.cumsum(starts_BNC.astype(jnp.int32), axis=-1)
    same_doc_BNCD = doc_BNC[..., :, None] == doc_BNC[..., None, :]
    reads_state_BNC = doc_BNC == 0  # no document start at or before this token in the chunk
    writes_state_BNC = doc_BNC == doc_BNC[..., -1:]  # no document start after this token
    carries_state_BN = doc_BNC[..., -1] == 0  # no document start anywhere in the chunk
    position = jnp.arange(chunk_size)
    causal_CD = position[:, None] >= position[None, :]
    strictly_causal_CD = position[:, None] > position[None, :]

    # Log decays, float32. The decay between positions j < i is the segment sum of g over (j, i],
    # accumulated directly (Mamba-2's segsum) rather than as b_i - b_j of chunk cumsums: after one
    # g ~ -1e4 token the cumsum sits near -6e5 where a float32 ulp is 0.06, and b_i - b_j would
    # carry that error into every later decay of the chunk. Summing g_t over (j, i] has no cancellation.
    # The sums over (j, i] for all i at once are one matmul with the [t <= i] mask (a cumsum over
    # the [C, C] array lowers to a reduce-window on CPU that re-adds up to C terms per entry).
    log_segment_BNHCD = matmul_highest("it,bnhtj->bnhij", causal_CD.astype(jnp.float32),
                                jnp.where(strictly_causal_CD, x.g[..., :, None], 0.0))
    log_from_start_BNHC = jnp.cumsum(x.g, axis=-1)  # decay from chunk start through token i
    log_to_end_BNHC = log_segment_BNHCD[..., -1, :]  # decay after token i to the chunk's end
    log_chunk_BNH = log_from_start_BNHC[..., -1]

    gamma_BNHCD = masked_exp(log_segment_BNHCD, (causal_CD & same_doc_BNCD)[:, :, None])
    decay_from_start_BNHC = masked_exp(log_from_start_BNHC, reads_state_BNC[:, :, None])
    decay_to_end_BNHC = masked_exp(log_to_end_BNHC, writes_state_BNC[:, :, None])
    decay_chunk_BNH = masked_exp(log_chunk_BNH, carries_state_BN[:, :, None])

    # WY form: T = (I + L)^-1, L = strict_lower(diag(beta) (K K^T) * Gamma).
    kk_BNHCD = matmul_highest("bnhck,bnhdk->bnhcd", x.k, x.k)
    if wy_BNHCD is None:
        wy_BNHCD = inverse(jnp.where(strictly_causal_CD, x.beta[..., None] * kk_BNHCD * gamma_BNHCD, 0.0))
    return ChunkFactors(gamma_BNHCD, decay_from_start_BNHC, decay_to_end_BNHC, decay_chunk_BNH, kk_BNHCD,
                        wy_BNHCD, (x.beta * decay_from_start_BNHC)[..., None] * x.k,
                        x.beta[..., None] * x.v)


def terms_from_factors(x: ChunkInputs, f: ChunkFactors) -> ChunkTerms:
    w_BNHCK = matmul_highest("bnhcd,bnhdk->bnhck", f.wy, f.k_scaled)
    u_BNHCV = matmul_highest("bnhcd,bnhdv->bnhcv", f.wy, f.v_scaled)
    attn_BNHCD = matmul_highest("bnhck,bnhdk->bnhcd", x.q, x.k) * f.gamma
    return ChunkTerms(w_BNHCK, u_BNHCV, attn_BNHCD, x.q * f.decay_from_start[..., None],
                      x.k * f.decay_to_end[..., None], f.decay)


def chunk_terms(x: ChunkInputs, starts_BNC, inverse=unit_lower_inverse_closed_form_vjp) -> ChunkTerms:
    """Every chunk's WY terms at once; a document start (starts_BNC) is a decay of exactly 0."""
    return terms_from_factors(x, chunk_factors(x, starts_BNC, inverse))


def chunk_state_step(state_BHKV, w_BHCK, u_BHCV, k_to_end_BHCK, decay_BH):
    """S_next = decay S + K_bwd^T (U - W S): one chunk's transition of the state."""
    v_new_BHCV = u_BHCV - matmul_highest("bhck,bhkv->bhcv", w_BHCK, state_BHKV)
    return decay_BH[..., None, None] * state_BHKV + matmul_highest("bhck,bhcv->bhkv", k_to_end_BHCK, v_new_BHCV)


def chunk_start_states(t: ChunkTerms, initial_BHKV):
    """The state at every chunk's start [B, N, H, K, V] and the final state, by a scan over chunks."""

    def step(state_BHKV, chunk):
        return chunk_state_step(state_BHKV, *chunk), state_BHKV

    chunk_major = lambda a: jnp.moveaxis(a, 1, 0)
    per_chunk = jax.tree.map(chunk_major, (t.w, t.u, t.k_to_end, t.decay))
    final_BHKV, states_NBHKV = lax.scan(step, initial_BHKV, per_chunk)
    return jnp.moveaxis(states_NBHKV, 0, 1), final_BHKV


def chunk_outputs(t: ChunkTerms, states_BNHKV):
    """Every chunk's output and end state from the state at its start (no sequential dependence)."""
    v_new = t.u - matmul_highest("bnhck,bnhkv->bnhcv", t.w, states_BNHKV)
    o_BNHCV = (matmul_highest("bnhck,bnhkv->bnhcv", t.q_decayed, states_BNHKV)
               + matmul_highest("bnhcd,bnhdv->bnhcv", t.attn, v_new))
    ends_BNHKV = t.decay[..., None, None] * states_BNHKV + matmul_highest("bnhck,bnhcv->bnhkv", t.k_to_end, v_new)
    return o_BNHCV, ends_BNHKV


def state_cotangent_step(d_end_BHKV, do_BHCV, w_BHCK, attn_BHCD, q_decayed_BHCK, k_to_end_BHCK, decay_BH):
    """docs/gdn.md section 2's adjoint: dS_in = decay dS_out + Q_dec^T dO - W^T (A_qk^T dO + K_bwd dS_out)."""
    d_v_new_BHCV = (matmul_highest("bhcd,bhcv->bhdv", attn_BHCD, do_BHCV)
                    + matmul_highest("bhck,bhkv->bhcv", k_to_end_BHCK, d_end_BHKV))
    return (decay_BH[..., None, None] * d_end_BHKV + matmul_highest("bhck,bhcv->bhkv", q_decayed_BHCK, do_BHCV)
            - matmul_highest("bhck,bhcv->bhkv", w_BHCK, d_v_new_BHCV))


def chunk_end_cotangents(t: ChunkTerms, do_BNHCV, d_final_BHKV):
    """dL/d(state at every chunk's end) [B, N, H, K, V] and dL/d(initial state), by a reverse scan."""

    def step(d_end_BHKV, chunk):
        return state_cotangent_step(d_end_BHKV, *chunk), d_end_BHKV

    chunk_major = lambda a: jnp.moveaxis(a, 1, 0)
    per_chunk = jax.tree.map(chunk_major, (do_BNHCV, t.w, t.attn, t.q_decayed, t.k_to_end, t.decay))
    d_initial_BHKV, d_ends_NBHKV = lax.scan(step, d_final_BHKV, per_chunk, reverse=True)
    return jnp.moveaxis(d_ends_NBHKV, 0, 1), d_initial_BHKV


def _sum_last(a):
    return jnp.sum(a, axis=-1)


def local_chunks_backward(x: ChunkInputs, f: ChunkFactors, t: ChunkTerms, states_BNHKV, do_BNHCV, d_ends_BNHKV):
    """Cotangents of the prepared inputs of every chunk at once, the state at each chunk's start and
    the cotangent of the state at its end given (the reverse scan supplies them).

    The forward of one chunk, with S its start state and a, e, c the decays from the chunk's start,
    to its end and across it (docs/gdn.md section 2):
        L = strict(diag(beta) K K^T * Gamma),  T = (I + L)^-1,  W = T diag(beta a) K,  U = T diag(beta) V,
        V_new = U - W S,  O = diag(a) Q S + (Q K^T * Gamma) V_new,  S_end = c S + (diag(e) K)^T V_new.
    Its adjoint by hand, each line the transpose of one forward line, so that every intra-chunk
    product is a batched matmul over all chunks (autodiff of the same forward doubles the passes
    over the [C, C] arrays: it keeps the where-masks' and the exp's own tangents).
    The gate g enters through log decays: a = exp(cumsum g), e = exp(sum over (i, C]), c = exp(sum g),
    Gamma = exp(segment sums); each log-decay cotangent is (cotangent of the decay) * decay, and
    d g_t collects the log cotangents of every sum that contains g_t.
    """
    chunk_size = x.g.shape[-1]
    position = jnp.arange(chunk_size)
    strictly_causal_CD = position[:, None] > position[None, :]
    v_new_BNHCV = t.u - matmul_highest("bnhck,bnhkv->bnhcv", t.w, states_BNHKV)

    # Outputs and end state: O = Q_dec S + A_qk V_new, S_end = c S + K_bwd^T V_new.
    d_v_new_BNHCV = (matmul_highest("bnhcd,bnhcv->bnhdv", t.attn, do_BNHCV)
                     + matmul_highest("bnhck,bnhkv->bnhcv", t.k_to_end, d_ends_BNHKV))
    d_attn_BNHCD = matmul_highest("bnhcv,bnhdv->bnhcd", do_BNHCV, v_new_BNHCV)
    d_q_decayed_BNHCK = matmul_highest("bnhcv,bnhkv->bnhck", do_BNHCV, states_BNHKV)
    d_k_to_end_BNHCK = matmul_highest("bnhcv,bnhkv->bnhck", v_new_BNHCV, d_ends_BNHKV)
    d_log_chunk_BNH = jnp.sum(states_BNHKV * d_ends_BNHKV, axis=(-2, -1)) * f.decay

    # V_new = U - W S; W = T K_s, U = T V_s.
    d_w_BNHCK = -matmul_highest("bnhcv,bnhkv->bnhck", d_v_new_BNHCV, states_BNHKV)
    d_k_scaled_BNHCK = matmul_highest("bnhcd,bnhck->bnhdk", f.wy, d_w_BNHCK)
    d_v_scaled_BNHCV = matmul_highest("bnhcd,bnhcv->bnhdv", f.wy, d_v_new_BNHCV)
    d_wy_BNHCD = (matmul_highest("bnhck,bnhdk->bnhcd", d_w_BNHCK, f.k_scaled)
                  + matmul_highest("bnhcv,bnhdv->bnhcd", d_v_new_BNHCV, f.v_scaled))
    # T = (I + L)^-1: dL = strict(-T^T dT T^T).
    t_d_wy = matmul_highest("bnhec,bnhed->bnhcd", f.wy, d_wy_BNHCD)
    d_lower_BNHCD = jnp.where(strictly_causal_CD, -matmul_highest("bnhce,bnhde->bnhcd", t_d_wy, f.wy), 0.0)

    # L = strict(diag(beta) KK^T * Gamma) and A_qk = QK^T * Gamma.
    d_lower_gamma = d_lower_BNHCD * f.gamma
    d_kk_BNHCD = x.beta[..., None] * d_lower_gamma
    qk_BNHCD = matmul_highest("bnhck,bnhdk->bnhcd", x.q, x.k)
    d_qk_BNHCD = d_attn_BNHCD * f.gamma
    # Cotangent of the log segment sums: (dGamma) * Gamma, zero wherever Gamma is masked.
    d_log_segment_BNHCD = (d_lower_gamma * x.beta[..., None] * f.kk + d_qk_BNHCD * qk_BNHCD)

    dq = matmul_highest("bnhcd,bnhdk->bnhck", d_qk_BNHCD, x.k) + f.decay_from_start[..., None] * d_q_decayed_BNHCK
    dk = (matmul_highest("bnhcd,bnhck->bnhdk", d_qk_BNHCD, x.q)
          + matmul_highest("bnhcd,bnhdk->bnhck", d_kk_BNHCD + jnp.swapaxes(d_kk_BNHCD, -1, -2), x.k)
          + (x.beta * f.decay_from_start)[..., None] * d_k_scaled_BNHCK
          + f.decay_to_end[..., None] * d_k_to_end_BNHCK)
    dv = x.beta[..., None] * d_v_scaled_BNHCV
    k_dot_d_k_scaled = _sum_last(x.k * d_k_scaled_BNHCK)
    d_beta = (_sum_last(d_lower_gamma * f.kk) + f.decay_from_start * k_dot_d_k_scaled
              + _sum_last(x.v * d_v_scaled_BNHCV))
    d_log_from_start = (x.beta * k_dot_d_k_scaled + _sum_last(x.q * d_q_decayed_BNHCK)) * f.decay_from_start
    d_log_to_end = _sum_last(x.k * d_k_to_end_BNHCK) * f.decay_to_end

    # g_t is in log_from_start_i for i >= t, in log_to_end_i for i < t, in the chunk's sum, and in
    # the segment sum (j, i] for j < t <= i: the last as one matmul with the [j < t] mask, then a
    # masked column sum over i >= t.
    later_or_same_CT = position[:, None] >= position[None, :]
    prefix_BNHCT = matmul_highest("bnhcd,dt->bnhct", d_log_segment_BNHCD, strictly_causal_CD.T.astype(jnp.float32))
    dg = (jnp.sum(jnp.where(later_or_same_CT, prefix_BNHCT, 0.0), axis=-2)
          + jnp.flip(jnp.cumsum(jnp.flip(d_log_from_start, -1), axis=-1), -1)
          + jnp.cumsum(d_log_to_end, axis=-1) - d_log_to_end
          + d_log_chunk_BNH[..., None])
    return ChunkInputs(dq, dk, dv, dg, d_beta)


def core_forward(x: ChunkInputs, starts_BNC, initial_BHKV):
    """(o [B, N, H, C, V], final state) and the residuals of `core_backward`."""
    f = chunk_factors(x, starts_BNC)
    t = terms_from_factors(x, f)
    states_BNHKV, final_BHKV = chunk_start_states(t, initial_BHKV)
    o_BNHCV, _ = chunk_outputs(t, states_BNHKV)
    return (o_BNHCV, final_BHKV), (x, starts_BNC, states_BNHKV, f.wy)


def replay_chunks(residuals):
    """The backward's recomputation: every chunk's terms, and the backward of the chunks taken one by one
    (a function of the output and end-state cotangents, like a vjp; the start states' cotangent,
    which the reverse scan carries instead, is None)."""
    x, starts_BNC, states_BNHKV, *saved_wy = residuals
    f = chunk_factors(x, starts_BNC, wy_BNHCD=saved_wy[0] if saved_wy else None)
    t = terms_from_factors(x, f)

    def local_vjp(cotangents):
        do_BNHCV, d_ends_BNHKV = cotangents
        return local_chunks_backward(x, f, t, states_BNHKV, do_BNHCV, d_ends_BNHKV), None

    return local_vjp, t


def finish_backward(local_vjp, t: ChunkTerms, do_BNHCV, d_final_BHKV):
    """Given the replay: one reverse scan for the state cotangents, then every chunk's vjp at once."""
    d_ends_BNHKV, d_initial_BHKV = chunk_end_cotangents(t, do_BNHCV, d_final_BHKV)
    dx, _ = local_vjp((do_BNHCV, d_ends_BNHKV))
    return dx, d_initial_BHKV


def core_backward(residuals, do_BNHCV, d_final_BHKV):
    """Cotangents of (ChunkInputs, initial state): recompute the terms, one reverse scan, one vjp."""
    return finish_backward(*replay_chunks(residuals), do_BNHCV, d_final_BHKV)


@jax.custom_vjp
def chunked_core(x: ChunkInputs, starts_BNC, initial_BHKV):
    """The chunked recurrence on prepared chunk-layout inputs: (o [B, N, H, C, V], final state)."""
    return core_forward(x, starts_BNC, initial_BHKV)[0]


def _core_fwd(x, starts_BNC, initial_BHKV):
    return core_forward(x, starts_BNC, initial_BHKV)


def _core_bwd(residuals, cotangents):
    dx, d_initial_BHKV = core_backward(residuals, *cotangents)
    return dx, None, d_initial_BHKV


chunked_core.defvjp(_core_fwd, _core_bwd)


def _chunked_core_autodiff(x: ChunkInputs, starts_BNC, initial_BHKV):
    """The same forward with gradients by autodiff through the scan and the substitution loop."""
    t = chunk_terms(x, starts_BNC, inverse=unit_lower_inverse)
    states_BNHKV, final_BHKV = chunk_start_states(t, initial_BHKV)
    return chunk_outputs(t, states_BNHKV)[0], final_BHKV


def prepare_chunks(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, chunk_size: int, normalize_qk: bool):
    """Normalise and group q, k, cast to float32, pad to whole chunks, chunk layout.

    Padding tokens leave the state alone: g = 0 (decay exp(0) = 1), beta = 0 and k = 0 (write
    nothing), no document start (they belong to the row's last document).
    """
    num_tokens, num_value_heads = v_BTHV.shape[1:3]
    f32 = jnp.float32
    q_BTHK, k_BTHK = prepare_query_key(q_BTGK, k_BTGK, num_value_heads, normalize_qk, f32)
    pad = -num_tokens % chunk_size
    pad_time = lambda a: jnp.pad(a.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    chunks = lambda a: to_chunks(pad_time(a), chunk_size)
    x = ChunkInputs(chunks(q_BTHK), chunks(k_BTHK), chunks(v_BTHV),
                    chunks(g_BTH[..., None])[..., 0], chunks(beta_BTH[..., None])[..., 0])
    starts_BNC = jnp.pad(starts_BT, [(0, 0), (0, pad)]).reshape(starts_BT.shape[0], -1, chunk_size)
    return x, starts_BNC


def gated_delta_rule_chunked(
    q_BTGK,
    k_BTGK,
    v_BTHV,
    g_BTH,
    beta_BTH,
    *,
    segment_ids=None,
    initial_state=None,
    chunk_size: int = 64,
    normalize_qk: bool = True,
    vjp: str = "custom",
    core=None,
):
    """Chunked gated delta rule. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] f32).

    core: (ChunkInputs, starts_BNC, initial_BHKV) -> (o_BNHCV, final_BHKV) in place of this file's
    (the Pallas backends); by default the XLA core with the `vjp` backward."""
    batch, num_tokens, num_value_heads, value_dim = v_BTHV.shape
    key_dim = q_BTGK.shape[-1]
    starts_BT = starts_or_none(segment_ids, batch, num_tokens)
    x, starts_BNC = prepare_chunks(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, chunk_size, normalize_qk)
    initial_BHKV = initial_or_zeros(initial_state, (batch, num_value_heads, key_dim, value_dim), jnp.float32)
    if core is None:
        core = {"custom": chunked_core, "autodiff": _chunked_core_autodiff}[vjp]
    o_BNHCV, final_BHKV = core(x, starts_BNC, initial_BHKV)
    return from_chunks(o_BNHCV)[:, :num_tokens].astype(v_BTHV.dtype), final_BHKV
