"""benchmarks/tpu_rl.py's parts end to end on CPU at tiny shapes (--tiny), so the chip's RL record
cannot rot between chip sessions: the record's fields, each rate its count over its own time as the
run's own metrics.jsonl gives them, the step split adding up to the step, the bound's arithmetic,
the learning run's curve as logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ATTENTION_LAYERS, SteppingClock, benchmark_script


def _benchmark():
    return benchmark_script("tpu_rl")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_part(benchmark, tmp_path: Path, part: str) -> dict:
    out = tmp_path / "tpu_rl.json"
    # In this process ("--in-process"), leaving the tests' compile cache as it is ("--compile-cache ''").
    assert benchmark.main(["--tiny", "--in-process", "--part", part, "--out", str(out), "--run-dir",
                           str(tmp_path / "runs"), "--compile-cache", "", "--hbm-probe-mib", "1"]) == 0
    return json.loads(out.read_text())


def test_both_parts_record_rates_split_bound_and_curve_from_their_own_metrics(tmp_path, monkeypatch):
    benchmark = _benchmark()
    # Attention layers only (helpers.ATTENTION_LAYERS): the record's figures come from the run's
    # metrics and the bound's arithmetic whatever the mixers; tiny's three GDN layers only added to
    # each compile. The learning run's code on the batch part's config: its programs are the batch's,
    # compiled once (chip-learn's own run, and tiny's layers for the batch: the slow test below).
    recipe, words = benchmark.TINY["batch"]
    monkeypatch.setitem(benchmark.TINY, "batch", (recipe, [*words, *ATTENTION_LAYERS]))
    monkeypatch.setitem(benchmark.TINY, "learn", benchmark.TINY["batch"])
    _check_batch(tmp_path, _run_part(benchmark, tmp_path, "batch"))
    record = _run_part(benchmark, tmp_path, "learn")
    assert "batch" in record  # the part run before is kept
    _check_learn(tmp_path, record["learn"], "tiny")


def _check_batch(tmp_path: Path, record: dict) -> None:
    assert record["benchmark"] == "tpu_rl" and record["device"] == "cpu" and "commit" in record
    b = record["batch"]
    grpo = [r for r in _metrics(tmp_path / "runs" / "batch") if r["phase"] == 1]
    timed = grpo[1:]  # the first step compiles
    assert len(grpo) == 2 and b["steps_timed"] == len(timed) == 1
    assert (b["rows"], b["prompts"], b["group_size"], b["max_new_tokens"]) == (16, 4, 4, 8)
    assert b["micro_batches"] == 1 and b["old_logprobs_micro_batches"] == 1 and b["rollout_batches"] == 1
    assert b["updates_per_rollout"] == 2 and "rl.updates_per_rollout=2" in b["command"]
    # The memory plan's lines: each program's count with its need (no budget on a CPU: the fewest).
    assert [line.split(":")[0] for line in b["plan_log"]][:2] == ["rl.micro_batches=1", "rl.micro_batches=1"]
    assert all("the program needs" in line for line in b["plan_log"][:2]), b["plan_log"]
    assert any(line.startswith("rl.rollout_batches=1: the program needs") for line in b["plan_log"]), b["plan_log"]

    # Counts from the metrics themselves: new tokens are the rows' completion lengths; the pi_old
    # pass and the updates (one epoch) each see every token of the rollout's rows once.
    new_tokens = sum(r["completion_len_mean"] * b["rows"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    times = {"rollout": sum(r["rollout_time_s"] for r in timed),
             "old_logprobs": sum(r["old_logprobs_time_s"] for r in timed),
             "update": sum(r["update_time_s"] for r in timed)}
    assert b["rollout"]["new_tokens"] == pytest.approx(new_tokens, rel=1e-12)
    assert b["old_logprobs"]["tokens"] == b["update"]["tokens"] == tokens > new_tokens
    for part, count_key in (("rollout", "new_tokens"), ("old_logprobs", "tokens"), ("update", "tokens")):
        fig = b[part]
        assert fig["time_s"] == pytest.approx(times[part], rel=1e-12) and fig["time_s"] > 0
        assert fig["tokens_per_s"] == pytest.approx(fig[count_key] / times[part], rel=1e-12)

    split = b["step_split_s"]
    assert split["step"] == pytest.approx(sum(r["step_time_s"] for r in timed) / len(timed), rel=1e-12)
    assert split["rollout"] + split["old_logprobs"] + split["update"] + split["rest"] == pytest.approx(split["step"],
                                                                                                      rel=1e-12)
    assert min(split.values()) >= 0  # the loop's parts lie inside its step

    hbm, bound = b["hbm"], b["bound"]
    assert hbm["bytes_per_s"] == max(hbm[k] for k in ("calibration_bytes_per_s", "read_bytes_per_s",
                                                      "copy_bytes_per_s")) == bound["hbm_bytes_per_s"]
    assert bound["rows_in_flight"] == 16 and bound["mean_kv_slots"] == 8 + (b["completion_len_max"] + 1) / 2
    assert bound["tokens_per_s"] == pytest.approx(16 * hbm["bytes_per_s"] / bound["bytes_per_decode_step"]["total"],
                                                  rel=1e-12)
    assert b["rollout_over_bound"] == pytest.approx(b["rollout"]["tokens_per_s"] / bound["tokens_per_s"], rel=1e-12)
    assert "peak_bytes_in_use" in b  # None on a CPU


def _check_learn(tmp_path: Path, learn: dict, recipe: str) -> None:
    curve = [r["reward_mean"] for r in _metrics(tmp_path / "runs" / "learn") if r["phase"] == 1]
    assert learn["recipe"] == recipe and learn["reward_mean_curve"] == curve and len(curve) == 2
    assert learn["reward_first"] == curve[0]
    assert learn["reward_last_5_mean"] == pytest.approx(sum(curve) / len(curve))
    assert learn["first_at_most_0.6"] == (curve[0] <= 0.6)
    assert learn["last_5_at_least_0.9"] == (learn["reward_last_5_mean"] >= 0.9)
    assert 0 < learn["steps_s"] < learn["wall_s"] and learn["within_600_s"] == (learn["wall_s"] <= 600)
    assert learn["plot"] == str(tmp_path / "runs" / "learn" / "metrics.png")  # docs/ shows a chip's run only


@pytest.mark.slow
def test_the_script_runs_each_part_in_a_watched_child(tmp_path):
    """The chip's path: each part a child process of its own (tiny's 8 simulated devices for the
    batch, chip-learn's recipe for the learning run), the record merged after each."""
    out = tmp_path / "tpu_rl.json"
    assert _benchmark().main(["--tiny", "--out", str(out), "--run-dir", str(tmp_path / "runs"), "--compile-cache",
                              str(tmp_path / "xla"), "--hbm-probe-mib", "1"]) == 0
    record = json.loads(out.read_text())
    _check_batch(tmp_path, record)
    _check_learn(tmp_path, record["learn"], "chip-learn")


