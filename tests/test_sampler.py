"""The sampler against the trainer: same log-probs on the same tokens, and the cached greedy decode
equals greedy decoding by re-running the full forward (8 simulated CPU devices, tiny model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TWO_LAYERS, tiny_config, tiny_params
from hybridmoe.model.forward import decoder_hidden, logits
from hybridmoe.kernels.logprobs import chunked_token_logprobs
from hybridmoe.rl.sampler import SamplingOptions, choose_tokens, left_pad_prompts, make_generate, sampling_logits
from hybridmoe.run.setup import build

PROMPT_LEN, NEW_TOKENS = 7, 6
# Different lengths in one batch (1 token up to the full prompt width); 8 rows split over 8 devices.
PROMPT_LENGTHS = (3, 7, 1, 5, 2, 7, 4, 6)


def _prompts(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, size=n).tolist() for n in PROMPT_LENGTHS]
    return left_pad_prompts(ids, PROMPT_LEN, pad_id=0)


def _setup():
    # gdn.chunk_size=4: the prefill and the trainer forward both cross chunk boundaries. One layer of
    # each mixer (TWO_LAYERS): the decode carries a GDN state and a KV cache, at about half of tiny's
    # four layers' compiles.
    cfg = tiny_config(*TWO_LAYERS, "gdn.chunk_size=4")
    return cfg, build(cfg), tiny_params(cfg)


def test_sampler_logprobs_equal_trainer_logprobs_at_the_sampling_temperature():
    cfg, setup, params = _setup()
    # eos_id=-1: no row stops early, so every completion slot is compared. T = 0.7 (no top-p): the
    # distribution drawn from is softmax(logits / 0.7), which the trainer computes the same way.
    opts = SamplingOptions(max_new_tokens=NEW_TOKENS, temperature=0.7, eos_id=-1)
    tokens, seg, pos = _prompts(cfg.model.vocab_size)
    with setup.context():
        out = make_generate(cfg, opts)(params, tokens, seg, pos, jax.random.key(1))
        h = jax.jit(lambda p, t, s, q: decoder_hidden(p, cfg, t, s, q))(
            params, out["tokens"], out["segment_ids"], out["positions"])
        trainer_logp, _ = chunked_token_logprobs(h[:, :-1], params["lm_head"], out["tokens"][:, 1:],
                                                 chunk_tokens=16, chunk_vocab=64, temperature=0.7)
        trainer_logp_t1, _ = chunked_token_logprobs(h[:, :-1], params["lm_head"], out["tokens"][:, 1:],
                                                    chunk_tokens=16, chunk_vocab=64)
    trainer_logp = np.asarray(trainer_logp)[:, PROMPT_LEN - 1:]
    sampler_logp = np.asarray(out["logprobs"])
    assert np.all(np.asarray(out["lengths"]) == NEW_TOKENS) and np.all(np.asarray(out["truncated"]))
    assert np.all(sampler_logp < 0)
    np.testing.assert_allclose(sampler_logp, trainer_logp, rtol=0, atol=1e-5)
    # ... and not the temperature-1 log-probs (what the sampler used to record).
    assert np.abs(sampler_logp - np.asarray(trainer_logp_t1)[:, PROMPT_LEN - 1:]).mean() > 0.05
    # The rows the trainer sees: prompt then completion, positions counting on from the prompt.
    lengths = np.asarray(PROMPT_LENGTHS)
    np.testing.assert_array_equal(np.asarray(out["positions"])[:, -1], lengths + NEW_TOKENS - 1)
    np.testing.assert_array_equal(np.asarray(out["segment_ids"]).sum(1), lengths + NEW_TOKENS)


def test_cached_greedy_equals_full_forward_greedy_and_stops_at_eos():
    cfg, setup, params = _setup()
    tokens, seg, pos = _prompts(cfg.model.vocab_size, seed=1)
    B = tokens.shape[0]
    full_logits = jax.jit(lambda p, t, s, q: logits(p, cfg, t, s, q))
    with setup.context():
        # Reference: re-run the whole forward each step on fixed-width rows (future slots hold
        # padding in the row's segment; causality keeps them out of the positions read).
        rows = np.concatenate([tokens, np.zeros((B, NEW_TOKENS), np.int32)], axis=1)
        rows_seg = np.concatenate([seg, np.ones((B, NEW_TOKENS), np.int32)], axis=1)
        rows_pos = np.concatenate([pos, pos[:, -1:] + 1 + np.arange(NEW_TOKENS)], axis=1)
        for t in range(NEW_TOKENS):
            lg = np.asarray(full_logits(params, rows, rows_seg, rows_pos))
            rows[:, PROMPT_LEN + t] = lg[:, PROMPT_LEN + t - 1].argmax(-1)
        want = rows[:, PROMPT_LEN:]
        greedy = make_generate(cfg, SamplingOptions(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=-1))
        got = greedy(params, tokens, seg, pos, jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(got["completion"]), want)

        # Row 0's third greedy token becomes a stop id (generation_config's list) and row 1's
        # second the EOS: each row ends at its first of either, the rest pads.
        stop, eos = int(want[0, 2]), int(want[1, 1])
        assert stop != eos, "the fixture needs two different ids to tell the stop ids from the EOS"
        stopping = make_generate(cfg, SamplingOptions(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=eos,
                                                      stop_ids=(stop,)))
        out = stopping(params, tokens, seg, pos, jax.random.key(0))
    completion = np.asarray(out["completion"])
    first_end = [next((i for i, x in enumerate(r) if x in (stop, eos)), None) for r in want]
    for b in range(B):
        if first_end[b] is None:
            np.testing.assert_array_equal(completion[b], want[b])
            assert out["truncated"][b] and out["lengths"][b] == NEW_TOKENS
        else:
            n = first_end[b] + 1
            np.testing.assert_array_equal(completion[b, :n], want[b, :n])
            assert np.all(completion[b, n:] == 0) and np.all(np.asarray(out["logprobs"])[b, n:] == 0)
            assert not out["truncated"][b] and out["lengths"][b] == n
    assert int(out["lengths"][0]) <= 3 and int(out["lengths"][1]) <= 2


def test_top_p_keeps_the_nucleus_only():
    logits_BV = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 4000))
    draws, logp = map(np.asarray, choose_tokens(logits_BV, jax.random.key(0), 1.0, 0.7))
    assert set(np.unique(draws)) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut
    assert abs((draws == 0).mean() - 0.5 / 0.8) < 0.03
    # The recorded log-prob is the nucleus's renormalised one, not the model's 0.5 / 0.3.
    np.testing.assert_allclose(logp, np.log(np.where(draws == 0, 0.5 / 0.8, 0.3 / 0.8)), rtol=1e-6)
    greedy, greedy_logp = choose_tokens(logits_BV[:3], jax.random.key(0), 0.0, 1.0)
    assert np.all(np.asarray(greedy) == 0) and np.all(np.asarray(greedy_logp) == 0)
    # top-k 1 at any temperature is greedy with log-prob 0; top-k 3 at T = 0.5 renormalises p^2.
    top1, top1_logp = choose_tokens(logits_BV[:50], jax.random.key(1), 0.7, 1.0, top_k=1)
    assert np.all(np.asarray(top1) == 0) and np.all(np.asarray(top1_logp) == 0)
    draws, logp = map(np.asarray, choose_tokens(logits_BV, jax.random.key(2), 0.5, 1.0, top_k=3))
    p2 = np.array([0.5, 0.3, 0.15]) ** 2
    assert set(np.unique(draws)) == {0, 1, 2}
    np.testing.assert_allclose(logp, np.log(p2 / p2.sum())[draws], rtol=1e-5)


def test_the_nucleus_whose_mass_lands_exactly_on_top_p_ends_there():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32): the two most likely reach top_p = 0.75
    exactly, so the nucleus is those two; the third would start past the edge (its mass before is
    0.75, not below it). At top_p 0.8 the third is needed, and its tie (the fourth) stays in."""
    logits_BV = jnp.log(jnp.asarray([[0.125, 0.5, 0.125, 0.25]]))
    kept = lambda top_p: np.isfinite(np.asarray(sampling_logits(logits_BV, 1.0, top_p)))[0].tolist()  # noqa: E731
    assert kept(0.75) == [False, True, False, True]
    assert kept(0.8) == [True, True, True, True]
    assert kept(0.5) == [False, True, False, False]


def test_left_padding_by_hand_and_a_prompt_that_cannot_be_one():
    """Prompts right-aligned in 4 slots: [5, 6] gets 2 padding slots (segment 0, position 0), a
    4-token prompt fills the row; an empty prompt and one of 5 tokens are refused, naming the prompt."""
    tokens, seg, pos = left_pad_prompts([[5, 6], [7, 8, 9, 10]], 4, pad_id=0)
    np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [7, 8, 9, 10]])
    np.testing.assert_array_equal(seg, [[0, 0, 1, 1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(pos, [[0, 0, 0, 1], [0, 1, 2, 3]])
    for prompts, n in (([[5], []], 0), ([[5], [1, 2, 3, 4, 5]], 5)):
        with pytest.raises(ValueError, match=f"prompt 1 has {n} tokens; a prompt needs 1 to 4"):
            left_pad_prompts(prompts, 4, pad_id=0)
