"""How long a compiled step would take on its target: a roofline cost model of the optimised HLO.

Nothing here runs the step. The model reads the program the compiler made (`compiled.as_text()`),
takes each instruction's FLOPs, bytes, Pallas grid steps and collective wire bytes as
analysis/hlo_cost.py counts them (loops' trip counts applied), and charges it the larger of its
compute time (FLOPs over the bf16 or fp8 peak) and its memory time (bytes over HBM bandwidth), plus
a fixed cost per Pallas grid step and per launched op; a collective costs its wire bytes over the
device's link bandwidth. On a generation a chip has calibrated (analysis/hardware.py), the rates and
fixed costs are the chip's measured ones, and each Pallas kernel's time is scaled by the ratio of its
measured time to the model's at the calibration shapes.

Totals: `serial` adds the collectives to the compute; `overlapped` assumes every collective hides
under compute (the larger of the two sums); `scheduled` reads the program's schedule (the order of
a scheduled module's instructions): asynchronous work (a collective's start and done, an async call
such as the TPU compiler's SparseCore offloads) runs while the compute between its start and its
done runs, and what is left at the done is exposed (hlo_cost.Estimator.timeline). It lies between
the other two. Its assumptions: the compiler's order is the chip's; pieces of async work in flight
together take turns on the links (none is faster for running beside another); the SparseCore's
offloaded copies and fusions run at the rates of the compute stream.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from hybridmoe.analysis.flops import designed_flops_per_device, model_flops_per_device
from hybridmoe.analysis.hardware import (ASSUMED_GRID_STEP_S, MAKERS, Hardware, generation_of_device,  # noqa: F401
                                         hardware_for)
from hybridmoe.analysis.hlo_cost import CATEGORIES, Estimator

# Hardware rows (the makers' figures, a chip's measurements over them): analysis/hardware.py.
HARDWARE = MAKERS
PALLAS_TPU_GRID_STEP_S = ASSUMED_GRID_STEP_S


# ---------------------------------------------------------------------------------------------
# The estimate

def op_seconds(c, hw: Hardware) -> tuple[float, float, float, float]:
    """(seconds, compute, memory, grid seconds) of one run of a non-collective op (hlo_cost.OpCost)
    on `hw`: the larger of its compute and memory times plus its grid steps' fixed cost, scaled by
    its Pallas kernel's measured factor, plus the fixed cost of a launched op."""
    compute = c.flops / (hw.fp8_flops if c.fp8 else hw.bf16_flops)
    memory = c.bytes / hw.hbm_bytes_per_s
    grid = c.grid_steps * hw.grid_step_s
    s = (max(compute, memory) + grid) * (hw.kernel_factor(c.kernel) if c.kernel else 1.0) + hw.op_overhead_s
    return s, compute, memory, grid


def op_estimates(text: str, hw: Hardware) -> dict[str, dict]:
    """{instruction name: {"category", "s" (per step: every run of it, loops' trip counts applied),
    "bound" (compute or memory), "runs"}} of every non-collective op the estimate walks: what a
    profile's per-op seconds are compared with."""
    out: dict[str, dict] = {}
    for name, c, k in Estimator(text).named_ops():
        if c.collective:
            continue
        s, compute, memory, _ = op_seconds(c, hw)
        row = out.setdefault(name, {"category": c.category, "s": 0.0, "bound": "", "runs": 0.0})
        row["s"] += s * k
        row["runs"] += k
        row["bound"] = "compute" if compute >= memory else "memory"
    return out


