"""Where a step's time goes on the device, by the step-time model's categories.

`trace_ops` runs a compiled step under JAX's profiler and reads the trace it writes (the Chrome
trace JSON beside the XSpace, `*.trace.json.gz`): each op the device ran, with its own seconds,
summed per op over the steps traced. Which events are ops: on a TPU or GPU, those of the first
device's "XLA Ops" line (process "/device:TPU:0", thread "XLA Ops"); on a CPU, the host's thunks of
device 0 (events with an `hlo_op` argument): every device runs the same program, and the model's
estimate is per device. An op is named by its `hlo_op` argument where the event has one, else by
the event's name (both the HLO instruction's name, "%" or its text after a space dropped). The
device's line nests a loop's body inside the loop's own event: each event counts its own time, less
the events nested in it, so a loop's seconds are its body's and are not counted twice.

`by_category` puts each op's seconds in the category the model gives the instruction of that name in
the same compiled program (analysis/hlo_cost.Estimator.instruction_categories: the one classifier the
estimate uses, over the instruction's op_name, the JAX name stack with the model's scopes); an op
the program does not name but whose event carries its op_name (`tf_op`) goes through the same
classifier. Seconds of ops neither places are reported apart, never dropped.

`op_table` sets the heaviest ops of the profile beside the model's estimate of the same
instructions (analysis/step_estimate.op_estimates), so a category the model misjudges points at its
ops.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import re
import tempfile
from collections import defaultdict
from typing import Callable

import jax

from hybridmoe.analysis.hlo_cost import CATEGORIES, Estimator, category_of

UNMATCHED = "not in the model's walk"
DEVICE_OPS_LINE = "XLA Ops"


@dataclasses.dataclass
class TracedOp:
    seconds: float   # per step traced: the op's own time (nested events' time taken out)
    op_name: str = ""  # the event's JAX name stack where it carries one (`tf_op`)


def _instruction(event: dict) -> str:
    """The HLO instruction an event ran: its `hlo_op` argument, else its name ("%fusion.3 = ..." ->
    "fusion.3")."""
    name = str((event.get("args") or {}).get("hlo_op") or event.get("name", ""))
    return re.split(r"[\s=]", name.lstrip("%"), maxsplit=1)[0]


def _own_seconds(events: list[dict]) -> list[tuple[dict, float]]:
    """Each event of one line with its own time: its duration less that of the events nested in it."""
    out: list[list] = []
    open_events: list[tuple[float, int]] = []  # (end, index into out) of the enclosing events
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        while open_events and open_events[-1][0] <= start:
            open_events.pop()
        if open_events:
            out[open_events[-1][1]][1] -= dur
        out.append([e, dur])
        open_events.append((start + dur, len(out) - 1))
    return [(e, max(own, 0.0) * 1e-6) for e, own in out]  # the trace's times are microseconds


def op_events(trace: dict, module: str | None = None) -> list[tuple[str, float, str]]:
    """(instruction, own seconds, op_name) of every op in a Chrome trace: the device's "XLA Ops"
    lines, else the host's thunks (`hlo_op` events). `module`: keep only the events of that HLO
    module where an event says its module (the step's, not a batch's copy)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in complete if str(processes.get(e["pid"], "")).startswith("/device:")
              and threads.get((e["pid"], e.get("tid"))) == DEVICE_OPS_LINE]
    if device:  # one device's ops (every device runs the same program): the first by name
        first = min(processes[e["pid"]] for e in device)
        chosen = [e for e in device if processes[e["pid"]] == first]
    else:
        chosen = [e for e in complete if (e.get("args") or {}).get("hlo_op")
                  and str((e.get("args") or {}).get("device_ordinal", 0)) == "0"]
    if module:
        chosen = [e for e in chosen if (e.get("args") or {}).get("hlo_module", module) == module]
    lines: dict[tuple, list[dict]] = defaultdict(list)
    for e in chosen:
        lines[(e["pid"], e.get("tid"))].append(e)
    return [(_instruction(e), s, str((e.get("args") or {}).get("tf_op", "")))
            for line in lines.values() for e, s in _own_seconds(line)]


