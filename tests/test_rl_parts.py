"""The model-independent parts of the GRPO trainer: tokenizer, tasks, rewards, advantages, the clipped
objective and chunked log-probs, each against numbers written out by hand or an unchunked oracle."""

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.rl.advantages import advantage_stats, group_advantages
from hybridmoe.kernels.logprobs import chunked_token_logprobs, token_logprobs_reference
from hybridmoe.rl.objective import clipped_policy_loss
from hybridmoe.rl.rewards import score_completions
from hybridmoe.data.arithmetic import ArithmeticTask, Example, FormatTask, get_task, solved_token_ids
from hybridmoe.data.tokenizer import CharTokenizer, load_tokenizer

LN2 = math.log(2.0)


# --- tokenizer -------------------------------------------------------------------------------------

def test_char_tokenizer_round_trip_and_specials():
    tok = load_tokenizer(None)
    assert isinstance(tok, CharTokenizer)
    assert tok.vocab_size <= 256  # the tiny model's head
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "answer only: 12+34=46 -7*8 X_y?\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert len(set(tok.encode(tok.alphabet))) == len(tok.alphabet)  # one id per character
    # decode stops at EOS and drops PAD/BOS/ids past the alphabet (sampled by a 256-row head)
    assert tok.decode([tok.bos_id] + tok.encode("12") + [255, tok.pad_id, tok.eos_id] + tok.encode("9")) == "12"
    with pytest.raises(ValueError, match="not in the character tokenizer"):
        tok.encode("12€")


def test_load_tokenizer_without_tokenizers_package_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(ImportError, match=r"pip install tokenizers==0\.23\.3"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


# --- tasks -----------------------------------------------------------------------------------------

def test_task_streams_are_deterministic_by_seed():
    task = get_task("arithmetic", digits=3, operators="+-*")
    a = task.sample(np.random.default_rng(7), 32)
    b = task.sample(np.random.default_rng(7), 32)
    c = task.sample(np.random.default_rng(8), 32)
    assert a == b and a != c
    assert {e.prompt[-1] for e in a} == {"="}
    assert {op for e in a for op in "+-*" if op in e.prompt} == {"+", "-", "*"}
    for e in a:  # every reference is the true value and earns full reward
        assert int(e.reference) == eval(e.prompt[:-1])
        assert task.reward(e.prompt, e.reference) == 1.0
        assert len(e.reference) <= task.max_completion_chars
    assert get_task("format").sample(np.random.default_rng(7), 4)[0].prompt.startswith("answer only: ")



def test_a_prompt_set_step_draws_distinct_prompts_until_the_set_runs_out():
    """data.prompts: a step's prompts are drawn without replacement (no prompt twice in a step while
    the set has enough); only a step asking more than the set holds repeats some."""
    from hybridmoe.data.arithmetic import Example
    from hybridmoe.data.prompts import PromptSetTask

    task = PromptSetTask(tuple(Example(f"q{i}", str(i)) for i in range(8)))
    for seed in range(5):
        rng = np.random.default_rng(seed)
        for n in (3, 8):
            prompts = [e.prompt for e in task.sample(rng, n)]
            assert len(prompts) == n and len(set(prompts)) == n, (seed, prompts)
    assert len(task.sample(np.random.default_rng(0), 12)) == 12

def test_a_prompt_set_is_measured_with_its_bos(tmp_path):
    """data.prompts against rl.max_prompt_len counts the BOS the run puts before each prompt: with
    the character tokenizer "12+3=" is 1 + 5 = 6 tokens, refused at 5 (naming 6) and kept at 6;
    "1+2=" (5 tokens) alongside it at 5 keeps the set (only a set of nothing but too-long prompts stops)."""
    from types import SimpleNamespace

    from hybridmoe.data.prompts import PromptSetTask
    from hybridmoe.data.records import DataError
    from hybridmoe.data.tokenizer import CharTokenizer

    def task(prompts, max_prompt_len):
        path = tmp_path / f"set{len(prompts)}_{max_prompt_len}.jsonl"
        path.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
        cfg = SimpleNamespace(data=SimpleNamespace(prompts=str(path), on_bad_line="stop"),
                              rl=SimpleNamespace(max_prompt_len=max_prompt_len))
        return PromptSetTask.from_config(cfg, CharTokenizer())

    with pytest.raises(DataError, match=r"shortest 6, longest 6\); raise rl.max_prompt_len to at least 6"):
        task(["12+3="], 5)
    assert len(task(["12+3="], 6).examples) == 1
    assert len(task(["12+3=", "1+2="], 5).examples) == 2


def test_arithmetic_reward_right_wrong_garbage():
    task = ArithmeticTask(digits=2, operators="+-")
    assert task.reward("12+34=", "46") == 1.0
    assert task.reward("12+34=", " 46 ") == 1.0  # surrounding whitespace is not the answer
    assert task.reward("12+34=", "47") == 0.0
    assert task.reward("12+34=", "4 6") == 0.0
    assert task.reward("12+34=", "") == 0.0
    assert task.reward("12+34=", "abc=+") == 0.0
    assert task.reward("3-15=", "-12") == 1.0
    assert task.reward("3-15=", "12") == 0.0
    with pytest.raises(ValueError, match="does not end with"):
        task.reward("hello", "1")  # a prompt the task did not write: a counted skip upstream


def test_format_reward_needs_the_integer_alone():
    task = FormatTask()
    assert task.reward("answer only: 12+34=", "46") == 1.0
    assert task.reward("answer only: 12+34=", "45") == 1.0  # format, not correctness
    assert task.reward("answer only: 12+34=", "46 ") == 0.0
    assert task.reward("answer only: 12+34=", "it is 46") == 0.0
    assert task.reward("answer only: 12+34=", "") == 0.0
    bonus = FormatTask(correct_bonus=0.5)
    assert bonus.reward("answer only: 12+34=", "46") == 1.5
    assert bonus.reward("answer only: 12+34=", "45") == 1.0


def test_task_registry_and_solved_examples():
    with pytest.raises(KeyError, match="known tasks: arithmetic, format"):
        get_task("chess")
    with pytest.raises(ValueError, match="operators"):
        get_task("arithmetic", operators="/")
    tok = CharTokenizer()
    ids, completion_mask = solved_token_ids(Example("12+34=", "46"), tok)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:]) == "12+34=46"
    assert completion_mask == [False] * 7 + [True] * 3  # BOS + 6 prompt chars; '4', '6', EOS


