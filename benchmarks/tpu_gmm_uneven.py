"""The MoE layer's six grouped matmuls at the seed cell's per-device shapes, tiled for uneven groups.

    python3 benchmarks/tpu_gmm_uneven.py                 # on a TPU host (docs/tpu.md), ~5 minutes
    python3 benchmarks/tpu_gmm_uneven.py --tiny          # CPU, interpret mode, tiny shapes: a smoke run

Real routing never fills the experts evenly. With rows sorted by expert, a row tile that straddles
two groups' edge is computed once for each (kernels/gmm/metadata.py), so at the cell (65,536 rows
over 128 local experts, about 512 rows each) a 512-row tile computes about twice the useful rows. The
tile table (`hybridmoe tune-gmm`) is measured at even groups, where large row tiles win. This script
times each kernel at the uneven split tools/chip_cases.py's cases use (`group_sizes`: every group a
different size, one empty) and searches its tiles there, by tune-gmm's coordinate search (three
rounds, from the seed recipe's tiles for that kernel). Per kernel: the seed tiles' and the found
tiles' milliseconds at the uneven split, and both again at an even split (the cost of unevenness).

The kernels (M rows, D = 4096 model width, F = 1024 expert width, 128 groups): wi forward gmm
[M, D] x [G, D, 2F]; its input gradient gmm_t [M, 2F] x [G, D, 2F]^T; its weight gradient tgmm
[M, D]^T [M, 2F]; wo forward gmm [M, F] x [G, F, D]; its input gradient gmm_t; its weight gradient
tgmm. The wi triple is chip_cases' `gmm_cell` case (forward + backward), whose useful TFLOP/s is the
row `gmm_cell (wi fwd + bwd)`.

On the chip the found tiles also go into the tile table's section of its generation
(kernels/gmm/tile_table.json, `kernels.gmm.tiling=auto`; each entry marked "split": "uneven"), where
they serve calls at about the cell's rows per group: chip_cases' `gmm_cell` case times them as its
backend `pallas_tpu_table`. A run of --rounds 0 (a timing at the record's tiles, no search) leaves
the table as it is.

Writes benchmarks/records/tpu_gmm_uneven.json: device, commit, ceiling_tflops (a bf16 8192^3 matmul,
median of 10), sizes (the uneven split), kernels: name -> {kind, m, k, n, groups, seed_tiles,
seed_ms, tiles, ms, tflops (useful 2 M K N per second, of ms), seed_tflops, even_seed_ms, even_ms,
timed, commit, aligned: {A: {ms, tflops, rows}} with --aligned}, totals: gmm_cell and moe_mlp_cell
fwd + bwd at the seed and the found tiles, aligned_totals: the same per alignment.

--aligned A,B also times each kernel on the layout moe.group_align_rows=A gives (hybridmoe/model/
moe_align.py): each group padded to a multiple of A rows, at row tile A and the found tk and tn, so
no tile spans two groups; useful TFLOP/s count the real rows only.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# Each kernel of the MoE layer: (name, kind, K, N) over the geometry's model width d and expert
# width f; the seed recipe's tiles for it are kernel_tiles(...)'s entry of the same name.
KERNELS = (
    ("wi_fwd", "gmm", "d", "2f"),
    ("wi_dlhs", "gmm_t", "2f", "d"),
    ("wi_drhs", "tgmm", "d", "2f"),
    ("wo_fwd", "gmm", "f", "d"),
    ("wo_dlhs", "gmm_t", "d", "f"),
    ("wo_drhs", "tgmm", "f", "d"),
)
# Row tiles searched: tune-gmm's, and 64 (at about 512 rows per group a smaller tile wastes less at
# each group's edges; 64 is a multiple of bf16's 16-row sublane packing).
ROW_TILES = (64, 128, 256, 512, 1024)
TOTALS = {"gmm_cell (wi fwd + bwd)": ("wi_fwd", "wi_dlhs", "wi_drhs"),
          "moe_mlp_cell (wi + wo, fwd + bwd)": tuple(name for name, *_ in KERNELS)}


def calls(g: dict) -> dict:
    """name -> tune_gmm Call of each kernel at the geometry's moe_mlp shape (bf16 operands)."""
    from hybridmoe.kernels.gmm.tile_table import Call

    dims = {"d": g["d"], "f": g["f"], "2f": 2 * g["f"]}
    return {name: Call(kind, g["rows"], dims[k], dims[n], g["groups"], 2, None) for name, kind, k, n in KERNELS}


