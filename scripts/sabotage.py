"""A review by sabotage: one-line slips made one at a time in a throwaway checkout, each run against
the default-suite tests that could catch it, and the outcome kept in the review's record.

    git worktree add --detach ../sab HEAD
    python scripts/sabotage.py benchmarks/records/sabotage_review_round3.json --tree ../sab [--tag after] [ID ...]

The record's "slips" list holds each slip: id, file, old (a fragment found exactly once in the file),
new, the effect a user would see, and the tests to run. For each slip (or the ids named) the file in
--tree is changed, `pytest -n 0 -x` runs those tests there, the file is put back byte for byte, and the
outcome goes under the slip's runs[TAG]: caught (a test failed), the first failing test, seconds. The
tree must be clean before and after every slip (git status), so no sabotage is ever left behind; the
record is rewritten after each slip, so a call cut short keeps what finished. A run that ends with
anything but pass or fail (a collection error, a timeout) is recorded as neither and named.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _git_clean(tree: Path) -> bool:
    return not subprocess.run(["git", "status", "--porcelain"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()


def run_slip(slip: dict, tree: Path, timeout_s: int) -> dict:
    """Make the slip in `tree`, run its tests, undo it; the outcome."""
    path = tree / slip["file"]
    source = path.read_bytes()
    text = source.decode()
    count = text.count(slip["old"])
    if count != 1:
        raise SystemExit(f"{slip['id']}: the fragment occurs {count} times in {slip['file']} (want 1)")
    line = text[:text.index(slip["old"])].count("\n") + 1
    path.write_text(text.replace(slip["old"], slip["new"]))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-p", "no:cacheprovider",
                               *slip["tests"]], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, output = None, ""
    finally:
        path.write_bytes(source)
    seconds = round(time.perf_counter() - t0, 1)
    if not _git_clean(tree):
        raise SystemExit(f"{slip['id']}: {tree} is not clean after the slip was undone; look before going on")
    failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in output.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    outcome = {0: "missed", 1: "caught"}.get(code, "error" if code is not None else "timeout")
    return {"line": line, "outcome": outcome, "caught_by": failed[0] if failed else None, "seconds": seconds,
            "tests": slip["tests"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("record", help="the review's record (its slips list is read and its runs written)")
    p.add_argument("ids", nargs="*", help="the slips to run (default: every one)")
    p.add_argument("--tree", required=True, help="a clean checkout to make the slips in (a git worktree)")
    p.add_argument("--tag", default="before", help="the run's name in each slip's runs (default: before)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per slip")
    args = p.parse_intermixed_args(argv)
    tree, record_path = Path(args.tree).resolve(), Path(args.record)
    if not _git_clean(tree):
        raise SystemExit(f"{tree} has changes: sabotage runs in a clean checkout only")
    record = json.loads(record_path.read_text())
    known = {s["id"] for s in record["slips"]}
    unknown = sorted(set(args.ids) - known)
    if unknown:
        raise SystemExit(f"no slip named {', '.join(unknown)} in {record_path}")
    for slip in record["slips"]:
        if args.ids and slip["id"] not in args.ids:
            continue
        outcome = run_slip(slip, tree, args.timeout)
        slip["line"] = outcome.pop("line")
        slip.setdefault("runs", {})[args.tag] = outcome
        print(f"{slip['id']}: {outcome['outcome']} ({outcome['caught_by'] or '-'}, {outcome['seconds']} s)", flush=True)
        record_path.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
