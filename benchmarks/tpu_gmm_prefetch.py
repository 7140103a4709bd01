"""The grouped matmuls with one K tile, their weight fetched a group ahead (pallas_tpu.gmm_prefetched),
against the grid-pipelined kernels (pallas_tpu.gmm), at the seed cell's per-device shapes.

    python3 benchmarks/tpu_gmm_prefetch.py            # on a TPU host (docs/tpu.md), ~3 minutes
    python3 benchmarks/tpu_gmm_prefetch.py --tiny     # CPU, interpret mode, tiny shapes: a smoke run

Per kernel (the MoE layer's forward and input-gradient matmuls, tpu_gmm_uneven.py's names), at the
uneven split chip_cases' cases use and at an even one: the grid-pipelined kernel at the tiles
tpu_gmm_uneven.json found, and the prefetched one at each (tm, tn, row chunk) of a small grid. Each
arm's output is checked against the grid-pipelined kernel's (max relative difference). Times: median
of --repeats after one warm call; useful TFLOP/s count 2 M K N.

Writes benchmarks/records/tpu_gmm_prefetch.json: device, commit, ceiling_tflops, sizes, kernels:
name -> {kind, m, k, n, groups, arms: arm -> {tiles, split -> {ms, tflops}, max_rel_diff}}.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402

KERNELS = {"wi_fwd": ("gmm", "d", "2f"), "wi_dlhs": ("gmm_t", "2f", "d"),
           "wo_fwd": ("gmm", "f", "d"), "wo_dlhs": ("gmm_t", "d", "f")}
# (tm, tn cap, row chunk) of the prefetched kernel; tn is the smaller of the cap and N.
GRID = ((128, 2048, 128), (256, 2048, 128), (512, 2048, 128), (512, 2048, 64), (256, 1024, 128),
        (512, 1024, 128), (256, 4096, 128), (1024, 2048, 128))
TINY_GRID = ((32, 128, 16), (64, 128, 32))


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=400.0)
    args = p.parse_args(argv)
    if args.tiny and args.out == p.get_default("out"):
        args.out = tempfile.mkstemp(prefix="tpu_gmm_prefetch_tiny_", suffix=".json")[1]
    harness.configure(cpu_only=args.tiny)
    import jax
    import jax.numpy as jnp

    from hybridmoe.kernels.gmm import pallas_tpu
    from hybridmoe.kernels.gmm.tiling import Tiling
    from hybridmoe.tools import chip_cases
    from hybridmoe.tools.calibrate import median_seconds

    g = chip_cases.GEOMETRIES["tiny" if args.tiny else "cell"]["moe_mlp"]
    dims = {"d": g["d"], "f": g["f"], "2f": 2 * g["f"]}
    m, groups = g["rows"], g["groups"]
    splits = {"uneven": [int(s) for s in chip_cases.group_sizes(m, groups)],
              "even": [m // groups + (i < m % groups) for i in range(groups)]}
    uneven_rec = Path(__file__).with_name("records") / "tpu_gmm_uneven.json"
    found = json.loads(uneven_rec.read_text())["kernels"] if uneven_rec.exists() and not args.tiny else {}
    from tpu_kernels import matmul_ceiling_tflops

    ceiling = matmul_ceiling_tflops(256 if args.tiny else 8192, 3 if args.tiny else 10)
    start = time.monotonic()
    log = lambda msg: print(f"[{time.monotonic() - start:6.1f} s] {msg}", flush=True)  # noqa: E731
    log(f"ceiling {ceiling:.1f} TFLOP/s")
    out: dict[str, dict] = {}
    key = jax.random.key(0)
    for name, (kind, kd, nd) in KERNELS.items():
        k, n = dims[kd], dims[nd]
        tr = kind == "gmm_t"
        lhs = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = jax.random.normal(jax.random.fold_in(key, 1), (groups, n, k) if tr else (groups, k, n),
                                jnp.float32).astype(jnp.bfloat16)
        tiles = found.get(name, {}).get("tiles") or [128, k, min(n, 2048)]
        arms = {"grid": (tuple(tiles), jax.jit(lambda a, b, s, t=Tiling(*tiles): pallas_tpu.gmm(
            a, b, s, transpose_rhs=tr, group_offset=0, sharded=False, out_dtype=jnp.bfloat16, tiling=t,
            interpret=args.tiny)))}
        for tm, tn_cap, rc in (TINY_GRID if args.tiny else GRID):
            tn = min(tn_cap, n)
            arms[f"prefetched_{tm}x{tn}_chunk{rc}"] = ((tm, k, tn, rc), jax.jit(
                lambda a, b, s, tm=tm, tn=tn, rc=rc: pallas_tpu.gmm_prefetched(
                    a, b, s, transpose_rhs=tr, group_offset=0, out_dtype=jnp.bfloat16, tm=tm, tn=tn,
                    row_chunk=rc, interpret=args.tiny)))
        row = {"kind": kind, "m": m, "k": k, "n": n, "groups": groups, "arms": {}}
        ref = {}
        for arm, (t, fn) in arms.items():
            if time.monotonic() - start > args.budget_s:
                row["arms"][arm] = {"tiles": list(t), "error": "past the budget"}
                continue
            rec = {"tiles": list(t)}
            try:
                for split, sizes in splits.items():
                    if split == "even" and arm != "grid" and not args.tiny and arm not in ("prefetched_512x2048_chunk128",
                                                                                          "prefetched_256x2048_chunk128"):
                        continue
                    sz = jnp.asarray(sizes, jnp.int32)
                    y = fn(lhs, rhs, sz)
                    if arm == "grid":
                        ref[split] = y
                    else:
                        d = jnp.max(jnp.abs(y.astype(jnp.float32) - ref[split].astype(jnp.float32)))
                        rec.setdefault("max_rel_diff", {})[split] = float(d / jnp.max(jnp.abs(ref[split].astype(jnp.float32))))
                    s = median_seconds(fn, lhs, rhs, sz, repeats=args.repeats)
                    rec[split] = {"ms": s * 1e3, "tflops": 2 * m * k * n / s / 1e12}
            except Exception as e:  # noqa: BLE001 - recorded per arm
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            row["arms"][arm] = rec
            log(f"{name} {arm}: " + ", ".join(f"{sp} {rec[sp]['ms']:.3f} ms {rec[sp]['tflops']:.1f}"
                                             for sp in splits if sp in rec) + f" {rec.get('max_rel_diff', '')} {rec.get('error', '')}")
        out[name] = row
        harness.write(args.out, "tpu_gmm_prefetch", ceiling_tflops=ceiling, sizes=splits["uneven"], kernels=out,
                      interpret=args.tiny, method=f"median of {args.repeats} after one warm call, each kernel alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