def useful_tflops(call, seconds: float) -> float:
    """2 M K N useful FLOPs (every row once, however the tiles fall) per second, in TFLOP/s."""
    return 2 * call.m * call.k * call.n / seconds / 1e12


def totals(rows: dict, calls_: dict) -> dict:
    """Per total of TOTALS: its kernels' useful TFLOP/s together at the seed and the found tiles."""
    out = {}
    for label, names in TOTALS.items():
        if not all(n in rows and "ms" in rows[n] for n in names):
            continue
        flops = sum(2 * calls_[n].m * calls_[n].k * calls_[n].n for n in names)
        ms = sum(rows[n]["ms"] for n in names)
        out[label] = {"ms": ms, "tflops": flops / ms / 1e9}
        if all("seed_ms" in rows[n] for n in names):  # else a seed tiling did not compile
            seed_ms = sum(rows[n]["seed_ms"] for n in names)
            out[label].update(seed_ms=seed_ms, seed_tflops=flops / seed_ms / 1e9)
    return out


def aligned_sizes(sizes: list[int], align: int) -> list[int]:
    """Each group's rows rounded up to a multiple of `align`: the sizes the kernels see under
    moe.group_align_rows (every expert local, as at the cell: no padding before the first)."""
    return [-(-s // align) * align for s in sizes]


def aligned_totals(rows: dict, calls_: dict) -> dict:
    """Per total of TOTALS and per alignment every kernel was timed at: useful TFLOP/s (the real rows'
    FLOPs over the summed milliseconds on the aligned layout)."""
    out = {}
    for label, names in TOTALS.items():
        common = set.intersection(*(set(rows.get(n, {}).get("aligned", {})) for n in names))
        for a in sorted(common, key=int):
            flops = sum(2 * calls_[n].m * calls_[n].k * calls_[n].n for n in names)
            ms = sum(rows[n]["aligned"][a]["ms"] for n in names)
            out.setdefault(label, {})[a] = {"ms": ms, "tflops": flops / ms / 1e9}
    return out


def table_entries(rows: dict) -> list[dict]:
    """The tile table's entries (tune_gmm.entry's form) of the kernels searched, marked as measured at
    the uneven split; the seed tiles' time is the entry's before."""
    out = []
    for r in rows.values():
        if "ms" not in r:
            continue
        tm, tk, tn = r["tiles"]
        out.append({**{k: r[k] for k in ("kind", "m", "k", "n", "groups", "itemsize")}, "tm": tm, "tk": tk, "tn": tn,
                    "ms": r["ms"], "default_ms": r.get("seed_ms"), "timed": r["timed"], "split": "uneven"})
    return out


def format_table(rows: dict, total: dict, ceiling: float, aligned_total: dict | None = None) -> str:
    lines = [f"{'kernel':<34} {'seed tiles':>16} {'ms':>8} {'TFLOP/s':>8}   {'found tiles':>16} {'ms':>8} "
             f"{'TFLOP/s':>8} {'of ceiling':>10}   {'even: seed':>10} {'found':>8}"]
    for name, r in rows.items():
        if "ms" not in r:
            lines.append(f"{name:<34} {r.get('error', 'not run')}")
            continue
        nan = float("nan")
        lines.append(f"{name:<34} {'x'.join(map(str, r['seed_tiles'])):>16} {r.get('seed_ms', nan):>8.3f} "
                     f"{r.get('seed_tflops', nan):>8.1f}   "
                     f"{'x'.join(map(str, r['tiles'])):>16} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['tflops'] / ceiling:>10.2f}"
                     f"   {r.get('even_seed_ms', nan):>10.3f} {r['even_ms']:>8.3f}")
    for label, t in total.items():
        lines.append(f"{label:<34} {'':>16} {t.get('seed_ms', float('nan')):>8.3f} {t.get('seed_tflops', float('nan')):>8.1f}"
                     f"   {'':>16} {t['ms']:>8.3f} {t['tflops']:>8.1f} {t['tflops'] / ceiling:>10.2f}")
    aligned_total = aligned_total or {}
    aligned = {name: r["aligned"] for name, r in rows.items() if r.get("aligned")}
    if aligned:
        lines.append("on the aligned layout (moe.group_align_rows = row tile A; useful TFLOP/s of the real rows):")
        for name, by_a in {**aligned, **aligned_total}.items():
            cells = "   ".join(f"A {a}: {v['ms']:.3f} ms {v['tflops']:.1f}" for a, v in sorted(by_a.items(), key=lambda i: int(i[0])))
            lines.append(f"  {name:<32} {cells}")
    lines.append(f"ceiling (bf16 8192^3 matmul): {ceiling:.1f} TFLOP/s")
    return "\n".join(lines)


def writes_table(args) -> bool:
    """Whether this run puts its tiles into the tile table: a search on the chip does; --tiny runs
    interpreted shapes, and --rounds 0 only times the tiles a record found (the table keeps the
    search's own entries, their timings and commit)."""
    return not args.tiny and args.rounds > 0


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--budget-s", type=float, default=330.0, help="start no timing after this many seconds (default 330)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per tiling (median); default 5")
    p.add_argument("--tiny", action="store_true",
                   help="CPU, interpret mode, the tiny geometry; writes a temporary record unless --out is given")
    p.add_argument("--compile-cache", help="JAX's persistent compile cache folder")
    p.add_argument("--only", help="comma-separated kernels (of wi_fwd, wi_dlhs, wi_drhs, wo_fwd, wo_dlhs, wo_drhs); "
                                  "every run is merged into --out's record of the same device")
    p.add_argument("--start", choices=("seed", "record"), default="seed",
                   help="where each kernel's search starts: the seed recipe's tiles (default), or the tiles the "
                        "record at --out found (the seed's timed beside them)")
    p.add_argument("--rounds", type=int, default=3, help="coordinate-search rounds per kernel (default 3)")
    p.add_argument("--aligned", default="", metavar="A,B",
                   help="also time each kernel on the layout of moe.group_align_rows=A (each group padded to a "
                        "multiple of A rows) at row tile A and the found tk, tn; comma-separated alignments")
    args = p.parse_args(argv)
    if args.tiny and args.out == p.get_default("out"):
        args.out = tempfile.mkstemp(prefix="tpu_gmm_uneven_tiny_", suffix=".json")[1]
    harness.configure(cpu_only=args.tiny, cache_dir=args.compile_cache)
    import jax

    from hybridmoe.kernels.gmm import kernel_tiles, tile_table
    from hybridmoe.kernels.gmm.tiling import Tiling
    from hybridmoe.tools import chip_cases, tune_gmm
    from hybridmoe.tools.record import machine_record, source_commit

    if not args.tiny and jax.default_backend() != "tpu":
        raise SystemExit(f"tpu_gmm_uneven times the Pallas TPU kernels on a TPU chip; this host's JAX sees "
                         f"{jax.default_backend()} (--tiny runs tiny shapes interpreted on CPU)")
    g = chip_cases.GEOMETRIES["tiny" if args.tiny else "cell"]["moe_mlp"]
    keys = chip_cases.seed_gmm_keys() if g["tiles"] == "seed" else g["tiles"]
    seed = kernel_tiles(keys)
    uneven = [int(s) for s in chip_cases.group_sizes(g["rows"], g["groups"])]
    start = time.perf_counter()
    deadline = time.monotonic() + args.budget_s
    log = lambda msg: print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)  # noqa: E731

    from tpu_kernels import matmul_ceiling_tflops

    ceiling = matmul_ceiling_tflops(256 if args.tiny else 8192, 3 if args.tiny else 10)
    log(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s on {jax.devices()[0].device_kind}")
    kernel_calls = calls(g)
    names = args.only.split(",") if args.only else list(kernel_calls)
    unknown = sorted(set(names) - set(kernel_calls))
    if unknown:
        raise SystemExit(f"--only: unknown kernels {unknown}; known: {', '.join(kernel_calls)}")
    now: dict[str, dict] = {}  # this run's kernels; the record keeps the same device's others (their commits)
    rows: dict[str, dict] = {}
    refused: dict[str, list] = {}

    def seconds(call, t, sizes=None):
        """The kernel's seconds; a tiling the compiler refuses (its blocks past the chip's VMEM) is
        noted and timed as never finishing, so the search goes on without it."""
        try:
            return tune_gmm.kernel_seconds(call, t, repeats=args.repeats, interpret=args.tiny, sizes=sizes)
        except Exception as e:  # noqa: BLE001 - recorded per tiling
            refused.setdefault(current[0], []).append(
                {"tiles": [t.tm, t.tk, t.tn], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})
            return math.inf

    current = [""]
    alignments = [int(a) for a in args.aligned.split(",") if a]
    # --start record: this device's rows of the record at --out (merged_with_earlier over no new rows)
    earlier = (harness.merged_with_earlier(args.out, "kernels", {}, machine_record()["device"], source_commit())
               if args.start == "record" else {})
    start_from = ("the tiles an earlier run found (the seed recipe's timed beside them)" if args.start == "record"
                  else "the seed recipe's")

    def write():
        rows.clear()
        rows.update(harness.merged_with_earlier(args.out, "kernels", now, machine_record()["device"], source_commit()))
        harness.write(args.out, "tpu_gmm_uneven", ceiling_tflops=ceiling, geometry=g, sizes=uneven, kernels=rows,
                      totals=totals(rows, kernel_calls), aligned_totals=aligned_totals(rows, kernel_calls),
                      interpret=args.tiny,
                      method=f"tune_gmm.kernel_seconds (median of {args.repeats} after one warm call) of each kernel "
                             f"alone at the uneven split; the tiles by tune_gmm.search ({args.rounds} rounds) from "
                             f"{start_from}; useful TFLOP/s 2 M K N per second; the even split for both tilings")

    for name in names:
        call, current[0] = kernel_calls[name], name
        if time.monotonic() > deadline:
            now[name] = {"kind": call.kind, "error": f"past the {args.budget_s:.0f} s budget"}
            continue
        base = getattr(seed, name)
        seed_t = Tiling(tm=base.tm, tk=min(base.tk, call.k), tn=min(base.tn, call.n))
        tiles_before = earlier.get(name, {}).get("tiles")
        start_t = Tiling(*tiles_before) if tiles_before else seed_t
        log(f"{name} ({call.kind} {call.m} x {call.k} -> {call.n}, {call.groups} groups) from {start_t.tm}x{start_t.tk}x{start_t.tn}")
        try:
            found = tune_gmm.search(call, lambda c, t: seconds(c, t, uneven), rounds=args.rounds, deadline=deadline,
                                    start=start_t, row_tiles=ROW_TILES)
            best = found["tiling"]
            if not math.isfinite(found["s"]):
                raise RuntimeError("no tiling compiled")
            seed_s = found["default_s"] if start_t == seed_t else seconds(call, seed_t, uneven)
            row = {**call.key(), "seed_tiles": [seed_t.tm, seed_t.tk, seed_t.tn],
                   "tiles": [best.tm, best.tk, best.tn], "ms": found["s"] * 1e3, "timed": found["timed"],
                   "tflops": useful_tflops(call, found["s"]), "even_ms": seconds(call, best) * 1e3}
            if start_t != seed_t:
                row.update(start_tiles=[start_t.tm, start_t.tk, start_t.tn])
            if math.isfinite(seed_s):  # else the seed tiles did not compile (refused lists why)
                row.update(seed_ms=seed_s * 1e3, seed_tflops=useful_tflops(call, seed_s),
                           even_seed_ms=seconds(call, seed_t) * 1e3)
        except Exception as e:  # noqa: BLE001 - one kernel's failure is recorded, the others go on
            row = {**call.key(), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        if "tiles" in row and alignments:
            # The aligned layout: the same real rows, each group from a multiple of a, at row tile a.
            row["aligned"] = {}
            for a in alignments:
                padded = aligned_sizes(uneven, a)
                call_a = dataclasses.replace(call, m=sum(padded))
                s = seconds(call_a, Tiling(tm=a, tk=row["tiles"][1], tn=row["tiles"][2]), padded)
                if math.isfinite(s):
                    row["aligned"][str(a)] = {"ms": s * 1e3, "tflops": useful_tflops(call, s), "rows": sum(padded)}
        if refused.get(name):
            row["refused"] = refused[name]
        now[name] = row
        log(f"{name}: {row.get('seed_ms', float('nan')):.3f} -> {row.get('ms', float('nan')):.3f} ms at {row.get('tiles')}")
        write()
    write()
    if writes_table(args):
        entries = table_entries(rows)
        tune_gmm.write_table(tune_gmm.check_host(), entries, tune_gmm.about({"device": jax.devices()[0].device_kind}))
        log(f"{len(entries)} entries into the tile table ({tile_table.TABLE_FILE})")
    print(format_table(rows, totals(rows, kernel_calls), ceiling, aligned_totals(rows, kernel_calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
