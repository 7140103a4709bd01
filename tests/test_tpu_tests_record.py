"""benchmarks/tpu_tests.py's record: a rerun on the same device replaces the outcomes of the tests it
ran (named with its commit) and keeps the others with theirs; an earlier record of another device
is not merged. The record is written by the plugin's own `write`, on this host (device "cpu")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_tests  # noqa: E402

EARLIER = {"t::fixed": {"outcome": "failed", "s": 3.0, "failure": "AssertionError", "commit": "c1"},
           "t::stands": {"outcome": "passed", "s": 1.0, "commit": "c1"},
           "t::skipped": {"outcome": "skipped", "s": 0.0, "commit": "c1"}}


def _write(out: Path, device: str, monkeypatch) -> dict:
    out.write_text(json.dumps({"benchmark": "tpu_tests", "device": device, "tests": EARLIER}))
    monkeypatch.setattr("hybridmoe.tools.record.source_commit", lambda: "c2")
    outcomes = tpu_tests.Outcomes(str(out))
    outcomes.collected = 1
    outcomes.tests = {"t::fixed": {"outcome": "passed", "s": 2.5}}  # the rerun of the failed one
    outcomes.write(complete=True)
    return json.loads(out.read_text())


def test_a_rerun_replaces_its_tests_and_keeps_the_others_with_their_commit(tmp_path, monkeypatch):
    rec = _write(tmp_path / "tpu_tests.json", "cpu", monkeypatch)
    assert rec["tests"] == {"t::fixed": {"outcome": "passed", "s": 2.5, "commit": "c2"},
                            "t::stands": EARLIER["t::stands"], "t::skipped": EARLIER["t::skipped"]}
    assert (rec["passed"], rec["failed"], rec["skipped"], rec["collected"], rec["complete"]) == (2, 0, 1, 1, True)


def test_another_devices_record_is_not_merged(tmp_path, monkeypatch):
    rec = _write(tmp_path / "tpu_tests.json", "TPU v5 lite x 1", monkeypatch)
    assert rec["tests"] == {"t::fixed": {"outcome": "passed", "s": 2.5, "commit": "c2"}}
    assert (rec["passed"], rec["failed"], rec["skipped"]) == (1, 0, 0)
    assert tpu_tests.harness.merged_with_earlier(tmp_path / "none.json", "tests", {}, "cpu", "c2") == {}


def test_an_earlier_outcome_of_a_test_the_suite_no_longer_has_is_dropped(tmp_path, monkeypatch):
    out = tmp_path / "tpu_tests.json"
    out.write_text(json.dumps({"benchmark": "tpu_tests", "device": "cpu", "tests": EARLIER}))
    monkeypatch.setattr("hybridmoe.tools.record.source_commit", lambda: "c2")
    outcomes = tpu_tests.Outcomes(str(out))
    outcomes.tests = {"t::fixed": {"outcome": "passed", "s": 2.5}}
    outcomes.existing = {"t::fixed", "t::stands"}  # t::skipped was removed from the suite
    outcomes.write(complete=True)
    rec = json.loads(out.read_text())
    assert set(rec["tests"]) == {"t::fixed", "t::stands"} and (rec["passed"], rec["skipped"]) == (2, 0)