def test_the_hbm_probe_rates_are_bytes_moved_over_the_clocks_seconds(monkeypatch):
    benchmark = _benchmark()
    monkeypatch.setattr(benchmark, "time", SteppingClock(0.25))  # every timed call: 0.25 s
    probe = benchmark.hbm_probe(1, repeats=3)
    # 1 MiB of bf16: 2^19 elements. The sum reads them once (2^20 bytes); the copy reads and writes (2^21).
    assert probe == {"probe_mib": 1, "read_bytes_per_s": 2**20 / 0.25, "copy_bytes_per_s": 2**21 / 0.25}


def _grpo_row(step: int, **fields) -> dict:
    row = {"phase": 1, "step": step, "rollout_batches": 2.0, "micro_batches": 1.0, "old_logprobs_micro_batches": 1.0,
           "rollout_tokens_per_s": 0.0, "completion_len_max": 6.0}
    return {**row, **fields}


def test_the_batch_figures_from_stubbed_metrics_by_hand(monkeypatch, tmp_path):
    """Two sampler passes, two epochs over the rollout: the bound's rows in flight are one pass's,
    the update's tokens every epoch's; the first step is left out of the timed figures."""
    benchmark = _benchmark()
    overrides = ["rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=8", "rl.max_prompt_len=8",
                 "rl.updates_per_rollout=4", "rl.epochs_per_rollout=2", "rl.rollout_batches=2"]
    monkeypatch.setitem(benchmark.TINY, "batch", ("tiny", overrides))
    t = dict(rollout_tokens=0.0, rollout_time_s=0.0, old_logprobs_time_s=0.0, update_time_s=0.0, tokens=0.0)
    rows = [_grpo_row(1, step_time_s=90.0, completion_len_mean=1.0, **t),  # compiles: not timed
            _grpo_row(2, step_time_s=10.0, rollout_tokens=64.0, rollout_time_s=4.0, old_logprobs_time_s=1.0,
                      update_time_s=3.0, tokens=200.0, completion_len_mean=4.0, completion_len_max=5.0),
            _grpo_row(3, step_time_s=12.0, rollout_tokens=96.0, rollout_time_s=6.0, old_logprobs_time_s=1.0,
                      update_time_s=4.0, tokens=216.0, completion_len_mean=6.0, completion_len_max=7.0)]
    monkeypatch.setattr(benchmark, "run_rl", lambda recipe, words, out, plan_log=None: rows)
    monkeypatch.setattr(benchmark, "hbm_probe", lambda mib: {"probe_mib": mib, "read_bytes_per_s": 1e9,
                                                             "copy_bytes_per_s": 2e9})
    args = benchmark.harness.parser(benchmark.__doc__, benchmark.__file__, raw=True).parse_args([])
    args.tiny, args.hbm_probe_mib = True, 1
    b = benchmark.batch_part(args, tmp_path)
    assert b["steps_timed"] == 2 and b["rows"] == 16 and b["rollout_batches"] == 2
    assert b["rollout"] == {"new_tokens": 160.0, "time_s": 10.0, "tokens_per_s": 16.0}
    assert b["old_logprobs"] == {"tokens": 416.0, "time_s": 2.0, "tokens_per_s": 208.0}
    assert b["update"] == {"tokens": 832.0, "time_s": 7.0, "tokens_per_s": 832.0 / 7.0}  # two epochs
    assert b["step_split_s"] == {"rollout": 5.0, "old_logprobs": 1.0, "update": 3.5, "step": 11.0, "rest": 1.5}
    assert b["completion_len_mean"] == 5.0 and b["completion_len_max"] == 7.0 and b["first_step_s"] == 90.0
    # One pass's rows in flight (16 / 2), the prompt's 8 slots and the mean of 7 decode steps' slots.
    bound = b["bound"]
    assert bound["rows_in_flight"] == 8 and bound["mean_kv_slots"] == 8 + (7 + 1) / 2
    assert b["hbm"]["bytes_per_s"] == bound["hbm_bytes_per_s"] == max(
        b["hbm"]["calibration_bytes_per_s"], 1e9, 2e9)
    assert b["rollout_over_bound"] == 16.0 / bound["tokens_per_s"]