def estimate(text: str, hw: Hardware, *, tokens_per_step: int, chips: int, devices: int,
             model_flops_per_device: float | None = None, apply_trip_counts: bool = True,
             grid_step_s: float | None = None) -> dict:
    """The step's estimated seconds by category on `hw` (per device; every device runs the same
    program), both overlap assumptions, tokens/s per chip and MFU against the model's FLOPs."""
    if grid_step_s is not None:
        hw = dataclasses.replace(hw, grid_step_s=grid_step_s)
    est = Estimator(text, apply_trip_counts=apply_trip_counts)
    cats = {c: {"s": 0.0, "compute_s": 0.0, "memory_s": 0.0, "grid_s": 0.0, "flops": 0.0, "bytes": 0.0}
            for c in CATEGORIES}
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: {"wire_bytes": 0.0, "s": 0.0})
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0.0, "grid_steps": 0.0, "s": 0.0, "flops": 0.0})
    missing = set()
    per_op: dict[str, dict] = {}
    for name, c, k in est.named_ops():
        row = cats[c.category]
        if c.collective:
            s = c.wire_bytes / hw.link_bytes_per_s
            by_kind[c.collective]["wire_bytes"] += c.wire_bytes * k
            by_kind[c.collective]["s"] += s * k
            row["s"] += s * k
            row["bytes"] += c.wire_bytes * k
            continue
        s, compute, memory, grid = op_seconds(c, hw)
        op = per_op.setdefault(name, {"category": c.category, "s": 0.0, "runs": 0.0, "flops": 0.0, "bytes": 0.0,
                                      "bound": "compute" if compute >= memory else "memory"})
        op["s"] += s * k
        op["runs"] += k
        op["flops"] += c.flops * k
        op["bytes"] += c.bytes * k
        row["s"] += s * k
        row["compute_s"] += compute * k
        row["memory_s"] += memory * k
        row["grid_s"] += grid * k
        row["flops"] += c.useful_flops * k
        row["bytes"] += c.bytes * k
        if c.kernel:
            kr = kernels[c.kernel]
            kr["calls"] += k
            kr["grid_steps"] += c.grid_steps * k
            kr["s"] += s * k
            kr["flops"] += c.flops * k
            if c.no_cost_estimate:
                missing.add(c.kernel)
    exposures: dict[str, float] = {}
    busy, exposed = est.timeline(lambda c: c.wire_bytes / hw.link_bytes_per_s if c.collective
                                 else op_seconds(c, hw)[0], exposures)
    op_names = est.op_names()
    return {"hardware": dataclasses.asdict(hw), "categories": cats, "collectives": dict(by_kind),
            "top_ops": top_ops(per_op, op_names), "top_op_groups": top_op_groups(per_op, op_names),
            "exposed_async_s": exposed, "top_exposed": top_exposed(exposures, op_names),
            "kernels": dict(kernels), "kernels_without_cost_estimate": sorted(missing),
            "kernel_factor_sources": ({k: hw.factor_source(k) for k in sorted(kernels)} if hw.kernel_factors else {}),
            "loops_with_unknown_trip_count": est.unknown_trips, "tokens_per_step": tokens_per_step,
            "chips": chips, "devices": devices, **totals(cats, hw.bf16_flops, tokens_per_step, chips,
                                                         model_flops_per_device, scheduled_s=busy + exposed)}


TOP_OPS = 8  # per category, in the estimate (and so in every inspect record)
# The parts of a jax op_name that say where it runs, not what it is (the step's loops and calls).
_PLACE_PARTS = {"while", "body", "closed_call", "shard_map"}


def op_path(op_name: str, parts: int = 4) -> str:
    """The tail of a jax op_name with the loops' and calls' parts dropped: what the model's code
    called the op (`moe/tgmm/pallas_call`), the same for every layer and micro-batch that runs it."""
    path = [p for p in op_name.split("/") if p not in _PLACE_PARTS]
    return "/".join(path[-parts:])


def _costliest_per_category(rows, n: int) -> dict[str, list[dict]]:
    """(category, row) pairs as {category: its n rows of the most seconds, costliest first}."""
    by_cat: dict[str, list] = defaultdict(list)
    for cat, row in rows:
        by_cat[cat].append(row)
    return {cat: sorted(rs, key=lambda r: -r["s"])[:n] for cat, rs in by_cat.items()}


def top_ops(per_op: dict[str, dict], op_names: dict[str, str], n: int = TOP_OPS) -> dict[str, list[dict]]:
    """Per category its `n` costliest instructions over the step (every run of each), with the
    jax op_name the compiler kept (what the model's code called it): where a category's seconds go."""
    return _costliest_per_category(((row["category"], {"name": name, "op_name": op_names.get(name, "")[:200], **row})
                                    for name, row in per_op.items()), n)


def top_op_groups(per_op: dict[str, dict], op_names: dict[str, str], n: int = TOP_OPS) -> dict[str, list[dict]]:
    """Per category its `n` costliest op paths (op_path: the instructions that run the same code of
    the model summed, e.g. one kernel in every layer, forward and replay): {path, instructions, s,
    runs, bytes, flops}."""
    groups: dict[tuple[str, str], dict] = {}
    for name, row in per_op.items():
        key = (row["category"], op_path(op_names.get(name, "")) or name)
        g = groups.setdefault(key, {"path": key[1], "instructions": 0, "s": 0.0, "runs": 0.0, "bytes": 0.0,
                                    "flops": 0.0})
        g["instructions"] += 1
        for field in ("s", "runs", "bytes", "flops"):
            g[field] += row[field]
    return _costliest_per_category(((cat, g) for (cat, _), g in groups.items()), n)


