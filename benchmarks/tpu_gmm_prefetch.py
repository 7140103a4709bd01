"""The MoE layer's grouped matmuls with one K tile, copying their own blocks, against the
grid-pipelined kernels, at the seed cell's per-device shapes.

    python3 benchmarks/tpu_gmm_prefetch.py                  # on a TPU host (docs/tpu.md), ~3 minutes
    python3 benchmarks/tpu_gmm_prefetch.py --write-table    # the same, the fastest tiles into the tile table
    python3 benchmarks/tpu_gmm_prefetch.py --tiny           # CPU, interpret mode, tiny shapes: a smoke run

With one K tile, Mosaic's grid pipeline fetches a group's weight slab (gmm, gmm_t) one step ahead,
and writes a group's weight-gradient block (tgmm) back during one step: at the cell's ~512 rows per
group both outlast the step they overlap. pallas_tpu_own_copies.gmm_prefetched fetches the weight a whole group
ahead into two VMEM slots; pallas_tpu_own_copies.tgmm_written_behind stages each finished block in one of two
slots and writes it while the following groups compute. Both compute a tile straddling a group edge
by 128-row chunks. The fused up projection (`wi_fused_fwd`: x through wi into h and the stored
pre-activations) has the same one-K-tile stall; pallas_tpu_own_copies.wi_fused_swiglu_prefetched, the same
approach, is timed against its grid-pipelined default (the seed recipe's 256 rows, 1,024 per half,
weight depth 2), and the fused input gradient (`wo_fused_dlhs`) likewise against its default at the
seed's 128 rows: each becomes the default only where this record says it is faster. Per kernel (tpu_gmm_uneven.py's names), at the uneven split chip_cases' cases use:
the grid-pipelined kernel at the tiles tpu_gmm_uneven.json found (`grid`), and the new kernel at each
tiling of a small grid; each arm's output is compared with `grid`'s (max relative difference). Times:
median of --repeats after one warm call; useful TFLOP/s count 2 M K N.

--write-table puts each kernel's fastest tiling (of the new kernels, the ones pallas_tpu.gmm and
pallas_tpu.tgmm run) into the tile table's section for this chip (kernels/gmm/tile_table.json,
entries marked "split": "uneven", as tpu_gmm_uneven.py's), with `grid`'s time as the entry's before.

Writes benchmarks/records/tpu_gmm_prefetch.json: device, commit, ceiling_tflops, sizes, kernels:
name -> {kind, m, k, n, groups, arms: arm -> {tiles, uneven: {ms, tflops}, max_rel_diff}}.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402

KERNELS = {"wi_fwd": ("gmm", "d", "2f"), "wi_dlhs": ("gmm_t", "2f", "d"), "wi_drhs": ("tgmm", "d", "2f"),
           "wo_fwd": ("gmm", "f", "d"), "wo_dlhs": ("gmm_t", "d", "f"), "wo_drhs": ("tgmm", "f", "d"),
           # the fused up projection (moe.wi_fused_swiglu), x [M, D] through wi [G, D, 2F] into h and the
           # pre-activations: its grid-pipelined kernel (the default) against wi_fused_swiglu_prefetched
           "wi_fused_fwd": ("wi_fused", "d", "2f"),
           # the fused input gradient (moe.wo_fused_dswiglu): g [M, D] through wo^T into d[gate | up] with
           # the SwiGLU VJP and the row scale; grid-pipelined (default) against ..._dlhs_prefetched
           "wo_fused_dlhs": ("wo_fused_dlhs", "d", "f")}
# (tm, tn cap) of gmm_prefetched (one K tile); (tm, tk cap, tn cap) of tgmm_written_behind. Caps: the
# smaller of the cap and the dimension.
GMM_GRID = ((256, 2048), (512, 2048), (256, 4096), (512, 1024), (1024, 2048))
TGMM_GRID = ((128, 4096, 1024), (256, 4096, 1024), (512, 4096, 1024), (512, 4096, 512), (256, 2048, 2048),
             (512, 1024, 4096))
# (tm, tile per half) of the fused up projection; its grid-pipelined arm at the seed recipe's 256 x 1024
# with the weight pipeline depth 2.
FUSED_GRID = ((128, 1024), (256, 1024), (512, 1024), (256, 512), (512, 512))
TINY_FUSED_GRID = ((32, 64), (64, 64))
TINY_GMM_GRID = ((32, 128), (64, 128))
TINY_TGMM_GRID = ((32, 128, 128), (64, 256, 128))


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=300.0, help="start no arm after this many seconds")
    p.add_argument("--write-table", action="store_true", help="each kernel's fastest tiling into the tile table")
    args = p.parse_args(argv)
    if args.tiny and args.out == p.get_default("out"):
        args.out = tempfile.mkstemp(prefix="tpu_gmm_prefetch_tiny_", suffix=".json")[1]
    harness.configure(cpu_only=args.tiny)
    import jax
    import jax.numpy as jnp

    from hybridmoe.kernels.gmm import pallas_tpu
    from hybridmoe.kernels.gmm.tiling import Tiling, row_chunk
    from hybridmoe.tools import chip_cases, tune_gmm
    from hybridmoe.tools.calibrate import median_seconds

    g = chip_cases.GEOMETRIES["tiny" if args.tiny else "cell"]["moe_mlp"]
    dims = {"d": g["d"], "f": g["f"], "2f": 2 * g["f"]}
    m, groups = g["rows"], g["groups"]
    sizes = jnp.asarray([int(s) for s in chip_cases.group_sizes(m, groups)], jnp.int32)
    uneven_rec = Path(__file__).with_name("records") / "tpu_gmm_uneven.json"
    found = json.loads(uneven_rec.read_text())["kernels"] if uneven_rec.exists() and not args.tiny else {}
    from tpu_kernels import matmul_ceiling_tflops

    ceiling = matmul_ceiling_tflops(256 if args.tiny else 8192, 3 if args.tiny else 10)
    start = time.monotonic()
    log = lambda msg: print(f"[{time.monotonic() - start:6.1f} s] {msg}", flush=True)  # noqa: E731
    log(f"ceiling {ceiling:.1f} TFLOP/s")
    out: dict[str, dict] = {}
    key = jax.random.key(0)

    @jax.jit
    def rel_diff(y, ref):  # per output, max |y - ref| / max |ref| in float32; the largest of the outputs
        return jnp.max(jnp.stack([jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                                  / jnp.max(jnp.abs(b.astype(jnp.float32)))
                                  for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(ref))]))
    common = dict(group_offset=0, sharded=False, out_dtype=jnp.bfloat16, interpret=args.tiny)
    for name, (kind, kd, nd) in KERNELS.items():
        k, n = dims[kd], dims[nd]
        lhs = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
        if kind == "tgmm":
            rhs = jax.random.normal(jax.random.fold_in(key, 1), (m, n), jnp.float32).astype(jnp.bfloat16)

            def run(t: Tiling, grid: bool):
                return jax.jit(lambda a, b, s: pallas_tpu.tgmm(a, b, s, num_local=groups, tiling=t,
                                                              grid_pipelined=grid, **common))
            new = [Tiling(tm=tm, tk=min(tk, k), tn=min(tn, n)) for tm, tk, tn in (TINY_TGMM_GRID if args.tiny else TGMM_GRID)]
        elif kind == "wi_fused":
            rhs = jax.random.normal(jax.random.fold_in(key, 1), (groups, k, n), jnp.float32).astype(jnp.bfloat16)

            def run(t: Tiling, grid: bool):
                # t.tn: the tile per half
                return jax.jit(lambda a, b, s: pallas_tpu.wi_fused_swiglu(
                    a, b, s, group_offset=0, sharded=False, tile_n_per_half=t.tn, mode="float32", tiling=t,
                    rhs_buffer_count=t.rhs_buffer_count, grid_pipelined=grid, interpret=args.tiny))
            new = [Tiling(tm=tm, tk=k, tn=min(tn, n // 2)) for tm, tn in (TINY_FUSED_GRID if args.tiny else FUSED_GRID)]
        elif kind == "wo_fused_dlhs":
            rhs = jax.random.normal(jax.random.fold_in(key, 1), (groups, n, k), jnp.float32).astype(jnp.bfloat16)
            pre = jax.random.normal(jax.random.fold_in(key, 2), (m, 2 * n), jnp.float32).astype(jnp.bfloat16)
            scale = jax.random.uniform(jax.random.fold_in(key, 3), (m,), jnp.float32, 0.1, 1.0)

            def run(t: Tiling, grid: bool):
                return jax.jit(lambda a, b, s: pallas_tpu.wo_fused_dswiglu_dlhs(
                    a, b, s, pre, preact_tile_n_per_half=n, row_scale_M=scale, out_tile_n_per_half=n, group_offset=0,
                    sharded=False, mode="float32", tiling=t, grid_pipelined=grid, interpret=args.tiny))
            new = [Tiling(tm=tm, tk=k, tn=n) for tm in ((32, 64) if args.tiny else (128, 256, 512))]
        else:
            shape = (groups, n, k) if kind == "gmm_t" else (groups, k, n)
            rhs = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.float32).astype(jnp.bfloat16)

            def run(t: Tiling, grid: bool):
                return jax.jit(lambda a, b, s: pallas_tpu.gmm(a, b, s, transpose_rhs=kind == "gmm_t", tiling=t,
                                                             grid_pipelined=grid, **common))
            new = [Tiling(tm=tm, tk=k, tn=min(tn, n)) for tm, tn in (TINY_GMM_GRID if args.tiny else GMM_GRID)]
        grid_tiles = found.get(name, {}).get("tiles") or [128, k, min(n, 1024)]
        if kind == "wi_fused":  # the seed recipe's fused forward: 256 rows, 1024 per half, weight depth 2
            grid_tiles = [32, k, 64] if args.tiny else [256, k, 1024]
        if kind == "wo_fused_dlhs":  # the seed recipe's fused input gradient: 128 rows, one K tile
            grid_tiles = [32 if args.tiny else 128, k, n]
        arms = {"grid": (Tiling(*grid_tiles, rhs_buffer_count=0 if args.tiny or kind != "wi_fused" else 2), True)}
        label = "written_behind" if kind == "tgmm" else "prefetched"
        for t in dict.fromkeys(new):
            arms[f"{label}_{t.tm}x{t.tk}x{t.tn}"] = (t, False)
        row = {"kind": kind, "m": m, "k": k, "n": n, "groups": groups, "itemsize": 2, "arms": {}}
        ref = None  # the grid-pipelined kernel's output, which the others are compared with
        for arm, (t, grid) in arms.items():
            rec = {"tiles": [t.tm, t.tk, t.tn]}
            if not grid:
                rec["row_chunk"] = row_chunk(t.tm)
            if time.monotonic() - start > args.budget_s:
                row["arms"][arm] = {**rec, "error": "past the budget"}
                continue
            try:
                fn = run(t, grid)
                y = fn(lhs, rhs, sizes)  # kept in its own dtype: wi_drhs's output has 1G elements
                if ref is None:
                    ref = y
                else:
                    rec["max_rel_diff"] = float(rel_diff(y, ref))
                del y
                s = median_seconds(fn, lhs, rhs, sizes, repeats=args.repeats)
                rec["uneven"] = {"ms": s * 1e3, "tflops": 2 * m * k * n / s / 1e12}
            except Exception as e:  # noqa: BLE001 - recorded per arm
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            row["arms"][arm] = rec
            log(f"{name} {arm}: " + (f"{rec['uneven']['ms']:.3f} ms {rec['uneven']['tflops']:.1f} TFLOP/s"
                                     if "uneven" in rec else rec.get("error", "")) + f"  diff {rec.get('max_rel_diff', '')}")
        out[name] = row
        harness.write(args.out, "tpu_gmm_prefetch", ceiling_tflops=ceiling, sizes=[int(v) for v in sizes], kernels=out,
                      interpret=args.tiny, method=f"median of {args.repeats} after one warm call, each kernel alone, "
                                                  f"at the uneven split")
    if args.write_table and not args.tiny:
        entries = []
        for name, row in out.items():
            if row["kind"] not in ("gmm", "gmm_t", "tgmm"):
                continue  # the table holds the plain kernels' tiles
            timed = {a: r for a, r in row["arms"].items() if "uneven" in r and a != "grid"
                     and r.get("max_rel_diff", 1.0) < 1e-2}
            if not timed:
                continue
            best = min(timed, key=lambda a: timed[a]["uneven"]["ms"])
            tm, tk, tn = timed[best]["tiles"]
            entries.append({**{f: row[f] for f in ("kind", "m", "k", "n", "groups", "itemsize")}, "tm": tm, "tk": tk,
                            "tn": tn, "ms": timed[best]["uneven"]["ms"],
                            "default_ms": row["arms"].get("grid", {}).get("uneven", {}).get("ms"),
                            "timed": len(timed), "split": "uneven"})
        tune_gmm.write_table(tune_gmm.check_host(), entries,
                             tune_gmm.about({"device": jax.devices()[0].device_kind}))
        log(f"{len(entries)} entries into the tile table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
