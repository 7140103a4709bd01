"""The GDN layer's forward + backward: the custom-VJP core against autodiff, and chunk 64 against 32.

    .venv/bin/python -m benchmarks.gdn_core [recipe=small] [section.key=value ...] [--steps N]

One process, one CPU device. Arms: the core backend (xla = the custom backward, xla_autodiff =
the same forward differentiated by autodiff, the path before the custom backward) times the chunk
size. Every arm is compiled first, then timed interleaved (the arm order rotates each round);
the figure is the mean over the timed rounds, as a ratio to the autodiff arm at chunk 64. For each
arm: the compiled program's temporaries, and the residuals the core's forward saves for its
backward (bytes, read from the linearised core by hybridmoe.analysis.program.saved_residuals).
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

ARMS = {  # name: (backend, chunk size)
    "autodiff C64": ("xla_autodiff", 64),
    "custom C64": ("xla", 64),
    "autodiff C32": ("xla_autodiff", 32),
    "custom C32": ("xla", 32),
}
BASELINE = "autodiff C64"


def layer_step(m, backend, chunk_size):
    def loss(p, x, seg):
        y = gdn_layer(p, x, seg, m, chunk_size=chunk_size, backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def core_residual_bytes(m, batch, tokens, backend, chunk_size):
    """Bytes the core's forward keeps for its backward (inputs it reads are counted too)."""
    f32 = jnp.float32
    shapes = [(batch, tokens, m.gdn_num_key_heads, m.gdn_key_dim)] * 2 + [
        (batch, tokens, m.gdn_num_value_heads, m.gdn_value_dim), (batch, tokens, m.gdn_num_value_heads),
        (batch, tokens, m.gdn_num_value_heads)]
    args = [jnp.zeros(s, f32) for s in shapes]

    def core(q, k, v, g, beta):
        o, _ = gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, backend=backend)
        return jnp.sum(o)

    return sum(int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in program.saved_residuals(core, *args))


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

    arms = {}
    for name, (backend, chunk_size) in ARMS.items():
        fn = layer_step(m, backend, chunk_size)
        prog = program.analyze(fn, params, x, seg)
        jax.block_until_ready(fn(params, x, seg))
        arms[name] = {"fn": fn, "backend": backend, "chunk_size": chunk_size, "times": [],
                      "temp_bytes": prog.temp_bytes,
                      "core_residual_bytes": core_residual_bytes(m, t.batch_size, t.seq_len, backend, chunk_size)}
    names = list(arms)
    for r in range(steps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(arms[name]["fn"](params, x, seg))
            arms[name]["times"].append(time.perf_counter() - t0)

    base_ms = 1e3 * float(np.mean(arms[BASELINE]["times"]))
    rows = []
    for name, a in arms.items():
        ms = 1e3 * float(np.mean(a["times"]))
        rows.append({"arm": name, "backend": a["backend"], "chunk_size": a["chunk_size"], "mean_ms": ms,
                     "std_ms": 1e3 * float(np.std(a["times"])), "time_ratio_to_baseline": ms / base_ms,
                     "temp_bytes": a["temp_bytes"], "core_residual_bytes": a["core_residual_bytes"]})
    print(f"GDN layer forward+backward, {t.batch_size}x{t.seq_len} tokens, D={m.d_model} "
          f"Hk={m.gdn_num_key_heads} Hv={m.gdn_num_value_heads} dk={m.gdn_key_dim} dv={m.gdn_value_dim} "
          f"{m.compute_dtype}, {steps} interleaved rounds on {jax.devices()[0].device_kind}")
    print(f"{'arm':<16}{'ms':>10}{'ratio':>8}{'temp MB':>10}{'core residuals MB':>19}")
    for row in rows:
        print(f"{row['arm']:<16}{row['mean_ms']:>10.2f}{row['time_ratio_to_baseline']:>8.3f}"
              f"{row['temp_bytes'] / 2**20:>10.2f}{row['core_residual_bytes'] / 2**20:>19.2f}")
    record = {
        "benchmark": "gdn_core",
        **machine_record(),
        "config": {"recipe": recipe, "overrides": overrides, "resolved": json.loads(cfg.model_dump_json())},
        "method": f"one device; every arm compiled first, then {steps} rounds with the arms interleaved "
                  "(order rotated per round); mean wall time of one jitted GDN layer forward+backward on "
                  "packed rows (two documents); compiled temporaries (hybridmoe.analysis.program); the core's "
                  "saved residuals from jax's saved_residuals of the core alone",
        "baseline": BASELINE,
        "rows": rows,
        "gpu": "not measured: no GPU was lent to this session (the Pallas core's forward + backward at "
               "Qwen3.5-35B-A3B per-device shapes remains to be measured)",
    }
    write_record(Path(args.out), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
