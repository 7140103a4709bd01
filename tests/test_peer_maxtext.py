"""benchmarks/peer_maxtext.py --tiny: MaxText's Qwen3.5 training step beside ours on the CPU, and the
GDN layer alone both ways, written to a record.

Needs MaxText installed (docs/tpu.md, "A peer on the chip: MaxText"): importable as it is, or in the
repository's .maxtext-site/ (`scripts/maxtext_wheels.sh fetch` then `install`). Skipped, with the reason, where it is
not there or does not import; slow (a few minutes of compiling on a CPU), so not run by CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL_SITE = ROOT / ".maxtext-site"  # where scripts/maxtext_wheels.sh install puts it
SITE = str(LOCAL_SITE) if (LOCAL_SITE / "maxtext" / "__init__.py").is_file() else None


def maxtext_present() -> bool:
    return SITE is not None or importlib.util.find_spec("maxtext") is not None


@pytest.mark.slow
@pytest.mark.skipif(not maxtext_present(),
                    reason="maxtext is not installed: scripts/maxtext_wheels.sh fetch, then install (into .maxtext-site/)")
def test_tiny_run_writes_both_arms_and_the_gdn_layer(tmp_path):
    out = tmp_path / "peer.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "peer_maxtext.py"), "--tiny", "--steps", "2",
               "--gdn-rounds", "2", "--out", str(out)]
    if SITE:
        command += ["--maxtext-site", SITE]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    record = json.loads(out.read_text()) if out.is_file() else {}
    if proc.returncode == 2 and record.get("maxtext_import_error"):
        pytest.skip(f"maxtext does not import here: {record['maxtext_import_error']}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    arms = record["arms"]
    assert set(arms) == {"ours", "maxtext_remat_full"}
    for name, arm in arms.items():
        assert arm["measured_s"] > 0 and arm["tokens_per_s"] > 0, name
        assert len(arm["step_times_s"]) == 2, name  # one timed step in each of two visits
        assert all(loss is not None and loss == loss for loss in arm["losses"]), name  # finite, not NaN
        assert arm["kernels"]["custom_calls"] is not None and arm["memory"]["compiled"]["argument"] > 0, name
    assert arms["maxtext_remat_full"]["kernels"]["configured"]["sparse_matmul"] == "True"
    assert record["maxtext_version"].startswith("0.")
    for side in ("ours", "maxtext"):
        assert record["gdn_layer"][side]["mean_s"] > 0
    assert record["gdn_layer_over_ours"] > 0


def test_a_later_run_keeps_the_earlier_runs_other_arms_of_the_same_device(tmp_path):
    """One chip call times ours beside MaxText at remat full, the next ours beside remat minimal: the
    record holds both MaxText arms, each with its own run's over_ours and commit, the later ours; a
    record of another device is not merged into."""
    from helpers import benchmark_script

    harness = benchmark_script("harness")
    out = tmp_path / "tpu_peer.json"
    out.write_text(json.dumps({"device": "TPU v5 lite x 1", "arms": {
        "ours": {"measured_s": 0.4, "over_ours": 1.0, "commit": "aaa"},
        "maxtext_remat_full": {"measured_s": 0.8, "over_ours": 2.0, "commit": "aaa"}}}))
    now = {"ours": {"measured_s": 0.5, "over_ours": 1.0}, "maxtext_remat_minimal": {"measured_s": 0.75, "over_ours": 1.5}}
    merged = harness.merged_with_earlier(out, "arms", now, "TPU v5 lite x 1", "bbb")
    assert merged == {"ours": {"measured_s": 0.5, "over_ours": 1.0, "commit": "bbb"},
                      "maxtext_remat_full": {"measured_s": 0.8, "over_ours": 2.0, "commit": "aaa"},
                      "maxtext_remat_minimal": {"measured_s": 0.75, "over_ours": 1.5, "commit": "bbb"}}
    assert harness.merged_with_earlier(out, "arms", now, "cpu", "bbb") == {n: {**r, "commit": "bbb"} for n, r in now.items()}
    assert harness.merged_with_earlier(tmp_path / "none.json", "arms", now, "cpu", "c")["ours"]["commit"] == "c"


def test_the_arms_figures_come_from_their_timed_steps():
    """Figures by hand from stubbed arms: ours 600 tokens a step in 0.2 and 0.4 s (mean 0.3 s, 2000
    tokens/s), MaxText's in 0.5, 0.7 and 0.6 s (mean 0.6 s, 1000 tokens/s, twice ours); an odd --steps
    rounds each visit's timed steps up."""
    from types import SimpleNamespace

    from helpers import benchmark_script

    peer = benchmark_script("peer_maxtext")
    common = {"tokens": 600, "losses": [], "compile_s": 1.0, "memory": {}, "device_after_visits": [], "kernels": {}}
    ours = object.__new__(peer.OursArm)
    vars(ours).update(common, times=[0.2, 0.4], overrides=["model.num_layers=4"])
    maxtext = SimpleNamespace(**common, times=[0.5, 0.7, 0.6], argv=["maxtext", "base.yml", "steps=100"])
    rows = peer.arm_rows({"ours": ours, "maxtext_remat_full": maxtext})
    assert rows["ours"]["measured_s"] == pytest.approx(0.3) and rows["ours"]["tokens_per_s"] == pytest.approx(2000)
    assert rows["maxtext_remat_full"]["measured_s"] == pytest.approx(0.6)
    assert rows["maxtext_remat_full"]["tokens_per_s"] == pytest.approx(1000)
    assert rows["maxtext_remat_full"]["over_ours"] == pytest.approx(2.0) and rows["ours"]["over_ours"] == 1.0
    assert rows["ours"]["settings"] == ["model.num_layers=4"] and rows["maxtext_remat_full"]["settings"] == ["steps=100"]
    assert [peer.steps_per_visit(SimpleNamespace(steps=n)) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]


def test_the_device_memory_after_a_visit_keeps_its_peak(monkeypatch):
    import jax

    from helpers import benchmark_script

    peer = benchmark_script("peer_maxtext")
    stats = {"bytes_in_use": 3 * 2**30, "peak_bytes_in_use": 5 * 2**30, "bytes_limit": 16 * 2**30, "num_allocs": 7}
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device(stats)])
    assert peer.device_memory() == {"bytes_in_use": 3 * 2**30, "peak_bytes_in_use": 5 * 2**30, "bytes_limit": 16 * 2**30}


class _Device:
    """A device that reports these memory stats."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats
