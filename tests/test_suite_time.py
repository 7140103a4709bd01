"""benchmarks/suite_time.py reads `make test`'s output: the wall time, pytest's tally and its
--durations table, here from a stubbed run whose output and clock are given."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import benchmark_script

OUTPUT = """\
============================= slowest durations ==============================
12.50s call     tests/test_a.py::test_x
1.25s setup    tests/test_b.py::test_y
2.00s teardown tests/test_c.py::test_z
= 1 failed, 10 passed, 2 skipped, 3 deselected, 1 error in 61.00s (0:01:01) =
"""


def test_a_suite_runs_tally_and_slowest_phases_from_pytests_output(monkeypatch):
    suite_time = benchmark_script("suite_time")
    clock = iter([100.0, 190.0])
    monkeypatch.setattr(suite_time, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(suite_time, "subprocess", SimpleNamespace(run=lambda *a, **k: SimpleNamespace(
        stdout=OUTPUT, returncode=1)))
    monkeypatch.setattr(suite_time, "os", SimpleNamespace(getloadavg=lambda: (2.34, 1.0, 0.5)))
    row = suite_time.run_suite()
    assert row["wall_s"] == 90.0 and row["wall_min"] == 1.5 and row["exit_code"] == 1
    assert {k: row[k] for k in ("failed", "passed", "skipped", "deselected", "error")} == {
        "failed": 1, "passed": 10, "skipped": 2, "deselected": 3, "error": 1}
    assert row["summary"] == "1 failed, 10 passed, 2 skipped, 3 deselected, 1 error in 61.00s (0:01:01)"
    assert row["slowest"] == [{"s": 12.5, "phase": "call", "test": "tests/test_a.py::test_x"},
                              {"s": 1.25, "phase": "setup", "test": "tests/test_b.py::test_y"},
                              {"s": 2.0, "phase": "teardown", "test": "tests/test_c.py::test_z"}]
    assert row["load_average_1min"] == 2.3
