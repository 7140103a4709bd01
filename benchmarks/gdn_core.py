"""The GDN layer's forward + backward: the custom-VJP core against autodiff, and chunk 64 against 32.

    .venv/bin/python -m benchmarks.gdn_core [recipe=small] [section.key=value ...] [--steps N]

One process, one CPU device. Arms: the core backend (xla = the custom backward, xla_autodiff =
the same forward differentiated by autodiff, the path before the custom backward) times the chunk
size, for the whole layer and for the core alone at the layer's shapes. Every arm is compiled first, then timed interleaved (the arm order rotates each round);
the figure is the mean over the timed rounds, as a ratio to the autodiff arm at chunk 64. For each
arm: the compiled program's temporaries, and the residuals the core's forward saves for its
backward (bytes, read from the linearised core by hybridmoe.analysis.program.saved_residuals).
The Pallas cores (kernels.gdn.backend=pallas_tpu, pallas_gpu) are timed only on their platform
(TPU, GPU): elsewhere they run interpreted, which is no speed measurement, so their arms record
the residual bytes alone.
Writes benchmarks/gdn_core.json. GPU/TPU figures (the Pallas core) are not measured here.
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

from hybridmoe.analysis import program
from hybridmoe.analysis.record import machine_record, write_record
from hybridmoe.config import load_config, split_args
from hybridmoe.kernels.gdn import gated_delta_rule
from hybridmoe.model.gdn import gdn_layer
from hybridmoe.model.params import declare_params, init_params

ARMS = {  # name: (what, backend, chunk size)
    "layer autodiff C64": ("layer", "xla_autodiff", 64),
    "layer custom C64": ("layer", "xla", 64),
    "layer autodiff C32": ("layer", "xla_autodiff", 32),
    "layer custom C32": ("layer", "xla", 32),
    "core autodiff C64": ("core", "xla_autodiff", 64),
    "core custom C64": ("core", "xla", 64),
    "core autodiff C32": ("core", "xla_autodiff", 32),
    "core custom C32": ("core", "xla", 32),
    "core pallas_tpu C64": ("core", "pallas_tpu", 64),
    "core pallas_gpu C64": ("core", "pallas_gpu", 64),
}
PALLAS_PLATFORM = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
BASELINE = {"layer": "layer autodiff C64", "core": "core autodiff C64"}


def layer_step(m, backend, chunk_size):
    def loss(p, x, seg):
        y = gdn_layer(p, x, seg, m, chunk_size=chunk_size, backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def core_inputs(m, batch, tokens):
    """Random core inputs at the layer's shapes (q, k, v, g, beta) with gates as the model makes them."""
    keys = jax.random.split(jax.random.key(2), 5)
    qk_shape = (batch, tokens, m.gdn_num_key_heads, m.gdn_key_dim)
    v_shape = (batch, tokens, m.gdn_num_value_heads, m.gdn_value_dim)
    gate_shape = v_shape[:3]
    return (jax.random.normal(keys[0], qk_shape), jax.random.normal(keys[1], qk_shape),
            jax.random.normal(keys[2], v_shape), -0.1 * jax.nn.softplus(jax.random.normal(keys[3], gate_shape)),
            jax.nn.sigmoid(jax.random.normal(keys[4], gate_shape)))


def interpreted(backend):
    """A Pallas backend off its platform runs interpreted: traced and counted, never timed."""
    return backend in PALLAS_PLATFORM and jax.default_backend() != PALLAS_PLATFORM[backend]


def core_loss(backend, chunk_size, seg):
    def loss(q, k, v, g, beta):
        o, _ = gated_delta_rule(q, k, v, g, beta, segment_ids=seg, chunk_size=chunk_size, backend=backend,
                                interpret=interpreted(backend))
        return jnp.sum(o.astype(jnp.float32) ** 2)

    return loss


