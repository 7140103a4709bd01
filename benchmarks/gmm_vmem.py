"""VMEM need of the fused up-projection forward kernel (wi_fused_swiglu) at weight depths 0 (Mosaic's
default), 1, 2 and 3, at two tiles.

Compiles the Mosaic TPU kernel for a compile-only TPU topology from a CPU host (libtpu comes with
the test extra, `jax[tpu]`), bfloat16, one K tile (the only case the depth applies to):
- upstream: tm 512, tk 4096, tn 1024 per half (the seed's 2048-wide [gate | up] tile);
- deciding: tm 256, tk 4096, tn 2048 per half, where Mosaic's default depth does not fit the
  57.60 MiB limit and depth 1 does.
The need is read from the Mosaic compiler's scoped-VMEM error at a 1 MiB limit; the fit is a
compile at the given limit (upstream 57.60 MiB = 90% of the core's 64 MiB). Prints a table and
writes benchmarks/records/gmm_vmem.json.

    python benchmarks/gmm_vmem.py [--topology tpu7x:2x2x1]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hybridmoe.kernels.gmm import wi_fused_swiglu  # noqa: E402
from hybridmoe.kernels.gmm.tiling import Tiling  # noqa: E402

MIB = 2**20
# Tiles (tm, tk, tn per half); the problem runs one K tile (D = tk) and one N tile per half.
TILES = {"upstream": (512, 4096, 1024), "deciding": (256, 4096, 2048)}
M, E = 4096, 8


def _compile(tile, depth: int, topology: str, limit_mib: float):
    """Compile the fused forward; returns (ok, error text)."""
    TM, TK, TN = tile
    D, F = TK, TN
    from jax.sharding import SingleDeviceSharding

    from hybridmoe.tools.train_program import tpu_target

    sh = SingleDeviceSharding(tpu_target(topology).devices[0])
    x = jax.ShapeDtypeStruct((M, D), jnp.bfloat16, sharding=sh)
    wi = jax.ShapeDtypeStruct((E, D, 2 * F), jnp.bfloat16, sharding=sh)
    gs = jax.ShapeDtypeStruct((E,), jnp.int32, sharding=sh)
    tiling = Tiling(tm=TM, tk=TK, tn=TN, vmem_limit_mib=limit_mib)

    def fwd(x, wi, gs):
        return wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=TN,
                          backend="pallas_tpu", tiling=tiling, rhs_buffer_count=depth)

    try:
        jax.jit(fwd).lower(x, wi, gs).compile()
        return True, ""
    except Exception as err:  # noqa: BLE001 - the compile error is the measurement
        return False, str(err)


_OOM = re.compile(r"size ([0-9.]+)M and limit ([0-9.]+)M")


def measure(tile, depth: int, topology: str, limit_mib: float) -> dict:
    """The kernel's scoped VMEM need (read from the Mosaic OOM at a 1 MiB limit) and whether it
    compiles under limit_mib."""
    row = {"tm": tile[0], "tk": tile[1], "tn_per_half": tile[2], "depth": depth, "need_mib": None,
           "limit_mib": limit_mib, "fits": None, "error": None}
    ok, err = _compile(tile, depth, topology, 1.0)
    hit = _OOM.search(err)
    if hit:
        row["need_mib"] = float(hit.group(1))
    elif not ok:
        row["error"] = err.splitlines()[0][:300] if err else None
        return row
    ok, err = _compile(tile, depth, topology, limit_mib)
    row["fits"] = ok
    if not ok and not _OOM.search(err):
        row["error"] = err.splitlines()[0][:300]
    return row


def vmem_estimate(tile, depth: int) -> float:
    """Blocks the kernel holds, by hand: x (2 buffers), gate + up weight (depth each),
    h and preact (2 buffers each), two float32 accumulators."""
    TM, TK, TN = tile
    b = 2
    x = 2 * TM * TK * b
    w = 2 * depth * TK * TN * b
    outs = 2 * TM * TN * b + 2 * TM * 2 * TN * b
    acc = 2 * TM * TN * 4
    return (x + w + outs + acc) / MIB


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--topology", default="tpu7x:2x2x1")
    ap.add_argument("--limit-mib", type=float, default=57.60,
                    help="scoped VMEM limit to test the fit against (upstream: 57.60 MiB)")
    args = ap.parse_args()
    rows = []
    # 0 = the kernel default (no pipeline_mode).
    for name, tile in TILES.items():
        for depth in (0, 1, 2, 3):
            r = {"tile": name, **measure(tile, depth, args.topology, args.limit_mib)}
            r["hand_estimate_mib"] = round(vmem_estimate(tile, depth or 2), 2)
            rows.append(r)
    print(f"fused wi_fused_swiglu forward, bf16, one K tile, {args.topology}, limit {args.limit_mib} MiB")
    print(f"{'tile':<9} {'tm':>4} {'tk':>5} {'tn/half':>7} {'depth':>5} {'need MiB':>9} {'fits':>5} "
          f"{'hand MiB':>9}  error")
    for r in rows:
        print(f"{r['tile']:<9} {r['tm']:>4} {r['tk']:>5} {r['tn_per_half']:>7} {r['depth']:>5} "
              f"{str(r['need_mib']):>9} {str(r['fits']):>5} {r['hand_estimate_mib']:>9}  {r['error'] or ''}")
    harness.write(
        args.out, "gmm_vmem", versions=harness.package_versions("jaxlib", "libtpu"),
        target="compile-only TPU topology on a CPU host",
        config={"topology": args.topology, "tiles": TILES, "M": M, "E": E, "D": "tk", "F": "tn_per_half",
                "dtype": "bfloat16"},
        upstream={"depth2_mib": 50.95, "depth3_mib": 66.95, "limit_mib": 57.60},
        rows=rows,
    )


if __name__ == "__main__":
    main()
