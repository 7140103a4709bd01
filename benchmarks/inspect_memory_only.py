"""How `hybridmoe inspect --memory-only` compares with the whole compile it cuts short, at one cell.

`--memory-only` reads the compile at its buffer assignment (XLA's default memory space, the peak,
the optimised HLO's collectives and step estimate) and stops before code generation. This script
runs it on a recipe and target in a process of its own (its wall time is the user's: load,
lowering, the HLO passes, the read, the exit) and compares every figure it reports with a record
of the whole compile of the same program (`hybridmoe inspect --out`, e.g. an arm of
benchmarks/seed_cell.py):

    python benchmarks/inspect_memory_only.py --against benchmarks/records/seed_cell/expert_grad_barrier.json

The recipe, overrides, target and program are the whole record's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

GIB = 2**30


def compare(fast: dict, whole: dict) -> dict:
    """What the memory-only read reports against the whole compile: each figure's two values and
    whether they are equal."""
    est = lambda p: None if p.get("step_estimate") is None else p["step_estimate"]["serial"]["step_s"]  # noqa: E731
    rows = {
        "default_space": (fast["memory"]["default_space"], whole["memory"]["default_space"]),
        "argument": (fast["memory"]["argument"], whole["memory"]["argument"]),
        "peak_buffers": (fast["peak_buffers"], whole["peak_buffers"]),
        "peak_categories": (fast["peak_by_category"]["categories"], whole["peak_by_category"]["categories"]),
        "collectives": (fast["collectives"], whole["collectives"]),
        "step_estimate_s": (est(fast), est(whole)),
    }
    return {k: {"equal": a == b, **({"memory_only": a, "whole": b} if not isinstance(a, list) else {})}
            for k, (a, b) in rows.items()}


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--against", required=True, help="a `hybridmoe inspect --out` record of the whole compile")
    args = p.parse_args(argv)
    harness.configure()
    whole_record = json.loads(Path(args.against).read_text())
    whole = whole_record["programs"]["base"]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "memory_only.json"
        argv = [sys.executable, "-m", "hybridmoe", "inspect", f"recipe={whole['recipe']}", *whole["overrides"],
                "--target", whole_record["target"], "--program", whole_record.get("program", "train"),
                "--memory-only", "--out", str(out)]
        print(f"[{time.strftime('%H:%M:%S')}] {' '.join(argv[3:])}", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=harness.ROOT, capture_output=True, text=True)
        wall_s = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"inspect --memory-only failed ({done.returncode}):\n{done.stderr[-4000:]}")
        fast = json.loads(out.read_text())["programs"]["base"]
    figures = compare(fast, whole)
    for name, row in figures.items():
        values = "" if "whole" not in row else f"  memory-only {row['memory_only']}  whole {row['whole']}"
        print(f"{name:<18} {'equal' if row['equal'] else 'DIFFERENT'}{values}")
    print(f"memory-only: {wall_s:.0f} s wall ({fast['compile_s']:.0f} s from lowering to the read); "
          f"the whole compile: {whole['compile_s']:.0f} s from lowering (record {args.against}, "
          f"commit {whole_record['commit'][:7]})")
    harness.write(args.out, "inspect_memory_only", against=args.against, against_commit=whole_record["commit"],
                  recipe=whole["recipe"], overrides=whole["overrides"], target=whole_record["target"],
                  program=whole_record.get("program", "train"), wall_s=round(wall_s, 1),
                  read_s=fast["compile_s"], whole_compile_s=whole["compile_s"], figures=figures,
                  default_space_gib=round(fast["memory"]["default_space"] / GIB, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
