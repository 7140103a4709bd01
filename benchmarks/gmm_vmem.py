"""The on-chip memory model of every Pallas kernel against the compiler (compile-only TPU from a CPU host).

Mosaic TPU: each kernel alone (grouped matmuls gmm / gmm_t / tgmm / the fused wi forward / the fused wo
input gradient, flash attention forward / dq / dk-dv, GDN forward / backward) at the tiles of
tests/vmem_sweep.py, on both sides of a small scoped limit: the model's need (MiB) and verdict against
the compiler's (compiles, or a VMEM overflow). With --bisect, also the smallest limit the compiler
accepts at each tile (4 KiB steps; about 14 compiles a tile).

The seed's wi forward tile (tm 512, tk 4096, tn 1024 per half, one K tile) at weight depths 1 and 2:
the model and the compiler's smallest accepted limit (the seed: 50.95 MiB at depth 2 of a 57.60 limit).

Triton: the flash kernels' shared memory per program by the model at Qwen3.5's head dim 256, at our
default blocks and at jax's own GPU flash attention's defaults (not measured: no GPU here).

    python benchmarks/gmm_vmem.py [--topology tpu7x:2x2x1] [--bisect]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hybridmoe.kernels.attention import limits as attention_limits  # noqa: E402
from hybridmoe.kernels.gmm import tiling  # noqa: E402
from hybridmoe.kernels.vmem import GPU_SHARED_LIMIT_BYTES, MIB, tpu_bytes  # noqa: E402
from tests import vmem_sweep  # noqa: E402

SEED_TILE = (512, 4096, 1024)


def smallest_limit_mib(compiles) -> float:
    """The smallest scoped limit (MiB, 4 KiB steps) at which compiles(limit_mib) holds."""
    lo, hi = 0, 64 * 1024  # KiB
    while hi - lo > 4:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compiles(mid / 1024) else (mid, hi)
    return hi / 1024


def seed_tile_compiles(dev, depth: int, limit_mib: float) -> bool:
    from hybridmoe.kernels.gmm import pallas_tpu

    tm, tk, tn = SEED_TILE
    t = tiling.Tiling(tm=tm, tk=tk, tn=tn, vmem_limit_mib=limit_mib)
    s = lambda shape, dtype=jnp.bfloat16: vmem_sweep._spec(shape, dtype, dev)  # noqa: E731
    try:
        jax.jit(lambda x, w, gs: pallas_tpu.wi_fused_swiglu(
            x, w, gs, group_offset=0, sharded=False, tile_n_per_half=tn, mode="float32", tiling=t,
            rhs_buffer_count=depth)).lower(s((16384, tk)), s((8, tk, 2 * tn)), s((8,), jnp.int32)).compile()
        return True
    except Exception as err:  # noqa: BLE001 - the compiler's verdict is the measurement
        if "vmem" not in str(err).lower():
            raise
        return False


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--topology", default="tpu7x:2x2x1")
    ap.add_argument("--bisect", action="store_true", help="also bisect the compiler's smallest accepted limit per tile")
    args = ap.parse_args()
    from hybridmoe.tools.train_program import tpu_target

    dev = tpu_target(args.topology).devices[0]
    limit = vmem_sweep.LIMIT_MIB
    rows = []
    for kernel, tiles in vmem_sweep.POINTS:
        ok, error = vmem_sweep.compile_verdict(kernel, tiles, limit, dev)
        row = {"kernel": kernel, "tiles": list(tiles), "model_mib": round(vmem_sweep.model_bytes(kernel, tiles) / MIB, 3),
               "limit_mib": limit, "model_fits": vmem_sweep.model_verdict(kernel, tiles, limit), "compiler_fits": ok,
               "compiler_error": error or None}
        if args.bisect:
            row["compiler_min_limit_mib"] = smallest_limit_mib(
                lambda lim, k=kernel, t=tiles: vmem_sweep.compile_verdict(k, t, lim, dev)[0])
        rows.append(row)
        print(f"{kernel:<26} {str(tiles):<18} model {row['model_mib']:7.3f} MiB  model {'fits' if row['model_fits'] else 'over'}"
              f"  compiler {'fits' if ok else 'overflows'}" + ("" if ok == row["model_fits"] else "  DISAGREE"))
    seed = []
    for depth in (2, 1):
        need = tpu_bytes(tiling.tpu_buffers("wi_fused", tm=SEED_TILE[0], tk=SEED_TILE[1], tn=SEED_TILE[2], depth=depth))
        seed.append({"depth": depth, "model_mib": need / MIB,
                     "compiler_min_limit_mib": smallest_limit_mib(lambda lim, d=depth: seed_tile_compiles(dev, d, lim))})
        print(f"seed wi forward tile {SEED_TILE} depth {depth}: {seed[-1]}")
    triton = []
    for name, bq, bk, stages in (("pallas_gpu default", *attention_limits.DEFAULT_BLOCKS["pallas_gpu"],
                                  attention_limits.GPU_NUM_STAGES),
                                 ("jax gpu attention forward default", 128, 128, 2),
                                 ("jax gpu attention backward default", 32, 32, 2), ("fits", 32, 32, 3)):
        need = {k: attention_limits.gpu_shared_bytes(k, block_q=bq, block_k=bk, head_dim=256, num_stages=stages) / 1024
                for k in attention_limits.KERNELS}
        triton.append({"blocks": name, "block_q": bq, "block_k": bk, "num_stages": stages, "head_dim": 256,
                       "shared_kib": need, "limit_kib": GPU_SHARED_LIMIT_BYTES / 1024})
        print(f"triton {name}: {need}")
    disagree = sum(r["model_fits"] != r["compiler_fits"] for r in rows)
    print(f"{len(rows)} tiles, model and compiler disagree at {disagree}")
    harness.write(
        args.out, "gmm_vmem", versions=harness.package_versions("jaxlib", "libtpu"),
        target="compile-only TPU topology on a CPU host; Triton figures are the model's only",
        config={"topology": args.topology, "limit_mib": limit, "shapes": {
            "gmm": {"M": vmem_sweep.M, "D": vmem_sweep.D, "F": vmem_sweep.F, "E": vmem_sweep.E},
            "attention": {"T": vmem_sweep.T, "N": vmem_sweep.N, "G": vmem_sweep.G},
            "gdn": {"B": vmem_sweep.GDN_B, "chunks": vmem_sweep.GDN_N, "heads": vmem_sweep.GDN_H}}},
        seed={"wi_fwd_tile": SEED_TILE, "depth2_mib": 50.95, "depth3_mib": 66.95, "limit_mib": 57.60},
        rows=rows, seed_tile=seed, triton=triton, disagree=disagree,
    )


if __name__ == "__main__":
    main()
