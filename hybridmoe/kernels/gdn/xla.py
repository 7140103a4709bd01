"""Gated DeltaNet, chunked form (GDN.md section 2) in plain XLA ops; gradients by autodiff.

Within a chunk everything is batched matmuls (the WY form); only the [K, V] state crosses chunks,
carried by a `lax.scan`. All of it runs in float32 with HIGHEST matmul precision: the state is
a long product of chunk transitions and a bf16 pass anywhere in it compounds over the sequence.

Dimension letters:
  B batch, T tokens, N chunks, C position in a chunk (D: a second position axis, the key / source
  side of a [C, C] matrix), G key heads (Hk), H value heads (Hv), K key dim (dk), V value dim (dv).
"""

import jax
import jax.numpy as jnp
from jax import lax

from hybridmoe.kernels.gdn.reference import document_starts, prepare_query_key

_HIGHEST = lax.Precision.HIGHEST

# Diagonal blocks of (I + L) are inverted by forward substitution at this size, then merged.
INVERSE_BLOCK_SIZE = 16


def _matmul(subscripts, *operands):
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
        new_row_Ad = eye[row] - _matmul("...j,...jd->...d", lower_row_Ac, inverse_Acd)
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
    eye_blocks = jnp.eye(num_blocks, dtype=dtype)
    diag_inverse_CD = jnp.einsum("...acd,ab->...acbd", diag_inverse_Acd, eye_blocks).reshape(strict_lower_CD.shape)

    block_of = jnp.arange(size) // block_size
    off_diagonal_CD = jnp.where(block_of[:, None] > block_of[None, :], strict_lower_CD, 0.0)
    neg_n_CD = -_matmul("...ce,...ed->...cd", diag_inverse_CD, off_diagonal_CD)
    eye = jnp.eye(size, dtype=dtype)
    series_CD, power_CD, reach = eye + neg_n_CD, neg_n_CD, 2
    while reach < num_blocks:  # series_CD holds the terms (-N)^n for n < reach
        power_CD = _matmul("...ce,...ed->...cd", power_CD, power_CD)
        series_CD = _matmul("...ce,...ed->...cd", series_CD, eye + power_CD)
        reach *= 2
    return _matmul("...ce,...ed->...cd", series_CD, diag_inverse_CD)


def _masked_exp(log_x, keep):
    """exp(log_x) where keep, else exactly 0, with the mask applied to the exponent BEFORE exp.

    Masked entries may hold large positive log values (the upper triangle of a segment sum,
    decay across a document start); exponentiating them first would give inf and then
    0 * inf = NaN in the products and in the gradient. exp(-inf) = 0 has a zero derivative.
    """
    return jnp.exp(jnp.where(keep, log_x, -jnp.inf))


