"""Per-token log-probs and entropies without the full [tokens, vocab] logits.

At Qwen3.5 sizes the logits of one micro-batch (e.g. 16k tokens x 248k vocab x 4 bytes = 16 GB)
do not fit next to the model, and autodiff through a chunked loop would keep every chunk's logits
as residuals anyway. So the chunking has its own VJP, over [token chunk, vocab chunk] blocks of
logits, with the vocabulary chunks outside and the token chunks inside:

forward, per vocab chunk (lax.scan), per token chunk (inner lax.scan), an online logsumexp whose
per-token state [tokens] rides across the vocab chunks:
  z = h @ W[:, chunk] / temperature             float32 accumulation whatever the input dtype
  m' = max(m, max z);  a = exp(m - m')
  s' = a s + sum exp(z - m')                    softmax denominator, relative to the running max
  u' = a (u + (m - m') s) + sum exp(z - m')(z - m')   sum of e (z - m), kept relative to m so the
                                                entropy is not a difference of two large numbers
  lse = m + log s;  H = log s - u / s;  logp = z_target - lse
backward recomputes each block of logits from the saved lse and H:
  p = exp(z - lse)
  dlogp/dz = onehot(target) - p
  dH/dz    = -p (z - lse + H)                   (= -p (log p + H))
  dh += g_z' @ W_chunk^T,  dW_chunk += h^T @ g_z'   with g_z' = g_z / temperature
A vocab chunk's dW is whole once its token loop ends: it is written, in the head's dtype, into
the gradient [D, V], which is the only [D, V] array the backward holds. Token chunks outside would
carry a float32 [D, V] accumulator through the loop instead (at the 397B cell 3.8 GiB per device,
beside its zero initial value and the cast copy) and read and write all of it once per token chunk;
vocab chunks outside carry dh, float32 [tokens, D] (256 MiB there), and read the hidden states once
per vocab chunk. Per element the sums run in the same order either way (token chunks ascending
inside each vocab chunk's sum, vocab chunks ascending inside each token's).

Token counts that chunk_tokens does not divide are padded (padded tokens get zero cotangent). The
vocabulary is never padded: where chunk_vocab does not divide V the last chunk starts early, at
V - chunk_vocab, and masks the columns the chunk before it covered. The final norm is the caller's:
`hidden` is what goes straight into the LM head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def vocab_chunks(vocab_size: int, chunk_vocab: int) -> int:
    return -(-vocab_size // chunk_vocab)


def _block_columns(v_index, chunk_vocab: int, vocab_size: int):
    """Vocab chunk v_index's first column, its column ids and which of them are its own: the last
    chunk starts early, at V - chunk_vocab, and its columns before v_index * chunk_vocab are the
    previous chunk's."""
    v_start = jnp.minimum(v_index * chunk_vocab, vocab_size - chunk_vocab)
    col_V = v_start + jnp.arange(chunk_vocab)
    return v_start, col_V, col_V >= v_index * chunk_vocab


def _logits_block(h_CD, lm_head_DV, v_index, chunk_vocab, temperature):
    """One [chunk_tokens, chunk_vocab] block of float32 logits / temperature (the division is the
    sampler's own op, so both see the same numbers), which of its columns are its own, their ids,
    and the weight columns."""
    v_start, col_V, own_V = _block_columns(v_index, chunk_vocab, lm_head_DV.shape[1])
    w_DC = jax.lax.dynamic_slice_in_dim(lm_head_DV, v_start, chunk_vocab, axis=1)
    z_CV = jnp.dot(h_CD, w_DC, preferred_element_type=jnp.float32)
    if temperature != 1.0:
        z_CV = z_CV / temperature
    return z_CV, own_V, col_V, w_DC


