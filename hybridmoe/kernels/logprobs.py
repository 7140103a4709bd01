"""Per-token log-probs and entropies without the full [tokens, vocab] logits.

At Qwen3.5 sizes the logits of one micro-batch (e.g. 16k tokens x 248k vocab x 4 bytes = 16 GB)
do not fit next to the model, and autodiff through a chunked loop would keep every chunk's logits
as residuals anyway. So the chunking has its own VJP:

forward, per token chunk (lax.scan), per vocab chunk (inner lax.scan), an online logsumexp:
  z = h @ W[:, chunk] / temperature             float32 accumulation whatever the input dtype
  m' = max(m, max z);  a = exp(m - m')
  s' = a s + sum exp(z - m')                    softmax denominator, relative to the running max
  u' = a (u + (m - m') s) + sum exp(z - m')(z - m')   sum of e (z - m), kept relative to m so the
                                                entropy is not a difference of two large numbers
  lse = m + log s;  H = log s - u / s;  logp = z_target - lse
backward recomputes each [token chunk, vocab chunk] block of logits from the saved lse and H (with
save_logits, kernels.logprobs.save_logits, it reads the forward's blocks instead: one matmul of three
fewer, for [tokens, vocab] float32 kept from the forward to the backward):
  p = exp(z - lse)
  dlogp/dz = onehot(target) - p
  dH/dz    = -p (z - lse + H)                   (= -p (log p + H))
  dh = g_z' @ W_chunk^T,  dW_chunk += h^T @ g_z'   with g_z' = g_z / temperature
Peak extra memory is one [chunk_tokens, chunk_vocab] float32 block plus the float32 dW accumulator.

Lengths that the chunk sizes do not divide are padded: padded tokens get zero cotangent, padded
vocab columns are masked out of every sum. The final norm is the caller's: `hidden` is what goes
straight into the LM head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _logits_block(h_CD, lm_head_DV, v_start, chunk_vocab, vocab_size, temperature, with_logits=True):
    """One [chunk_tokens, chunk_vocab] block of float32 logits / temperature (None without
    with_logits), which of its columns are real, their ids and the LM head's block (the division is
    the sampler's own op, so both see the same numbers)."""
    w_DC = jax.lax.dynamic_slice_in_dim(lm_head_DV, v_start, chunk_vocab, axis=1)
    z_CV = jnp.dot(h_CD, w_DC, preferred_element_type=jnp.float32) if with_logits else None
    if with_logits and temperature != 1.0:
        z_CV = z_CV / temperature
    col_V = v_start + jnp.arange(chunk_vocab)
    return z_CV, col_V < vocab_size, col_V, w_DC


def _forward_chunk(h_CD, targets_C, lm_head_DV, chunk_vocab, vocab_size, temperature, save_logits=False):
    """(log p(target), u, s, lse) per token; with save_logits also every vocab chunk's logits block
    as computed, [vocab chunks, tokens, chunk_vocab] (else None)."""
    num_tokens = h_CD.shape[0]
    num_vocab_chunks = lm_head_DV.shape[1] // chunk_vocab

    def over_vocab(carry, v_index):
        m_C, s_C, u_C, z_target_C = carry
        raw_CV, real_V, col_V, _ = _logits_block(h_CD, lm_head_DV, v_index * chunk_vocab, chunk_vocab, vocab_size,
                                                 temperature)
        z_CV = jnp.where(real_V, raw_CV, -jnp.inf)
        m_new_C = jnp.maximum(m_C, z_CV.max(axis=1))  # finite after the first chunk (column 0 is real)
        shifted_CV = jnp.where(real_V, z_CV - m_new_C[:, None], 0.0)
        e_CV = jnp.where(real_V, jnp.exp(shifted_CV), 0.0)
        # (m - m') s is 0 - inf = NaN before the first chunk: s == 0 there, so the term is 0.
        rescale_C = jnp.exp(m_C - m_new_C)
        moved_C = jnp.where(s_C > 0, (m_C - m_new_C) * s_C, 0.0)
        u_C = rescale_C * (u_C + moved_C) + (e_CV * shifted_CV).sum(axis=1)
        s_C = rescale_C * s_C + e_CV.sum(axis=1)
        hit_CV = col_V[None, :] == targets_C[:, None]
        z_target_C = z_target_C + jnp.where(hit_CV & real_V, z_CV, 0.0).sum(axis=1)
        return (m_new_C, s_C, u_C, z_target_C), raw_CV if save_logits else None

    zeros_C = jnp.zeros((num_tokens,), jnp.float32)
    init = (jnp.full((num_tokens,), -jnp.inf, jnp.float32), zeros_C, zeros_C, zeros_C)
    (m_C, s_C, u_C, z_target_C), z_NCV = jax.lax.scan(over_vocab, init, jnp.arange(num_vocab_chunks))
    lse_C = m_C + jnp.log(s_C)
    return z_target_C - lse_C, u_C, s_C, lse_C, z_NCV


