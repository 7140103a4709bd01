"""The step-time bench: named arms (sets of overrides) of one recipe, timed in one process.

Every arm is built and compiled first; then the arms take turns, one training step each per round
(the order rotates every round), so drift in the machine's speed spreads over all arms. Seconds
per step is the mean of rounds 1.. (round 0 runs the freshly compiled program and is left out).
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


def run_bench(recipe: str, common: list[str], arms: list[tuple[str, list[str]]], rounds: int) -> dict:
    if len({n for n, _ in arms}) != len(arms):
        raise ValueError("--arm names must be distinct")
    built = [Arm(n, o, _arm_config(recipe, [*common, *o])) for n, o in arms]
    runs, states = [], []
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
        runs.append((arm, setup, compiled))
        states.append(init_state(setup, jax.random.key(t.seed)))
    peak = measure_peak_flops(runs[0][1].mesh, jnp.dtype(built[0].cfg.model.compute_dtype))
    for r in range(rounds):
        for i in np.roll(np.arange(len(runs)), -r):
            arm, setup, compiled = runs[i]
            t = arm.cfg.train
            with setup.context():
                batch = put_global(synthetic_batch(t.seed, r, t.micro_batches, t.batch_size, t.seq_len,
                                                   arm.cfg.model.vocab_size), setup.batch_sharding(1))
                t0 = time.perf_counter()
                states[i], m = compiled(states[i], batch)
                fetch_global(m)
                arm.times.append(time.perf_counter() - t0)
    out = {}
    for arm, setup, _ in runs:
        t = arm.cfg.train
        sec = float(np.mean(arm.times[1:]))
        tokens = t.micro_batches * t.batch_size * t.seq_len
        out[arm.name] = {"overrides": arm.overrides, "seconds_per_step": sec, "step_times_s": arm.times,
                         "tokens_per_step": tokens, "tokens_per_s_per_device": tokens / sec / setup.mesh.size,
                         "compile_s": arm.compile_s, "program": arm.program,
                         "peak_flops_per_device": peak,
                         "mfu": arm.program["flops_per_device"] / sec / peak,
                         "useful_flops_per_step": step_flops(arm.cfg),
                         "useful_mfu": step_flops(arm.cfg) / setup.mesh.size / sec / peak,
                         "config": json.loads(arm.cfg.model_dump_json())}
    return out


def format_table(results: dict) -> str:
    first = next(iter(results.values()))["seconds_per_step"]
    lines = [f"{'arm':<16} {'s/step':>8} {'ratio':>6} {'tok/s/dev':>10} {'compile s':>9} {'temp MiB':>9} "
             f"{'loop colls':>10} {'MFU':>6} {'useful':>6}"]
    for name, a in results.items():
        lines.append(f"{name:<16} {a['seconds_per_step']:>8.4f} {a['seconds_per_step'] / first:>6.3f} "
                     f"{a['tokens_per_s_per_device']:>10.1f} {a['compile_s']:>9.1f} "
                     f"{a['program'].get('temp', 0) / 2**20:>9.2f} {a['program']['collectives_in_loop']:>10} "
                     f"{a['mfu']:>6.1%} {a['useful_mfu']:>6.1%}")
    lines.append(f"MFU: XLA's FLOPs of the step per device per second over a measured peak of "
                 f"{next(iter(results.values()))['peak_flops_per_device'] / 1e9:.1f} GFLOP/s per device (dense matmul on every "
                 "device at once); useful: the model's FLOPs counted from its shape")
    return "\n".join(lines)