def _online_update(h_CD, targets_C, state, lm_head_DV, v_index, chunk_vocab, temperature):
    """The per-token state (running max, sum, entropy numerator, target logit) after one more vocab chunk."""
    m_C, s_C, u_C, z_target_C = state
    z_CV, own_V, col_V, _ = _logits_block(h_CD, lm_head_DV, v_index, chunk_vocab, temperature)
    z_CV = jnp.where(own_V, z_CV, -jnp.inf)
    m_new_C = jnp.maximum(m_C, z_CV.max(axis=1))  # finite after the first chunk (column 0 is its own)
    shifted_CV = jnp.where(own_V, z_CV - m_new_C[:, None], 0.0)
    e_CV = jnp.where(own_V, jnp.exp(shifted_CV), 0.0)
    # (m - m') s is 0 - inf = NaN before the first chunk: s == 0 there, so the term is 0.
    rescale_C = jnp.exp(m_C - m_new_C)
    moved_C = jnp.where(s_C > 0, (m_C - m_new_C) * s_C, 0.0)
    u_C = rescale_C * (u_C + moved_C) + (e_CV * shifted_CV).sum(axis=1)
    s_C = rescale_C * s_C + e_CV.sum(axis=1)
    hit_CV = col_V[None, :] == targets_C[:, None]
    z_target_C = z_target_C + jnp.where(hit_CV & own_V, z_CV, 0.0).sum(axis=1)
    return m_new_C, s_C, u_C, z_target_C


def _forward(h_KCD, lm_head_DV, targets_KC, chunk_vocab, temperature):
    def over_vocab(state_KC, v_index):
        def over_tokens(_, xs):
            h_CD, targets_C, *state_C = xs
            return None, _online_update(h_CD, targets_C, state_C, lm_head_DV, v_index, chunk_vocab, temperature)

        _, state_KC = jax.lax.scan(over_tokens, None, (h_KCD, targets_KC, *state_KC))
        return state_KC, None

    zeros_KC = jnp.zeros(targets_KC.shape, jnp.float32)
    init = (jnp.full(targets_KC.shape, -jnp.inf, jnp.float32), zeros_KC, zeros_KC, zeros_KC)
    num_vocab_chunks = vocab_chunks(lm_head_DV.shape[1], chunk_vocab)
    (m_KC, s_KC, u_KC, z_target_KC), _ = jax.lax.scan(over_vocab, init, jnp.arange(num_vocab_chunks))
    lse_KC = m_KC + jnp.log(s_KC)
    return z_target_KC - lse_KC, jnp.log(s_KC) - u_KC / s_KC, lse_KC


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(h_KCD, lm_head_DV, targets_KC, chunk_vocab, temperature):
    logp_KC, entropy_KC, _ = _forward(h_KCD, lm_head_DV, targets_KC, chunk_vocab, temperature)
    return logp_KC, entropy_KC


def _chunked_fwd(h_KCD, lm_head_DV, targets_KC, chunk_vocab, temperature):
    logp_KC, entropy_KC, lse_KC = _forward(h_KCD, lm_head_DV, targets_KC, chunk_vocab, temperature)
    return (logp_KC, entropy_KC), (h_KCD, lm_head_DV, targets_KC, lse_KC, entropy_KC)


