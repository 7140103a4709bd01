"""The chunked log-probs' sizes and gradients pinned to hand-worked numbers (kernels/logprobs.py):
how the chunk sizes are clipped and the lengths padded, and the custom backward at one token.
Tiny eager arrays."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels import logprobs


def test_chunk_sizes_are_refused_below_one_each():
    h, w, t = jnp.zeros((1, 2, 2)), jnp.zeros((2, 3)), jnp.zeros((1, 2), int)
    with pytest.raises(ValueError, match="chunk sizes must be >= 1, got chunk_tokens=2, chunk_vocab=0"):
        logprobs.chunked_token_logprobs(h, w, t, chunk_tokens=2, chunk_vocab=0)
    with pytest.raises(ValueError, match="got chunk_tokens=0, chunk_vocab=3"):
        logprobs.chunked_token_logprobs(h, w, t, chunk_tokens=0, chunk_vocab=3)
    logprobs.chunked_token_logprobs(h, w, t, chunk_tokens=1, chunk_vocab=1)


def test_chunks_are_clipped_to_the_lengths_and_the_rest_padded(monkeypatch):
    seen = {}

    def chunked(h_KCD, lm_head_DV, targets_KC, chunk_vocab, vocab_size, temperature, save_logits):
        seen.update(h=h_KCD.shape, head=lm_head_DV.shape, targets=targets_KC.shape, chunk_vocab=chunk_vocab,
                    vocab=vocab_size)
        zeros = jnp.zeros(targets_KC.shape, jnp.float32)
        return zeros, zeros

    monkeypatch.setattr(logprobs, "_chunked", chunked)
    h, w, t = jnp.zeros((2, 3, 4)), jnp.zeros((4, 5)), jnp.zeros((2, 3), int)
    # 6 tokens in chunks of 4: 2 chunks (2 padding tokens); vocab 5 in chunks of 2: padded to 6
    out = logprobs.chunked_token_logprobs(h, w, t, chunk_tokens=4, chunk_vocab=2)
    assert seen == dict(h=(2, 4, 4), head=(4, 6), targets=(2, 4), chunk_vocab=2, vocab=5)
    assert out[0].shape == out[1].shape == (2, 3)
    # chunks larger than the lengths: one chunk of all 6 tokens, one of the whole vocabulary, no padding
    logprobs.chunked_token_logprobs(h, w, t, chunk_tokens=100, chunk_vocab=100)
    assert seen == dict(h=(1, 6, 4), head=(4, 5), targets=(1, 6), chunk_vocab=5, vocab=5)


def test_gradients_of_one_token_by_hand_with_a_padded_vocab_chunk():
    # D 1, V 3, lm_head (0, ln 3, ln 4), hidden 1: p = (1, 3, 4) / 8; target 1: logp = ln(3 / 8).
    # dlogp/dz = onehot - p = (-1/8, 5/8, -4/8); z = h w: dlogp/dh = sum g_z w = (5 ln 3 - 4 ln 4) / 8,
    # dlogp/dw = h g_z. Vocab chunks of 2: the second holds column 2 and one padding column.
    head = jnp.array([[0.0, math.log(3.0), math.log(4.0)]])
    hidden = jnp.array([[[1.0]]])

    def f(h, w):
        return logprobs.chunked_token_logprobs(h, w, jnp.array([[1]]), chunk_tokens=1, chunk_vocab=2)[0].sum()

    v, (dh, dw) = jax.value_and_grad(f, argnums=(0, 1))(hidden, head)
    assert float(v) == pytest.approx(math.log(3 / 8), rel=1e-6)
    assert float(dh[0, 0, 0]) == pytest.approx((5 * math.log(3.0) - 4 * math.log(4.0)) / 8, rel=1e-5)
    np.testing.assert_allclose(np.asarray(dw), [[-1 / 8, 5 / 8, -4 / 8]], rtol=1e-5)
    # temperature 2 divides the logits and the gradients: p = (1, sqrt 3, 2) / (3 + sqrt 3)
    def g(h, w):
        return logprobs.chunked_token_logprobs(h, w, jnp.array([[1]]), chunk_tokens=1, chunk_vocab=2,
                                               temperature=2.0)[0].sum()

    p = np.array([1.0, math.sqrt(3.0), 2.0]) / (3.0 + math.sqrt(3.0))
    np.testing.assert_allclose(np.asarray(jax.grad(g, argnums=1)(hidden, head)), [(np.eye(3)[1] - p) / 2], rtol=1e-5)


def test_gradients_come_back_in_each_inputs_dtype():
    h = jnp.ones((1, 2, 4), jnp.float32)
    w = jnp.ones((4, 3), jnp.bfloat16)

    def f(h, w):
        return logprobs.chunked_token_logprobs(h, w, jnp.array([[0, 2]]), chunk_tokens=1, chunk_vocab=2)[0].sum()

    dh, dw = jax.grad(f, argnums=(0, 1))(h, w)
    assert (dh.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16)