def top_exposed(exposures: dict[str, float], op_names: dict[str, str], n: int = TOP_OPS) -> list[dict]:
    """The `n` async starts (and synchronous collectives) whose work the schedule leaves most exposed
    over the step: {name, op_name, exposed_s}."""
    rows = sorted(exposures.items(), key=lambda kv: -kv[1])[:n]
    return [{"name": name, "op_name": op_names.get(name, "")[:200], "exposed_s": s} for name, s in rows]


def totals(cats: dict, bf16_flops: float, tokens_per_step: int, chips: int,
           model_flops_per_device: float | None, scheduled_s: float | None = None) -> dict:
    """The step's totals from its categories: `serial` adds the collectives to the compute,
    `overlapped` hides the shorter under the longer, `scheduled` (where the program's schedule was
    read: hlo_cost.Estimator.timeline) exposes what the compute between each async start and its
    done does not cover; each with tokens/s per chip and MFU."""
    collective_s = cats["collectives"]["s"]
    compute_s = sum(v["s"] for cat, v in cats.items() if cat != "collectives")

    def rates(step_s):
        return {"step_s": step_s, "tokens_per_s_per_chip": tokens_per_step / step_s / chips if step_s else None,
                "mfu": (model_flops_per_device / (step_s * bf16_flops)
                        if model_flops_per_device and step_s else None)}

    return {"hlo_flops_per_device": sum(v["flops"] for v in cats.values()),
            "model_flops_per_device": model_flops_per_device,
            "serial": rates(compute_s + collective_s), "overlapped": rates(max(compute_s, collective_s)),
            **({"scheduled": rates(scheduled_s)} if scheduled_s is not None else {})}


