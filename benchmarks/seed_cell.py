"""The seed's cell compiled for 128 TPU v7x chips, lever by lever: per-device memory against 96 GiB.

Qwen3.5-397B-A17B as recipe `qwen3.5-397b-a17b-v7x-128` on `tpu7x:4x4x8` (256 JAX devices, mesh
fsdp 32 x context 4 x expert 2, one 65,536-token sequence per context group, 9 micro-batches).
Each arm is the cell with the levers up to it on, in the seed's order (the MoE grouped-matmul
levers on the Pallas kernels, the 1-byte fp8 expert gather, the attention levers, the GDN
context-parallel scan and Pallas core, the wi tile and buffer depth); `before` is the cell as the
code stood before flash attention and weights over every axis could be used (the masked XLA
attention core). Every arm is compiled by `hybridmoe inspect` in a process of its own (the 2-core
host needs 10-40 min for an arm that fits, a few for one the compiler refuses; a refusal is a
result: the compiler's figure) into benchmarks/records/seed_cell/<arm>.json; then the GRPO update
(rl.micro_batches=auto: the fewest count whose program fits the device's HBM, found as a run finds
it; its search in `count_search`) and the sampler of the full arm. This script then gathers them into benchmarks/records/seed_cell.json
(arms already recorded are kept unless --redo names them).

    python benchmarks/seed_cell.py [--arms default,moe,...] [--redo ARM,...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

RECIPE = "qwen3.5-397b-a17b-v7x-128"
TARGET = "tpu7x:4x4x8"
SEED_TOTAL_GIB = 78.00  # the seed's build with every key on (seed 000, "78.00 GiB in the default memory space")

# Each lever's keys as (off, on) overrides; the recipe itself turns every one of them on.
LEVERS = {
    "moe": (["moe.wi_fused_swiglu=false", "moe.wo_fused_dswiglu=false", "moe.router_grad_from_wo_input=false",
             "kernels.gmm.backend=xla", "kernels.gmm.tiling=heuristic", "kernels.gmm.wi_fwd_tm=0",
             "kernels.gmm.wi_fwd_tk=0", "kernels.gmm.wo_dlhs_tm=0", "kernels.gmm.wo_dlhs_tk=0",
             *[f"kernels.gmm.{k}_{d}=0" for k in ("wi_dlhs", "wi_drhs", "wo_fwd", "wo_drhs") for d in ("tm", "tk", "tn")]],
            []),  # the per-kernel tiles need explicit tiling
    "fp8_gather8": (["quant.fp8_moe_fake_quant=false", "quant.fp8_fake_quant_hoist=off"], []),
    "attention": (["attention.cp_load_balance=false", "attention.cp_load_balance_hoist_ids=false",
                   "remat.policy=full", "remat.save=[]"], []),
    "gdn": (["gdn.cp_m_scan=false", "gdn.cp_dh_scan=false", "gdn.cp_terms_in_kernel=false", "kernels.gdn.backend=xla"],
            []),
    "wi_tile": (["kernels.gmm.wi_fwd_tile_n_per_half=0", "kernels.gmm.wi_fwd_rhs_buffer_count=0"], []),
    # Not the seed's, last: a checkpoint per layer of the block (remat.unit), the MoE over the
    # tokens in chunks (moe.token_chunks), the expert weights' FSDP split on their experts
    # (mesh.expert_fsdp_dim), a checkpoint per residual sublayer (remat.unit=sublayer), each layer's
    # expert-weight gradient reduced before the layers below run (remat.expert_grad_barrier), the
    # MoE's row moves' backwards as gathers (moe.gather_backward).
    "remat_unit": (["remat.unit=block"], []),
    # The recipe now runs one chunk (the weights read once a micro-batch: step_estimate.json), so this
    # arm's "off" is the recipe's own; seed_cell.json's arm is of the four-chunk recipe of its commit.
    "token_chunks": (["moe.token_chunks=1"], []),
    "expert_fsdp": (["mesh.expert_fsdp_dim=embed"], []),
    "sublayer": (["remat.unit=layer"], []),
    "expert_grad_barrier": (["remat.expert_grad_barrier=false"], []),
    # The MoE dispatch's and combine's backwards as gathers (moe.gather_backward), last: the arms
    # before it were compiled with the scatter-add backwards.
    "gather_backward": (["moe.gather_backward=false"], []),
}
ORDER = list(LEVERS)


def arm_overrides(arm: str) -> list[str]:
    """The overrides of an arm: every lever after it in the seed's order off ("default": all off),
    the last lever's first, so where two set one key (remat.unit) the earlier lever's off wins."""
    if arm == "before":
        return arm_overrides("default") + ["kernels.attention.backend=xla"]
    if arm == "default":
        on = 0
    else:
        on = ORDER.index(arm) + 1
    return [w for lever in reversed(ORDER[on:]) for w in LEVERS[lever][0]]


ARMS = ["before", "default", *ORDER]
PROGRAMS = {"grpo": ORDER[-1], "sample": ORDER[-1]}  # program -> the arm it is compiled at


def run_inspect(name: str, overrides: list[str], program: str, out: Path) -> dict:
    argv = [sys.executable, "-m", "hybridmoe", "inspect", f"recipe={RECIPE}", *overrides, "--target", TARGET,
            "--program", program, "--out", str(out)]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(argv[3:])}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=harness.ROOT, capture_output=True, text=True)
    print(done.stdout[-4000:], flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    record = json.loads(out.read_text())
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return record


def summary(name: str, record: dict) -> dict:
    prog = record["programs"]["base"]
    return {"arm": name, "program": record.get("program", "train"), "overrides": prog["overrides"],
            "memory": prog["memory"], "compile_s": prog["compile_s"], "peak_buffers": prog.get("peak_buffers", []),
            "peak_by_category": prog.get("peak_by_category"),
            "flops": prog.get("flops"), "model_flops": prog.get("model_flops"),
            "count_search": prog.get("count_search"), "commit": record["commit"],
            "date": record["date"]}


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--arms", default=",".join([*ARMS, *PROGRAMS]),
                   help="arms (and programs grpo, sample) to compile where they have no record yet; the gathered "
                        "record holds these and every other arm recorded before")
    p.add_argument("--redo", default="", help="arms to compile again although recorded")
    args = p.parse_args(argv)
    folder = Path(args.out).with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    redo = set(filter(None, args.redo.split(",")))
    asked = set(filter(None, args.arms.split(",")))
    unknown = sorted(asked - set(ARMS) - set(PROGRAMS))
    if unknown:
        raise SystemExit(f"unknown arm {unknown[0]!r}; choices: {', '.join([*ARMS, *PROGRAMS])}")
    rows = []
    for name in [*ARMS, *PROGRAMS]:  # the seed's order
        out = folder / f"{name}.json"
        if name not in asked and not out.exists():
            continue  # an arm not asked for but recorded before is gathered as it is, never dropped
        program, overrides = (name, arm_overrides(PROGRAMS[name])) if name in PROGRAMS else ("train", arm_overrides(name))
        record = json.loads(out.read_text()) if out.exists() and name not in redo else run_inspect(
            name, overrides, program, out)
        rows.append(summary(name, record))
    harness.write(args.out, "seed_cell", recipe=RECIPE, target=TARGET, seed_total_gib=SEED_TOTAL_GIB,
                  order=ORDER, arms=rows)
    for r in rows:
        m = r["memory"]
        space = "-" if m.get("default_space") is None else f"{m['default_space'] / 2**30:7.2f}"
        print(f"{r['arm']:<12} {r['program']:<7} args {m['argument'] / 2**30:7.2f}  temps {m['temp'] / 2**30:7.2f}  "
              f"total {m['total'] / 2**30:7.2f}  default space {space} GiB  fits {m['fits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
