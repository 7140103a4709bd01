"""The step-time bench: named arms (sets of overrides) of one recipe, timed in one process.

Every arm is built and compiled first, and an arm whose step cannot fit the device's free memory
is refused before anything runs. Then the arms take turns in two visits each (A B C, then B C A):
a visit makes the arm's state on the device, runs one untimed step and then its timed ones, and
frees the state, so only one arm's state is on the device at a time (a chip's 16 GiB holds one
arm of a large model, not two). Seconds per step is the mean of the timed steps. Beside it, the
step-time model's estimate of the same compiled program on the device's own generation
(analysis/step_estimate.py; calibrated where `hybridmoe calibrate` ran on that generation).
Program facts come from the compiled step: temporaries and collectives inside the layer loop.
MFU: the compiled step's FLOPs (XLA's count, per device) per second, over a peak measured on the
same devices just before the arms run (a dense matmul on every device at once, best of a few).
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
from hybridmoe.analysis.program import (cost_figures, count, memory_figures, parse_hlo, parse_stablehlo,
                                        per_iteration)
from hybridmoe.recipe import load_config, split_args
from hybridmoe.config.schema import Config
from hybridmoe.parallel.host import fetch_global, put_global
from hybridmoe.data.synthetic import synthetic_batch
from hybridmoe.run.setup import build, init_state, jit_train_step


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


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name:key=value,key=value' (or just 'name' for the recipe as it is)."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"--arm {text!r}: an arm is NAME or NAME:section.key=value,...")
    return name, [o for o in rest.split(",") if o]


def measure_peak_flops(mesh, dtype, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s per device of a [size, size] x [size, size] matmul run on every device of the mesh
    at once (best of `repeats`): the peak the step's MFU is measured against."""
    from jax.sharding import NamedSharding, PartitionSpec

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


def program_bytes(figures: dict) -> int:
    """The device memory one run of a compiled step holds at its peak: its arguments (the state and
    the batch), temporaries and outputs, less the outputs that reuse a donated argument's buffer."""
    return figures.get("argument", 0) + figures.get("temp", 0) + figures.get("output", 0) - figures.get("alias", 0)


def fit_problems(arms: list[Arm], free_bytes: int | None) -> list[str]:
    """One line per arm whose step needs more device memory than is free (each arm's state is on the
    device alone, so each is checked against all of it)."""
    if free_bytes is None:
        return []
    gib = 2**30
    return [f"--arm {a.name}: its step needs {program_bytes(a.program) / gib:.2f} GiB per device (arguments "
            f"{a.program.get('argument', 0) / gib:.2f}, temporaries {a.program.get('temp', 0) / gib:.2f}, outputs not "
            f"aliased {(a.program.get('output', 0) - a.program.get('alias', 0)) / gib:.2f}) and the device has "
            f"{free_bytes / gib:.2f} GiB free: shorten train.seq_len or train.batch_size, or remat more "
            "(remat.policy=full)" for a in arms if program_bytes(a.program) > free_bytes]