def _forward(h_KCD, lm_head_DV, targets_KC, chunk_vocab, vocab_size, temperature, save_logits=False):
    def over_tokens(_, xs):
        h_CD, targets_C = xs
        logp_C, u_C, s_C, lse_C, z_NCV = _forward_chunk(h_CD, targets_C, lm_head_DV, chunk_vocab, vocab_size,
                                                        temperature, save_logits)
        entropy_C = jnp.log(s_C) - u_C / s_C
        return None, (logp_C, entropy_C, lse_C, z_NCV)

    _, (logp_KC, entropy_KC, lse_KC, z_KNCV) = jax.lax.scan(over_tokens, None, (h_KCD, targets_KC))
    return logp_KC, entropy_KC, lse_KC, z_KNCV


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(h_KCD, lm_head_DV, targets_KC, chunk_vocab, vocab_size, temperature, save_logits):
    logp_KC, entropy_KC, _, _ = _forward(h_KCD, lm_head_DV, targets_KC, chunk_vocab, vocab_size, temperature)
    return logp_KC, entropy_KC


def _chunked_fwd(h_KCD, lm_head_DV, targets_KC, chunk_vocab, vocab_size, temperature, save_logits):
    logp_KC, entropy_KC, lse_KC, z_KNCV = _forward(h_KCD, lm_head_DV, targets_KC, chunk_vocab, vocab_size, temperature,
                                                   save_logits)
    return (logp_KC, entropy_KC), (h_KCD, lm_head_DV, targets_KC, lse_KC, entropy_KC, z_KNCV)


def backward_logits(saved_NCV, h_CD, lm_head_DV, v_index, chunk_vocab, vocab_size, temperature):
    """The backward's [token chunk, vocab chunk] block of logits / temperature, which columns are
    real, their ids and the LM head's block: the forward's block where it was saved (saved_NCV, the
    token chunk's blocks), else computed again."""
    z_CV, real_V, col_V, w_DC = _logits_block(h_CD, lm_head_DV, v_index * chunk_vocab, chunk_vocab, vocab_size,
                                              temperature, with_logits=saved_NCV is None)
    return (z_CV if saved_NCV is None else saved_NCV[v_index]), real_V, col_V, w_DC


