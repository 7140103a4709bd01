"""benchmarks/tpu_rl.py's figures that the smoke tests leave open: which HBM rate the bound is
judged by, how a part's record merges with another device's, the learning part's median step and
wall-time condition, a cut part's record. Stubbed runs and devices; nothing compiles."""

import json
import time
from types import SimpleNamespace

import pytest

from helpers import benchmark_script


def _tpu_rl():
    return benchmark_script("tpu_rl")


def test_hbm_rates_judge_by_the_highest_of_calibration_and_probe(monkeypatch):
    import hybridmoe.analysis.hardware as hardware
    import hybridmoe.kernels.platform as platform

    rl = _tpu_rl()
    monkeypatch.setattr(platform, "generation_of_device", lambda device: "v6e")
    monkeypatch.setattr(hardware, "hardware_for", lambda gen: SimpleNamespace(hbm_bytes_per_s=800e9))
    monkeypatch.setattr(hardware, "read_calibration", lambda: {"v6e": {"measured": {"commit": "abc1234"}}})
    got = rl.hbm_rates({"probe_mib": 256, "read_bytes_per_s": 900e9, "copy_bytes_per_s": 700e9})
    assert got["generation"] == "v6e" and got["calibration_source"] == "abc1234" and got["probe_mib"] == 256
    assert got["judged_by"] == "read_bytes_per_s" and got["bytes_per_s"] == 900e9
    assert got["calibration_bytes_per_s"] == 800e9 and got["copy_bytes_per_s"] == 700e9
    slow = rl.hbm_rates({"probe_mib": 256, "read_bytes_per_s": 500e9, "copy_bytes_per_s": 600e9})
    assert slow["judged_by"] == "calibration_bytes_per_s" and slow["bytes_per_s"] == 800e9
    monkeypatch.setattr(platform, "generation_of_device", lambda device: None)
    monkeypatch.setattr(hardware, "read_calibration", lambda: {})
    cpu = rl.hbm_rates({"probe_mib": 1, "read_bytes_per_s": 1.0, "copy_bytes_per_s": 1.0})
    assert cpu["generation"] == "v5e" and cpu["calibration_source"] == "maker's figures"


def test_a_part_keeps_the_other_part_only_from_the_same_device(tmp_path):
    rl = _tpu_rl()
    out = tmp_path / "tpu_rl.json"
    out.write_text(json.dumps({"device": "TPU v5 lite", "learn": {"grpo_steps": 3}, "batch": {"old": 1}}))
    written = []
    rl.merge_part(out, "batch", {"new": 2}, "TPU v5 lite", lambda **f: written.append(f))
    assert written[-1] == {"learn": {"grpo_steps": 3}, "batch": {"new": 2}}
    rl.merge_part(out, "batch", {"new": 2}, "TPU v6 lite", lambda **f: written.append(f))
    assert written[-1] == {"batch": {"new": 2}}
    rl.merge_part(tmp_path / "none.json", "learn", {"x": 1}, "cpu", lambda **f: written.append(f))
    assert written[-1] == {"learn": {"x": 1}}


def test_the_learning_part_median_step_is_of_grpo_steps_and_wall_time_is_judged_against_600_s(monkeypatch, tmp_path):
    """GRPO step seconds 3, 1, 2, 9 (sorted 1, 2, 3, 9: the upper middle, 3); the warm-up step's 50 s
    counts in steps_s (50 + 15 = 65) but not in the median; 700 s since the start: not within 600 s."""
    rl = _tpu_rl()
    rows = [{"phase": 0, "step": 0, "step_time_s": 50.0, "reward_mean": 0.0}]
    rows += [{"phase": 1, "step": i + 1, "step_time_s": s, "reward_mean": 0.5} for i, s in enumerate((3.0, 1.0, 2.0, 9.0))]
    monkeypatch.setattr(rl, "run_rl", lambda recipe, overrides, out, plan_log=None: rows)
    args = SimpleNamespace(tiny=True, learn_set=[], batch_set=[], set=[])
    monkeypatch.setattr(rl, "part_words", lambda part, a: ("demo", []))
    got = rl.learn_part(args, tmp_path, time.perf_counter() - 700.0)
    assert got["grpo_step_s_median"] == 3.0 and got["steps_s"] == 65.0
    assert got["within_600_s"] is False and got["wall_s"] >= 700.0
    assert got["grpo_steps"] == 4 and got["warmup_steps"] == 1
    fast = rl.learn_part(args, tmp_path, time.perf_counter() - 10.0)
    assert fast["within_600_s"] is True


def test_a_cut_learning_part_records_why_and_the_curve_it_reached(tmp_path, monkeypatch):
    """Rewards 0.5 then 0.95 x 5: first 0.5 (<= 0.6), last five mean 0.95 (>= 0.9)."""
    rl = _tpu_rl()
    import hybridmoe.tools.record as record

    run_dir = tmp_path / "runs"
    (run_dir / "learn").mkdir(parents=True)
    rows = [{"phase": 1, "step": i, "reward_mean": r} for i, r in enumerate([0.5] + [0.95] * 5)]
    (run_dir / "learn" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setattr(record, "source_commit", lambda: "c0ffee")
    out = tmp_path / "tpu_rl.json"
    out.write_text(json.dumps({"benchmark": "tpu_rl", "batch": {"kept": True}}))
    rl.record_cut(out, "learn", "stopped after 700 s", run_dir)
    got = json.loads(out.read_text())
    assert got["batch"] == {"kept": True}
    learn = got["learn"]
    assert learn["cut"] == "stopped after 700 s" and learn["commit"] == "c0ffee"
    assert learn["reward_first"] == 0.5 and learn["reward_last_5_mean"] == pytest.approx(0.95)
    assert learn["first_at_most_0.6"] is True and learn["last_5_at_least_0.9"] is True
    assert learn["grpo_steps"] == 6