def test_the_learning_runs_median_step_is_of_its_grpo_steps(monkeypatch, tmp_path):
    benchmark = _benchmark()
    rows = [{"phase": 0, "step_time_s": s} for s in (100.0, 100.0, 100.0, 100.0)] + [
        {"phase": 1, "step_time_s": s, "reward_mean": r} for s, r in ((5.0, 0.5), (1.0, 0.9), (3.0, 1.0))]
    monkeypatch.setattr(benchmark, "run_rl", lambda recipe, words, out, plan_log=None: rows)
    args = benchmark.harness.parser(benchmark.__doc__, benchmark.__file__, raw=True).parse_args([])
    args.tiny = True
    learn = benchmark.learn_part(args, tmp_path, started=0.0)
    assert learn["grpo_step_s_median"] == 3.0 and learn["steps_s"] == 409.0  # the median of 1, 3, 5
    assert learn["grpo_steps"] == 3 and learn["warmup_steps"] == 4 and learn["reward_first"] == 0.5
    assert learn["reward_last_5_mean"] == pytest.approx(0.8) and learn["first_at_most_0.6"]
    assert not learn["last_5_at_least_0.9"]


def test_the_pi_old_figures_count_only_the_steps_that_ran_the_pass():
    """Two timed steps, only the second with a pi_old pass (1 s over its 300 tokens): the pass's
    tokens are that step's 300, its rate 300 / 1; the update's are both steps' 100 + 300 over 2 + 4 s."""
    steps = [_grpo_row(2, step_time_s=5.0, rollout_tokens=10.0, rollout_time_s=2.0, old_logprobs_time_s=0.0,
                       update_time_s=2.0, tokens=100.0, completion_len_mean=2.0),
             _grpo_row(3, step_time_s=9.0, rollout_tokens=30.0, rollout_time_s=3.0, old_logprobs_time_s=1.0,
                       update_time_s=4.0, tokens=300.0, completion_len_mean=4.0)]
    b = _benchmark().batch_figures(steps)
    assert b["old_logprobs"] == {"tokens": 300.0, "time_s": 1.0, "tokens_per_s": 300.0}
    assert b["update"] == {"tokens": 400.0, "time_s": 6.0, "tokens_per_s": 400.0 / 6.0}
    # Means per step: 2.5 + 0.5 + 3 of the step's 7, rest 1.
    assert b["step_split_s"] == {"rollout": 2.5, "old_logprobs": 0.5, "update": 3.0, "step": 7.0, "rest": 1.0}


def test_the_last_five_steps_mean_reward_is_of_those_five_only():
    """Seven GRPO steps: the last five rewards 0.6, 0.8, 1.0, 1.0, 1.0 average 0.88 (not their sum
    over seven, 0.629); under 0.9, so the condition fails."""
    rows = [{"phase": 0}] + [{"phase": 1, "reward_mean": r} for r in (0.0, 0.2, 0.6, 0.8, 1.0, 1.0, 1.0)]
    learn = _benchmark().learn_figures(rows)
    assert learn["grpo_steps"] == 7 and learn["warmup_steps"] == 1 and learn["reward_first"] == 0.0
    assert learn["reward_last_5_mean"] == pytest.approx(4.4 / 5, rel=1e-12)
    assert learn["first_at_most_0.6"] and not learn["last_5_at_least_0.9"]
