"""Rewards from the user (rl.reward=file.py:fn / module:fn), the shipped answer rewards, and a GRPO
run on a JSONL prompt set from the fixture checkpoint with a reward that sometimes raises."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.cli import main
from hybridmoe.rl.answer_rewards import answer_format, final_answer, final_answer_match
from hybridmoe.rl.reward_loading import RewardSpecError, load_reward, load_rewards
from hybridmoe.rl.rewards import apply_reward_error_policy, score_completions

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY, DATA = FIXTURES / "hf_tiny", FIXTURES / "data"


@pytest.mark.parametrize("completion, answer, want", [
    ("so \\boxed{42}", "42", 1.0),
    ("\\boxed{41} no, \\boxed{42}", "42", 1.0),            # the last one counts
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),        # nested braces
    ("work...\n#### 1,000", "1000", 1.0),                  # GSM8K style, numbers as numbers
    ("#### $1000.00", "Natalia sold 48/2 = 24 ... 1000\n#### 1000", 1.0),  # a GSM8K solution as the reference
    ("42", "42", 0.0),                                     # no final-answer marker
    ("\\boxed{42", "42", 0.0),                             # unclosed
    ("#### 43", "42", 0.0),
])
def test_final_answer_match(completion, answer, want):
    assert final_answer_match("q", completion, {"answer": answer}) == want


def test_final_answer_and_format():
    assert final_answer("a \\boxed{x} b #### y") == "x" and final_answer("nothing") is None
    assert answer_format("q", "so the answer is \\boxed{7}.", {}) == 1.0
    assert answer_format("q", "\\boxed{7} and more words", {}) == 0.0      # must end with it
    assert answer_format("q", "\\boxed{7} #### 7", {}) == 0.0              # exactly one
    assert answer_format("q", "steps\n#### 7", {}) == 1.0
    with pytest.raises(KeyError, match="answer"):
        final_answer_match("q", "\\boxed{1}", {})


def test_load_from_file_and_module_and_weights():
    (r_file, w1), (r_mod, w2) = load_rewards(
        [f"{DATA / 'rewards.py'}:answer_in_boxed_or_hashes", "hybridmoe.rl.answer_rewards:answer_format"], [1.0, 0.25])
    assert (w1, w2) == (1.0, 0.25)
    assert r_file("q", "\\boxed{5}", {"answer": "5"}) == 1.0 and r_mod("q", "#### 5", {}) == 1.0
    rewards, skipped, counts = score_completions(
        [(r_file, 1.0), (r_mod, 0.25)], ["q", "q"], ["\\boxed{5}", "#### 4 then"], [{"answer": "5"}, {"answer": "4"}])
    np.testing.assert_allclose(rewards, [1.25, 0.25])  # "4 then" is not the answer; the form is right
    assert not skipped.any() and counts["scored"] == 2


@pytest.mark.parametrize("spec, needle", [
    ("no_colon", "expected path/to/file.py:function"),
    ("missing_file.py:f", "no file missing_file.py"),
    ("hybridmoe.no_such_module:f", "cannot import module"),
    ("hybridmoe.rl.answer_rewards:nope", "has no 'nope'"),
    ("hybridmoe.rl.answer_rewards:re", "not a function"),
])
def test_bad_specs_are_named(spec, needle):
    with pytest.raises(RewardSpecError, match=needle):
        load_reward(spec)


def test_a_file_that_fails_to_import_is_named(tmp_path):
    bad = tmp_path / "r.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RewardSpecError, match=f"importing {bad} failed: SyntaxError"):
        load_reward(f"{bad}:f")


def test_reward_error_policies():
    def flaky(prompt, completion, example):
        if completion == "boom":
            raise RuntimeError("boom")
        return math.nan if completion == "nan" else 1.0
    flaky.takes_example = True
    rewards, failed, counts = score_completions([(flaky, 1.0)], ["q"] * 4, ["ok", "boom", "ok", "nan"], [{}] * 4)
    assert failed.tolist() == [False, True, False, True] and rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert counts["raised:RuntimeError"] == 1 and counts["nonfinite"] == 1
    none = np.zeros(4, bool)
    assert apply_reward_error_policy("skip_sample", failed, none, 2).tolist() == [False, True, False, True]
    assert apply_reward_error_policy("zero", failed, none, 2).tolist() == [False] * 4
    assert apply_reward_error_policy("skip_group", np.array([False, False, False, True]), none, 2).tolist() == \
        [False, False, True, True]
    # A skipped prompt's rows (group 1 here) were never scored: the loop hands them in as failed, and
    # they stay masked under every policy, "zero" included (a placeholder is not a reward of 0.0).
    prompt_skipped = np.array([False, False, True, True])
    failed = np.array([False, True, True, True])
    assert apply_reward_error_policy("skip_sample", failed, prompt_skipped, 2).tolist() == [False, True, True, True]
    assert apply_reward_error_policy("zero", failed, prompt_skipped, 2).tolist() == [False, False, True, True]
    assert apply_reward_error_policy("skip_group", failed, prompt_skipped, 2).tolist() == [True] * 4


RL_WORDS = ["rl", "rl.task=prompts", f"data.prompts={DATA / 'prompts.jsonl'}", "rl.warmup_steps=0", "rl.steps=2",
            "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_prompt_len=64", "rl.max_new_tokens=6",
            "rl.checkpoint_every=0", "--init-hf", str(HF_TINY)]


def test_bad_reward_path_stops_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*RL_WORDS, "rl.reward=nowhere/r.py:f", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rl.reward=nowhere/r.py:f: no file nowhere/r.py" in err and "Traceback" not in err
    assert not out.exists()


def test_grpo_on_a_jsonl_prompt_set_survives_a_raising_reward(tmp_path):
    flaky = tmp_path / "flaky.py"
    flaky.write_text("def by_task(prompt, completion, example):\n"
                     "    if example['task'] == 'mul':\n        raise ValueError('no multiplication reward')\n"
                     "    return float(len(completion) % 2)\n")
    out = tmp_path / "run"
    assert main([*RL_WORDS, f"rl.reward=[{DATA / 'rewards.py'}:answer_in_boxed_or_hashes, {flaky}:by_task]",
                 "rl.reward_weights=[1.0, 0.5]", "--out", str(out)]) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(math.isfinite(r["loss"]) for r in recs)
    # 4 of the 16 prompts are `mul`: over 8 prompts some step very likely drew one (fixed seed: it did).
    assert sum(r["reward_errors"] for r in recs) > 0
    assert sum(r["reward_errors"] for r in recs) == sum(r["rewards_skipped"] for r in recs)


def test_a_prompt_set_longer_than_the_prompt_slots_is_refused_up_front(tmp_path, capsys):
    out = tmp_path / "run"
    words = [w for w in RL_WORDS if not w.startswith("rl.max_prompt_len")]
    assert main([*words, "rl.max_prompt_len=8", "rl.reward=hybridmoe.rl.answer_rewards:answer_format",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "every prompt is longer than rl.max_prompt_len=8" in err and "raise rl.max_prompt_len" in err
    assert not out.exists()
