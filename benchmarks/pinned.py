"""The pinned method of the CPU benchmarks that compare our step with the PyTorch reference.

On a machine that several people share, a comparison is fair only when both sides get the same
cores and the same number of compute threads, and run at the same time as each other's noise:

- Cores: `pin(cores)` sets this process's CPU affinity (what `taskset -c` does) before JAX starts
  its CPU client; the worker processes it starts inherit it, so both sides run on exactly those
  cores.
- Threads: XLA's CPU client sizes its intra-op (Eigen) thread pool to the process's schedulable
  CPUs, i.e. the affinity mask (`thread_census` counts its `tf_XLAEigen` threads to show it);
  the reference calls `torch.set_num_threads(len(cores))`. Both numbers go in the record.
- Time: the sides take turns round by round (the order alternating), so drift in the machine's
  load lands on both; each round gives one ratio; the record keeps every step's time, the median
  and the spread (min, quartiles, max) of each side and of the per-round ratios, and the load
  average at every round.

It imports only the standard library and numpy: the reference's Python (torch, no JAX) imports it too.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np


def parse_cores(text: str) -> list[int]:
    """'0' / '0,1' / '0-3' -> sorted core ids (each one schedulable here)."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"--cores {text!r}: give core ids like 0, 0,1 or 0-1") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise SystemExit(f"--cores {text!r}: this process may run on cores {sorted(allowed)} only")
    return sorted(cores)


def pin(cores: list[int]) -> None:
    """Run this process, and every process it starts from now on, on `cores` only."""
    os.sched_setaffinity(0, cores)


def thread_census() -> dict[str, int]:
    """This process's threads by name (Linux), e.g. {'tf_XLAEigen': 1, ...}."""
    names: collections.Counter = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names[fh.read().strip()] += 1
        except OSError:
            pass
    return dict(names)


def spread(values) -> dict:
    """Median and spread of a list of numbers."""
    v = np.asarray(values, np.float64)
    q = np.percentile(v, [0, 25, 50, 75, 100])
    return {"n": int(v.size), "median": float(q[2]), "min": float(q[0]), "p25": float(q[1]),
            "p75": float(q[3]), "max": float(q[4])}


class Worker:
    """A subprocess that answers one JSON line on stdout per JSON line on stdin."""

    def __init__(self, argv: list[str], name: str):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} worker stopped (asked {request.get('cmd')!r}); its error is above")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def serve(handlers: dict) -> None:
    """The worker's loop: read a JSON request per line, answer with handlers[cmd](request)."""
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "quit":
            return
        out = handlers[req["cmd"]](req)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
