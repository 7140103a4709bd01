"""benchmarks/tpu_rl.py's parts end to end on CPU at tiny shapes (--tiny), so the chip's RL record
cannot rot between chip sessions: the record's fields, each rate its count over its own time as the
run's own metrics.jsonl gives them, the step split adding up to the step, the bound's arithmetic,
the learning run's curve as logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import benchmark_script


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
    # The learning run's code on the batch part's config: its programs are the batch's, compiled once
    # (chip-learn's own run: the slow test below).
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