def read_trace(folder: str) -> dict:
    """The Chrome trace JSON the profiler wrote under `folder`."""
    files = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))
    if not files:
        raise RuntimeError(f"the profiler wrote no trace under {folder}")
    with gzip.open(files[0], "rt") as f:
        return json.load(f)


def module_name(compiled_text: str) -> str | None:
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", compiled_text)
    return m.group(1) if m else None


def sum_ops(events: list[tuple[str, float, str]], steps: int) -> dict[str, TracedOp]:
    """{instruction: TracedOp} per step over `steps` traced steps."""
    totals: dict[str, TracedOp] = {}
    for name, seconds, op_name in events:
        op = totals.setdefault(name, TracedOp(0.0, op_name))
        op.seconds += seconds / steps
        op.op_name = op.op_name or op_name
    return totals


def trace_ops(run: Callable[[], object], steps: int, module: str | None = None) -> dict[str, TracedOp]:
    """{instruction: TracedOp} of `steps` calls of run() (each waited for) under the profiler."""
    with tempfile.TemporaryDirectory(prefix="hybridmoe-profile-") as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                jax.block_until_ready(run())
        trace = read_trace(folder)
    return sum_ops(op_events(trace, module), steps)


def by_category(ops: dict[str, TracedOp | float], compiled_text: str) -> dict[str, float]:
    """{category: seconds} of traced ops, by the category the model gives each instruction name
    (or, for a name the program lacks, the event's op_name); UNMATCHED holds the rest."""
    category = Estimator(compiled_text).instruction_categories()
    out = {c: 0.0 for c in (*CATEGORIES, UNMATCHED)}
    for name, op in ops.items():
        op_name = op.op_name if isinstance(op, TracedOp) else ""
        cat = category.get(name)
        if cat is None and op_name:
            cat = category_of(op_name, bool(re.search(r"dot_general|conv_general|einsum", op_name)))
        out[cat or UNMATCHED] += _seconds(op)
    return out


def _seconds(op: TracedOp | float) -> float:
    return op.seconds if isinstance(op, TracedOp) else op


def op_table(ops: dict[str, TracedOp | float], estimates: dict[str, dict], top: int = 30) -> list[dict]:
    """The profile's ops beside the model's estimate of each, matched by instruction name: the `top`
    ops by the device's seconds, then those among the model's `top` that the device does not put
    there (an op the model over-counts shows as much as one it misses), largest first by either.
    `estimates`: step_estimate.op_estimates of the same compiled program. Each row: op, category,
    measured_s and estimated_s per step (None where one side does not name the op), bound, runs."""
    by_device = sorted(ops, key=lambda n: -_seconds(ops[n]))[:top]
    by_model = sorted(estimates, key=lambda n: -estimates[n]["s"])[:top]
    rows = []
    for name in dict.fromkeys([*by_device, *by_model]):
        est = estimates.get(name)
        rows.append({"op": name, "category": est["category"] if est else None,
                     "measured_s": _seconds(ops[name]) if name in ops else None,
                     "estimated_s": est["s"] if est else None,
                     "bound": est["bound"] if est else None, "runs": est["runs"] if est else None})
    return sorted(rows, key=lambda r: -max(r["measured_s"] or 0.0, r["estimated_s"] or 0.0))


def format_profile(measured: dict[str, float], modelled: dict[str, float] | None, step_s: float) -> str:
    """The device's seconds per category beside the model's."""
    lines = [f"  {'category':<26}{'device s':>10}{'share':>8}{'model s':>10}"]
    for cat, s in measured.items():
        model = "" if modelled is None or cat not in modelled else f"{modelled[cat]:>10.4g}"
        lines.append(f"  {cat:<26}{s:>10.4g}{s / step_s if step_s else 0:>8.1%}{model}")
    lines.append(f"  {'ops traced, per step':<26}{sum(measured.values()):>10.4g}   (the step: {step_s:.4g} s)")
    return "\n".join(lines)
