"""The tests marked tpu, run on this host's TPU chip, and their outcome as a record.

    python3 benchmarks/tpu_tests.py            # on a TPU host (docs/tpu.md): pytest --chip tests/

Writes benchmarks/records/tpu_tests.json: device, commit, passed, failed, skipped, and each test's
outcome and seconds. Exits 1 when a test failed (the record is written either way).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


class Outcomes:
    """A pytest plugin that keeps each test's outcome (its call phase, or the phase that failed)."""

    def __init__(self):
        self.tests: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        row = self.tests.setdefault(report.nodeid, {"outcome": "passed", "s": 0.0})
        row["s"] += report.duration
        if report.failed:
            row["outcome"] = "failed"
        elif report.skipped and row["outcome"] != "failed":
            row["outcome"] = "skipped"


def main(argv=None) -> int:
    import pytest

    p = harness.parser(__doc__, __file__)
    p.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    args = p.parse_args(argv)
    harness.configure()
    outcomes = Outcomes()
    code = pytest.main(["--chip", "-q", "-p", "no:cacheprovider", *args.paths], plugins=[outcomes])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise SystemExit(f"pytest --chip ended with {code!r}: no record written")
    counts = {k: sum(t["outcome"] == k for t in outcomes.tests.values()) for k in ("passed", "failed", "skipped")}
    harness.write(args.out, "tpu_tests", **counts, tests=outcomes.tests)
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