def _chunked_bwd(chunk_vocab, temperature, residuals, cotangents):
    h_KCD, lm_head_DV, targets_KC, lse_KC, entropy_KC = residuals
    g_logp_KC, g_entropy_KC = cotangents

    def over_vocab(carry, v_index):
        d_h_KCD, d_lm_head_DV = carry

        def over_tokens(d_w_DC, xs):
            h_CD, targets_C, lse_C, entropy_C, g_logp_C, g_entropy_C, d_h_CD = xs
            z_CV, own_V, col_V, w_DC = _logits_block(h_CD, lm_head_DV, v_index, chunk_vocab, temperature)
            log_p_CV = z_CV - lse_C[:, None]
            p_CV = jnp.where(own_V, jnp.exp(log_p_CV), 0.0)
            onehot_CV = (col_V[None, :] == targets_C[:, None]).astype(jnp.float32)
            g_z_CV = (g_logp_C[:, None] * (onehot_CV - p_CV)
                      - g_entropy_C[:, None] * p_CV * (log_p_CV + entropy_C[:, None]))
            g_z_CV = jnp.where(own_V, g_z_CV, 0.0)
            if temperature != 1.0:  # z = raw / temperature
                g_z_CV = g_z_CV / temperature
            d_h_CD = d_h_CD + jnp.dot(g_z_CV.astype(w_DC.dtype), w_DC.T, preferred_element_type=jnp.float32)
            d_w_DC = d_w_DC + jnp.dot(h_CD.T, g_z_CV.astype(h_CD.dtype), preferred_element_type=jnp.float32)
            return d_w_DC, d_h_CD

        d_w_DC = jnp.zeros((lm_head_DV.shape[0], chunk_vocab), jnp.float32)
        xs = (h_KCD, targets_KC, lse_KC, entropy_KC, g_logp_KC, g_entropy_KC, d_h_KCD)
        d_w_DC, d_h_KCD = jax.lax.scan(over_tokens, d_w_DC, xs)
        v_start, _, own_V = _block_columns(v_index, chunk_vocab, d_lm_head_DV.shape[1])
        block_DC = jax.lax.dynamic_slice_in_dim(d_lm_head_DV, v_start, chunk_vocab, axis=1)
        block_DC = jnp.where(own_V[None, :], d_w_DC.astype(d_lm_head_DV.dtype), block_DC)
        return (d_h_KCD, jax.lax.dynamic_update_slice_in_dim(d_lm_head_DV, block_DC, v_start, axis=1)), None

    init = (jnp.zeros(h_KCD.shape, jnp.float32), jnp.zeros(lm_head_DV.shape, lm_head_DV.dtype))
    g_logp_KC, g_entropy_KC = g_logp_KC.astype(jnp.float32), g_entropy_KC.astype(jnp.float32)
    num_vocab_chunks = vocab_chunks(lm_head_DV.shape[1], chunk_vocab)
    (d_h_KCD, d_lm_head_DV), _ = jax.lax.scan(over_vocab, init, jnp.arange(num_vocab_chunks))
    return d_h_KCD.astype(h_KCD.dtype), d_lm_head_DV, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_token_logprobs(
    hidden_BTD: jnp.ndarray,
    lm_head_DV: jnp.ndarray,
    targets_BT: jnp.ndarray,
    *,
    chunk_tokens: int,
    chunk_vocab: int,
    temperature: float = 1.0,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(log p(target) float32 [B, T], entropy of the next-token distribution float32 [B, T]).

    hidden_BTD: final-normed hidden states; lm_head_DV: the output projection; targets_BT: ids in
    [0, V). Differentiable in hidden and lm_head (custom VJP, same gradients as the unchunked
    `token_logprobs_reference`); chunk sizes need not divide B*T or V. temperature: the logits are
    divided by it first (the distribution the sampler draws from at that temperature).
    """
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"chunk sizes must be >= 1, got chunk_tokens={chunk_tokens}, chunk_vocab={chunk_vocab}")
    batch, seq_len, d_model = hidden_BTD.shape
    if lm_head_DV.shape[0] != d_model:
        raise ValueError(f"lm_head {lm_head_DV.shape} does not match hidden width {d_model}")
    vocab_size = lm_head_DV.shape[1]
    num_tokens = batch * seq_len
    chunk_tokens = min(chunk_tokens, num_tokens)
    chunk_vocab = min(chunk_vocab, vocab_size)

    pad_tokens = -num_tokens % chunk_tokens
    h_ND = jnp.pad(hidden_BTD.reshape(num_tokens, d_model), ((0, pad_tokens), (0, 0)))
    targets_N = jnp.pad(targets_BT.reshape(num_tokens).astype(jnp.int32), (0, pad_tokens))

    num_chunks = (num_tokens + pad_tokens) // chunk_tokens
    logp_KC, entropy_KC = _chunked(h_ND.reshape(num_chunks, chunk_tokens, d_model), lm_head_DV,
                                   targets_N.reshape(num_chunks, chunk_tokens), chunk_vocab, float(temperature))
    logp_BT = logp_KC.reshape(-1)[:num_tokens].reshape(batch, seq_len)
    entropy_BT = entropy_KC.reshape(-1)[:num_tokens].reshape(batch, seq_len)
    return logp_BT, entropy_BT


def token_logprobs_reference(hidden_BTD, lm_head_DV, targets_BT, temperature: float = 1.0):
    """The unchunked definition (materialises [B, T, V]): the oracle for tests and tiny models."""
    logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD, lm_head_DV, preferred_element_type=jnp.float32) / temperature
    log_p_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    logp_BT = jnp.take_along_axis(log_p_BTV, targets_BT[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy_BT = -(jnp.exp(log_p_BTV) * log_p_BTV).sum(axis=-1)
    return logp_BT, entropy_BT
