"""GRPO glue pinned with the model's log-probs stubbed: one micro-batch's metric sums, and small
figures of the RL loop and the answer rewards."""

import types

import jax.numpy as jnp
import numpy as np
import pytest


def _grpo_with_a_stubbed_policy(monkeypatch, importance_correction: str):
    """rl/grpo with the policy's log-prob -1 at every target and its entropy 0.5 (no model), and an RL
    config: importance cap 2, clip 0.2 both ways, no KL, token-mean aggregation."""
    import hybridmoe.rl.grpo as grpo

    monkeypatch.setattr(grpo, "sequence_logprobs",
                        lambda params, cfg, tokens, *rest: (jnp.full(tokens.shape, -1.0), jnp.full(tokens.shape, 0.5)))
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(importance_correction=importance_correction, importance_cap=2.0,
                                                         eps=0.2, eps_high=None, beta=0.0, aggregation="token_mean"))
    return grpo, cfg


def test_a_micro_batchs_sums_take_each_figure_from_its_own_rows(monkeypatch):
    grpo, cfg = _grpo_with_a_stubbed_policy(monkeypatch, "mis")
    # Row 0: 2 completion tokens, kept; sampler log-probs -1.5, -0.5: log w = 0.5 - 0.5 = 0, weight 1.
    # Row 1: 1 completion token, dropped; sampler -1: weight 1.
    # Row 2: no completion token, kept.
    # Row 3: 1 completion token, kept; sampler -4: log w = 3 > log 2, masked (weight 0).
    mask = jnp.array([[0, 1, 1], [0, 1, 0], [0, 0, 0], [0, 0, 1]], jnp.float32)
    mb = {"tokens": jnp.zeros((4, 3), jnp.int32), "segment_ids": None, "positions": None, "mask": mask,
          "logp_sampler": jnp.array([[0, -1.5, -0.5], [0, -1.0, 0], [0, 0, 0], [0, 0, -4.0]], jnp.float32),
          "advantages": jnp.array([1.0, 0.0, 0.0, 1.0]), "keep": jnp.array([True, False, True, True]),
          "normalizer": jnp.float32(3.0)}
    loss, sums = grpo.micro_batch_loss(None, None, cfg, mb)
    got = {k: float(v) for k, v in sums.items()}
    assert got["kept_tokens"] == 3.0 and got["completion_tokens"] == 4.0  # rows 0 and 3; rows 0, 1, 3
    assert got["entropy_sum"] == 2.0 and got["logp_sum"] == -4.0  # over all 4 completion tokens, kept or not
    assert got["gap_sum"] == 4.0 and got["gap_max"] == 3.0  # |-1 + 1.5| + |-1 + 0.5| + |-1 + 1| + |-1 + 4|
    assert got["rows_with_tokens"] == 3.0 and got["is_masked_rows"] == 1.0  # rows 0, 1, 3; row 3 masked
    assert got["is_weight_sum"] == 2.0  # weight 1 on row 0's two kept tokens, 0 on row 3's
    assert got["ratio_sum"] == 3.0 and got["ratio_max"] == 1.0 and got["ratio_min"] == 1.0  # on policy
    assert got["kl_sum"] == 0.0
    # pg = -A r w: -1 on each of row 0's two tokens, 0 on row 3's (weight 0), over the normaliser 3.
    assert float(loss) == pytest.approx(-2 / 3, rel=1e-6) and got["pg_loss"] == pytest.approx(-2 / 3, rel=1e-6)