def _chunked_bwd(chunk_vocab, vocab_size, temperature, save_logits, residuals, cotangents):
    h_KCD, lm_head_DV, targets_KC, lse_KC, entropy_KC, z_KNCV = residuals
    g_logp_KC, g_entropy_KC = cotangents
    num_vocab_chunks = lm_head_DV.shape[1] // chunk_vocab

    def over_tokens(d_lm_head_DV, xs):
        h_CD, targets_C, lse_C, entropy_C, g_logp_C, g_entropy_C, z_NCV = xs

        def over_vocab(carry, v_index):
            d_h_CD, d_lm_head_DV = carry
            v_start = v_index * chunk_vocab
            z_CV, real_V, col_V, w_DC = backward_logits(z_NCV, h_CD, lm_head_DV, v_index, chunk_vocab, vocab_size,
                                                        temperature)
            log_p_CV = z_CV - lse_C[:, None]
            p_CV = jnp.where(real_V, jnp.exp(log_p_CV), 0.0)
            onehot_CV = (col_V[None, :] == targets_C[:, None]).astype(jnp.float32)
            g_z_CV = (g_logp_C[:, None] * (onehot_CV - p_CV)
                      - g_entropy_C[:, None] * p_CV * (log_p_CV + entropy_C[:, None]))
            g_z_CV = jnp.where(real_V, g_z_CV, 0.0)
            if temperature != 1.0:  # z = raw / temperature
                g_z_CV = g_z_CV / temperature
            d_h_CD = d_h_CD + jnp.dot(g_z_CV.astype(w_DC.dtype), w_DC.T, preferred_element_type=jnp.float32)
            d_w_DC = jnp.dot(h_CD.T, g_z_CV.astype(h_CD.dtype), preferred_element_type=jnp.float32)
            block_DC = jax.lax.dynamic_slice_in_dim(d_lm_head_DV, v_start, chunk_vocab, axis=1)
            d_lm_head_DV = jax.lax.dynamic_update_slice_in_dim(d_lm_head_DV, block_DC + d_w_DC, v_start, axis=1)
            return (d_h_CD, d_lm_head_DV), None

        d_h_CD = jnp.zeros(h_CD.shape, jnp.float32)
        (d_h_CD, d_lm_head_DV), _ = jax.lax.scan(over_vocab, (d_h_CD, d_lm_head_DV), jnp.arange(num_vocab_chunks))
        return d_lm_head_DV, d_h_CD

    d_lm_head_DV = jnp.zeros(lm_head_DV.shape, jnp.float32)
    xs = (h_KCD, targets_KC, lse_KC, entropy_KC,
          g_logp_KC.astype(jnp.float32), g_entropy_KC.astype(jnp.float32), z_KNCV)
    d_lm_head_DV, d_h_KCD = jax.lax.scan(over_tokens, d_lm_head_DV, xs)
    return d_h_KCD.astype(h_KCD.dtype), d_lm_head_DV.astype(lm_head_DV.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_token_logprobs(
    hidden_BTD: jnp.ndarray,
    lm_head_DV: jnp.ndarray,
    targets_BT: jnp.ndarray,
    *,
    chunk_tokens: int,
    chunk_vocab: int,
    temperature: float = 1.0,
    save_logits: bool = False,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(log p(target) float32 [B, T], entropy of the next-token distribution float32 [B, T]).

    hidden_BTD: final-normed hidden states; lm_head_DV: the output projection; targets_BT: ids in
    [0, V). Differentiable in hidden and lm_head (custom VJP, same gradients as the unchunked
    `token_logprobs_reference`); chunk sizes need not divide B*T or V. temperature: the logits are
    divided by it first (the distribution the sampler draws from at that temperature). save_logits:
    the backward reads the forward's logits instead of computing them again (the same gradients;
    [B * T, V] float32 kept in between).
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
    pad_vocab = -vocab_size % chunk_vocab
    h_ND = jnp.pad(hidden_BTD.reshape(num_tokens, d_model), ((0, pad_tokens), (0, 0)))
    targets_N = jnp.pad(targets_BT.reshape(num_tokens).astype(jnp.int32), (0, pad_tokens))
    lm_head_padded_DV = jnp.pad(lm_head_DV, ((0, 0), (0, pad_vocab))) if pad_vocab else lm_head_DV

    num_chunks = (num_tokens + pad_tokens) // chunk_tokens
    logp_KC, entropy_KC = _chunked(h_ND.reshape(num_chunks, chunk_tokens, d_model), lm_head_padded_DV,
                                   targets_N.reshape(num_chunks, chunk_tokens), chunk_vocab, vocab_size,
                                   float(temperature), bool(save_logits))
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
