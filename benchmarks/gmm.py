"""The MoE layer's forward + backward with each grouped-matmul lever on and off, on this machine.

    .venv/bin/python benchmarks/gmm.py [recipe=small] [section.key=value ...] [--steps N]

One process, one device, every arm compiled first, then the arms timed interleaved (arm order
rotates each round, so drift in the machine's speed spreads over all arms); the figure is the
mean over the timed rounds, reported as a ratio to the levers-off arm. For each arm the compiled
forward + backward program's bytes accessed and temporaries come from hybridmoe.analysis.program.
Writes benchmarks/records/gmm.json (machine, date, versions, commit, resolved config) and prints a table.

The Pallas kernels (and kernels.gmm.wi_fwd_rhs_buffer_count, a Pallas-only lever) are not timed
here: on CPU they run in interpret mode, whose speed says nothing about the hardware. GPU
figures need a GPU run (the record says whether one was made).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.analysis import program  # noqa: E402
from hybridmoe.model import moe as moe_mod  # noqa: E402

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


def table_rows(arms: dict) -> list[dict]:
    """A record row per arm: its mean and spread of wall milliseconds, their ratio to the levers-off
    arm, and the compiled program's figures."""
    off_ms = 1e3 * float(np.mean(arms["off"]["times"]))
    rows = []
    for name, a in arms.items():
        ms = 1e3 * float(np.mean(a["times"]))
        rows.append({"arm": name, "overrides": a["overrides"], "mean_ms": ms,
                     "std_ms": 1e3 * float(np.std(a["times"])), "time_ratio_to_off": ms / off_ms,
                     "bytes_accessed": a["bytes_accessed"], "temp_bytes": a["temp_bytes"],
                     "flops": a["flops"]})
    return rows


def main(argv=None) -> int:
    args, recipe, overrides, base, steps = harness.one_device_config(__doc__, __file__, argv)
    m, t = base.model, base.train
    params, x, _ = harness.layer_case(base, m.layer_pattern[0], "moe")

    arms = {}
    for name, extra in ARMS.items():
        cfg = load_config(recipe, [*overrides, *extra])
        fn = _layer_step(cfg)
        prog = program.analyze(fn, params, x)
        jax.block_until_ready(fn(params, x))  # compile and warm
        arms[name] = {"fn": fn, "overrides": list(extra),
                      "bytes_accessed": prog.bytes_accessed, "temp_bytes": prog.temp_bytes,
                      "flops": prog.cost.get("flops", 0.0)}
    times = harness.interleaved({name: (lambda fn=a["fn"]: fn(params, x)) for name, a in arms.items()}, steps)
    for name, a in arms.items():
        a["times"] = times[name]["wall_s"]

    rows = table_rows(arms)
    print(f"MoE layer forward+backward, {t.batch_size}x{t.seq_len} tokens, D={m.d_model} "
          f"E={m.num_experts} k={m.num_experts_per_tok} F={m.moe_intermediate_size} "
          f"{m.compute_dtype}, {steps} interleaved rounds on {jax.devices()[0].device_kind}")
    print(f"{'arm':<28}{'ms':>10}{'ratio':>8}{'MB accessed':>14}{'temp MB':>10}")
    for row in rows:
        print(f"{row['arm']:<28}{row['mean_ms']:>10.1f}{row['time_ratio_to_off']:>8.3f}"
              f"{row['bytes_accessed'] / 2**20:>14.1f}{row['temp_bytes'] / 2**20:>10.1f}")
    harness.write(
        args.out, "gmm",
        config={"recipe": recipe, "overrides": overrides, "resolved": json.loads(base.model_dump_json())},
        method=f"one device; every arm compiled first, then {steps} rounds with the arms interleaved "
               "(order rotated per round); mean wall time of one jitted forward+backward; bytes accessed "
               "and temporaries of the compiled program (hybridmoe.analysis.program)",
        rows=rows,
        gpu="not measured here: grouped-matmul TFLOP/s of the Pallas kernels against jax.lax.ragged_dot, fused "
            "vs unfused backward and the fraction of bf16 peak need a GPU run",
        pallas_rhs_buffer_count="not timed on CPU (interpret mode); its VMEM effect is measured in "
                                "benchmarks/records/gmm_vmem.json",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