def _to_chunks(x_BT, num_chunks: int, chunk_size: int):
    """[B, N*C, H, ...] -> [B, N, H, C, ...] (heads ahead of positions for the per-chunk matmuls)."""
    chunked = x_BT.reshape(x_BT.shape[0], num_chunks, chunk_size, *x_BT.shape[2:])
    return jnp.moveaxis(chunked, 2, 3)


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
):
    """Chunked gated delta rule. Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] f32)."""
    batch, num_tokens, num_value_heads, value_dim = v_BTHV.shape
    key_dim = q_BTGK.shape[-1]
    f32 = jnp.float32
    q_BTHK, k_BTHK = prepare_query_key(q_BTGK, k_BTGK, num_value_heads, normalize_qk, f32)
    if segment_ids is None:
        starts_BT = jnp.zeros((batch, num_tokens), bool)
    else:
        starts_BT = document_starts(segment_ids)

    # Pad to whole chunks with tokens that leave the state alone: g = 0 (decay exp(0) = 1), beta = 0
    # and k = 0 (write nothing), no document start (they belong to the row's last document).
    num_chunks = -(-num_tokens // chunk_size)
    pad = num_chunks * chunk_size - num_tokens
    pad_time = lambda x: jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    chunks = lambda x: _to_chunks(pad_time(x), num_chunks, chunk_size)
    q_BNHCK, k_BNHCK, v_BNHCV = chunks(q_BTHK), chunks(k_BTHK), chunks(v_BTHV)
    g_BNHC, beta_BNHC = chunks(g_BTH[..., None])[..., 0], chunks(beta_BTH[..., None])[..., 0]
    starts_BNC = jnp.pad(starts_BT, [(0, 0), (0, pad)]).reshape(batch, num_chunks, chunk_size)

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
    log_segment_BNHCD = jnp.cumsum(jnp.where(strictly_causal_CD, g_BNHC[..., :, None], 0.0), axis=-2)
    log_from_start_BNHC = jnp.cumsum(g_BNHC, axis=-1)  # decay from chunk start through token i
    log_to_end_BNHC = log_segment_BNHCD[..., -1, :]  # decay after token i to the chunk's end
    log_chunk_BNH = log_from_start_BNHC[..., -1]

    # A document start is a decay of exactly 0: masking these exponents is the recurrence's reset.
    gamma_BNHCD = _masked_exp(log_segment_BNHCD, (causal_CD & same_doc_BNCD)[:, :, None])
    decay_from_start_BNHC = _masked_exp(log_from_start_BNHC, reads_state_BNC[:, :, None])
    decay_to_end_BNHC = _masked_exp(log_to_end_BNHC, writes_state_BNC[:, :, None])
    decay_chunk_BNH = _masked_exp(log_chunk_BNH, carries_state_BN[:, :, None])

    # WY form: T = (I + L)^-1, L = strict_lower(diag(beta) (K K^T) * Gamma).
    kk_BNHCD = _matmul("bnhck,bnhdk->bnhcd", k_BNHCK, k_BNHCK)
    lower_BNHCD = jnp.where(strictly_causal_CD, beta_BNHC[..., None] * kk_BNHCD * gamma_BNHCD, 0.0)
    wy_BNHCD = unit_lower_inverse(lower_BNHCD)
    w_BNHCK = _matmul("bnhcd,bnhdk->bnhck", wy_BNHCD, (beta_BNHC * decay_from_start_BNHC)[..., None] * k_BNHCK)
    u_BNHCV = _matmul("bnhcd,bnhdv->bnhcv", wy_BNHCD, beta_BNHC[..., None] * v_BNHCV)
    attn_BNHCD = _matmul("bnhck,bnhdk->bnhcd", q_BNHCK, k_BNHCK) * gamma_BNHCD
    q_decayed_BNHCK = q_BNHCK * decay_from_start_BNHC[..., None]
    k_to_end_BNHCK = k_BNHCK * decay_to_end_BNHC[..., None]

    def chunk_step(state_BHKV, chunk):
        w_BHCK, u_BHCV, attn_BHCD, q_decayed_BHCK, k_to_end_BHCK, decay_chunk_BH = chunk
        v_new_BHCV = u_BHCV - _matmul("bhck,bhkv->bhcv", w_BHCK, state_BHKV)
        o_BHCV = _matmul("bhck,bhkv->bhcv", q_decayed_BHCK, state_BHKV) + _matmul(
            "bhcd,bhdv->bhcv", attn_BHCD, v_new_BHCV
        )
        state_BHKV = decay_chunk_BH[..., None, None] * state_BHKV + _matmul(
            "bhck,bhcv->bhkv", k_to_end_BHCK, v_new_BHCV
        )
        return state_BHKV, o_BHCV

    if initial_state is None:
        state_BHKV = jnp.zeros((batch, num_value_heads, key_dim, value_dim), f32)
    else:
        state_BHKV = initial_state.astype(f32)
    per_chunk = (w_BNHCK, u_BNHCV, attn_BNHCD, q_decayed_BNHCK, k_to_end_BNHCK, decay_chunk_BNH)
    chunk_major = lambda x: jnp.moveaxis(x, 1, 0)
    state_BHKV, o_NBHCV = lax.scan(chunk_step, state_BHKV, jax.tree.map(chunk_major, per_chunk))

    o_BNCHV = jnp.moveaxis(o_NBHCV, (0, 2), (1, 3))
    o_BTHV = o_BNCHV.reshape(batch, num_chunks * chunk_size, num_value_heads, value_dim)[:, :num_tokens]
    return o_BTHV.astype(v_BTHV.dtype), state_BHKV
