"""The persistent compile cache (run.compile_cache_dir): each command run twice into one empty cache
folder, as a user would run it again; the wall time of the first run (compiles and stores) against
the second (reads the programs back).

  python benchmarks/compile_cache.py [--out benchmarks/records/compile_cache.json]

Commands: `hybridmoe demo` (the embedded GRPO run), two steps of `hybridmoe train recipe=small` (a
rerun compiles what a --resume compiles) and `hybridmoe inspect recipe=small` for the host and for a
TPU target. inspect's report reads the compiler's dumps, which JAX's cache does not give back (and
a compile-only TPU client cannot load an executable), so it keeps the compile's facts instead
(analysis/compiled_facts.py): its second run compiles nothing.
Each runs in its own process in a scratch folder, so nothing but the cache folder carries over.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

COMMANDS = {
    "demo": ["demo"],
    # A run and its rerun (as a --resume compiles the same programs): small's step, 2 steps.
    "train small, 2 steps": ["train", "recipe=small", "train.batch_size=8", "train.steps=2", "--out", "run",
                             "--overwrite"],
    # inspect keeps what it read from the compile (program-facts), not the executable.
    "inspect small (cpu:8)": ["inspect", "recipe=small", "train.batch_size=8", "--target", "cpu:8"],
    "inspect small (tpu7x:2x2x1)": ["inspect", "recipe=small", "train.batch_size=8", "--target", "tpu7x:2x2x1"],
}


def timed(argv: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hybridmoe", *argv], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hybridmoe {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = harness.parser(__doc__, __file__).parse_args(argv)
    harness.configure(cpu_only=True)
    rows = []
    for name, words in COMMANDS.items():
        with tempfile.TemporaryDirectory(prefix="hybridmoe-cc-") as scratch:
            cache = Path(scratch) / "cache"
            words = [*words, f"run.compile_cache_dir={cache}"]
            first = timed(words, Path(scratch))
            entries = len(list(cache.glob("*-cache")))
            facts = len(list((cache / "program-facts").glob("*.json.gz")))
            second = timed(words, Path(scratch))
        rows.append({"command": f"hybridmoe {' '.join(words[:-1])}", "first_s": round(first, 1),
                     "second_s": round(second, 1), "second_over_first": round(second / first, 3),
                     "programs_stored": entries, "facts_kept": facts, "load_average_1min": round(os.getloadavg()[0], 1)})
        print(f"{name:30s} first {first:7.1f} s   second {second:7.1f} s   ({second / first:.2f}x, "
              f"{entries} programs stored, {facts} compiles' facts kept)", flush=True)
    harness.write(args.out, "compile_cache", runs=rows,
                  method="each command twice in a fresh process into one empty cache folder; wall time of the "
                         "whole command (start-up, compile or cache read, and its run)")


if __name__ == "__main__":
    main()