# --- rewards ---------------------------------------------------------------------------------------

def test_reward_failures_are_masked_and_counted_not_raised():
    def raises_on_x(prompt, completion):
        if "x" in completion:
            raise ZeroDivisionError("boom")
        return 1.0

    def nan_on_n(prompt, completion):
        return float("nan") if completion == "n" else 2.0

    completions = ["ok", "x", "n", "xn", "fine"]
    rewards, skipped, counts = score_completions(
        [(raises_on_x, 0.5), (nan_on_n, 1.0)], ["p"] * 5, completions)
    assert rewards.dtype == np.float32
    np.testing.assert_array_equal(skipped, [False, True, True, True, False])
    np.testing.assert_allclose(rewards, [2.5, 0.0, 0.0, 0.0, 2.5])  # 0.5 * 1 + 1.0 * 2
    assert counts["raised:ZeroDivisionError"] == 2
    assert counts["nonfinite"] == 1  # "xn" raised first, nan_on_n still returned 2.0 for it
    assert counts["skipped"] == 3 and counts["scored"] == 2

    _, skipped, counts = score_completions([(lambda p, c: "not a number", 1.0)], ["p"], ["c"])
    assert skipped.tolist() == [True] and counts["raised:ValueError"] == 1
    with pytest.raises(ValueError):
        score_completions([], ["p"], ["c"])


# --- advantages ------------------------------------------------------------------------------------

def test_advantage_estimators_on_a_hand_computed_group():
    # group 0: rewards 1, 2, 3, 6: mean 3, deviations -2, -1, 0, 3,
    #          population variance (4 + 1 + 0 + 9) / 4 = 3.5
    # group 1: all 0.5: zero variance, dropped
    rewards = jnp.array([[1.0, 2.0, 3.0, 6.0], [0.5, 0.5, 0.5, 0.5]])
    dev = np.array([-2.0, -1.0, 0.0, 3.0])
    expected = {
        "grpo": dev / (math.sqrt(3.5) + 1e-6),
        "rloo": np.array([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3]),  # r_i - mean of the other three
        "drgrpo": dev,
    }
    for estimator, want in expected.items():
        adv, keep, kept_frac = group_advantages(rewards, estimator=estimator)
        np.testing.assert_allclose(adv[0], want, rtol=1e-6, err_msg=estimator)
        np.testing.assert_array_equal(adv[1], 0.0)
        np.testing.assert_array_equal(keep, [[True] * 4, [False] * 4])
        assert float(kept_frac) == 0.5
    # without zero-variance masking the flat group is kept (with zero advantage)
    adv, keep, kept_frac = group_advantages(rewards, estimator="grpo", mask_zero_variance=False)
    assert float(kept_frac) == 1.0 and bool(keep.all())
    np.testing.assert_allclose(adv[1], 0.0, atol=1e-6)


