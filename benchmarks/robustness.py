"""Robustness figures: config fuzz draws, kill -9 trials per command, 2-process == 1-process runs.

Runs the same checks as tests/test_config_fuzz.py, tests/test_kill_resume.py and
tests/test_multihost.py, counting outcomes instead of stopping at the first failure, and writes
benchmarks/records/robustness.json (machine, date, commit, versions, and what was run).

    python benchmarks/robustness.py [--fuzz-draws 3000] [--kill-trials 20] [--multihost]

A count of 0 skips that section; a skipped section is carried over from the existing record.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package and test helpers

from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8, cpu_only=True)


def fuzz(draws: int) -> dict:
    from hypothesis import HealthCheck, given, settings

    from config_fuzz import check, override_sets

    outcomes, failures = collections.Counter(), []

    @settings(max_examples=draws, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(override_sets())
    def draw(overrides):
        try:
            outcomes[check(overrides)] += 1
        except Exception as e:  # noqa: BLE001 -- counted: the figure is how many there were
            outcomes["other_exception"] += 1
            failures.append({"overrides": overrides, "error": "".join(traceback.format_exception_only(e))[-500:]})

    t0 = time.perf_counter()
    draw()
    return {"draws": sum(outcomes.values()), **outcomes, "seconds": round(time.perf_counter() - t0, 1),
            "failures": failures[:20]}


def kills(trials: int, work: Path) -> dict:
    from kill_harness import run_trials

    out = {}
    for command in ("train", "rl"):
        try:
            out[command] = run_trials(command, trials, work / command)
        except AssertionError as e:
            out[command] = {"trials": trials, "failed": str(e)[-2000:]}
    return out


def multihost(work: Path) -> dict:
    """Per command: do 2 processes x 4 devices give the 1 process x 8 devices metrics, step for step?"""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_multihost.py", "--basetemp", str(work / "pytest")],
                            cwd=ROOT, capture_output=True, text=True)
    return {"tests": "tests/test_multihost.py", "returncode": result.returncode,
            "summary": result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]}


def main() -> None:
    from hybridmoe.tools.record import machine_record, write_record

    ap = harness.parser(__doc__, __file__)
    ap.add_argument("--fuzz-draws", type=int, default=3000)
    ap.add_argument("--kill-trials", type=int, default=20)
    ap.add_argument("--multihost", action="store_true")
    args = ap.parse_args()
    record = {"benchmark": "robustness", **machine_record()}
    with tempfile.TemporaryDirectory(prefix="hybridmoe-robustness-") as tmp:
        work = Path(tmp)
        if args.fuzz_draws:
            record["fuzz"] = fuzz(args.fuzz_draws)
            print("fuzz:", {k: v for k, v in record["fuzz"].items() if k != "failures"})
        if args.kill_trials:
            record["kill"] = kills(args.kill_trials, work)
            for command, s in record["kill"].items():
                print(f"kill {command}:", {k: v for k, v in s.items() if k != "events"})
        if args.multihost:
            record["multihost"] = multihost(work)
            print("multihost:", record["multihost"])
    # A section not run this time is kept from the record it replaces, marked with that record's
    # date and commit (its figures are that code's, not this one's).
    out = Path(args.out)
    if out.exists():
        earlier = json.loads(out.read_text())
        for section in ("fuzz", "kill", "multihost"):
            if section not in record and section in earlier:
                kept = earlier[section]
                record[section] = {**kept, "from_record": kept.get("from_record") or {
                    "date": earlier.get("date"), "commit": earlier.get("commit")}}
    write_record(out, record)


if __name__ == "__main__":
    main()