def core_residual_bytes(core_args, backend, chunk_size, seg):
    """Bytes the core's forward keeps for its backward (inputs it reads are counted too)."""
    residuals = program.saved_residuals(core_loss(backend, chunk_size, seg), *core_args)
    return sum(int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in residuals)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="timed rounds (0 = bench.steps)")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args, words = parser.parse_known_args(argv)
    recipe, overrides = split_args(words or ["recipe=small"])
    overrides = ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1", *overrides]
    cfg = load_config(recipe, overrides)
    steps = args.steps or cfg.bench.steps
    m, t = cfg.model, cfg.train
    gdn_index = m.layer_pattern.index("gdn")
    blocks = init_params(declare_params(m), jax.random.key(0))["blocks"]
    params = jax.tree.map(lambda a: a[0], blocks[gdn_index]["mixer"])
    x = jax.random.normal(jax.random.key(1), (t.batch_size, t.seq_len, m.d_model)).astype(m.compute_dtype)
    # Two documents per row: the packed path, as training runs it.
    seg = jnp.where(jnp.arange(t.seq_len) < t.seq_len // 3, 1, 2)[None].repeat(t.batch_size, 0).astype(jnp.int32)

    core_args = core_inputs(m, t.batch_size, t.seq_len)
    arms = {}
    for name, (what, backend, chunk_size) in ARMS.items():
        if interpreted(backend):
            arms[name] = {"what": what, "backend": backend, "chunk_size": chunk_size, "times": None,
                          "core_residual_bytes": core_residual_bytes(core_args, backend, chunk_size, seg)}
            continue
        if what == "layer":
            fn, fn_args = layer_step(m, backend, chunk_size), (params, x, seg)
        else:
            fn, fn_args = jax.jit(jax.grad(core_loss(backend, chunk_size, seg), argnums=range(5))), core_args
        prog = program.analyze(fn, *fn_args)
        jax.block_until_ready(fn(*fn_args))
        arms[name] = {"fn": fn, "args": fn_args, "what": what, "backend": backend, "chunk_size": chunk_size,
                      "times": [], "temp_bytes": prog.temp_bytes, "gflops": prog.cost.get("flops", 0.0) / 1e9,
                      "core_residual_bytes": core_residual_bytes(core_args, backend, chunk_size, seg)}
    names = [name for name, a in arms.items() if a["times"] is not None]
    for r in range(steps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(arms[name]["fn"](*arms[name]["args"]))
            arms[name]["times"].append(time.perf_counter() - t0)

    base_ms = {what: 1e3 * float(np.mean(arms[name]["times"])) for what, name in BASELINE.items()}
    rows = []
    for name, a in arms.items():
        if a["times"] is None:
            rows.append({"arm": name, "what": a["what"], "backend": a["backend"], "chunk_size": a["chunk_size"],
                         "timed": False, "why_not_timed": f"interpreted on {jax.default_backend()}",
                         "core_residual_bytes": a["core_residual_bytes"]})
            continue
        ms = 1e3 * float(np.mean(a["times"]))
        rows.append({"arm": name, "what": a["what"], "backend": a["backend"], "chunk_size": a["chunk_size"],
                     "mean_ms": ms, "min_ms": 1e3 * float(np.min(a["times"])),
                     "std_ms": 1e3 * float(np.std(a["times"])), "time_ratio_to_baseline": ms / base_ms[a["what"]],
                     "gflops": a["gflops"], "temp_bytes": a["temp_bytes"],
                     "core_residual_bytes": a["core_residual_bytes"]})
    print(f"GDN layer forward+backward, {t.batch_size}x{t.seq_len} tokens, D={m.d_model} "
          f"Hk={m.gdn_num_key_heads} Hv={m.gdn_num_value_heads} dk={m.gdn_key_dim} dv={m.gdn_value_dim} "
          f"{m.compute_dtype}, {steps} interleaved rounds on {jax.devices()[0].device_kind}")
    print(f"{'arm':<22}{'ms':>10}{'ratio':>8}{'GFLOP':>8}{'temp MB':>10}{'core residuals MB':>19}")
    for row in rows:
        if not row.get("timed", True):
            print(f"{row['arm']:<22}{'not timed (' + row['why_not_timed'] + ')':>36}"
                  f"{row['core_residual_bytes'] / 2**20:>19.2f}")
            continue
        print(f"{row['arm']:<22}{row['mean_ms']:>10.2f}{row['time_ratio_to_baseline']:>8.3f}{row['gflops']:>8.2f}"
              f"{row['temp_bytes'] / 2**20:>10.2f}{row['core_residual_bytes'] / 2**20:>19.2f}")
    record = {
        "benchmark": "gdn_core",
        **machine_record(),
        "config": {"recipe": recipe, "overrides": overrides, "resolved": json.loads(cfg.model_dump_json())},
        "method": f"one device; every arm compiled first, then {steps} rounds with the arms interleaved "
                  "(order rotated per round); mean wall time of one jitted forward+backward of the GDN layer, "
                  "or of the core alone at the layer's shapes, on packed rows (two documents); ratios to the "
                  "autodiff chunk-64 arm of the same kind; XLA's flop count and compiled temporaries "
                  "(hybridmoe.analysis.program); the core's saved residuals from jax's saved_residuals",
        "baselines": BASELINE,
        "rows": rows,
        "gpu": "not measured: no GPU or TPU was lent to this session; the Pallas cores ran interpreted on "
               "CPU, which is no speed measurement, so pallas_gpu's forward + backward time at Qwen3.5-35B-A3B "
               "per-device shapes (B 1, T 8192, 32 value heads, dims 128) next to the XLA path remains to be "
               "measured (this benchmark times it when run on a GPU: recipe=small model.gdn_num_key_heads=16 "
               "model.gdn_num_value_heads=32 model.gdn_key_dim=128 model.gdn_value_dim=128 train.seq_len=8192 "
               "train.batch_size=1)",
    }
    write_record(Path(args.out), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
