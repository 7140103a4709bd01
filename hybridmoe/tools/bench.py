"""The step-time bench: named arms (sets of overrides) of one recipe, timed in one process.

Every arm is built and compiled first. Whether an arm fits is the device's call, as it is for
`hybridmoe train` (the same jitted step: run/setup.jit_train_step, the state donated): an arm the
compiler refuses for memory, or whose arguments alone exceed the device's free memory (certain: the
state and batch must all be on the device), is refused before anything runs; an arm whose
allocation the runtime refuses at its visit is refused then. Each refusal carries the device's own
figures (analysis/device_refusal.py), not a sum of XLA's memory analysis, which on a TPU counts
temporaries its buffer assignment packs into less (16.68 GiB summed for a step that runs in 15.75).
Then the arms take turns in two visits each (A B C, then B C A):
a visit makes the arm's state on the device, runs one untimed step and then its timed ones, and
frees the state, so only one arm's state is on the device at a time (a chip's 16 GiB holds one
arm of a large model, not two). Seconds per step is the mean of the timed steps. Beside it, the
step-time model's estimate of the same compiled program on the device's own generation
(analysis/step_estimate.py; calibrated where `hybridmoe calibrate` ran on that generation).
Program facts come from the compiled step: temporaries and collectives inside the layer loop.
MFU: the compiled step's FLOPs (XLA's count, per device) per second, over the chip's bf16 ceiling:
its generation's calibration row (analysis/chip_calibration.json, `hybridmoe calibrate`) where there
is one, else a dense matmul measured on the same devices just before the arms run (8192^3 on an
accelerator, large enough that only the matrix unit bounds it; 1024^3 on a CPU), the record saying
which (`peak_source`).
Useful MFU: the same with the step's useful FLOPs counted from the model shape
(hybridmoe.analysis.flops, as benchmarks/step_anatomy.py counts both frameworks), which do not
grow with work a kernel wastes (ragged_dot on CPU computes every expert for every row).
An arm may name another recipe (`--arm tuned:recipe=tuned`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.analysis.flops import step_flops
from hybridmoe.analysis.hlo_cost import hlo_flops
from hybridmoe.analysis.program import (cost_figures, count, memory_figures, parse_hlo, parse_stablehlo,
                                        per_iteration)
from hybridmoe.recipe import load_config, split_args
from hybridmoe.config.schema import Config
from hybridmoe.parallel.host import fetch_global, put_global
from hybridmoe.data.synthetic import synthetic_batch
from hybridmoe.run.setup import build, init_state, jit_train_step
from hybridmoe.analysis.device_refusal import describe, device_refusal


@dataclasses.dataclass
class Arm:
    name: str
    overrides: list[str]
    cfg: Config
    times: list[float] = dataclasses.field(default_factory=list)
    compile_s: float = 0.0
    program: dict = dataclasses.field(default_factory=dict)
    estimate: dict | None = None
    profile: dict | None = None   # the device's seconds per step by category (bench --profile)
    profile_ops: list | None = None  # its heaviest ops beside the model's estimate of each (profile.op_table)
    refusal: dict | None = None   # the device's refusal for memory (analysis/device_refusal.py), or ours


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name:key=value,key=value' (or just 'name' for the recipe as it is)."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"--arm {text!r}: an arm is NAME or NAME:section.key=value,...")
    return name, [o for o in rest.split(",") if o]


def measure_peak_flops(mesh, dtype, size: int | None = None, repeats: int = 5) -> float:
    """FLOP/s per device of a [size, size] x [size, size] matmul run on every device of the mesh
    at once (best of `repeats`). size: 8192 on an accelerator (a 1024^3 product measured 3.5 TFLOP/s
    on a v5e that does 164: launch-bound, not a ceiling), 1024 on a CPU."""
    from jax.sharding import NamedSharding, PartitionSpec

    if size is None:
        size = 1024 if mesh.devices.flat[0].platform == "cpu" else 8192
    n = mesh.size
    sh = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    a = jax.device_put(jnp.ones((n, size, size), dtype), sh)
    f = jax.jit(lambda a: jnp.einsum("nij,njk->nik", a, a), out_shardings=sh)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def peak_flops(mesh, dtype) -> tuple[float, str]:
    """(FLOP/s per device, where it came from) that MFU is taken against: the calibration row of
    the devices' generation (its measured bf16 matmul rate per chip over the devices on a chip),
    else a matmul measured on the spot."""
    from hybridmoe.analysis.hardware import MAKERS, read_calibration
    from hybridmoe.kernels.platform import generation_of_device

    generation = generation_of_device(mesh.devices.flat[0])
    row = read_calibration().get(generation) if generation else None
    if row:
        measured = row.get("measured", {})
        return (row["bf16_flops_chip"] / MAKERS[generation].devices_per_chip,
                f"the {generation} calibration row (analysis/chip_calibration.json: {measured.get('matmul', 'a matmul')} "
                f"on {measured.get('device', '?')} at {str(measured.get('commit', '?'))[:10]})")
    size = 1024 if mesh.devices.flat[0].platform == "cpu" else 8192
    return (measure_peak_flops(mesh, dtype, size),
            f"a {size}^3 {jnp.dtype(dtype).name} matmul on every device at once, measured before the arms")


def _arm_config(recipe: str, words: list[str]) -> Config:
    name, overrides = split_args([f"recipe={recipe}", *words])
    return load_config(name, overrides)


def device_free_bytes(device) -> int | None:
    """What the device can still give one arm: its allocator's limit less what is in use (None where
    the runtime keeps no figures: the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def arguments_refusal(figures: dict, free_bytes: int | None) -> dict | None:
    """The one refusal certain before the device is asked: the step's arguments (the state and the
    batch, which must all be on the device) alone exceed its free memory. Temporaries are not
    judged here: XLA's memory analysis sums more of them than the compiler's buffer assignment
    holds, and the compiler, which refuses a program that does not fit, has already accepted it."""
    if free_bytes is None or figures.get("argument", 0) <= free_bytes:
        return None
    return {"what": "the step's arguments (state and batch)", "when": "before running",
            "needed_bytes": figures["argument"], "available_bytes": free_bytes,
            "message": "XLA's memory analysis of the compiled step, against the device's memory_stats"}


