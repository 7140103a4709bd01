"""benchmarks/harness.py's watched child: a piece of work past its share is stopped and named, with
how long it ran and what it last printed, and the pieces before it count as done; a child that dies
inside a piece names that piece; one that ends well names none. And tpu_kernels' record of a cut."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402

CHILD = """
import sys, time
sys.path.insert(0, {bench!r})
import harness
for name, seconds, fail in {pieces!r}:
    harness.mark("start", name)
    print(f"{{name}}: compiling", flush=True)
    if fail:
        sys.exit(3)
    time.sleep(seconds)
    harness.mark("done", name)
"""


def _run(pieces, share_s):
    lines = []
    t0 = time.perf_counter()
    ended = harness.watched([sys.executable, "-c", CHILD.format(bench=str(ROOT / "benchmarks"), pieces=pieces)],
                            share_s, lines.append)
    return ended, lines, time.perf_counter() - t0


def test_a_piece_past_its_share_is_stopped_and_named():
    ended, lines, wall = _run([("a", 0.1, False), ("b", 60, False), ("c", 0.1, False)], share_s=2.0)
    assert ended.returncode is None and ended.cut == "b"
    assert 2.0 <= ended.seconds < 10 and wall < 30  # stopped near its share, not after the 60 s sleep
    assert ended.last_line == "b: compiling"
    assert lines == ["a: compiling", "b: compiling"]  # the marks are not echoed, c never started
    assert ended.reason(2.0).startswith("stopped after 2 s, past its 2 s share (its last line: 'b: compiling')")


def test_a_child_that_dies_in_a_piece_names_it_and_one_that_ends_well_names_none():
    died, _, _ = _run([("a", 0.1, False), ("b", 0, True)], share_s=30.0)
    assert died.returncode == 3 and died.cut == "b" and "status 3" in died.reason(30.0)
    fine, lines, _ = _run([("a", 0.1, False), ("b", 0.1, False)], share_s=30.0)
    assert fine.returncode == 0 and fine.cut is None and lines == ["a: compiling", "b: compiling"]


def test_tpu_kernels_records_a_cut_and_drops_that_case_s_earlier_figures(tmp_path):
    from helpers import benchmark_script

    module = benchmark_script("tpu_kernels")
    out = tmp_path / "tpu_kernels.json"
    module.record_cut(out, "cp_dh_scan_cell", "stopped after 150 s")  # no record yet
    record = json.loads(out.read_text())
    assert record["cases"]["cp_dh_scan_cell"]["cut"] == "stopped after 150 s" and "device" not in record
    record["kernels"] = {"cp_dh_scan_cell": {"scan": {"ms": 1.0}}, "gdn_cell": {"xla": {"ms": 2.0}}}
    record["cases"]["gdn_cell"] = {"seconds": 5}
    out.write_text(json.dumps(record))
    module.record_cut(out, "cp_dh_scan_cell", "stopped again")
    record = json.loads(out.read_text())
    assert record["kernels"] == {"gdn_cell": {"xla": {"ms": 2.0}}}
    assert record["cases"]["cp_dh_scan_cell"]["cut"] == "stopped again" and record["cases"]["gdn_cell"] == {"seconds": 5}


def test_tpu_kernels_missing_runs_only_the_cases_the_record_has_no_figures_for(tmp_path, monkeypatch):
    """--missing: the child is handed the geometry's cases less those the record times (a cut case and
    a case never run are run again); no record at all: every case."""
    from types import SimpleNamespace

    from helpers import benchmark_script

    module = benchmark_script("tpu_kernels")
    children = []
    monkeypatch.setattr(module.harness, "watched",
                        lambda cmd, share: children.append(cmd[cmd.index("--only") + 1]) or SimpleNamespace(cut=None, returncode=0))
    out = tmp_path / "tpu_kernels.json"
    module.main(["--missing", "--geometry", "one_chip", "--out", str(out)])
    everything = ("gmm_one_chip,moe_mlp_one_chip,moe_mlp_fp8_one_chip,gdn_one_chip,gdn_cp_one_chip,cp_m_scan_one_chip,"
                  "cp_dh_scan_one_chip,attention_one_chip")
    assert children == [everything]
    out.write_text(json.dumps({"kernels": {"gmm_one_chip": {"ragged_dot": {"ms": 1.0}}, "gdn_one_chip": {"xla": {"ms": 2.0}},
                                           "gdn_cell": {"xla": {"ms": 3.0}}},
                               "cases": {"attention_one_chip": {"not_run": "past the budget"},
                                         "moe_mlp_one_chip": {"cut": "stopped after 150 s"}}}))
    module.main(["--missing", "--geometry", "one_chip", "--out", str(out)])
    assert children[1] == ("moe_mlp_one_chip,moe_mlp_fp8_one_chip,gdn_cp_one_chip,cp_m_scan_one_chip,cp_dh_scan_one_chip,"
                           "attention_one_chip")
