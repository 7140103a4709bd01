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


def test_eval_figures_per_task_by_hand(monkeypatch):
    """evaluate() on made-up completions (the sampler stubbed), 3 samples a prompt, reward = the
    completion as a number ("x" raises: a reward error, a failed sample), pass threshold 1.0:

      add p0: 1, 0, 1      passes 2 (a reward of exactly 1.0 passes)   pass@1 2/3  pass@3 1
      add p1: 0.5, x, 1    passes 1 (the raising one fails)           pass@1 1/3  pass@3 1
      mul p2: x, 0, 0.5    passes 0                                    pass@1 0    pass@3 0
      mul p3: 2, 1, 1      passes 3                                    pass@1 1    pass@3 1

    add: pass@1 (2/3 + 1/3) / 2 = 0.5, pass@3 1, mean reward (1 + 0 + 1 + 0.5 + 0 + 1) / 6 = 0.5833,
    1 reward error; mul: pass@1 0.5, pass@3 0.5, mean reward (0 + 0 + 0.5 + 2 + 1 + 1) / 6 = 0.75, 1 error."""
    from hybridmoe.data.arithmetic import Example
    from hybridmoe.tools.evaluate import evaluate

    texts = ["1", "0", "1", "0.5", "x", "1", "x", "0", "0.5", "2", "1", "1"]
    examples = [Example(f"p{i}", "", fields={"task": task}) for i, task in enumerate(("add", "add", "mul", "mul"))]

    def sampler(policy, prompts, **kwargs):
        assert prompts == [e.prompt for e in examples for _ in range(3)]
        return [{"prompt": p, "completion": t} for p, t in zip(prompts, texts)], {"batches": 1}

    monkeypatch.setattr("hybridmoe.rl.policy_io.generate_texts", sampler)
    rec = evaluate(None, examples, [(lambda prompt, completion: float(completion), 1.0)], samples=3,
                   pass_threshold=1.0, generate_kwargs={})
    add, mul = rec["tasks"]["add"], rec["tasks"]["mul"]
    assert (add["prompts"], add["samples"], add["reward_errors"]) == (2, 6, 1)
    assert add["pass@1"] == pytest.approx(0.5) and add["pass@3"] == 1.0
    assert add["mean_reward"] == pytest.approx(3.5 / 6)
    assert (mul["prompts"], mul["samples"], mul["reward_errors"]) == (2, 6, 1)
    assert mul["pass@1"] == pytest.approx(0.5) and mul["pass@3"] == pytest.approx(0.5)
    assert mul["mean_reward"] == pytest.approx(0.75)
    assert rec["reward_errors"] == 2 and rec["reward_error_kinds"] == {"raised:ValueError": 2}
    assert [c["reward"] for c in rec["completions"]] == [1, 0, 1, 0.5, 0, 1, 0, 0, 0.5, 2, 1, 1]


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


def test_a_runs_latest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    """--run takes the latest finished checkpoint: with steps 9 and 10 kept (and orbax's unfinished
    11), step 10 and its own metadata (train.seed 10 here), though "9" sorts after "10" as text."""
    from helpers import tiny_config
    from hybridmoe.rl.policy_io import run_config

    for step in (9, 10):
        meta = tmp_path / "checkpoints" / str(step) / "meta"
        meta.mkdir(parents=True)
        (meta / "metadata").write_text(json.dumps({"config": json.loads(tiny_config(f"train.seed={step}")
                                                                        .model_dump_json())}))
    (tmp_path / "checkpoints" / "11.orbax-checkpoint-tmp-1").mkdir()
    cfg, step, _ = run_config(tmp_path)
    assert (step, cfg.train.seed) == (10, 10)


def test_help_names_recipes_hf_dirs_and_overrides(capsys):
    from hybridmoe.cli import COMMANDS
    for words in [[], *([name] for name in COMMANDS)]:
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        text = capsys.readouterr().out
        assert "recipe=hf:DIR" in text and "section.key=value" in text and "recipe=NAME" in text, words


def test_eval_whose_reward_raises_on_every_sample_exits_non_zero_unless_accepted(tmp_path, capsys):
    rewards = tmp_path / "broken_rewards.py"
    rewards.write_text("def broken(prompt, completion, example):\n    raise KeyError('answer')\n")
    out = tmp_path / "eval.json"
    words = ["eval", "--hf", str(HF_TINY), "--prompts", str(DATA / "prompts.jsonl"), "--samples", "2",
             "--max-new-tokens", "6", "--batch-size", "16", f"rl.reward=[{rewards}:broken]", "--out", str(out)]
    assert main(words) == 1
    captured = capsys.readouterr()
    assert "reward errors 24 of 24" in captured.out and "reward errors 8 of 8" in captured.out
    assert "every one of the" in captured.err and "--accept-reward-errors" in captured.err
    assert "raised:KeyError" in captured.err and not out.exists()  # no record that looks like a score
    assert main([*words, "--accept-reward-errors"]) == 0
    rec = json.loads(out.read_text())
    total = sum(t["samples"] for t in rec["tasks"].values())
    assert rec["reward_errors"] == total == sum(t["reward_errors"] for t in rec["tasks"].values())


def test_generate_out_holds_the_token_ids_and_tokens_per_s_leaves_the_compile_out(tmp_path, capsys):
    from hybridmoe.data.tokenizer import load_tokenizer
    out = tmp_path / "gen.jsonl"
    assert main(["generate", "--hf", str(HF_TINY), "--prompt", "What is 2 plus 3?", "--prompt", "1+1=",
                 "--max-new-tokens", "6", "--batch-size", "16", "--temperature", "0", "--out", str(out)]) == 0
    tok = load_tokenizer(HF_TINY)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    for rec in recs:
        assert rec["prompt_ids"] == tok.encode(rec["prompt"])
        assert len(rec["completion_ids"]) == rec["tokens"] and tok.decode(rec["completion_ids"]) == rec["completion"]
    err = capsys.readouterr().err
    assert "tokens/s, compile not included (compiled in" in err
    # The count behind tokens/s is the two prompts' new tokens (read from the records' ids), not the
    # 16 rows' of the batch (14 of them padding that repeats the last prompt).
    new_tokens = sum(len(rec["completion_ids"]) for rec in recs)
    assert 0 < new_tokens <= 2 * 6
    assert f"{new_tokens} new tokens in 1 batch(es) of 16 rows:" in err, err


def test_chat_without_a_chat_template_says_to_drop_chat(tmp_path, capsys):
    import shutil
    d = tmp_path / "no_template"
    shutil.copytree(HF_TINY, d)
    (d / "chat_template.jinja").unlink()
    assert main(["generate", "--hf", str(d), "--prompt", "hi", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "drop --chat" in err and str(d) in err and "messages" not in err and "Traceback" not in err
