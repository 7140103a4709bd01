"""All-gather vs ring context parallelism, per attention layer, from the compiled program: the K/V
bytes each device moves and the peak temporary memory, forward + backward, on 8 simulated CPU
devices.

The program is one gated attention layer of the `small` recipe's model (4 query heads over 2 kv
heads of dim 64, d_model 256, float32), value and gradient (weights and input) of sum(sin(y)),
at --tokens tokens per row (default 16,384) and one row per context group (the batch over the
fsdp devices that the context axis leaves). Arms, for context 2, 4 and 8:
  all_gather           attention.cp_impl=all_gather, the flash-xla core (kernels.attention.backend=xla)
  all_gather[masked]   the same with the masked XLA core ([t, T] scores: the old default on GPU/TPU)
  ring                 attention.cp_impl=ring, the flash-xla core
each with attention.cp_load_balance. Figures per device: the K/V collectives (keys, values and their
gradients: result bytes times the executions the loop trip counts give, and the bytes a device
receives: an all-gather (P - 1) / P of its result, a reduce-scatter P - 1 shards, a permute its
result), the ids' (positions, segment ids), and the compiled memory analysis' temporaries; every
collective is in the record. Compile
only (nothing runs), so the figures are exact program facts, not timings.

  .venv/bin/python -m benchmarks.cp_ring [--tokens 16384]
Prints a table and writes benchmarks/records/cp_ring.json.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8, cpu_only=True)

import jax  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from hybridmoe.model.attention import attention_layer  # noqa: E402
from hybridmoe.model.params import declare_params, init_params  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.run.setup import build  # noqa: E402
from hybridmoe.analysis import program  # noqa: E402

RECIPE = "small"
CONTEXTS = (2, 4, 8)
ARMS = {"all_gather": ["attention.cp_impl=all_gather", "kernels.attention.backend=xla"],
        "all_gather[masked]": ["attention.cp_impl=all_gather", "kernels.attention.backend=blocked"],
        "ring": ["attention.cp_impl=ring", "kernels.attention.backend=xla"]}


def layer_program(cfg, tokens: int, rows: int):
    specs = declare_params(cfg.model)
    params = init_params(specs, jax.random.key(0))
    kinds = cfg.model.layer_pattern
    p = jax.tree.map(lambda a: a[0], params["blocks"][kinds.index("attention")]["mixer"])
    x = jnp.zeros((rows, tokens, cfg.model.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (rows, tokens))
    seg = jnp.ones((rows, tokens), jnp.int32)

    def f(p, x):
        y = attention_layer(p, x, pos, seg, cfg.model, cfg.attention, packed=True, kernels=cfg.kernels)
        return jnp.sum(jnp.sin(y))

    setup = build(cfg)
    with setup.context():
        return program.analyze(jax.jit(jax.value_and_grad(f, argnums=(0, 1))), p, x)


# Bytes a device receives per collective over P ranks, from its result bytes: an all-gather's result
# holds its own shard too; a reduce-scatter receives P - 1 partial shards; a permute its result.
WIRE = {"all-gather": lambda n, P: n * (P - 1) / P, "reduce-scatter": lambda n, P: n * (P - 1),
        "collective-permute": lambda n, P: n, "all-reduce": lambda n, P: 2 * n * (P - 1) / P}


def facts(prog: program.Program, kv_dims: tuple[int, int], P: int) -> dict:
    """Collectives per device, each as result bytes times the executions (loop trip counts), split
    into K/V (float, last dims [kv heads, head dim]: keys, values and their gradients), ids (int32
    positions and segment ids) and other (the load-balancing permutes of the layer's input and
    output, the weight gradients' all-reduce), and the compiled temporaries."""
    rows, by_class = [], defaultdict(int)
    for c in prog.compiled_collectives:
        n = c.trip_count or 1 if c.in_loop else 1
        what = ("ids" if c.dtype.startswith("s") else
                "kv" if tuple(c.shape[-2:]) == kv_dims else "other")
        rows.append({"kind": c.kind, "dtype": c.dtype, "shape": list(c.shape), "bytes": c.bytes, "executions": n,
                     "class": what})
        by_class[what] += c.bytes * n
    kv_by_kind, kv_wire = defaultdict(int), 0
    for r in rows:
        if r["class"] == "kv":
            kv_by_kind[f"{r['kind']} {r['dtype']}"] += r["bytes"] * r["executions"]
            kv_wire += WIRE[r["kind"]](r["bytes"], P) * r["executions"]
    return {"kv_bytes": by_class["kv"], "kv_wire_bytes": int(kv_wire), "ids_bytes": by_class["ids"],
            "other_bytes": by_class["other"], "kv_bytes_by_kind": dict(kv_by_kind), "collectives": rows,
            "temp_bytes": prog.temp_bytes, "memory": prog.memory}


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    results = {}
    mib = 2 ** 20
    print(f"{'context':>7} {'arm':<20} {'K/V MiB (results)':>18} {'(by kind)':<52} {'K/V MiB received':>17} "
          f"{'temp MiB':>9}")
    for P in CONTEXTS:
        rows = 8 // P
        for name, overrides in ARMS.items():
            cfg = load_config(RECIPE, ["mesh.cpu_devices=8", f"mesh.context={P}", "mesh.data=1", "mesh.fsdp=-1",
                                       f"train.seq_len={args.tokens}", f"model.max_seq_len={args.tokens}",
                                       f"train.batch_size={rows}", "attention.cp_load_balance=true", *overrides])
            f = facts(layer_program(cfg, args.tokens, rows), (cfg.model.num_kv_heads, cfg.model.head_dim), P)
            results[f"context{P} {name}"] = {"context": P, "arm": name, "overrides": overrides, **f}
            kinds = ", ".join(f"{k} {v / mib:.1f}" for k, v in sorted(f["kv_bytes_by_kind"].items()))
            print(f"{P:>7} {name:<20} {f['kv_bytes'] / mib:>18.1f} {kinds:<52} {f['kv_wire_bytes'] / mib:>17.1f} "
                  f"{f['temp_bytes'] / mib:>9.1f}", flush=True)
    harness.write(args.out, "cp_ring", recipe=RECIPE, tokens=args.tokens, rows_per_context_group=1, arms=results)


if __name__ == "__main__":
    main()
