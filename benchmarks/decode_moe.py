"""A decode step's MoE block on CPU: which path computes its few routed rows cheapest.

One MoE layer of `recipe=small` (E = 16 experts, top-4, D = 256, F = 128) on T tokens, jitted, on
one CPU device, each path checked against ragged_dot (< 1e-4) and then timed interleaved:
  ragged_dot    jax.lax.ragged_dot (on CPU every expert for every routed row: T k E row products)
  tiled128      model/moe.tiled_experts, the CPU default program's MoE: row tiles of 128 rows
                (ceil(T k / 128) + E tiles, each gathering its expert's weights) end to end
  row_tiles8    the grouped matmul (kernels.gmm) with 8-row tiles
  every_expert  model/moe.every_expert_rows: every expert on every token (T E rows, weights in
                place), then the k routed rows taken
T = 8 .. 512 covers decode steps (one token per row: the rows of a rollout) up to a prefill's
tokens. What `every_expert_is_cheaper` (moe.py) predicts is printed beside the times; the sampler
takes every_expert in a decode step where it says so. Figures: median CPU seconds of the process
per call (all threads; less sensitive to other load than wall time, both recorded).

  .venv/bin/python benchmarks/decode_moe.py [--cores 0] [--steps 7] [--tokens 8,16,32,64,128,256,512]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

CALLS_PER_ROUND = 20


def per_call_figures(times: dict) -> tuple[dict, str]:
    """Per path, the spread over rounds of one call's seconds (a round times CALLS_PER_ROUND calls),
    CPU and wall; and the path fastest by median CPU time."""
    from benchmarks.pinned import spread

    per_call = {n: {k: spread([v / CALLS_PER_ROUND for v in t[k]]) for k in ("cpu_s", "wall_s")}
                for n, t in times.items()}
    fastest = min(per_call, key=lambda n: per_call[n]["cpu_s"]["median"])
    return per_call, fastest


def main() -> None:
    p = harness.parser(__doc__, __file__)
    p.add_argument("--cores", default="0", help="the cores this process is pinned to (default 0)")
    p.add_argument("--steps", type=int, default=7, help="timed rounds")
    p.add_argument("--tokens", default="8,16,32,64,128,256,512")
    args = p.parse_args()
    from benchmarks.pinned import parse_cores, pin, spread

    cores = parse_cores(args.cores)
    pin(cores)
    harness.configure(cpu_only=True)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hybridmoe.kernels import gmm as K
    from hybridmoe.model import moe as M
    from hybridmoe.model.params import declare_params, init_params
    from hybridmoe.recipe import load_config

    cfg = load_config("small", ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1"])
    m = cfg.model
    params = jax.tree.map(lambda a: a[0], init_params(declare_params(m), jax.random.key(0))["blocks"][0]["moe"])
    tiles = lambda R: (lambda lhs, rhs, sizes: K.gmm(lhs, rhs, sizes, xla_impl="row_tiles", xla_tile_rows=R))  # noqa: E731
    paths = {"ragged_dot": lambda *a: M.sparse_experts(*a, jax.lax.ragged_dot),
             "tiled128": lambda *a: M.tiled_experts(*a, tile_rows=128),
             "row_tiles8": lambda *a: M.sparse_experts(*a, tiles(8)),
             "every_expert": M.every_expert_rows}

    def layer(path):
        def f(p, x_TD):
            w, idx, _ = M.route(p["router"], x_TD, m)
            return path(x_TD, w, idx, p["wi"], p["wo"])
        return jax.jit(f)

    jitted = {name: layer(path) for name, path in paths.items()}
    rng = np.random.default_rng(0)
    results = {}
    print(f"{'tokens':>6} " + " ".join(f"{n:>13}" for n in paths) + "  predicted (every_expert_is_cheaper)")
    for T in (int(t) for t in args.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((T, m.d_model)).astype(np.float32))
        want = np.asarray(jitted["ragged_dot"](params, x))
        errors = {n: float(np.abs(np.asarray(f(params, x)) - want).max()) for n, f in jitted.items()}
        assert max(errors.values()) < 1e-4, errors

        def calls(f):
            def run():
                for _ in range(CALLS_PER_ROUND):
                    y = f(params, x)
                return y
            return run

        times = harness.interleaved({n: calls(f) for n, f in jitted.items()}, args.steps)
        per_call, fastest = per_call_figures(times)
        cheaper = M.every_expert_is_cheaper(T, m.num_experts_per_tok, m.num_experts, cfg.kernels.gmm.xla_tile_rows)
        results[str(T)] = {"per_call": per_call, "max_abs_diff_vs_ragged_dot": errors,
                           "every_expert_is_cheaper": cheaper, "fastest_by_cpu_time": fastest}
        print(f"{T:>6} " + " ".join(f"{per_call[n]['cpu_s']['median'] * 1e3:>11.2f}ms" for n in paths)
              + f"  {'every_expert' if cheaper else 'tiled128'} (fastest: {fastest})", flush=True)
    harness.write(args.out, "decode_moe", script="benchmarks/decode_moe.py",
                  method={"cores": cores, "affinity": sorted(os.sched_getaffinity(0)), "rounds": args.steps,
                          "calls_per_round": CALLS_PER_ROUND, "order": "interleaved, rotated each round",
                          "figure": "median over rounds of the per-call process CPU seconds (and wall)"},
                  load_average=os.getloadavg(),
                  shape={"experts": m.num_experts, "top_k": m.num_experts_per_tok, "d_model": m.d_model,
                         "moe_intermediate_size": m.moe_intermediate_size, "dtype": m.compute_dtype,
                         "tile_rows_default": cfg.kernels.gmm.xla_tile_rows},
                  tokens=results)


if __name__ == "__main__":
    main()