def test_a_later_updates_sums_count_its_clipped_tokens_and_ratios_against_pi_old(monkeypatch):
    import math

    grpo, cfg = _grpo_with_a_stubbed_policy(monkeypatch, "none")
    mask = jnp.array([[0, 1, 1], [0, 1, 0], [0, 0, 0], [0, 1, 1]], jnp.float32)
    mb = {"tokens": jnp.zeros((4, 3), jnp.int32), "segment_ids": None, "positions": None, "mask": mask,
          "logp_sampler": jnp.array([[0, -1.5, -0.5], [0, -1.0, 0], [0, 0, 0], [0, 0, -4.0]], jnp.float32),
          "logp_old": jnp.array([[0, -1.5, -0.5], [0, 0, 0], [0, 0, 0], [0, 0, 0]], jnp.float32),
          "on_policy": jnp.bool_(False),
          "advantages": jnp.array([1.0, 0.0, 0.0, -1.0]), "keep": jnp.array([True, False, True, True]),
          "normalizer": jnp.float32(3.0)}
    _, sums = grpo.micro_batch_loss(None, None, cfg, mb)
    got = {k: float(v) for k, v in sums.items()}
    # Kept tokens: row 0's (ratios e^0.5 with A = 1: over 1.2, clipped high; e^-0.5: not clipped, A > 0)
    # and row 3's two (e^-1 each with A = -1: under 0.8, clipped low).
    assert got["kept_tokens"] == 4.0
    assert got["clipped_sum"] == pytest.approx(3.0) and got["clipped_high_sum"] == pytest.approx(1.0)
    assert got["clipped_low_sum"] == pytest.approx(2.0)
    assert got["ratio_sum"] == pytest.approx(math.exp(0.5) + math.exp(-0.5) + 2 * math.exp(-1.0), rel=1e-6)
    assert got["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert got["ratio_min"] == pytest.approx(math.exp(-1.0), rel=1e-6)
    # |pi_old - sampler| on every completion token: 0 + 0 (row 0), 1 (row 1), 0 + 4 (row 3).
    assert got["gap_sum"] == 5.0 and got["gap_max"] == 4.0
    assert got["is_weight_sum"] == 4.0 and got["is_masked_rows"] == 0.0  # no correction: weight 1, none masked


def test_an_rl_run_is_its_warm_up_steps_then_its_grpo_steps():
    from hybridmoe.rl.loop import _Run
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(warmup_steps=3, steps=5))
    run = _Run(cfg, *([None] * 9))
    assert run.total_steps == 8


def test_files_train_from_file_documents_and_anything_else_from_the_step(monkeypatch):
    import hybridmoe.data.sources as sources
    monkeypatch.setattr(sources, "FileSource", lambda cfg: "files")
    monkeypatch.setattr(sources, "StepSource", lambda cfg: "step")
    cfg = lambda data: types.SimpleNamespace(train=types.SimpleNamespace(data=data))  # noqa: E731
    assert sources.training_source(cfg("files")) == "files"
    assert sources.training_source(cfg("synthetic")) == "step"
    assert sources.training_source(cfg("arithmetic")) == "step"


def test_an_unclosed_box_at_the_end_is_no_answer():
    from hybridmoe.rl.answer_rewards import answer_format, final_answer
    assert final_answer("so \\boxed{12") is None
    assert final_answer("\\boxed{1} then \\boxed{2") == "1"  # the closed one before it still counts
    assert final_answer("\\boxed{a{b}c}") == "a{b}c"
    assert answer_format("", "x \\boxed{3}.", {}) == 1.0
    assert answer_format("", "\\boxed{3} #### 3", {}) == 0.0  # two answers


def test_the_default_arithmetic_task_is_two_digit_addition():
    from hybridmoe.data.arithmetic import ArithmeticTask, get_task
    t = get_task("arithmetic")
    assert (t.digits, t.operators) == (2, "+")
    assert t.max_completion_chars == 3  # 99 + 99 = 198
    ex = ArithmeticTask().sample(np.random.default_rng(0), 50)
    assert all(0 <= int(a) <= 99 and 0 <= int(b) <= 99 for a, b in (e.prompt[:-1].split("+") for e in ex))
    assert max(int(e.prompt.split("+")[0]) for e in ex) >= 10  # two digits are drawn, not one


def test_prompts_up_to_the_limit_are_kept_and_longer_or_unencodable_ones_skipped(caplog):
    import logging

    from hybridmoe.data.tokenizer import CharTokenizer
    from hybridmoe.rl.loop import _encode_prompts
    tok = CharTokenizer()
    run = types.SimpleNamespace(tokenizer=tok, cfg=types.SimpleNamespace(rl=types.SimpleNamespace(max_prompt_len=4)))
    with caplog.at_level(logging.WARNING, logger="hybridmoe.rl.loop"):
        ids, skipped = _encode_prompts(run, ["1+2", "10+2", "\u00e9"])
    # With BOS: 4 tokens (at the limit, kept), 5 (over it), none (the tokenizer cannot encode it).
    assert ids == [[1, *tok.encode("1+2")], [0], [0]] and skipped.tolist() == [False, True, True]
    assert "1 of 3 prompts skipped: longer than rl.max_prompt_len=4 (the longest has 5 tokens)" in caplog.text
    assert "1 of 3 prompts skipped: the tokenizer cannot encode them" in caplog.text
