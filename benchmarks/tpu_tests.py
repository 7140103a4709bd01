"""The tests marked tpu, run on this host's TPU chip, and their outcome as a record.

    python3 benchmarks/tpu_tests.py            # on a TPU host (docs/tpu.md): pytest --chip tests/
    python3 benchmarks/tpu_tests.py -k fp8     # those whose names match (pytest's -k), merged into the record

Writes benchmarks/records/tpu_tests.json: device, commit, passed, failed, skipped, collected, and
each test's outcome and seconds; rewritten after every test (`complete` false until the session
ends), so a call cut short still returns what finished. An earlier record of the same device is
merged into: the tests run now replace theirs, the others keep their outcome and commit (rerun the
failed ones by naming them); an earlier outcome of a test the suite no longer has is dropped. Exits 1 when a test failed (the record is
written either way).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


class Outcomes:
    """A pytest plugin that keeps each test's outcome (its call phase, or the phase that failed) and
    writes the record after each test."""

    def __init__(self, out: str):
        self.out, self.tests, self.collected = out, {}, 0
        self.existing: set[str] = set()  # every test id the suite has now, run or deselected

    def pytest_deselected(self, items):
        self.existing.update(item.nodeid for item in items)

    def pytest_collection_finish(self, session):
        self.collected = len(session.items)  # after conftest's --chip selection: the tpu tests
        self.existing.update(item.nodeid for item in session.items)

    def pytest_runtest_logreport(self, report):
        row = self.tests.setdefault(report.nodeid, {"outcome": "passed", "s": 0.0})
        row["s"] += report.duration
        if report.failed:
            row["outcome"] = "failed"
            row["failure"] = report.longreprtext[-3000:]  # the record says why, even when the call is cut
        elif report.skipped and row["outcome"] != "failed":
            row["outcome"] = "skipped"
        if report.when == "teardown":
            self.write(complete=False)

    def write(self, complete: bool) -> None:
        from hybridmoe.tools.record import machine_record, source_commit

        # A rerun of the failed tests after a fix leaves the passed ones standing, with their commit;
        # an earlier outcome of a test the suite no longer has is dropped.
        tests = harness.merged_with_earlier(self.out, "tests", self.tests, machine_record()["device"], source_commit())
        if self.existing:
            tests = {name: row for name, row in tests.items() if name in self.existing}
        harness.write(self.out, "tpu_tests", **counts_of(tests), collected=self.collected, complete=complete,
                      tests=tests)


def counts_of(tests: dict) -> dict[str, int]:
    return {k: sum(t["outcome"] == k for t in tests.values()) for k in ("passed", "failed", "skipped")}


def main(argv=None) -> int:
    import pytest

    p = harness.parser(__doc__, __file__)
    p.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    p.add_argument("-k", dest="select", default=None, help="only the tests whose names match (pytest's -k)")
    args = p.parse_args(argv)
    harness.configure()
    outcomes = Outcomes(args.out)
    select = ["-k", args.select] if args.select else []
    code = pytest.main(["--chip", "-q", "-p", "no:cacheprovider", *select, *args.paths], plugins=[outcomes])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise SystemExit(f"pytest --chip ended with {code!r}" + ("" if outcomes.tests else ": no record written"))
    outcomes.write(complete=True)
    counts = counts_of(outcomes.tests)
    print(", ".join(f"{n} {k}" for k, n in counts.items()) + f" of {outcomes.collected} collected (this run)")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
