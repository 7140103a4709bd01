"""The GDN core's forward + backward compiled for a TPU at Qwen3.5-35B-A3B per-device shapes:
XLA core against the Pallas core (kernels.gdn.backend=pallas_tpu), compiled memory only.

    python -m benchmarks.gdn_pallas_tpu [--topology tpu7x:2x2x1]

Compiles jax.grad of sum(o) w.r.t. q, k, v, g, beta for one device of a compile-only TPU topology
from this CPU host (libtpu comes with the test extra, `jax[tpu]`): B 1, T 8192, 16 key / 32 value
heads, dk = dv = 128, chunk 64, bf16 q / k / v, with segment ids (the packed path). Records each
backend's compile time on this host and the compiled program's memory (arguments, temporaries);
XLA's flop count is recorded but does not see inside a Pallas kernel. No TPU runs anything here:
there is no time of the kernels, only what the compiler reserves. Writes
benchmarks/records/gdn_pallas_tpu.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from hybridmoe.kernels.gdn import gated_delta_rule  # noqa: E402
from hybridmoe.tools.train_program import tpu_target  # noqa: E402

MIB = 2**20
# Qwen3.5-35B-A3B's GDN layer, one device's share at B 1, T 8192.
SHAPE = dict(batch=1, tokens=8192, key_heads=16, value_heads=32, key_dim=128, value_dim=128, chunk_size=64)
BACKENDS = ("xla", "pallas_tpu")


def compiled_core(backend: str, device):
    s = SHAPE
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    qk = (s["batch"], s["tokens"], s["key_heads"], s["key_dim"])
    gates = (s["batch"], s["tokens"], s["value_heads"])
    args = (spec(qk, jnp.bfloat16), spec(qk, jnp.bfloat16),
            spec((s["batch"], s["tokens"], s["value_heads"], s["value_dim"]), jnp.bfloat16),
            spec(gates, jnp.float32), spec(gates, jnp.float32), spec((s["batch"], s["tokens"]), jnp.int32))

    def loss(q, k, v, g, beta, segment_ids):
        o, _ = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=s["chunk_size"],
                                backend=backend)
        return jnp.sum(o.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()


def main(argv=None) -> int:
    parser = harness.parser(__doc__, __file__)
    parser.add_argument("--topology", default="tpu7x:2x2x1")
    args = parser.parse_args(argv)
    device = tpu_target(args.topology).devices[0]
    rows = []
    for backend in BACKENDS:
        t0 = time.perf_counter()
        compiled = compiled_core(backend, device)
        compile_s = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}
        rows.append({"backend": backend, "compile_s": compile_s,
                     "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
                     "output_bytes": memory.output_size_in_bytes, "xla_flops": cost.get("flops", 0.0),
                     "pallas_kernels": compiled.as_text().count("tpu_custom_call")})
    print(f"GDN core forward+backward for {args.topology} (one device), B {SHAPE['batch']} T {SHAPE['tokens']} "
          f"Hk {SHAPE['key_heads']} Hv {SHAPE['value_heads']} dk {SHAPE['key_dim']} dv {SHAPE['value_dim']} "
          f"chunk {SHAPE['chunk_size']}, bf16 inputs")
    print(f"{'backend':<12}{'compile s':>10}{'args MiB':>10}{'temp MiB':>10}{'kernels':>9}")
    for r in rows:
        print(f"{r['backend']:<12}{r['compile_s']:>10.1f}{r['argument_bytes'] / MIB:>10.1f}"
              f"{r['temp_bytes'] / MIB:>10.1f}{r['pallas_kernels']:>9}")
    harness.write(
        args.out, "gdn_pallas_tpu",
        config={"topology": args.topology, **SHAPE,
                "inputs": "q, k, v bfloat16; g, beta float32; segment ids given (the packed path)"},
        method="jax.grad of sum(o) w.r.t. q, k, v, g, beta lowered and compiled for one device of a "
               "compile-only TPU topology on this CPU host; memory from the compiled program's "
               "memory_analysis; XLA's flop count does not see inside Pallas kernels",
        rows=rows,
        not_measured="time: compiled-memory facts only; the time needs a TPU run",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
