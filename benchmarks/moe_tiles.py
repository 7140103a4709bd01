"""The MoE block's routed experts on CPU: the sorted path through two row-tiled grouped matmuls
against the same sums kept in the tile layout end to end (the default path of the routed experts).

Arms, at the `small` shape (2048 tokens, D 256, 16 experts, top-4, F 128, 128-row tiles, float32),
forward + backward of router, routing and routed experts, compiled once each, one process pinned
to `--cores`, the arms alternating round by round:
  sorted  model/moe.sparse_experts with kernels/gmm/row_tiles.row_tiled_dot (the path before)
  tiles   model/moe.tiled_experts (kernels/gmm/row_tiles.routed_swiglu_mlp)
Prints each arm's median CPU and wall ms with the spread and the per-round ratio tiles / sorted,
and the largest relative difference of the outputs and gradients; writes
benchmarks/records/moe_tiles.json.

  .venv/bin/python benchmarks/moe_tiles.py [--cores 0] [--rounds 20]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

from benchmarks.pinned import parse_cores, pin, spread  # noqa: E402


def figures(times: dict) -> tuple[dict, dict, dict]:
    """`times`: {arm: [(cpu s, wall s) per round]} -> per arm the spread of each clock, and the
    spreads of the per-round ratios tiles / sorted, CPU and wall."""
    res = {n: {"cpu_s": spread([c for c, _ in v]), "wall_s": spread([w for _, w in v]), "times": v}
           for n, v in times.items()}
    ratio_cpu = spread([a[0] / b[0] for a, b in zip(times["tiles"], times["sorted"])])
    ratio_wall = spread([a[1] / b[1] for a, b in zip(times["tiles"], times["sorted"])])
    return res, ratio_cpu, ratio_wall


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--cores", default="0")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    cores = parse_cores(args.cores)
    pin(cores)
    harness.configure(cpu_only=True)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from hybridmoe.kernels.gmm import row_tiles as rt
    from hybridmoe.model import moe as M
    from hybridmoe.recipe import load_config

    cfg = load_config("small", ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=-1"])
    m, tile = cfg.model, cfg.kernels.gmm.xla_tile_rows
    T, D, E, F = cfg.train.batch_size * cfg.train.seq_len, m.d_model, m.num_experts, m.moe_intermediate_size
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    wi = jnp.asarray(rng.normal(size=(E, D, 2 * F)) * 0.05, jnp.float32)
    wo = jnp.asarray(rng.normal(size=(E, F, D)) * 0.05, jnp.float32)
    router = jnp.asarray(rng.normal(size=(D, E)) * 0.05, jnp.float32)
    cot = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)

    def routed(experts):
        def f(x, router, wi, wo):
            w, idx, _ = M.route(router, x, m)
            return experts(x, w, idx, wi, wo)
        return f

    arms = {"sorted": routed(lambda x, w, i, wi, wo: M.sparse_experts(
                x, w, i, wi, wo, lambda a, b, s: rt.row_tiled_dot(a, b, s, tile_rows=tile))),
            "tiles": routed(lambda x, w, i, wi, wo: M.tiled_experts(x, w, i, wi, wo, tile))}
    progs = {n: jax.jit(lambda *a, f=f: jax.vjp(f, *a)[1](cot)).lower(x, router, wi, wo).compile()
             for n, f in arms.items()}
    outs = {n: jax.block_until_ready(p(x, router, wi, wo)) for n, p in progs.items()}
    rel = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(outs["tiles"], outs["sorted"]))
    times = {n: [] for n in progs}
    loads = []
    for r in range(args.rounds):
        for n in (list(progs) if r % 2 == 0 else list(progs)[::-1]):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(progs[n](x, router, wi, wo))
            times[n].append((time.process_time() - c0, time.perf_counter() - t0))
        loads.append(os.getloadavg())
    res, ratio_cpu, ratio_wall = figures(times)
    for n, v in res.items():
        c, w = v["cpu_s"], v["wall_s"]
        print(f"{n:<7} cpu ms {1e3 * c['median']:7.1f} (p25 {1e3 * c['p25']:.1f}, p75 {1e3 * c['p75']:.1f})  "
              f"wall ms {1e3 * w['median']:7.1f}")
    print(f"tiles / sorted per round: cpu {ratio_cpu['median']:.3f} ({ratio_cpu['p25']:.3f}-{ratio_cpu['p75']:.3f}), "
          f"wall {ratio_wall['median']:.3f}; largest relative L2 difference of the gradients {rel:.1e}; "
          f"load average {min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f}")
    harness.write(args.out, "moe_tiles", script="benchmarks/moe_tiles.py", cores=cores, rounds=args.rounds,
                  shape={"tokens": T, "d_model": D, "experts": E, "top_k": m.num_experts_per_tok,
                         "moe_intermediate": F, "tile_rows": tile}, arms=res, ratio_cpu=ratio_cpu,
                  ratio_wall=ratio_wall, max_rel_l2_grad_difference=rel, load_average_per_round=loads)


if __name__ == "__main__":
    main()
