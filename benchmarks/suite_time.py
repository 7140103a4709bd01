"""The wall time of `make test` (what CI runs), from an empty compile cache and again from the cache
that run filled.

  python benchmarks/suite_time.py [--runs cold,warm] [--out benchmarks/records/suite_time.json]

cold: the suite's compile cache (tests/conftest.py, outside the checkout) is emptied first, as on a
new machine; warm: a second run, which compiles only what the first did not store (programs with
host callbacks, for one). Each row: wall time, the pytest tally, the machine's load average.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import harness  # noqa: E402
from conftest import TEST_COMPILE_CACHE  # noqa: E402

TALLY = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?)")
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)$")


def slowest(stdout: str) -> list[dict]:
    """pytest's --durations table (make test lists every phase of a second or more): seconds, phase, test."""
    return [{"s": float(m.group(1)), "phase": m.group(2), "test": m.group(3)}
            for m in map(DURATION.match, stdout.splitlines()) if m]


def run_suite() -> dict:
    t0 = time.perf_counter()
    done = subprocess.run(["make", "test"], cwd=harness.ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    last = [line for line in done.stdout.splitlines() if " in " in line and "passed" in line][-1:]
    tally = {kind: int(n) for n, kind in TALLY.findall(last[0])} if last else {}
    return {"wall_s": round(wall, 1), "wall_min": round(wall / 60, 2), "exit_code": done.returncode, **tally,
            "summary": last[0].strip("= ") if last else done.stdout[-500:], "slowest": slowest(done.stdout),
            "load_average_1min": round(os.getloadavg()[0], 1)}


def main(argv=None) -> None:
    p = harness.parser(__doc__, __file__)
    p.add_argument("--runs", default="cold,warm", help="comma-separated: cold (cache emptied first), warm")
    args = p.parse_args(argv)
    harness.configure(cpu_only=True)
    rows, kinds = [], args.runs.split(",")
    for i, kind in enumerate(kinds):
        if kind == "cold":
            shutil.rmtree(TEST_COMPILE_CACHE, ignore_errors=True)
        row = {"cache": kind, **run_suite()}
        rows.append(row)
        print(f"{kind:5s} {row['wall_min']:6.1f} min  {row['summary']}", flush=True)
        # In the temporary folder after each run (a cold run's figure survives a warm run that is
        # stopped), the record itself only after the last: a new record under benchmarks/ mid-way
        # would fail the next run's docs test (docs/performance.md renders the records).
        out = Path(args.out) if i == len(kinds) - 1 else Path(tempfile.gettempdir()) / "suite_time.partial.json"
        harness.write(out, "suite_time", runs=rows, cores=os.cpu_count(), command="make test",
                      cache_dir=str(TEST_COMPILE_CACHE).replace(str(Path.home()), "~"))


if __name__ == "__main__":
    main()
