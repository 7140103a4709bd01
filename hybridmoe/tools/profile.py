"""Where a step's time goes on the device, by the step-time model's categories.

`trace_ops` runs a compiled step under JAX's profiler and reads the trace it writes (an XSpace:
`jax.profiler.ProfileData`): each op the device ran (on a TPU, the events of its "XLA Ops" lines;
on a CPU, the thunks that name their `hlo_op`), with its seconds, summed per op name over the
steps traced. `by_category` puts each op's seconds in the category the model gives the
instruction of that name in the same compiled program (analysis/hlo_cost.py: grouped matmuls,
attention, GDN, dense matmuls, collectives, the rest), so the model's categories and the device's
can be read side by side; seconds of ops the model's walk does not list (a conditional's lighter
branch, a runtime op) are reported apart, never dropped.
"""

from __future__ import annotations

import glob
import tempfile
from collections import defaultdict
from typing import Callable

import jax

from hybridmoe.analysis.hlo_cost import CATEGORIES, Estimator

UNMATCHED = "not in the model's walk"


def _op_events(space) -> list[tuple[str, float]]:
    """(op name, seconds) of every op event in a profile: a TPU's device planes ("XLA Ops" lines),
    else a host's thunks (events with an `hlo_op` stat)."""
    device = [(e.name, e.duration_ns * 1e-9) for plane in space.planes if plane.name.startswith("/device:")
              for line in plane.lines if line.name == "XLA Ops" for e in line.events]
    if device:
        return device
    out = []
    for plane in space.planes:
        for line in plane.lines:
            for e in line.events:
                op = dict(e.stats).get("hlo_op")
                if op:
                    out.append((op, e.duration_ns * 1e-9))
    return out


def trace_ops(run: Callable[[], object], steps: int) -> dict[str, float]:
    """{op name: seconds per step} of `steps` calls of run() (each waited for) under the profiler."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory(prefix="hybridmoe-profile-") as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                jax.block_until_ready(run())
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace under {folder}")
        space = ProfileData.from_file(files[0])
        totals: dict[str, float] = defaultdict(float)
        for name, seconds in _op_events(space):
            totals[name.lstrip("%")] += seconds / steps
    return dict(totals)


def by_category(op_seconds: dict[str, float], compiled_text: str) -> dict[str, float]:
    """{category: seconds} of traced ops, by the category the model gives each instruction name;
    UNMATCHED holds the seconds of names the model's walk of that program does not list."""
    category = {name: c.category for name, c, _ in Estimator(compiled_text).named_ops()}
    out = {c: 0.0 for c in (*CATEGORIES, UNMATCHED)}
    for name, seconds in op_seconds.items():
        out[category.get(name, UNMATCHED)] += seconds
    return out


def format_profile(measured: dict[str, float], modelled: dict[str, float] | None, step_s: float) -> str:
    """The device's seconds per category beside the model's."""
    lines = [f"  {'category':<26}{'device s':>10}{'share':>8}{'model s':>10}"]
    for cat, s in measured.items():
        model = "" if modelled is None or cat not in modelled else f"{modelled[cat]:>10.4g}"
        lines.append(f"  {cat:<26}{s:>10.4g}{s / step_s if step_s else 0:>8.1%}{model}")
    lines.append(f"  {'ops traced, per step':<26}{sum(measured.values()):>10.4g}   (the step: {step_s:.4g} s)")
    return "\n".join(lines)
