"""Prefill once per prompt, chunked prefill and early stop, on 8 simulated CPU devices.

One prompt set, three compiled samplers shared by every test of the module:
  shared    3 prompts x G = 8 rows: each prompt prefilled once (on 8 rows: 3 padded to the 8 batch
            shards), its state copied to its 8 rows;
  unshared  the 24 rows, each prompt repeated 8 times and prefilled on its own row (group_size 1);
  chunked   `shared` with rl.prefill_chunk = gdn.chunk_size = 4: the 13 prompt slots run as 3 whole
            chunks and a 1-token remainder through the cache.
Same seed, temperature 1: the completions are equal and the sampler log-probs agree to float
rounding. Not bit for bit: XLA CPU's row reductions (RMSNorm's sum of squares, the softmax sums)
vectorise differently with the number of rows reduced, so the same row rounds differently in a
prefill of 8 rows than of 24, or of 4 tokens than of 13 (measured: a sum of squares over 64 floats
moves by 1.5e-5 between 4 x 7 and 16 x 7 rows). The clean gap is ~1e-6; each broken variant's is
printed beside it and is >= 10x the tolerance.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from broken_variants import mutated
from helpers import tiny_config, tiny_params
from hybridmoe.model import decode
from hybridmoe.rl import sampler
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
from hybridmoe.run.setup import build
from hybridmoe.analysis.program import ops_by_shape

PROMPT_SLOTS, NEW_TOKENS, G = 13, 6, 8
# Prompt lengths: the full 13 slots, and padding that ends inside chunk 0, 2 and exactly at chunk 1's
# edge (chunks of 4 slots: 0-3, 4-7, 8-11, remainder 12).
PROMPT_LENGTHS = (13, 2, 5)
LOGP_TOL = 1e-5  # the clean gap is ~1e-6 (rounding, see the module docstring)


def _config(*extra):
    # One block of each mixer (both caches are shared and chunked); routing replay on: the prompt
    # tokens' experts are shared too (and compared as integers).
    return tiny_config("gdn.chunk_size=4", "moe.routing_replay=true", "model.layer_pattern=[gdn,attention]",
                       "model.num_layers=2", *extra)


def _prompt_rows(vocab: int, repeat: int = 1):
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, vocab, size=n).tolist() for n in PROMPT_LENGTHS]
    return left_pad_prompts([x for x in ids for _ in range(repeat)], PROMPT_SLOTS, pad_id=0)


OPTS = SamplingOptions(max_new_tokens=NEW_TOKENS, temperature=1.0, eos_id=-1)


def _sample(cfg, group_size: int, repeat: int, opts=OPTS, seed: int = 5):
    """(the rollout as numpy, the sampler's jaxpr): one trace, one compile."""
    setup = build(cfg)
    args = (tiny_params(cfg), *_prompt_rows(cfg.model.vocab_size, repeat), jax.random.key(seed))
    with setup.context():
        traced = make_generate(cfg, opts, group_size=group_size).trace(*args)
        return jax.device_get(traced.lower().compile()(*args)), traced.jaxpr


@pytest.fixture(scope="module")
def unshared():
    return _sample(_config(), group_size=1, repeat=G)


@pytest.fixture(scope="module")
def shared():
    return _sample(_config(), group_size=G, repeat=1)


CHUNK = 4


@pytest.fixture(scope="module")
def chunked():
    return _sample(_config(f"rl.prefill_chunk={CHUNK}"), group_size=G, repeat=1)


def _gap(got, want) -> float:
    """How far two rollouts lie apart: inf if any integer output differs, else the largest
    sampler log-prob difference."""
    for k in want:
        if k != "logprobs" and not np.array_equal(np.asarray(got[k]), np.asarray(want[k])):
            return float("inf")
    return float(np.abs(np.asarray(got["logprobs"]) - np.asarray(want["logprobs"])).max())


def test_prefill_once_per_prompt_equals_prefill_per_row(shared, unshared):
    (got, _), (want, _) = shared, unshared
    assert np.asarray(got["completion"]).shape == (len(PROMPT_LENGTHS) * G, NEW_TOKENS)
    # The G rows of a prompt are different samples (the copy does not make them one row).
    assert len({tuple(r) for r in np.asarray(got["completion"])[:G]}) > 1
    gap = _gap(got, want)
    print(f"shared vs unshared: completions, rows, routing equal; log-prob gap {gap:.2e}")
    assert gap < LOGP_TOL


def _rows_of_prompt_matmuls(jaxpr) -> set[int]:
    return {shape[0] for (prim, shape, _), _ in ops_by_shape(jaxpr).items()
            if prim == "dot_general" and len(shape) > 2 and shape[1] == PROMPT_SLOTS}


def test_prefill_runs_on_prompt_rows_not_group_rows(shared, unshared):
    """Program fact (jaxpr): every matmul over the prompt's 13 slots has the prefill's 8 rows (3
    prompts padded to the 8 batch shards), never the 24 rows; the unshared sampler's have 24."""
    assert _rows_of_prompt_matmuls(shared[1]) == {8}
    assert _rows_of_prompt_matmuls(unshared[1]) == {len(PROMPT_LENGTHS) * G}


def _wrong_prompts_state():
    # Each row continues the state of the prompt of the mirrored row.
    return mutated(sampler, "share_prompts", "cache_rows(cache, rows_B)", "cache_rows(cache, rows_B[::-1])")


def _one_token_too_many():
    # The state copied after the last prompt token ran through the decoder once more.
    return mutated(sampler, "_generate", "share_prompts(cache, ",
                   "share_prompts(cached_hidden(params, cfg, cache, *(prompt(a)[:, -1:] for a in (tokens_QP, "
                   "segment_ids_QP, positions_QP)))[1], ")


SHARING_VARIANTS = {"wrong_prompts_state": ("share_prompts", _wrong_prompts_state),
                    "one_token_too_many": ("_generate", _one_token_too_many)}


@pytest.mark.parametrize("variant", list(SHARING_VARIANTS))
def test_broken_sharing_is_caught(variant, unshared, monkeypatch):
    name, make = SHARING_VARIANTS[variant]
    monkeypatch.setattr(sampler, name, make())
    gap = _gap(_sample(_config(), group_size=G, repeat=1)[0], unshared[0])
    print(f"{variant}: gap {gap:.2e} (tolerance {LOGP_TOL:.0e})")
    assert gap >= 10 * LOGP_TOL


# ---------------------------------------------------------------------------------------------
# Chunked prefill: the same rollout as the one-piece prefill.

def test_chunked_prefill_equals_one_piece(chunked, shared):
    gap = _gap(chunked[0], shared[0])
    print(f"chunked vs one-piece prefill: log-prob gap {gap:.2e}")
    assert gap < LOGP_TOL


def _float_ops_over_prompt(jaxpr, d_model: int) -> int:
    """Float ops whose output has a row per prompt token: 13 beside d_model (activations) or 13
    twice (scores of 13 queries over the 13 cache slots). The prompt cache's own [13, G, A] slots
    and a chunk's [4, 13] scores over them are not."""
    return sum(n for (prim, shape, dtype), n in ops_by_shape(jaxpr).items()
               if "float" in dtype and (shape.count(PROMPT_SLOTS) > 1 or PROMPT_SLOTS in shape and d_model in shape))


def test_chunked_prefill_never_holds_the_whole_prompt(chunked, shared):
    """Program fact (jaxpr): with chunks of 4, no float array has a row per prompt token (no
    [13, 13] attention scores, no [13, D] activations); one-piece, many do."""
    d_model = _config().model.d_model
    assert d_model != PROMPT_SLOTS
    assert _float_ops_over_prompt(chunked[1], d_model) == 0
    assert _float_ops_over_prompt(shared[1], d_model) > 10


def test_group_rows_copy_the_prompts_cache_before_it_grows(shared):
    """Program fact (jaxpr): the copies of each prompt's attention cache to its group's rows (the
    gathers) read the prompt's 13 slots, not the 13 + N of the rollout (at the 397B cell the
    full-length copy needed 120 GiB a device); the cache grows to 13 + N after them."""
    gathers = {shape for (prim, shape, dtype), n in ops_by_shape(shared[1]).items()
               if prim == "gather" and "float" in dtype and len(shape) == 5}
    slots = {shape[2] for shape in gathers}  # [L, B, slots, heads, head dim] (GDN: conv tail, state rows)
    assert PROMPT_SLOTS in slots and PROMPT_SLOTS + NEW_TOKENS not in slots, gathers
    assert any(prim == "pad" and PROMPT_SLOTS + NEW_TOKENS in shape
               for (prim, shape, dtype), n in ops_by_shape(shared[1]).items()), "the cache never grows"


CHUNK_VARIANTS = {
    # Each chunk starts from the cache the prefill began with (no KV append or GDN state carried).
    "state_not_carried": ("return out[1], (out[0][:, -1]", "return cache, (out[0][:, -1]"),
    # The remainder after the whole chunks is never prefilled.
    "remainder_dropped": ("if P > whole * C:", "if False:"),
}


@pytest.mark.parametrize("variant", list(CHUNK_VARIANTS))
def test_broken_chunked_prefill_is_caught(variant, shared, monkeypatch):
    monkeypatch.setattr(sampler, "prefill", mutated(decode, "prefill", *CHUNK_VARIANTS[variant]))
    gap = _gap(_sample(_config(f"rl.prefill_chunk={CHUNK}"), group_size=G, repeat=1)[0], shared[0])
    print(f"{variant}: gap {gap:.2e} (tolerance {LOGP_TOL:.0e})")
    assert gap >= 10 * LOGP_TOL


def test_a_prompt_of_whole_chunks_only_is_read_at_its_last_token():
    """8 prompt slots in chunks of 4: two whole chunks and no remainder. The hidden state the first
    token is sampled from is the 8th slot's, as the one-piece prefill gives it, and the cache it
    leaves is the one-piece prefill's."""
    cfg = tiny_config("model.layer_pattern=[attention]", "model.num_layers=1")
    rng = np.random.default_rng(1)
    tokens, seg, pos = left_pad_prompts([rng.integers(3, cfg.model.vocab_size, size=n).tolist() for n in (8, 5)], 8,
                                        pad_id=0)
    params = tiny_params(cfg)

    def run(chunk_tokens):
        cache = decode.init_cache(cfg, 2, 8)
        return decode.prefill(params, cfg, cache, tokens, seg, pos, chunk_tokens=chunk_tokens)[:2]

    (chunked_BD, chunked_cache), (whole_BD, whole_cache) = jax.device_get(jax.jit(lambda: (run(4), run(8)))())
    np.testing.assert_allclose(chunked_BD, whole_BD, rtol=0, atol=LOGP_TOL)
    assert int(chunked_cache["slot"]) == int(whole_cache["slot"]) == 8
    for a, b in zip(jax.tree.leaves(chunked_cache), jax.tree.leaves(whole_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0, atol=LOGP_TOL)


# ---------------------------------------------------------------------------------------------
# Early stop: the decode loop ends when every row has ended; running on to N changes nothing.


@pytest.mark.default_cpu_codegen
def test_early_stop_changes_nothing_but_time(monkeypatch):
    cfg = _config()
    # Half the vocabulary ends a row: every row ends within a few tokens, long before N = 24.
    opts = SamplingOptions(max_new_tokens=24, temperature=1.0, eos_id=3, stop_ids=tuple(range(4, 256, 2)))
    early = _sample(cfg, G, 1, opts)[0]
    assert int(np.asarray(early["lengths"]).max()) < 24 and not np.asarray(early["truncated"]).any()
    monkeypatch.setattr(sampler, "_generate", mutated(sampler, "_generate", "return (t < N) & ~jnp.all(done_B)",
                                                      "return t < N"))
    to_the_end = _sample(cfg, G, 1, opts)[0]
    for k in early:
        np.testing.assert_array_equal(np.asarray(early[k]), np.asarray(to_the_end[k]), err_msg=k)


def test_prefill_chunk_off_the_gdn_chunks_is_a_config_error():
    from hybridmoe.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _config("rl.prefill_chunk=6")
    assert "rl.prefill_chunk" in str(e.value) and "rl.prefill_chunk=8" in str(e.value), str(e.value)
    # Without a GDN layer there are no GDN chunks to keep in place.
    tiny_config("rl.prefill_chunk=6", "model.layer_pattern=[attention]", "model.num_layers=2")