def refusal_line(arm: Arm) -> str:
    """--arm NAME: why it was refused, with the figures, and what to change."""
    r = arm.refusal
    said = (describe(r) if r["when"] in ("compile", "run") or r["needed_bytes"] is None else
            f"{r['what']} need {r['needed_bytes'] / 2**30:.2f} GiB per device and the device has "
            f"{r['available_bytes'] / 2**30:.2f} GiB free")
    return (f"--arm {arm.name}: {said}: shorten train.seq_len or train.batch_size, or remat more "
            "(remat.policy=full)")


def _estimate(text: str, cfg: Config, devices, hardware: str | None) -> dict | None:
    """The step-time model's estimate of the compiled step on `hardware` (default: the device's own
    generation; None on a CPU unless named), beside the measured time."""
    from hybridmoe.analysis.flops import model_flops_per_device
    from hybridmoe.analysis.step_estimate import default_hardware, estimate, hardware_for, tokens_per_step
    from hybridmoe.tools.train_program import host_target

    name = hardware or default_hardware(host_target())
    if name is None:
        return None
    hw = hardware_for(name)
    e = estimate(text, hw, tokens_per_step=tokens_per_step(cfg, "train"),
                 chips=max(1, len(devices) // hw.devices_per_chip), devices=len(devices),
                 model_flops_per_device=model_flops_per_device(cfg, len(devices), "train"))
    return {"hardware": name, "calibrated": hw.measured is not None, "step_s": e["serial"]["step_s"],
            "overlapped_step_s": e["overlapped"]["step_s"],
            "category_s": {c: v["s"] for c, v in e["categories"].items()}}


def _timed_visit(arm: Arm, setup, compiled, visit: int, steps: int, profile_steps: int = 0) -> None:
    """One visit of an arm: its state made on the device, one untimed step, then `steps` timed ones,
    then `profile_steps` under the profiler (tools/profile.py); the state is freed before the next
    arm's visit, so one arm's state is on the device at a time."""
    from hybridmoe.tools import profile

    t = arm.cfg.train
    with setup.context():
        state = init_state(setup, jax.random.key(t.seed + visit))

        def step(i):
            nonlocal state
            batch = put_global(synthetic_batch(t.seed, visit * (steps + 1) + i, t.fewest_micro_batches, t.rows_per_micro_batch,
                                               t.seq_len, arm.cfg.model.vocab_size), setup.batch_sharding(1))
            state, m = compiled(state, batch)
            return fetch_global(m)

        for i in range(steps + 1):
            t0 = time.perf_counter()
            step(i)
            if i:
                arm.times.append(time.perf_counter() - t0)
        if profile_steps:
            text = compiled.as_text()
            ops = profile.trace_ops(lambda: step(steps + 1), profile_steps, profile.module_name(text))
            arm.profile = profile.by_category(ops, text)
            if arm.estimate:
                from hybridmoe.analysis.step_estimate import hardware_for, op_estimates

                arm.profile_ops = profile.op_table(ops, op_estimates(text, hardware_for(arm.estimate["hardware"])))
    del state


def run_bench(recipe: str, common: list[str], arms: list[tuple[str, list[str]]], steps: int, *,
              estimate_for: str | None = None, free_bytes: int | None = -1, skip_unfit: bool = False,
              profile_steps: int = 0) -> dict:
    """Every arm compiled first (a program that cannot fit is refused before anything runs), then
    timed in visits that alternate the arms (A B C A B C: drift in the machine's speed spreads over
    all of them), `steps` timed steps per arm in all, split over two visits. free_bytes: the device
    memory an arm may use (-1: what the first device reports free; None: unchecked). skip_unfit: an
    arm that cannot fit is left out and its entry says why ({"refused": ...}) instead. profile_steps:
    after its last visit's timed steps, each arm runs that many more under the profiler, and its entry
    gets the device's seconds per step by the model's categories ("profile_category_s")."""
    if len({n for n, _ in arms}) != len(arms):
        raise ValueError("--arm names must be distinct")
    built = [Arm(n, o, _arm_config(recipe, [*common, *o])) for n, o in arms]
    runs = []
    for arm in built:
        setup = build(arm.cfg)
        t = arm.cfg.train
        step_fn = jit_train_step(setup)
        with setup.context():
            batch0 = put_global(synthetic_batch(t.seed, 0, t.fewest_micro_batches, t.rows_per_micro_batch, t.seq_len,
                                                arm.cfg.model.vocab_size), setup.batch_sharding(1))
            t0 = time.perf_counter()
            lowered = step_fn.lower(setup.abstract_state(), batch0)
            try:
                compiled = compile_lowered(lowered)
            except jax.errors.JaxRuntimeError as e:
                arm.refusal = device_refusal(e, "compile")
                if arm.refusal is None:
                    raise
                continue
            arm.compile_s = time.perf_counter() - t0
        text = compiled.as_text()
        colls, lowered_colls = parse_hlo(text), parse_stablehlo(lowered.as_text())
        per_loop = lambda cs: {loop: dict(c) for loop, c in per_iteration(cs).items()}  # noqa: E731
        # Per loop (micro-batch scan, forward and backward layer scans): collectives per iteration,
        # compiled (every one) and lowered (the explicit ones, before XLA moves any out of a loop).
        # MFU's numerator: the program's own FLOPs (analysis/hlo_cost.hlo_flops: ragged dots by their
        # rows); XLA's cost analysis counts a ragged dot as dense over every group, kept beside it.
        arm.program = {**memory_figures(compiled), "flops_per_device": hlo_flops(text),
                       "xla_cost_flops_per_device": cost_figures(compiled).get("flops", 0.0),
                       "compiled_collectives_per_loop_iteration": per_loop(colls),
                       "lowered_collectives_per_loop_iteration": per_loop(lowered_colls),
                       "lowered_int32_permutes_per_loop_iteration": per_loop(
                           [c for c in lowered_colls if c.kind == "collective-permute" and c.dtype == "s32"]),
                       "compiled_collectives": dict(Counter(f"{c.kind} {c.dtype}" for c in colls)),
                       "collectives_in_loop": count(colls, in_loop=True),
                       "collectives_outside_loop": count(colls, in_loop=False)}
        arm.estimate = _estimate(text, arm.cfg, setup.mesh.devices.flat, estimate_for)
        runs.append((arm, setup, compiled))
        del batch0
    if free_bytes == -1:
        free_bytes = device_free_bytes(jax.devices()[0])
    for arm, _, _ in runs:
        arm.refusal = arguments_refusal(arm.program, free_bytes)
    refused = [refusal_line(a) for a in built if a.refusal]
    if refused and not skip_unfit:
        raise ValueError("arms that cannot fit the device (nothing was timed):\n  " + "\n  ".join(refused))
    runs = [r for r in runs if not r[0].refusal]
    peak, peak_source = peak_flops(runs[0][1].mesh, jnp.dtype(built[0].cfg.model.compute_dtype)) if runs else (0, "")
    visits = 2
    per_visit = -(-steps // visits)
    for visit in range(visits):
        for i in np.roll(np.arange(len(runs)), -visit):
            arm = runs[i][0]
            if arm.refusal:
                continue
            try:
                _timed_visit(*runs[i], visit, per_visit, profile_steps if visit == visits - 1 else 0)
            except jax.errors.JaxRuntimeError as e:
                # The runtime's no at load or run (the arm's state was freed with the visit's frame).
                arm.refusal = device_refusal(e, "run")
                if arm.refusal is None:
                    raise
    out = {}
    for arm, setup, _ in runs:
        if arm.refusal:
            continue
        t = arm.cfg.train
        sec = float(np.mean(arm.times))
        tokens = t.batch_size * t.seq_len
        out[arm.name] = {"overrides": arm.overrides, "seconds_per_step": sec, "step_times_s": arm.times,
                         "tokens_per_step": tokens, "tokens_per_s_per_device": tokens / sec / setup.mesh.size,
                         "compile_s": arm.compile_s, "program": arm.program,
                         "peak_flops_per_device": peak, "peak_source": peak_source,
                         "mfu": arm.program["flops_per_device"] / sec / peak,
                         "useful_flops_per_step": step_flops(arm.cfg),
                         "useful_mfu": step_flops(arm.cfg) / setup.mesh.size / sec / peak,
                         "estimate": arm.estimate,
                         "measured_over_estimated": sec / arm.estimate["step_s"] if arm.estimate else None,
                         "profile_category_s": arm.profile, "profile_ops": arm.profile_ops,
                         "config": json.loads(arm.cfg.model_dump_json())}
    for arm in built:
        if arm.refusal:
            out[arm.name] = {"overrides": arm.overrides, "refused": refusal_line(arm), "device_refusal": arm.refusal,
                             "program": arm.program, "estimate": arm.estimate}
    return out


def compile_lowered(lowered):
    """The device's compile of an arm's step: the compiler refuses a program that cannot fit."""
    return lowered.compile()


def format_table(results: dict) -> str:
    timed = {n: a for n, a in results.items() if "refused" not in a}
    first = next(iter(timed.values()))["seconds_per_step"] if timed else None
    lines = [f"{'arm':<16} {'s/step':>8} {'ratio':>6} {'tok/s/dev':>10} {'compile s':>9} {'temp MiB':>9} "
             f"{'loop colls':>10} {'MFU':>6} {'useful':>6} {'est. s':>8} {'meas/est':>8}"]
    estimated = None
    for name, a in results.items():
        if "refused" in a:
            lines.append(f"{name:<16} refused: {a['refused'].split(': ', 1)[1]}")
            continue
        est = a.get("estimate")
        estimated = estimated or est
        lines.append(f"{name:<16} {a['seconds_per_step']:>8.4f} {a['seconds_per_step'] / first:>6.3f} "
                     f"{a['tokens_per_s_per_device']:>10.1f} {a['compile_s']:>9.1f} "
                     f"{a['program'].get('temp', 0) / 2**20:>9.2f} {a['program']['collectives_in_loop']:>10} "
                     f"{a['mfu']:>6.1%} {a['useful_mfu']:>6.1%} "
                     + (f"{est['step_s']:>8.4f} {a['measured_over_estimated']:>8.2f}" if est else f"{'-':>8} {'-':>8}"))
    if timed:
        first_timed = next(iter(timed.values()))
        lines.append(f"MFU: the compiled step's FLOPs (ragged dots by their rows) per device per second over a peak of "
                     f"{first_timed['peak_flops_per_device'] / 1e9:.1f} GFLOP/s per device ({first_timed['peak_source']}); "
                     "useful: the model's FLOPs counted from its shape")
    if estimated:
        source = "calibrated on a chip" if estimated["calibrated"] else "the maker's figures"
        lines.append(f"est.: the step-time model on {estimated['hardware']} ({source}), collectives not overlapped")
    return "\n".join(lines)
