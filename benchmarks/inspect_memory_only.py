"""How `hybridmoe inspect --memory-only` compares with the whole compile it cuts short, at one cell.

`--memory-only` reads the compile at its buffer assignment (XLA's default memory space, the peak,
the optimised HLO's collectives and step estimate) and stops before code generation. This script
does what the command does in-process (tools/train_program.compile_step with memory_only), then
waits for the compile's thread to finish: the time to the read and the time to the whole compile
come from one compile on one machine load (from the start of the call: the mesh, tracing,
lowering). Every figure the read reports is compared with a record of the whole compile of the
same program (`hybridmoe inspect --out`, e.g. an arm of benchmarks/seed_cell.py), whose recipe,
overrides, target and program it takes:

    python benchmarks/inspect_memory_only.py --against benchmarks/records/seed_cell/expert_grad_barrier.json
"""

from __future__ import annotations

import json
import sys
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
    import threading

    from hybridmoe.analysis.program import COMPILE_THREAD
    from hybridmoe.analysis.step_estimate import estimate_step
    from hybridmoe.recipe import load_config
    from hybridmoe.tools import train_program as tp

    whole_record = json.loads(Path(args.against).read_text())
    whole = whole_record["programs"]["base"]
    program = whole_record.get("program", "train")
    cfg = load_config(whole["recipe"], whole["overrides"], platform="tpu")
    print(f"[{time.strftime('%H:%M:%S')}] recipe={whole['recipe']} {' '.join(whole['overrides'])} for "
          f"{whole_record['target']} ({program}), read at buffer assignment", flush=True)
    t0 = time.perf_counter()
    step = tp.compile_step(cfg, tp.tpu_target(whole_record["target"]), program_name=program, with_residuals=False,
                           memory_only=True)
    read_s = time.perf_counter() - t0
    facts = tp.step_facts(step)
    facts["step_estimate"] = estimate_step(step)
    going_on = [t for t in threading.enumerate() if t.name == COMPILE_THREAD]
    for t in going_on:
        t.join()
    whole_s = time.perf_counter() - t0
    figures = compare(facts, whole)
    for name, row in figures.items():
        values = "" if "whole" not in row else f"  memory-only {row['memory_only']}  whole {row['whole']}"
        print(f"{name:<18} {'equal' if row['equal'] else 'DIFFERENT'}{values}")
    print(f"read at {read_s:.0f} s; the same compile done at {whole_s:.0f} s (from the call: mesh, tracing, lowering, "
          f"compile); figures against {args.against} (commit {whole_record['commit'][:7]})")
    harness.write(args.out, "inspect_memory_only", against=args.against, against_commit=whole_record["commit"],
                  recipe=whole["recipe"], overrides=whole["overrides"], target=whole_record["target"],
                  program=program, read_s=round(read_s, 1), whole_s=round(whole_s, 1),
                  read_before_the_end=bool(going_on), figures=figures,
                  default_space_gib=round(facts["memory"]["default_space"] / GIB, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
