"""The step time on its target, estimated from the compiled program (analysis/step_estimate.py), arm by arm.

Each arm is a recipe plus overrides, compiled for the target (a TPU topology: compile-only devices,
the Mosaic compiler runs for real) and read by the cost model: seconds per step by category
(grouped matmuls, attention, GDN, dense matmuls, collectives, the rest), the three totals
(collectives not overlapped: `step_s`; hidden under compute: `overlapped_step_s`; as the program's
schedule hides them: `scheduled_step_s`), tokens/s per chip and MFU against the model's FLOPs, and
each category's costliest ops (`top_ops`). Nothing runs on a TPU: these are estimates, not timings.

Arms already in the record are kept unless named again, so the seed cell's arms can be added by a
later run of this script with the same record:

    python benchmarks/step_estimate.py --recipe small --target tpu7x:2x2x1 \\
        --arm default= --arm gmm_tiles_512=kernels.gmm.tiling=explicit,kernels.gmm.tm=512
    python benchmarks/step_estimate.py --recipe qwen3.5-397b-a17b-v7x-128 --target tpu7x:4x4x8 --arm cell=

--from-inspect RECORD takes an arm's estimate from a `hybridmoe inspect --out RECORD` record instead
of compiling again (its extrapolated estimate when inspect ran with --layers, else its base
program's), so a cell compiled once by inspect is recorded without a second compile:

    hybridmoe inspect recipe=qwen3.5-397b-a17b-v7x-128 --target tpu7x:4x4x8 --layers 8 \
        --out benchmarks/records/inspect_cell_layers8.json
    python benchmarks/step_estimate.py --from-inspect benchmarks/records/inspect_cell_layers8.json --arm cell=

With --layers N each arm compiles at N layers and at one block more and extrapolates the estimate
to the model's depth (tools/depth.extrapolate_estimate: the estimate counts the layer loop's body
once per block, so it is affine in the blocks): a step too large to compile whole (or to fit)
still gets its estimate, and each depth's own figure is recorded beside it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def _arm(text: str) -> tuple[str, list[str]]:
    if "=" not in text:
        raise SystemExit(f"--arm takes NAME=override,override,... (NAME= for the recipe as it is); got {text!r}")
    name, overrides = text.split("=", 1)
    return name, [o for o in overrides.split(",") if o]


def _summary(est: dict) -> dict:
    """What the record keeps of an estimate (analysis/step_estimate.estimate)."""
    return {
        "hardware": est["hardware"]["name"],
        "step_s": est["serial"]["step_s"], "overlapped_step_s": est["overlapped"]["step_s"],
        "tokens_per_s_per_chip": est["serial"]["tokens_per_s_per_chip"],
        "overlapped_tokens_per_s_per_chip": est["overlapped"]["tokens_per_s_per_chip"],
        "mfu": est["serial"]["mfu"], "overlapped_mfu": est["overlapped"]["mfu"],
        # The schedule's figure (analysis/step_estimate.py: what the compute between each async
        # start and its done leaves exposed); absent from estimates made before it was read.
        "scheduled_step_s": est.get("scheduled", {}).get("step_s"),
        "scheduled_mfu": est.get("scheduled", {}).get("mfu"),
        "exposed_async_s": est.get("exposed_async_s"),
        "top_ops": est.get("top_ops"), "top_op_groups": est.get("top_op_groups"), "top_exposed": est.get("top_exposed"),
        "category_s": {c: r["s"] for c, r in est["categories"].items()},
        "categories": est["categories"], "collectives": est["collectives"], "kernels": est["kernels"],
        "kernels_without_cost_estimate": est["kernels_without_cost_estimate"],
        "loops_with_unknown_trip_count": len(est["loops_with_unknown_trip_count"]),
        "hlo_flops_per_device": est["hlo_flops_per_device"],
        "model_flops_per_device": est["model_flops_per_device"],
        "designed_flops_per_device": est.get("designed_flops_per_device"),
        "tokens_per_step": est["tokens_per_step"], "chips": est["chips"], "devices": est["devices"],
        "grid_step_s": est["hardware"]["grid_step_s"],
        # Where the rates came from: None for the maker's figures, else the calibration's provenance
        # (its chip, commit and date; `carried_from` where another generation's row calibrated it).
        "calibration": est["hardware"].get("measured"),
    }


def main(argv=None) -> int:
    harness.configure()
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--recipe", default="small")
    p.add_argument("--target", default="tpu7x:2x2x1", help="a TPU topology (or cpu:N with --estimate-for)")
    p.add_argument("--arm", action="append", default=[], help="NAME=override,override,... (repeatable)")
    p.add_argument("--estimate-for", default=None, help="hardware row (default: the target's generation)")
    p.add_argument("--grid-step-us", type=float, default=None, help="fixed cost per Pallas grid step (us)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="compile at N layers and one block more and extrapolate to the model's depth")
    p.add_argument("--from-inspect", default=None, metavar="RECORD",
                   help="take the (one) arm's estimate from this `hybridmoe inspect --out` record")
    args = p.parse_args(argv)
    arms = dict(_arm(a) for a in args.arm) or {"default": []}
    out = Path(args.out)
    previous = json.loads(out.read_text()).get("arms", {}) if out.exists() else {}
    if args.from_inspect:
        return _from_inspect(Path(args.from_inspect), arms, out, previous)

    from hybridmoe.cli import _inspect_config
    from hybridmoe.parallel.mesh import configure_cpu_devices
    from hybridmoe.analysis import step_estimate as se
    from hybridmoe.analysis.flops import model_flops_per_device
    from hybridmoe.tools import depth
    from hybridmoe.tools import train_program as tp
    from hybridmoe.tools.record import source_commit

    kind, count = tp.parse_target(args.target)
    results = {}
    target = None
    grid = None if args.grid_step_us is None else args.grid_step_us * 1e-6
    for name, overrides in arms.items():
        recipe, overrides, cfg = _inspect_config([f"recipe={args.recipe}", *overrides], kind, count)
        if target is None:
            if kind != "tpu":
                configure_cpu_devices(cfg.mesh)
            target = tp.tpu_target(args.target) if kind == "tpu" else tp.host_target()
        t0 = time.perf_counter()
        layers = [None] if args.layers is None else list(depth.depths(cfg, args.layers))
        estimates = {}
        for n in layers:
            words = [f"recipe={args.recipe}", *overrides, *([] if n is None else [f"model.num_layers={n}"])]
            step_cfg = cfg if n is None else _inspect_config(words, kind, count)[2]
            print(f"{name}: recipe={recipe} {' '.join(words[1:])} (compiling for {target.name})", flush=True)
            step = tp.compile_step(step_cfg, target, with_residuals=False)
            estimates[n] = se.estimate_step(step, args.estimate_for, recipe=recipe, grid_step_s=grid)
        if not all(estimates.values()):
            print(f"{name}: no estimate (the compiler refused the step, or no hardware row for {target.name})")
            results[name] = {"recipe": recipe, "overrides": overrides, "target": target.name,
                             "refused": (step.out_of_memory or {}).get("message")}
            continue
        if args.layers is None:
            est = estimates[None]
        else:
            m = cfg.model
            est = depth.extrapolate_estimate(estimates, len(m.layer_pattern), m.num_layers,
                                             model_flops_per_device(cfg, target.num_devices))
        print(se.format_estimate(est, est.get("reference")), flush=True)
        results[name] = {"recipe": recipe, "overrides": overrides, "target": target.name, "commit": source_commit(),
                         "compile_s": round(time.perf_counter() - t0, 1), **_summary(est)}
        if args.layers is not None:
            results[name]["extrapolated_from"] = {str(n): _summary(e) for n, e in estimates.items()}
    _write(out, {**previous, **results})
    return 0


def _from_inspect(path: Path, arms: dict, out: Path, previous: dict) -> int:
    from hybridmoe.analysis import step_estimate as se

    if len(arms) != 1 or next(iter(arms.values())):
        raise SystemExit("--from-inspect records one arm as inspect compiled it: --arm NAME= (no overrides)")
    try:
        rec = json.loads(path.read_text())
        programs = rec["programs"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--from-inspect {path}: not a `hybridmoe inspect --out` record ({e!r})")
    name = next(iter(arms))
    first = programs[min(programs, key=lambda k: programs[k]["config"]["model"]["num_layers"])]
    est = rec.get("step_estimate") or first["step_estimate"]
    if est is None:
        raise SystemExit(f"{path}: inspect made no step estimate (the compiler refused the step, or no hardware row)")
    print(se.format_estimate(est, est.get("reference")), flush=True)
    result = {"recipe": first["recipe"], "overrides": [o for o in first["overrides"] if not o.startswith("model.num_layers=")],
              "target": rec["target"], "commit": rec.get("commit", ""),
              "compile_s": round(sum(p["compile_s"] for p in programs.values()), 1),
              "from_inspect": (str(path.resolve().relative_to(harness.ROOT)) if path.resolve().is_relative_to(harness.ROOT)
                               else str(path)),
              **_summary(est)}
    if "step_estimate" in rec:
        result["extrapolated_from"] = {str(p["config"]["model"]["num_layers"]): _summary(p["step_estimate"])
                                       for p in programs.values()}
    _write(out, {**previous, name: result})
    return 0


def _write(out: Path, arms: dict) -> None:
    from hybridmoe.analysis import step_estimate as se

    harness.write(out, "step_estimate", arms=arms,
                  assumptions="per-op roofline (max of compute and HBM time) over the optimised HLO, loops' "
                  "trip counts applied, Pallas calls by their stated cost estimate plus a fixed cost per grid "
                  "step, collectives' ring wire bytes over the link bandwidth; step_s adds the collectives to "
                  "the compute, overlapped_step_s hides them under it, scheduled_step_s hides what the compute between "
                  "each async start and its done covers (in-flight pieces taking turns on the links); a "
                  "conditional costs its heaviest branch",
                  seed=se.SEED_CELL, seed_lever_effects=SEED_LEVER_EFFECTS)


# The seed's levers measured at its cell, each against a control in the same pod (seconds per step),
# by the name of the arm that turns the lever off at the cell (its estimated effect: the cell arm's
# step_s minus that arm's).
SEED_LEVER_EFFECTS = {
    "no_wi_fwd_tile": {"lever": "the wi forward's one N tile per half (1024) at weight pipeline depth 2",
                       "overrides": ["kernels.gmm.wi_fwd_tile_n_per_half=512", "kernels.gmm.wi_fwd_rhs_buffer_count=0"],
                       "seed_s": [-0.36, -0.32]},
    "no_gdn_m_scan": {"lever": "gdn.cp_m_scan", "overrides": ["gdn.cp_m_scan=false"], "seed_s": [-0.66, -0.66]},
}


if __name__ == "__main__":
    raise SystemExit(main())