def test_advantage_masking_of_skipped_and_truncated_samples():
    # The skipped sample's placeholder reward (100) must not move the group statistics:
    # valid rewards 1, 3, 5: mean 3, deviations -2, 0, 2, population std sqrt(8/3).
    rewards = jnp.array([[1.0, 100.0, 3.0, 5.0]])
    skipped = jnp.array([[False, True, False, False]])
    truncated = jnp.array([[False, False, False, True]])
    adv, keep, kept_frac = group_advantages(rewards, estimator="grpo", skipped_PG=skipped)
    np.testing.assert_allclose(adv[0], np.array([-2.0, 0.0, 0.0, 2.0]) / (math.sqrt(8 / 3) + 1e-6), rtol=1e-6)
    assert keep.tolist() == [[True, False, True, True]] and float(kept_frac) == 0.75
    # A truncated sample's reward still counts in the baseline; its loss is masked.
    adv, keep, kept_frac = group_advantages(rewards, estimator="drgrpo", skipped_PG=skipped,
                                            truncated_PG=truncated, mask_truncated=True)
    np.testing.assert_allclose(adv[0], [-2.0, 0.0, 0.0, 0.0])
    assert keep.tolist() == [[True, False, True, False]] and float(kept_frac) == 0.5
    # rloo needs two valid samples for a leave-one-out baseline.
    adv, keep, _ = group_advantages(jnp.array([[1.0, 0.0]]), estimator="rloo",
                                    skipped_PG=jnp.array([[False, True]]), mask_zero_variance=False)
    assert keep.tolist() == [[False, False]] and adv.tolist() == [[0.0, 0.0]]
    # ... and two are enough: rewards 1 and 3 (the other two skipped), each against the other: -2, +2.
    adv, keep, _ = group_advantages(jnp.array([[1.0, 7.0, 3.0, 7.0]]), estimator="rloo",
                                    skipped_PG=jnp.array([[False, True, False, True]]))
    assert keep.tolist() == [[True, False, True, False]] and adv.tolist() == [[-2.0, 0.0, 2.0, 0.0]]
    stats = advantage_stats(*group_advantages(jnp.array([[0.0, 2.0]]), estimator="drgrpo")[:2])
    assert (float(stats["adv_min"]), float(stats["adv_max"]), float(stats["adv_mean"])) == (-1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(rewards, estimator="ppo")


# --- objective -------------------------------------------------------------------------------------

def _hand_case():
    """Two sequences, eps = 0.2, eps_high = 0.3, logp_old = 0 so ratio = exp(logp).

    seq 0, A = +1, ratios 1.5, 1.25, 0.5:
      1.5  -> max(-1.5, -1.3) = -1.3   clipped (high side)
      1.25 -> max(-1.25, -1.25) = -1.25 inside [0.8, 1.3]; would clip at 1.2 if eps_high were eps
      0.5  -> max(-0.5, -0.8) = -0.5   A > 0 never clips low
    seq 1, A = -2, ratios 0.5, 2.0, (masked token with log-ratio 100):
      0.5  -> max(1.0, 1.6) = 1.6      clipped (low side)
      2.0  -> max(4.0, 2.6) = 4.0      A < 0 never clips high
    token_mean = (-1.3 - 1.25 - 0.5 + 1.6 + 4.0) / 5 = 2.55 / 5 = 0.51
    seq_mean_token_mean = ((-3.05 / 3) + (5.6 / 2)) / 2 = 0.891666...
    k3 with ref - logp = ln2: 1 - ln2; = -ln2: ln2 - 1/2; = 0: 0.
    """
    logp = jnp.log(jnp.array([[1.5, 1.25, 0.5], [0.5, 2.0, 1.0]]))
    logp = logp.at[1, 2].set(100.0)
    logp_old = jnp.zeros((2, 3))
    adv = jnp.array([1.0, -2.0])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    logp_ref = logp + jnp.array([[LN2, 0.0, -LN2], [0.0, LN2, 5.0]])
    return logp, logp_old, adv, mask, logp_ref


def test_clipped_loss_hand_computed_both_aggregations():
    logp, logp_old, adv, mask, logp_ref = _hand_case()
    kw = dict(eps=0.2, eps_high=0.3)
    loss, m = clipped_policy_loss(logp, logp_old, adv, mask, aggregation="token_mean", **kw)
    np.testing.assert_allclose(loss, 0.51, rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac"], 0.4)
    np.testing.assert_allclose(m["pg_clipfrac_high"], 0.2)
    np.testing.assert_allclose(m["pg_clipfrac_low"], 0.2)
    np.testing.assert_allclose(m["ratio_mean"], (1.5 + 1.25 + 0.5 + 0.5 + 2.0) / 5, rtol=1e-6)
    assert float(m["num_tokens"]) == 5.0 and float(m["kl"]) == 0.0
    loss, _ = clipped_policy_loss(logp, logp_old, adv, mask, aggregation="seq_mean_token_mean", **kw)
    np.testing.assert_allclose(loss, (-3.05 / 3 + 5.6 / 2) / 2, rtol=1e-6)
    # symmetric clipping (eps_high = eps = 0.2) caps seq 0's first two tokens at 1.2 instead
    loss, m = clipped_policy_loss(logp, logp_old, adv, mask, eps=0.2)
    np.testing.assert_allclose(loss, (-1.2 - 1.2 - 0.5 + 1.6 + 4.0) / 5, rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac"], 0.6)


def test_clipped_loss_kl_term_and_gradient():
    logp, logp_old, adv, mask, logp_ref = _hand_case()
    kw = dict(eps=0.2, eps_high=0.3, beta=0.1, logp_ref_BT=logp_ref)
    kl_tokens = [1 - LN2, 0.0, LN2 - 0.5, 0.0, 1 - LN2]
    loss, m = clipped_policy_loss(logp, logp_old, adv, mask, aggregation="token_mean", **kw)
    np.testing.assert_allclose(m["kl"], sum(kl_tokens) / 5, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.51 + 0.1 * sum(kl_tokens) / 5, rtol=1e-5)
    loss, _ = clipped_policy_loss(logp, logp_old, adv, mask, aggregation="seq_mean_token_mean", **kw)
    seq_kl = (sum(kl_tokens[:3]) / 3 + sum(kl_tokens[3:]) / 2) / 2
    np.testing.assert_allclose(loss, (-3.05 / 3 + 5.6 / 2) / 2 + 0.1 * seq_kl, rtol=1e-5)
    with pytest.raises(ValueError, match="logp_ref_BT"):
        clipped_policy_loss(logp, logp_old, adv, mask, beta=0.1)

    # d/dlogp of -A r is -A r on unclipped tokens and 0 on clipped (and masked) ones; / 5 tokens.
    grad = jax.grad(lambda lp: clipped_policy_loss(lp, logp_old, adv, mask, eps=0.2, eps_high=0.3)[0])(logp)
    np.testing.assert_allclose(grad, [[0.0, -1.25 / 5, -0.5 / 5], [0.0, 4.0 / 5, 0.0]], rtol=1e-6, atol=1e-7)
    assert bool(jnp.isfinite(grad).all())  # the masked log-ratio of 100 was clipped before exp


def test_clipped_loss_keep_mask_and_micro_batch_normalizer():
    logp, logp_old, adv, mask, _ = _hand_case()
    kw = dict(eps=0.2, eps_high=0.3)
    # dropping sequence 1 leaves seq 0's token mean
    loss, m = clipped_policy_loss(logp, logp_old, adv, mask, keep_B=jnp.array([True, False]), **kw)
    np.testing.assert_allclose(loss, -3.05 / 3, rtol=1e-6)
    assert float(m["num_tokens"]) == 3.0
    # two micro-batches of one sequence each, normalised by the batch-wide count, sum to the batch loss
    for aggregation, normalizer, want in (("token_mean", 5.0, 0.51),
                                          ("seq_mean_token_mean", 2.0, (-3.05 / 3 + 5.6 / 2) / 2)):
        parts = [clipped_policy_loss(logp[i:i + 1], logp_old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                                     aggregation=aggregation, normalizer=normalizer, **kw)[0] for i in (0, 1)]
        np.testing.assert_allclose(sum(parts), want, rtol=1e-6)


# The objective against an independent re-derivation (tests/grpo_reference.py: numpy, float64,
# derivatives written out), on a case where every term acts: both clip sides, a masked token whose
# log-ratio is 100, a dropped sequence whose tokens would clip, an empty sequence, k3 and TIS.

OBJECTIVE_TOL = 1e-4  # float32 against float64: ~1e-6 measured


def _objective_case(seed=0):
    rng = np.random.default_rng(seed)
    B, T = 6, 9
    logp = -rng.exponential(2.0, (B, T))
    logp_old = logp - rng.normal(0.0, 0.35, (B, T))  # ratios e^(+-0.35): both clip sides engage
    mask = np.zeros((B, T))
    for b, n in enumerate((7, 5, 7, 3, 0, 6)):  # two prompt slots, then n completion tokens
        mask[b, 2:2 + n] = 1.0
    logp_old[1, 0] = logp[1, 0] - 100.0  # a prompt slot far off: clipped to 20 before exp, masked
    return {"logp": logp.astype(np.float32), "logp_old": logp_old.astype(np.float32),
            "adv": np.asarray([1.3, -0.7, 0.0, 2.0, -1.5, 0.4], np.float32), "mask": mask.astype(np.float32),
            "keep": np.asarray([True, True, True, False, True, True]),
            "logp_ref": (logp + rng.normal(0.0, 0.5, (B, T))).astype(np.float32),
            "logp_sampler": (logp_old + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)}


# (aggregation, normaliser, beta, importance correction)
OBJECTIVE_CONFIGS = (("token_mean", None, 0.0, "none"), ("token_mean", 40.0, 0.05, "tis"),
                     ("seq_mean_token_mean", None, 0.05, "none"), ("seq_mean_token_mean", 7.0, 0.0, "tis"))


def objective_errors() -> dict[str, float]:
    """The largest error of rl.objective against the numpy re-derivation over OBJECTIVE_CONFIGS:
    loss, d loss / d logp, and every metric, each relative to the reference's largest value."""
    from grpo_reference import grpo_reference, tis_reference
    from hybridmoe.rl import objective

    c = _objective_case()
    errors: dict[str, float] = {}
    for aggregation, normalizer, beta, correction in OBJECTIVE_CONFIGS:
        kw = dict(eps=0.2, eps_high=0.28, beta=beta, aggregation=aggregation, normalizer=normalizer)
        weight = objective.importance_weights(correction, 1.5, c["logp_old"], c["logp_sampler"], c["mask"])

        def loss_fn(logp):
            return objective.clipped_policy_loss(logp, c["logp_old"], c["adv"], c["mask"], logp_ref_BT=c["logp_ref"],
                                                 keep_B=c["keep"], is_weight_BT=weight, **kw)

        (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(c["logp"]))
        want = grpo_reference(c["logp"], c["logp_old"], c["adv"], c["mask"], logp_ref=c["logp_ref"], keep=c["keep"],
                              is_weight=(None if correction == "none" else
                                         tis_reference(c["logp_old"], c["logp_sampler"], c["mask"], 1.5)), **kw)
        got = {"loss": float(loss), "grad": np.asarray(grad), **{k: float(v) for k, v in metrics.items()}}
        for key, value in want.items():
            err = float(np.max(np.abs(np.asarray(got[key], np.float64) - value)) / max(np.max(np.abs(value)), 1e-3))
            errors[key] = max(errors.get(key, 0.0), err)
    return errors


def test_objective_equals_the_independent_re_derivation():
    errors = objective_errors()
    assert max(errors.values()) < OBJECTIVE_TOL, errors
    ref = __import__("grpo_reference").grpo_reference
    c = _objective_case()
    both = ref(c["logp"], c["logp_old"], c["adv"], c["mask"], eps=0.2, eps_high=0.28, keep=c["keep"])
    # The case exercises what it claims: both clip sides, and the dropped row would clip.
    assert both["pg_clipfrac_high"] > 0 and both["pg_clipfrac_low"] > 0
    assert ref(c["logp"], c["logp_old"], c["adv"], c["mask"], eps=0.2, eps_high=0.28)["pg_clipfrac"] != \
        both["pg_clipfrac"]


def test_clip_fraction_counts_only_kept_completion_tokens():
    """Hand case, eps = eps_high = 0.2, logp_old = 0 (ratio = exp(logp)):
    row 0, A = +1: ratios 1.5 (clipped high), 1.0, and a masked 2.0 that would clip high;
    row 1, A = -1: ratios 0.5 (clipped low), 0.9, and a masked 0.1 that would clip low;
    row 2, A = +1, dropped by the keep mask: 3.0 three times, every one would clip high.
    Kept tokens 4, clipped 2: pg_clipfrac 0.5 (high 0.25, low 0.25); ratio max 1.5, min 0.5;
    loss (-1.2 - 1.0 + 0.8 + 0.9) / 4 = -0.125; d/dlogp -A r / 4 on the two unclipped tokens only."""
    from hybridmoe.rl import objective
    logp = jnp.log(jnp.array([[1.5, 1.0, 2.0], [0.5, 0.9, 0.1], [3.0, 3.0, 3.0]]))
    mask = jnp.array([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    args = (jnp.zeros((3, 3)), jnp.array([1.0, -1.0, 1.0]), mask)
    keep = jnp.array([True, True, False])
    loss_fn = lambda lp: objective.clipped_policy_loss(lp, *args, eps=0.2, keep_B=keep)  # noqa: E731
    (loss, m), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    got = {k: float(m[k]) for k in ("pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "ratio_max", "ratio_min")}
    want = {"pg_clipfrac": 0.5, "pg_clipfrac_high": 0.25, "pg_clipfrac_low": 0.25, "ratio_max": 1.5, "ratio_min": 0.5}
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(loss), -0.125, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, -0.25, 0.0], [0.0, 0.225, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6, atol=1e-8)


# One-line bugs in rl/objective.py, each patched in: the re-derivation or the hand case must catch it.
OBJECTIVE_BROKEN = {
    "min_instead_of_max": ("clipped_policy_loss", "jnp.maximum(unclipped_BT, clipped_BT)",
                           "jnp.minimum(unclipped_BT, clipped_BT)"),
    "upper_clip_at_eps": ("clipped_policy_loss", "jnp.clip(ratio_BT, 1.0 - eps, 1.0 + eps_high)",
                          "jnp.clip(ratio_BT, 1.0 - eps, 1.0 + eps)"),
    "inverted_ratio": ("clipped_policy_loss", "jnp.clip(logp_BT - logp_old_BT,", "jnp.clip(logp_old_BT - logp_BT,"),
    "keep_mask_dropped": ("clipped_policy_loss", "mask_BT = mask_BT * keep_B.astype(jnp.float32)[:, None]",
                          "mask_BT = mask_BT * 1.0"),
    "k3_of_the_reverse_kl": ("clipped_policy_loss", "kl_BT = jnp.exp(ref_gap_BT) - ref_gap_BT - 1.0",
                             "kl_BT = jnp.exp(-ref_gap_BT) + ref_gap_BT - 1.0"),
    "importance_weight_dropped": ("clipped_policy_loss",
                                  "pg_BT = jax.lax.stop_gradient(is_weight_BT.astype(jnp.float32)) * pg_BT",
                                  "pg_BT = pg_BT"),
    "normaliser_ignored": ("_aggregate", "denom = mask_BT.sum() if normalizer is None else normalizer",
                           "denom = mask_BT.sum()"),
    "sequence_mean_over_empty_sequences": ("_aggregate", "denom = (tokens_B > 0).sum() if",
                                           "denom = tokens_B.shape[0] if"),
    "clipfrac_counts_masked_tokens": ("clipped_policy_loss", "((clipped_high_BT | clipped_low_BT) * mask_BT).sum()",
                                      "(clipped_high_BT | clipped_low_BT).sum()"),
    "ratio_extremes_over_dropped_rows": ("clipped_policy_loss", "valid_BT = mask_BT > 0",
                                         "valid_BT = completion_mask_BT > 0"),
}


@pytest.mark.parametrize("variant", list(OBJECTIVE_BROKEN))
def test_broken_objective_is_caught(variant, monkeypatch):
    from broken_variants import mutated
    from hybridmoe.rl import objective
    clean = max(objective_errors().values())
    name, old, new = OBJECTIVE_BROKEN[variant]
    monkeypatch.setattr(objective, name, mutated(objective, name, old, new))
    broken = max(objective_errors().values())
    try:
        test_clip_fraction_counts_only_kept_completion_tokens()
        hand = "passed"
    except AssertionError:
        hand = "failed"
    assert broken > OBJECTIVE_TOL and broken >= 10 * clean or hand == "failed", (
        f"{variant}: clean {clean:.2e}, broken {broken:.2e}, hand case {hand}")


# --- chunked log-probs -----------------------------------------------------------------------------

def _logprob_case(batch=3, seq_len=7, d_model=8, vocab=37, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = 2.0 * jax.random.normal(k[0], (batch, seq_len, d_model))
    lm_head = jax.random.normal(k[1], (d_model, vocab))
    targets = jax.random.randint(k[2], (batch, seq_len), 0, vocab)
    weights = jax.random.normal(k[3], (batch, seq_len))
    return hidden, lm_head, targets, weights


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(4, 10), (5, 37), (64, 3), (1, 1)])
def test_chunked_logprobs_match_unchunked_values_and_gradients(chunk_tokens, chunk_vocab):
    # 21 tokens and 37 vocab rows: none of these chunk sizes divide both, so padding is exercised.
    hidden, lm_head, targets, weights = _logprob_case()

    def objective(fn):
        def f(h, w):
            logp, entropy = fn(h, w, targets)
            return (weights * logp).sum() + (weights**2 * entropy).sum()
        return f

    def chunked(h, w, t):
        return chunked_token_logprobs(h, w, t, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)

    logp, entropy = jax.jit(chunked)(hidden, lm_head, targets)
    logp_ref, entropy_ref = token_logprobs_reference(hidden, lm_head, targets)
    assert logp.dtype == entropy.dtype == jnp.float32 and logp.shape == targets.shape
    np.testing.assert_allclose(logp, logp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(entropy, entropy_ref, rtol=1e-5, atol=1e-5)
    assert float(entropy.min()) >= 0.0 and float(entropy.max()) <= math.log(37) + 1e-5

    grads = jax.jit(jax.grad(objective(chunked), argnums=(0, 1)))(hidden, lm_head)
    grads_ref = jax.grad(objective(token_logprobs_reference), argnums=(0, 1))(hidden, lm_head)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
        assert float(jnp.abs(g_ref).max()) > 0.1  # the comparison is not of two near-zero tensors


def test_chunked_logprobs_never_materialise_the_full_logits():
    hidden, lm_head, targets, weights = _logprob_case()
    num_tokens, vocab = targets.size, lm_head.shape[1]

    def loss(h, w):
        logp, entropy = chunked_token_logprobs(h, w, targets, chunk_tokens=4, chunk_vocab=10)
        return (weights * logp).sum() + entropy.sum()

    def largest_value(jaxpr) -> int:
        sizes = [math.prod(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars if hasattr(v.aval, "shape")]
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", None)  # scan / jit / custom_vjp bodies
                if inner is not None:
                    sizes.append(largest_value(getattr(inner, "jaxpr", inner)))
        return max(sizes, default=0)

    fwd_bwd = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, lm_head)
    assert largest_value(fwd_bwd.jaxpr) < num_tokens * vocab  # 21 x 37; a logits block is 4 x 10
    ref = jax.make_jaxpr(lambda h, w: token_logprobs_reference(h, w, targets))(hidden, lm_head)
    assert largest_value(ref.jaxpr) >= num_tokens * vocab  # the probe does see full logits


def test_chunked_logprobs_extreme_logits_stay_finite():
    # Logits spanning thousands: the online max must keep exp from overflowing or underflowing to NaN.
    hidden, lm_head, targets, _ = _logprob_case(batch=2, seq_len=5)
    hidden = hidden * 300.0
    logp, entropy = chunked_token_logprobs(hidden, lm_head, targets, chunk_tokens=3, chunk_vocab=8)
    assert bool(jnp.isfinite(logp).all() & jnp.isfinite(entropy).all())
    # Truth in float64. Logits near 1000 carry float32 rounding of ~6e-5 each (in the reference too),
    # so the tolerance is a few of those, not 1e-5.
    z = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1]) @ np.asarray(lm_head, np.float64)
    log_p = z - z.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(logp.reshape(-1), log_p[np.arange(z.shape[0]), np.asarray(targets).reshape(-1)],
                               rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(entropy.reshape(-1), -(np.exp(log_p) * log_p).sum(axis=1), atol=3e-4)


def test_importance_weights_tis_caps_and_mis_masks_whole_sequences():
    from hybridmoe.rl.objective import importance_weights
    logp_old = jnp.log(jnp.array([[0.5, 0.2, 0.9], [0.4, 0.4, 0.1]]))
    # The sampler's probabilities: token (0, 0) 5x less likely than the trainer's, (1, 2) unchanged.
    logp_sampler = jnp.log(jnp.array([[0.1, 0.4, 0.9], [0.2, 0.4, 0.1]]))
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    assert importance_weights("none", 2.0, logp_old, logp_sampler, mask) is None
    tis = importance_weights("tis", 2.0, logp_old, logp_sampler, mask)
    # min(w, C): 5 capped at 2, 0.5 kept, 1 kept; seq 1: 2 (at the cap), 1, masked slot weight 1.
    np.testing.assert_allclose(tis, [[2.0, 0.5, 1.0], [2.0, 1.0, 1.0]], rtol=1e-6)
    # MIS at C = 2.2: sequence ratio prod w = 5 * 0.5 = 2.5 masks seq 0; seq 1's 2 * 1 = 2 stays
    # (its masked slot, far off, does not count).
    mis = importance_weights("mis", 2.2, logp_old, logp_sampler * jnp.array([[1, 1, 1], [1, 1, 9.0]]), mask)
    np.testing.assert_allclose(mis, [[0.0] * 3, [1.0] * 3], atol=1e-6)
    # In the loss: the weight scales each token's pg term, and its gradient (ratio 1 here: A * w / n).
    adv = jnp.array([1.0, -1.0])
    grad = jax.grad(lambda lp: clipped_policy_loss(lp, jax.lax.stop_gradient(lp), adv, mask, is_weight_BT=tis)[0])(
        logp_old)
    np.testing.assert_allclose(grad, [[-2.0 / 5, -0.5 / 5, -1.0 / 5], [2.0 / 5, 1.0 / 5, 0.0]], rtol=1e-6)
    with pytest.raises(ValueError, match="importance correction"):
        importance_weights("is", 2.0, logp_old, logp_sampler, mask)


# MIS judges a sequence by the product of its tokens' ratios w = pi_old / pi_sampler over its
# completion tokens (rl/objective.py: 1 if prod_t w <= C else 0). Hand case, C = 2, four slots per
# row (slot 0 a prompt slot, mask 0); each row's ratios and what MIS keeps:
#   row 0: 1.5, 1.5, 1.5         no token over C, product 3.375 > C       masked
#   row 1: 4, 0.25, 1.5          one token over C, product 1.5 <= C        kept
#   row 2: 1.25, 1.25, pad       product 1.5625; the prompt slot (w = 50) and the padding slot
#                                (log-ratio 100, clipped to 20) are not in the sequence       kept
#   row 3: 2, 1, 1               product exactly C (the same float32 log 2)                  kept
MIS_CAP = 2.0
MIS_KEPT = [0.0, 1.0, 1.0, 1.0]


def _mis_case():
    log = math.log
    logp_sampler = np.log(np.full((4, 4), 0.3))
    log_w = np.asarray([[0.0, log(1.5), log(1.5), log(1.5)],
                        [0.0, log(4.0), log(0.25), log(1.5)],
                        [log(50.0), log(1.25), log(1.25), 100.0],
                        [0.0, 0.0, 0.0, 0.0]])
    mask = np.asarray([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]], np.float32)
    logp_old = jnp.asarray(logp_sampler + log_w, jnp.float32)
    logp_sampler = jnp.asarray(logp_sampler, jnp.float32)
    # Row 3 at exactly the cap: pi_sampler 1 and pi_old 2 on its first token, in float32, so that
    # its log-ratio is bit for bit the log C the rule compares with.
    logp_old = logp_old.at[3].set(jnp.asarray([0.0, jnp.log(jnp.float32(MIS_CAP)), 0.0, 0.0]))
    logp_sampler = logp_sampler.at[3].set(0.0)
    return logp_old, logp_sampler, jnp.asarray(mask)


def mis_errors() -> dict:
    """The MIS weights of the hand case against MIS_KEPT: the rows judged wrong, and the largest
    error of d loss / d logp (on policy, ratio 1: -A w / kept tokens on every completion token)."""
    from hybridmoe.rl import objective

    logp_old, logp_sampler, mask = _mis_case()
    w = np.asarray(objective.importance_weights("mis", MIS_CAP, logp_old, logp_sampler, mask))
    wrong_rows = int(sum(not np.all(w[b] == MIS_KEPT[b]) for b in range(4)))
    adv = jnp.asarray([1.0, -1.0, 2.0, 0.5])
    grad = jax.grad(lambda lp: objective.clipped_policy_loss(
        lp, jax.lax.stop_gradient(lp), adv, mask, is_weight_BT=jnp.asarray(w))[0])(logp_old)
    want = -np.asarray(adv)[:, None] * np.asarray(MIS_KEPT)[:, None] * np.asarray(mask) / float(np.sum(mask))
    return {"wrong_rows": wrong_rows, "grad": float(np.abs(np.asarray(grad) - want).max() / np.abs(want).max())}


def test_mis_masks_a_sequence_by_its_product_of_ratios_not_its_worst_token():
    errors = mis_errors()
    assert errors["wrong_rows"] == 0 and errors["grad"] < 1e-6, errors


# One-line bugs in the MIS rule, each patched into rl/objective.py: the hand case must catch it.
MIS_BROKEN = {
    "judged_by_the_worst_token": ("keep_B = log_w_BT.sum(axis=1) <= jnp.log(cap)",
                                  "keep_B = log_w_BT.max(axis=1) <= jnp.log(cap)"),
    "judged_by_the_mean_log_ratio": ("keep_B = log_w_BT.sum(axis=1) <= jnp.log(cap)",
                                     "keep_B = log_w_BT.mean(axis=1) <= jnp.log(cap)"),
    "prompt_and_padding_slots_counted": ("-LOG_RATIO_CLIP, LOG_RATIO_CLIP)) * mask_BT",
                                         "-LOG_RATIO_CLIP, LOG_RATIO_CLIP))"),
    "masked_at_the_cap": ("keep_B = log_w_BT.sum(axis=1) <= jnp.log(cap)",
                          "keep_B = log_w_BT.sum(axis=1) < jnp.log(cap)"),
}


@pytest.mark.parametrize("variant", list(MIS_BROKEN))
def test_broken_mis_is_caught(variant, monkeypatch):
    from broken_variants import mutated
    from hybridmoe.rl import objective
    monkeypatch.setattr(objective, "importance_weights", mutated(objective, "importance_weights",
                                                                 *MIS_BROKEN[variant]))
    errors = mis_errors()
    assert errors["wrong_rows"] >= 1 and errors["grad"] > 0.1, f"{variant}: {errors}"


def test_dynamic_sampling_keeps_groups_with_reward_variance_and_fills_the_batch(monkeypatch):
    import types

    from hybridmoe.recipe import load_config
    from hybridmoe.rl import loop

    G = 2
    # Per round, per group: (reward a, reward b); equal pairs carry no signal.
    rounds = [[(1, 0), (1, 1), (0, 0), (0, 1)], [(1, 1), (0, 1), (0, 0), (0, 0)], [(1, 1)] * 4]
    calls = []

    def fake_sample(run, state, step, round_index, key):
        calls.append(round_index)
        r = np.asarray(rounds[round_index], np.float32).reshape(-1)
        ids = np.arange(len(r)) + 100 * round_index  # which round and row each sample came from
        # round r sampled 10^r new tokens, met r reward errors (skipped) and r too-long prompts
        return {"tokens": ids[:, None], "rewards": r, "skipped": np.zeros(len(r), bool),
                "truncated": np.zeros(len(r), bool), "prompt_skipped": np.arange(len(r) // G) < round_index,
                "rewards_skipped": float(round_index), "reward_errors": float(round_index),
                "new_tokens": 10.0 ** round_index}

    monkeypatch.setattr(loop, "_sample_groups", fake_sample)
    for max_rounds, want_rounds, want_rows, frac in ((3, 3, [0, 1, 6, 7, 102, 103, 2, 3], 0.75),
                                                     (1, 1, [0, 1, 6, 7, 2, 3, 4, 5], 0.5)):
        calls.clear()
        cfg = load_config("tiny", ["rl.prompts_per_step=4", f"rl.group_size={G}", "rl.dynamic_sampling=true",
                                   f"rl.dynamic_sampling_rounds={max_rounds}"])
        batch, first, ds = loop._fill_batch(types.SimpleNamespace(cfg=cfg), None, 0, jax.random.key(0))
        # Round 0's informative groups 0 and 3, then round 1's group 1; round 2 has none; the rest
        # is filled with round 0's zero-variance groups, in order.
        assert calls == list(range(want_rounds))
        np.testing.assert_array_equal(batch["tokens"][:, 0], want_rows)
        failed = float(sum(range(want_rounds)))  # 0 + 1 + 2: every round's failures count, once
        assert ds == {"ds_rounds": want_rounds, "ds_rollouts": 8.0 * want_rounds, "ds_informative_frac": frac,
                      "rollout_tokens": sum(10.0 ** i for i in range(want_rounds)),  # every round's, once
                      "rewards_skipped": failed, "reward_errors": failed, "prompts_skipped": failed}
        assert first["rewards"].tolist() == [1, 0, 1, 1, 0, 0, 0, 1]  # what the step logs as reward_mean


def test_a_sequence_without_completion_tokens_is_not_counted_and_the_low_clip_is_at_eps():
    """logp_old = 0 (ratio = exp(logp)), eps 0.2, eps_high 0.3: row 0 (A = +1) ratios 1, 1: pg -1, -1;
    row 1 (A = -1) ratios 0.75, 1: 0.75 is below 1 - eps = 0.8, clipped to it (pg max(0.75, 0.8) = 0.8;
    it would not be clipped at 1 - eps_high = 0.7), then 1.0; row 2 has no completion token. The
    sequence mean is over the 2 sequences with a token: (-1 + 0.9) / 2; the low clip fraction 1 of 4."""
    logp = jnp.log(jnp.array([[1.0, 1.0], [0.75, 1.0], [1.0, 1.0]]))
    mask = jnp.array([[1, 1], [1, 1], [0, 0]])
    loss, m = clipped_policy_loss(logp, jnp.zeros((3, 2)), jnp.array([1.0, -1.0, 1.0]), mask, eps=0.2, eps_high=0.3,
                                  aggregation="seq_mean_token_mean")
    np.testing.assert_allclose(float(loss), (-1.0 + 0.9) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(m["pg_clipfrac_low"]), 0.25)
    np.testing.assert_allclose(float(m["pg_clipfrac_high"]), 0.0)


def test_a_grpo_steps_record_takes_each_figure_from_its_own_rows_and_times(monkeypatch):
    """rl/loop.py's _grpo_step with its parts stubbed: round 0 as sampled (every row truncated, 5 of
    8 rewards 1) and the batch trained on (rows of later rounds: 1 of 8 truncated, lengths 2, 4, 6, 8
    twice, 9 tokens a row). The rewards are round 0's, the lengths, truncation and tokens the
    batch's; the clock moves 1 s a reading: the step 4 s, the rollout 1 s, the updates 1 s less
    the pi_old pass's 0.25 s."""
    import types

    from hybridmoe.rl import loop
    from hybridmoe.recipe import load_config

    cfg = load_config("tiny", ["rl.prompts_per_step=4", "rl.group_size=2"])
    first = {"rewards": np.array([0, 1, 1, 1, 0, 0, 1, 1], np.float32), "skipped": np.zeros(8, bool),
             "prompt_skipped": np.zeros(4, bool), "rewards_skipped": 0.0, "truncated": np.ones(8, bool)}
    batch = {"rewards": np.array([0, 1, 1, 0, 0, 1, 1, 0], np.float32), "skipped": np.zeros(8, bool),
             "truncated": np.arange(8) == 1, "lengths": np.array([2, 4, 6, 8] * 2),
             "segment_ids": np.concatenate([np.ones((8, 9), np.int32), np.zeros((8, 3), np.int32)], axis=1)}
    ds = {"rollout_tokens": 30.0, "ds_rounds": 2.0}
    metrics = {k: 0.0 for k in ("loss", "pg_loss", "kl", "entropy", "logp_mean", "grad_norm", "pg_clipfrac",
                                "pg_clipfrac_high", "pg_clipfrac_low", "ratio_mean", "ratio_min", "ratio_max",
                                "sampler_gap_mean", "sampler_gap_max", "is_weight_mean", "is_masked_frac",
                                "update_applied", "update_skipped")}
    clock = {"now": 0.0}

    def perf_counter():
        clock["now"] += 1.0
        return clock["now"]

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(loop, "_fill_batch", lambda run, state, step, key: (batch, first, ds))
    monkeypatch.setattr(loop, "update_rows", lambda cfg, rollout, adv, keep: None)
    monkeypatch.setattr(loop, "policy_updates", lambda *a: ("state", {**metrics, "old_logprobs_time_s": 0.25}))
    run = types.SimpleNamespace(cfg=cfg, empty_steps=0, setup=None, grpo_step=None, old_logprobs=None,
                                old_logprobs_micro_batches=None)
    _, rec = loop._grpo_step(run, "state", None, 3, None)
    assert rec["reward_mean"] == 0.625 and rec["scored_samples"] == 8.0
    assert (rec["completion_len_mean"], rec["completion_len_min"], rec["completion_len_max"]) == (5.0, 2.0, 8.0)
    assert rec["truncated_frac"] == 0.125 and rec["tokens"] == 72.0 and rec["ds_rounds"] == 2.0
    assert (rec["step_time_s"], rec["rollout_time_s"], rec["update_time_s"], rec["old_logprobs_time_s"]) == (
        4.0, 1.0, 0.75, 0.25)
    assert rec["tokens_per_s"] == 72.0 / 4.0 and rec["rollout_tokens_per_s"] == 30.0 / 1.0


def test_the_logged_advantage_std_is_the_population_one_over_the_kept_samples():
    """drgrpo on rewards 1, (skipped), 3, 5: advantages -2, 0, 2 kept (the skipped one 0, not kept):
    mean 0, std sqrt(8 / 3) over the three kept (not sqrt(8 / 2), nor over all four)."""
    adv, keep, _ = group_advantages(jnp.array([[1.0, 100.0, 3.0, 5.0]]), estimator="drgrpo",
                                    skipped_PG=jnp.array([[False, True, False, False]]))
    stats = advantage_stats(adv, keep)
    assert float(stats["adv_mean"]) == 0.0
    assert float(stats["adv_std"]) == pytest.approx(math.sqrt(8 / 3), rel=1e-6)
    # One group of two: -1 and 1, a population std of exactly 1.
    stats = advantage_stats(*group_advantages(jnp.array([[0.0, 2.0]]), estimator="drgrpo")[:2])
    assert float(stats["adv_std"]) == 1.0