def format_estimate(e: dict, reference: dict | None = None) -> str:
    """The estimate as a table: seconds per step by category, the two totals, tokens/s per chip,
    MFU; `reference` {"step_s", "tokens_per_s_per_chip", "label"} printed beside it."""
    hw = e["hardware"]
    lines = [f"step time estimate on {hw['name']} ({e['devices']} devices, {e['chips']} chips; roofline per op, "
             "loops' trip counts applied)",
             f"  {'category':<18}{'s/step':>11}{'compute s':>11}{'memory s':>11}{'grid s':>11}{'TFLOPs/dev':>12}"]
    for cat in CATEGORIES:
        r = e["categories"][cat]
        lines.append(f"  {cat:<18}{r['s']:>11.4g}{r['compute_s']:>11.4g}{r['memory_s']:>11.4g}{r['grid_s']:>11.4g}"
                     f"{r['flops'] / 1e12:>12.4g}")
    for key, label in (("serial", "collectives not overlapped"), ("overlapped", "collectives hidden under compute"),
                       ("scheduled", "async work the schedule exposes")):
        if key not in e:
            continue
        r = e[key]
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"  total, {label:<33}{r['step_s']:>9.4g} s/step  {r['tokens_per_s_per_chip']:>10,.0f} "
                     f"tokens/s per chip  MFU {mfu}")
    if reference:
        lines.append(f"  {reference['label']:<41}{reference['step_s']:>9.2f} s/step  "
                     f"{reference['tokens_per_s_per_chip']:>10,.0f} tokens/s per chip")
    designed = e.get("designed_flops_per_device")
    if designed:
        lines.append(f"  FLOPs per device: {e['hlo_flops_per_device'] / 1e12:,.1f} TFLOP compiled (Pallas calls as they "
                     f"state), {designed / 1e12:,.1f} designed ({e['hlo_flops_per_device'] / designed - 1:+.1%})")
    for kind, r in sorted(e["collectives"].items()):
        lines.append(f"  collective {kind:<20}{r['wire_bytes'] / 2**30:>9.3g} GiB sent per device  {r['s']:.4g} s")
    for name, r in sorted(e["kernels"].items(), key=lambda kv: -kv[1]["s"]):
        lines.append(f"  Pallas {name:<28}{r['calls']:>8.0f} calls {r['grid_steps']:>12,.0f} grid steps  {r['s']:.4g} s")
    for r in e.get("top_exposed", [])[:3]:
        lines.append(f"  exposed {r['exposed_s']:.4g} s at the done of {r['name']}"
                     + (f" ({r['op_name'][-80:]})" if r["op_name"] else ""))
    measured = hw.get("measured")
    source = (f"measured on {measured['device']} at {measured['commit'][:10]} (hybridmoe calibrate)" if measured
              else "the maker's figures")
    if measured and measured.get("carried_from"):
        source = (f"the maker's figures at the fractions a {measured['carried_from']} chip reached of its own, and its "
                  f"fixed costs and kernel factors: {source}")
    lines.append(f"  assumptions ({source}): bf16 {hw['bf16_flops_chip'] / hw['devices_per_chip'] / 1e12:.0f} TFLOP/s, "
                 f"HBM {hw['hbm_bytes_per_s_chip'] / hw['devices_per_chip'] / 1e9:.0f} GB/s, links "
                 f"{hw['link_bytes_per_s_chip'] / hw['devices_per_chip'] / 1e9:.0f} GB/s per device; "
                 f"{hw['grid_step_s'] * 1e6:.2f} us per Pallas grid step, {hw['op_overhead_s'] * 1e6:.2f} us per op"
                 f"{'; Pallas kernels scaled by their measured/modelled time' if hw['kernel_factors'] else ''}; "
                 "a conditional costs its heaviest branch; elementwise work hides under memory time")
    sources = e.get("kernel_factor_sources", {})
    borrowed = [f"{k} at {v}'s" for k, v in sources.items() if v not in (None, k)]
    if borrowed:
        lines.append(f"  Pallas kernels no chip case timed, at the factor of the kernel whose body they share: "
                     f"{', '.join(borrowed)}")
    if unmeasured := [k for k, v in sources.items() if v is None]:
        lines.append(f"  Pallas kernels without a measured factor (the bare model): {', '.join(unmeasured)}")
    if e["kernels_without_cost_estimate"]:
        lines.append(f"  Pallas kernels without a cost estimate (counted as memory only): "
                     f"{', '.join(e['kernels_without_cost_estimate'])}")
    if e["loops_with_unknown_trip_count"]:
        lines.append(f"  loops whose trip count is unreadable (counted once): {len(e['loops_with_unknown_trip_count'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# From a compiled step (tools/train_program.py), for `hybridmoe inspect` and benchmarks/step_estimate.py

# The seed's measured step at its cell (Qwen3.5-397B-A17B on 128 TPU v7x chips, every lever).
SEED_CELL = {"recipe": "qwen3.5-397b-a17b-v7x-128", "label": "seed, measured (128 v7x chips)",
             "step_s": 78.35, "tokens_per_s_per_chip": 3764.0}


def tokens_per_step(cfg, program_name: str) -> int | None:
    """Tokens one run of the program trains on: the step's micro-batches, or the GRPO update's rows."""
    if program_name == "train":
        t = cfg.train
        return t.batch_size * t.seq_len
    if program_name == "grpo":
        r = cfg.rl
        return r.rollouts_per_step // r.mini_batches * r.sequence_len
    return None


def default_hardware(target) -> str | None:
    """The table's row for a target: a TPU topology's generation ("tpu7x:4x4x8" -> tpu7x), or the
    host's own accelerator by its device kind ("tpu:1" on a v5e host -> v5e); None for a CPU."""
    gen = target.name.split(":")[0]
    if gen in HARDWARE:
        return gen
    return generation_of_device(target.devices[0]) if target.devices else None


def estimate_step(step, hardware: str | None = None, *, recipe: str | None = None,
                  grid_step_s: float | None = None, calibration_from: str | None = None) -> dict | None:
    """The estimate of a compiled step (train_program.CompiledStep) on `hardware` (a HARDWARE key;
    default the target's generation). None when there is no program (refused for memory), no
    token count (the sampler) or no hardware row."""
    name = hardware or default_hardware(step.target)
    tokens = tokens_per_step(step.cfg, step.program_name)
    if step.program is None or tokens is None or name is None:
        return None
    hw = hardware_for(name, calibration_from=calibration_from)
    devices = step.target.num_devices
    out = estimate(step.program.compiled_text, hw, tokens_per_step=tokens,
                   chips=max(1, devices // hw.devices_per_chip), devices=devices,
                   model_flops_per_device=model_flops_per_device(step.cfg, devices, step.program_name),
                   grid_step_s=grid_step_s)
    if step.program_name == "train":
        out["designed_flops_per_device"] = designed_flops_per_device(step.cfg, devices, step.target.platform)
    if recipe == SEED_CELL["recipe"] and step.program_name == "train":
        out["reference"] = SEED_CELL
    return out