def _estimate(compiled, cfg: Config, devices, hardware: str | None) -> dict | None:
    """The step-time model's estimate of the compiled step on `hardware` (default: the device's own
    generation; None on a CPU unless named), beside the measured time."""
    from hybridmoe.analysis.flops import model_flops_per_device
    from hybridmoe.analysis.step_estimate import default_hardware, estimate, hardware_for, tokens_per_step
    from hybridmoe.tools.train_program import host_target

    name = hardware or default_hardware(host_target())
    if name is None:
        return None
    hw = hardware_for(name)
    e = estimate(compiled.as_text(), hw, tokens_per_step=tokens_per_step(cfg, "train"),
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
            batch = put_global(synthetic_batch(t.seed, visit * (steps + 1) + i, t.micro_batches, t.batch_size,
                                               t.seq_len, arm.cfg.model.vocab_size), setup.batch_sharding(1))
            state, m = compiled(state, batch)
            return fetch_global(m)

        for i in range(steps + 1):
            t0 = time.perf_counter()
            step(i)
            if i:
                arm.times.append(time.perf_counter() - t0)
        if profile_steps:
            ops = profile.trace_ops(lambda: step(steps + 1), profile_steps)
            arm.profile = profile.by_category(ops, compiled.as_text())
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
            batch0 = put_global(synthetic_batch(t.seed, 0, t.micro_batches, t.batch_size, t.seq_len,
                                                arm.cfg.model.vocab_size), setup.batch_sharding(1))
            t0 = time.perf_counter()
            lowered = step_fn.lower(setup.abstract_state(), batch0)
            compiled = lowered.compile()
            arm.compile_s = time.perf_counter() - t0
        colls, lowered_colls = parse_hlo(compiled.as_text()), parse_stablehlo(lowered.as_text())
        per_loop = lambda cs: {loop: dict(c) for loop, c in per_iteration(cs).items()}  # noqa: E731
        # Per loop (micro-batch scan, forward and backward layer scans): collectives per iteration,
        # compiled (every one) and lowered (the explicit ones, before XLA moves any out of a loop).
        arm.program = {**memory_figures(compiled), "flops_per_device": cost_figures(compiled).get("flops", 0.0),
                       "compiled_collectives_per_loop_iteration": per_loop(colls),
                       "lowered_collectives_per_loop_iteration": per_loop(lowered_colls),
                       "lowered_int32_permutes_per_loop_iteration": per_loop(
                           [c for c in lowered_colls if c.kind == "collective-permute" and c.dtype == "s32"]),
                       "compiled_collectives": dict(Counter(f"{c.kind} {c.dtype}" for c in colls)),
                       "collectives_in_loop": count(colls, in_loop=True),
                       "collectives_outside_loop": count(colls, in_loop=False)}
        arm.estimate = _estimate(compiled, arm.cfg, setup.mesh.devices.flat, estimate_for)
        runs.append((arm, setup, compiled))
        del batch0
    if free_bytes == -1:
        free_bytes = device_free_bytes(runs[0][1].mesh.devices.flat[0])
    refused = fit_problems(built, free_bytes)
    if refused and not skip_unfit:
        raise ValueError("arms that cannot fit the device (nothing was timed):\n  " + "\n  ".join(refused))
    unfit = {line.split(":", 1)[0].removeprefix("--arm "): line for line in refused}
    runs = [r for r in runs if r[0].name not in unfit]
    if not runs:
        return {a.name: {"overrides": a.overrides, "refused": unfit[a.name]} for a in built}
    peak = measure_peak_flops(runs[0][1].mesh, jnp.dtype(built[0].cfg.model.compute_dtype))
    visits = 2
    per_visit = -(-steps // visits)
    for visit in range(visits):
        for i in np.roll(np.arange(len(runs)), -visit):
            _timed_visit(*runs[i], visit, per_visit, profile_steps if visit == visits - 1 else 0)
    out = {}
    for arm, setup, _ in runs:
        t = arm.cfg.train
        sec = float(np.mean(arm.times))
        tokens = t.micro_batches * t.batch_size * t.seq_len
        out[arm.name] = {"overrides": arm.overrides, "seconds_per_step": sec, "step_times_s": arm.times,
                         "tokens_per_step": tokens, "tokens_per_s_per_device": tokens / sec / setup.mesh.size,
                         "compile_s": arm.compile_s, "program": arm.program,
                         "peak_flops_per_device": peak,
                         "mfu": arm.program["flops_per_device"] / sec / peak,
                         "useful_flops_per_step": step_flops(arm.cfg),
                         "useful_mfu": step_flops(arm.cfg) / setup.mesh.size / sec / peak,
                         "estimate": arm.estimate,
                         "measured_over_estimated": sec / arm.estimate["step_s"] if arm.estimate else None,
                         "profile_category_s": arm.profile,
                         "config": json.loads(arm.cfg.model_dump_json())}
    for arm in built:
        if arm.name in unfit:
            out[arm.name] = {"overrides": arm.overrides, "refused": unfit[arm.name], "program": arm.program,
                             "estimate": arm.estimate}
    return out


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
        lines.append(f"MFU: XLA's FLOPs of the step per device per second over a measured peak of "
                     f"{next(iter(timed.values()))['peak_flops_per_device'] / 1e9:.1f} GFLOP/s per device (dense matmul "
                     "on every device at once); useful: the model's FLOPs counted from its shape")
    if estimated:
        source = "calibrated on a chip" if estimated["calibrated"] else "the maker's figures"
        lines.append(f"est.: the step-time model on {estimated['hardware']} ({source}), collectives not overlapped")
    return "\n".join(lines)
