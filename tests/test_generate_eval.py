"""`hybridmoe generate` and `hybridmoe eval` from a Hugging Face folder or a run's checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.cli import main
from hybridmoe.tools.evaluate import pass_at_k

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY, DATA = FIXTURES / "hf_tiny", FIXTURES / "data"


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 * 2) / (4 * 3))  # 1 - C(3,2)/C(4,2)
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(4, 1, 5)


def test_eval_on_a_prompt_set_writes_a_record_per_task(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--hf", str(HF_TINY), "--prompts", str(DATA / "prompts.jsonl"), "--samples", "2",
                 "--max-new-tokens", "6", "--batch-size", "16",
                 f"rl.reward=[{DATA / 'rewards.py'}:brevity, hybridmoe.rl.answer_rewards:answer_format]",
                 "rl.reward_weights=[1.0, 0.5]", "--pass-threshold", "0.5", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    lines = [json.loads(x) for x in (DATA / "prompts.jsonl").read_text().splitlines()]
    assert set(rec["tasks"]) == {"add", "mul"} and rec["tasks"]["add"]["prompts"] == sum(x["task"] == "add" for x in lines)
    rewards = np.array([c["reward"] for c in rec["completions"]])
    assert len(rewards) == 2 * len(lines) and rec["generation"]["batches"] == 2
    n_add = rec["tasks"]["add"]["samples"]
    assert rec["tasks"]["add"]["mean_reward"] == pytest.approx(rewards[:n_add].mean(), rel=1e-6)
    for t in rec["tasks"].values():
        assert 0 <= t["pass@1"] <= t["pass@2"] <= 1
    assert "add:" in capsys.readouterr().out and rec["machine"]


@pytest.mark.parametrize("words, needle", [
    (["generate", "--prompt", "x"], "exactly one of --hf DIR"),
    (["generate", "--hf", str(HF_TINY)], "give --prompts FILE"),
    (["generate", "--run", "nowhere", "--prompt", "x"], "--run nowhere: no checkpoint"),
    (["eval", "--hf", str(HF_TINY), "--prompts", str(DATA / "prompts.jsonl")], "pass rl.reward="),
])
def test_bad_invocations_are_one_line(words, needle, capsys):
    assert main(words) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.slow  # a training compile and a sampler compile
def test_generate_from_a_runs_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "train.steps=1", "--init-hf", str(HF_TINY), "--out", str(run)]) == 0
    out = tmp_path / "gen.jsonl"
    assert main(["generate", "--run", str(run), "--prompt", "1+2=", "--max-new-tokens", "4", "--temperature", "0",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["prompt"] == "1+2=" and 1 <= rec["tokens"] <= 4


def test_help_names_recipes_hf_dirs_and_overrides(capsys):
    from hybridmoe.cli import COMMANDS
    for words in [[], *([name] for name in COMMANDS)]:
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        text = capsys.readouterr().out
        assert "recipe=hf:DIR" in text and "section.key=value" in text and "recipe=NAME" in text, words
