"""Sequence-sharded GDN: the scan keys against the trees, and the layer on 2, 4, 8 context ranks.

    .venv/bin/python -m benchmarks.gdn_cp [--rounds N] [--tokens 4096 --heads 16 --dim 128]

Part 1, one device, per-device geometry of one rank (default 4096 tokens, 16 value heads, dk = dv
= 128, chunk 64): the transition product M_r (tree vs scan, gdn.cp_m_scan) and the backward's
local state cotangent (tree vs scan, gdn.cp_dh_scan): time (interleaved rounds), compiled
temporaries, and the scan's error relative to max against the float32 HIGHEST tree.

Part 2, the GDN layer forward + backward at the `small` shape (batch 4 x 512 tokens) on 1 device
and with the sequence split over 2, 4 and 8 simulated CPU devices, with each cross-rank prefix
(all-gather + serial merge, the default; log2(P) collective-permutes): time (interleaved),
compiled temporaries and collective bytes. The simulated devices share this machine's cores, so
the CP times measure overhead, not speed-up. Writes benchmarks/records/gdn_cp.json.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.analysis import program  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.kernels.gdn import context_parallel as cp  # noqa: E402
from hybridmoe.kernels.gdn.reference import document_starts  # noqa: E402
from hybridmoe.kernels.gdn.xla import chunk_terms, prepare_chunks  # noqa: E402
from hybridmoe.model.gdn import gdn_layer  # noqa: E402
from hybridmoe.parallel.mesh import make_mesh  # noqa: E402
from hybridmoe.parallel.rules import DEFAULT_RULES, use_rules  # noqa: E402


def _mean_ms(fns: dict, rounds: int) -> dict:
    return {name: 1e3 * float(np.mean(t["wall_s"])) for name, t in harness.interleaved(fns, rounds).items()}


def error_vs_tree(results: dict, name: str) -> float:
    """An arm's largest absolute difference from its tree arm's result, relative to the tree's
    largest magnitude (0 for a tree arm)."""
    tree = results[name.replace("scan", "tree")]
    return float(jnp.abs(results[name] - tree).max() / jnp.abs(tree).max())


def scans_vs_trees(tokens: int, heads: int, dim: int, rounds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    chunk = 64
    q, k = (jnp.asarray(rng.normal(size=(1, tokens, heads, dim)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, tokens, heads, dim)), jnp.float32)
    g = jnp.asarray(np.log(rng.uniform(0.995, 1.0, size=(1, tokens, heads))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.01, 0.1, size=(1, tokens, heads)), jnp.float32)
    starts = document_starts(jnp.ones((1, tokens), jnp.int32))
    x, starts_BNC = prepare_chunks(q, k, v, g, beta, starts, chunk, True)
    terms = jax.jit(chunk_terms)(x, starts_BNC)
    do = jnp.asarray(rng.normal(size=x.v.shape), jnp.float32)
    arms = {
        "cp_m_tree": (cp.cp_m_tree_product, (terms,)),
        "cp_m_scan": (cp.cp_m_scan_product, (terms,)),
        "cp_dh_tree": (cp.cp_dh_tree_cotangent, (terms, do)),
        "cp_dh_scan": (cp.cp_dh_scan_cotangent, (terms, do)),
    }
    compiled, results = {}, {}
    for name, (fn, args) in arms.items():
        jitted = jax.jit(fn)
        compiled[name] = (program.analyze(jitted, *args).temp_bytes, jitted, args)
        results[name] = jitted(*args)
    ms = _mean_ms({n: (lambda j=j, a=a: j(*a)) for n, (_, j, a) in compiled.items()}, rounds)
    rows = []
    for name in arms:
        err = error_vs_tree(results, name)
        rows.append({"arm": name, "mean_ms": ms[name], "temp_bytes": compiled[name][0],
                     "rel_max_error_vs_tree": err})
    return rows


def layer_on_context_ranks(rounds: int) -> list[dict]:
    cfg = load_config("small", [])
    m = cfg.model
    params, x, seg = harness.layer_case(cfg, "gdn", "mixer")

    def step_for(prefix):
        def loss(p, x, seg):
            y = gdn_layer(p, x, seg, m, chunk_size=cfg.gdn.chunk_size, cp_prefix=prefix)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    arms = {}
    for ranks in (1, 2, 4, 8):
        mesh_cfg = load_config("small", [f"mesh.context={ranks}", "mesh.fsdp=1", "mesh.data=1",
                                         f"mesh.cpu_devices={ranks}"]).mesh
        mesh = make_mesh(mesh_cfg.resolve(ranks)[0], jax.devices()[:ranks])
        for prefix in (("all_gather", "ppermute") if ranks > 1 else ("none",)):
            fn = step_for(prefix if ranks > 1 else "all_gather")
            with jax.set_mesh(mesh), use_rules(DEFAULT_RULES):
                prog = program.analyze(fn, params, x, seg)
                jax.block_until_ready(fn(params, x, seg))
            colls = prog.compiled_collectives
            arms[f"P={ranks} {prefix}"] = {"ranks": ranks, "prefix": prefix, "fn": fn, "mesh": mesh,
                                           "temp_bytes": prog.temp_bytes,
                                           "collective_bytes": program.executed_bytes(colls),
                                           "collectives": dict(Counter(c.kind for c in colls))}

    def run(a):
        with jax.set_mesh(a["mesh"]), use_rules(DEFAULT_RULES):
            return a["fn"](params, x, seg)

    ms = _mean_ms({name: (lambda a=a: run(a)) for name, a in arms.items()}, rounds)
    return layer_rows(arms, ms)


def layer_rows(arms: dict, ms: dict) -> list[dict]:
    """A record row per arm: its mean milliseconds and their ratio to the one-device arm's, its
    compiled figures."""
    base = ms["P=1 none"]
    return [{"arm": name, "ranks": a["ranks"], "prefix": a["prefix"], "mean_ms": ms[name],
             "time_ratio_to_1_device": ms[name] / base, "temp_bytes": a["temp_bytes"],
             "collective_bytes": a["collective_bytes"], "collectives": a["collectives"]}
            for name, a in arms.items()]


def main(argv=None) -> int:
    parser = harness.parser(__doc__, __file__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args(argv)

    scan_rows = scans_vs_trees(args.tokens, args.heads, args.dim, args.rounds)
    print(f"transition product / local state cotangent, {args.tokens} tokens, {args.heads} heads, dims {args.dim}, "
          f"chunk 64, {args.rounds} interleaved rounds")
    print(f"{'arm':<10}{'ms':>10}{'temp MB':>10}{'err vs tree':>14}")
    for r in scan_rows:
        print(f"{r['arm']:<10}{r['mean_ms']:>10.1f}{r['temp_bytes'] / 2**20:>10.1f}{r['rel_max_error_vs_tree']:>14.2e}")

    layer_rows = layer_on_context_ranks(args.rounds)
    print("GDN layer forward+backward, small shape (4 x 512 tokens), sequence split over P simulated CPU devices")
    print(f"{'arm':<18}{'ms':>10}{'ratio':>8}{'temp MB':>10}{'collective KB':>15}")
    for r in layer_rows:
        print(f"{r['arm']:<18}{r['mean_ms']:>10.1f}{r['time_ratio_to_1_device']:>8.2f}"
              f"{r['temp_bytes'] / 2**20:>10.1f}{r['collective_bytes'] / 2**10:>15.1f}")

    harness.write(
        args.out, "gdn_cp",
        config={"scan_geometry": {"tokens": args.tokens, "value_heads": args.heads, "dk": args.dim,
                                  "dv": args.dim, "chunk": 64}, "layer": "recipe=small", "rounds": args.rounds},
        method="every arm compiled first, then timed in interleaved rounds (order rotated per round), mean wall "
               "time; compiled temporaries and collective bytes from hybridmoe.analysis.program. Simulated CPU "
               "devices share the host's cores: CP rows measure overhead on one host, not multi-device speed.",
        scans=scan_rows,
        layer=layer_rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
