"""The MoE layer's forward + backward with each grouped-matmul lever on and off, on this machine.

    .venv/bin/python benchmarks/gmm.py [recipe=small] [section.key=value ...] [--steps N]

One process, one device, every arm compiled first, then the arms timed interleaved (arm order
rotates each round, so drift in the machine's speed spreads over all arms); the figure is the
mean over the timed rounds, reported as a ratio to the levers-off arm. For each arm the compiled
forward + backward program's bytes accessed and temporaries come from hybridmoe.tools.program.
Writes benchmarks/records/gmm.json (machine, date, versions, commit, resolved config) and prints a table.

The Pallas kernels (and kernels.gmm.wi_fwd_rhs_buffer_count, a Pallas-only lever) are not timed
here: on CPU they run in interpret mode, whose speed says nothing about the hardware. GPU
figures need a GPU run (the record says whether one was made).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.tools import program
from hybridmoe.tools.record import machine_record, write_record
from hybridmoe.recipe import load_config, split_args
from hybridmoe.model import moe as moe_mod
from hybridmoe.model.params import declare_params, init_params

ARMS = {
    "off": (),
    "wi_fused_swiglu": ("moe.wi_fused_swiglu=true",),
    "wo_fused_dswiglu": ("moe.wo_fused_dswiglu=true",),
    "router_grad_from_wo_input": ("moe.router_grad_from_wo_input=true",),
    "wi+wo": ("moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true"),
    "all three": ("moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true",
                  "moe.router_grad_from_wo_input=true"),
}


def _layer_step(cfg):
    def loss(p, x):
        y = moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="timed rounds (0 = bench.steps)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "records" / (Path(__file__).stem + ".json")))
    args, words = parser.parse_known_args(argv)
    recipe, overrides = split_args(words or ["recipe=small"])
    # One device: the layer's own arithmetic, no collectives in the timing.
    overrides = ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1", *overrides]
    base = load_config(recipe, overrides)
    steps = args.steps or base.bench.steps
    m, t = base.model, base.train
    specs = declare_params(m)
    params = jax.tree.map(lambda a: a[0], init_params(specs, jax.random.key(0))["blocks"][0]["moe"])
    x = jax.random.normal(jax.random.key(1), (t.batch_size, t.seq_len, m.d_model)).astype(m.compute_dtype)

    arms = {}
    for name, extra in ARMS.items():
        cfg = load_config(recipe, [*overrides, *extra])
        fn = _layer_step(cfg)
        prog = program.analyze(fn, params, x)
        jax.block_until_ready(fn(params, x))  # compile and warm
        arms[name] = {"fn": fn, "overrides": list(extra), "times": [],
                      "bytes_accessed": prog.bytes_accessed, "temp_bytes": prog.temp_bytes,
                      "flops": prog.cost.get("flops", 0.0)}
    names = list(arms)
    for r in range(steps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(arms[name]["fn"](params, x))
            arms[name]["times"].append(time.perf_counter() - t0)

    off_ms = 1e3 * float(np.mean(arms["off"]["times"]))
    rows = []
    for name, a in arms.items():
        ms = 1e3 * float(np.mean(a["times"]))
        rows.append({"arm": name, "overrides": a["overrides"], "mean_ms": ms,
                     "std_ms": 1e3 * float(np.std(a["times"])), "time_ratio_to_off": ms / off_ms,
                     "bytes_accessed": a["bytes_accessed"], "temp_bytes": a["temp_bytes"],
                     "flops": a["flops"]})
    print(f"MoE layer forward+backward, {t.batch_size}x{t.seq_len} tokens, D={m.d_model} "
          f"E={m.num_experts} k={m.num_experts_per_tok} F={m.moe_intermediate_size} "
          f"{m.compute_dtype}, {steps} interleaved rounds on {jax.devices()[0].device_kind}")
    print(f"{'arm':<28}{'ms':>10}{'ratio':>8}{'MB accessed':>14}{'temp MB':>10}")
    for row in rows:
        print(f"{row['arm']:<28}{row['mean_ms']:>10.1f}{row['time_ratio_to_off']:>8.3f}"
              f"{row['bytes_accessed'] / 2**20:>14.1f}{row['temp_bytes'] / 2**20:>10.1f}")
    record = {
        "benchmark": "gmm",
        **machine_record(),
        "config": {"recipe": recipe, "overrides": overrides, "resolved": json.loads(base.model_dump_json())},
        "method": f"one device; every arm compiled first, then {steps} rounds with the arms interleaved "
                  "(order rotated per round); mean wall time of one jitted forward+backward; bytes accessed "
                  "and temporaries of the compiled program (hybridmoe.tools.program)",
        "rows": rows,
        "gpu": "not measured: no GPU was lent to this task (grouped-matmul TFLOP/s of the Pallas kernels "
               "against jax.lax.ragged_dot, fused vs unfused backward and the fraction of bf16 peak remain "
               "to be measured on an H100/H200)",
        "pallas_rhs_buffer_count": "not timed on CPU (interpret mode); its VMEM effect is measured in "
                                   "benchmarks/records/gmm_vmem.json",
    }
    write_record(Path(args.out), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
