"""kernels.logprobs.save_logits: the LM head's backward reads the forward's logits blocks instead of
computing them again. The proofs: the gradients equal the lever off's bit for bit (chunk sizes that
pad both the tokens and the vocabulary, a temperature, both cotangents), the backward holds two
matmuls a block instead of three, and three broken ways of reading the saved blocks are caught
against the unchunked reference."""

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.analysis.program import iter_eqns
from hybridmoe.kernels import logprobs
from hybridmoe.kernels.logprobs import chunked_token_logprobs, token_logprobs_reference

TEMPERATURE = 0.7
CHUNKS = [(4, 10), (5, 37)]  # 21 tokens and 37 vocabulary columns: neither pair divides both


def _case(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = 2.0 * jax.random.normal(k[0], (3, 7, 8))
    lm_head = jax.random.normal(k[1], (8, 37))
    targets = jax.random.randint(k[2], (3, 7), 0, 37)
    weights = jax.random.normal(k[3], (3, 7))
    return hidden, lm_head, targets, weights


def _objective(fn, targets, weights):
    def f(h, w):
        logp, entropy = fn(h, w, targets)
        return (weights * logp).sum() + (weights ** 2 * entropy).sum()
    return f


def _chunked(chunk_tokens, chunk_vocab, save_logits):
    return lambda h, w, t: chunked_token_logprobs(h, w, t, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
                                                  temperature=TEMPERATURE, save_logits=save_logits)


def _grads(fn):
    hidden, lm_head, targets, weights = _case()
    return jax.jit(jax.grad(_objective(fn, targets, weights), argnums=(0, 1)))(hidden, lm_head)


def _error_to_reference(chunk_tokens, chunk_vocab) -> float:
    """The largest gradient error with save_logits against the unchunked reference, relative to its scale."""
    got = _grads(_chunked(chunk_tokens, chunk_vocab, True))
    want = _grads(lambda h, w, t: token_logprobs_reference(h, w, t, temperature=TEMPERATURE))
    return max(float(jnp.abs(g - r).max() / jnp.abs(r).max()) for g, r in zip(got, want))


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", CHUNKS)
def test_saved_logits_give_the_lever_offs_gradients(chunk_tokens, chunk_vocab):
    # Not bit for bit: the two programs fuse the logits' division by the temperature and the exp
    # after it differently (float32 rounding, about 1.2e-6 of the scale); the broken variants below
    # are off by 0.99 of it and more.
    on, off = _grads(_chunked(chunk_tokens, chunk_vocab, True)), _grads(_chunked(chunk_tokens, chunk_vocab, False))
    for a, b in zip(on, off):
        assert float(jnp.abs(b).max()) > 0.1  # not two near-zero tensors
        assert float(jnp.abs(a - b).max() / jnp.abs(b).max()) < TOL / 10


def test_the_backward_computes_no_logits_of_its_own():
    hidden, lm_head, targets, weights = _case()

    def dots(save_logits):
        loss = _objective(_chunked(4, 10, save_logits), targets, weights)
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, lm_head)
        return sum(e.primitive.name == "dot_general" for e in iter_eqns(jaxpr))

    # The forward's logits block, then the backward's: the logits again (off), d hidden and d head.
    assert (dots(False), dots(True)) == (4, 3)


def _shifted_block(saved, h, w, v_index, chunk_vocab, vocab_size, temperature):
    z, real, col, w_block = REAL_BACKWARD_LOGITS(saved, h, w, v_index, chunk_vocab, vocab_size, temperature)
    return (z if saved is None else saved[v_index - 1]), real, col, w_block


def _divided_again(saved, h, w, v_index, chunk_vocab, vocab_size, temperature):
    z, real, col, w_block = REAL_BACKWARD_LOGITS(saved, h, w, v_index, chunk_vocab, vocab_size, temperature)
    return (z if saved is None else z / temperature), real, col, w_block


def _rows_shifted(saved, h, w, v_index, chunk_vocab, vocab_size, temperature):
    # The saved block's rows one token off.
    z, real, col, w_block = REAL_BACKWARD_LOGITS(saved, h, w, v_index, chunk_vocab, vocab_size, temperature)
    if saved is None:
        return z, real, col, w_block
    return jnp.roll(z, 1, axis=0), real, col, w_block


REAL_BACKWARD_LOGITS = logprobs.backward_logits
BROKEN = {"previous_vocab_chunk": _shifted_block, "temperature_twice": _divided_again,
          "rows_shifted": _rows_shifted}
TOL = 1e-4  # clean: about 1.1e-6 of the gradients' scale; the broken variants: 0.99 and more


def test_the_saved_logits_agree_with_the_reference():
    clean = max(_error_to_reference(*c) for c in CHUNKS)
    assert clean < TOL / 10, clean


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_reads_of_the_saved_logits_are_caught(variant, monkeypatch):
    monkeypatch.setattr(logprobs, "backward_logits", BROKEN[variant])
    broken = _error_to_reference(*CHUNKS[0])  # 4 vocab chunks: a block from the wrong one shows
    assert broken > TOL, f"{variant}: broken error {broken:.2e} within the tolerance {TOL:.0e}"
