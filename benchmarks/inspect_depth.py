"""How well `hybridmoe inspect --layers N` predicts a full compile: memory against depth, measured.

`inspect --layers N` compiles the step at N layers and at N + one block and extrapolates memory to
the model's depth along the line through them (tools/depth.py). This script compiles one geometry
at several depths, each by `hybridmoe inspect` in a process of its own (a compile-only TPU
topology on this host), and records every depth's memory, step-time estimate and compile time, the extrapolation of both from
each pair of neighbouring depths (as `--layers` makes it) and its error against the full compile:

    python benchmarks/inspect_depth.py [--recipe small] [--target tpu7x:2x2x1] [--layers 8,12,16,20]
                                       [--full 32] [--set train.batch_size=8 ...]

Default: the `small` recipe (blocks of 4 layers) deepened to 32 layers, 8 rows of 512 tokens, on
tpu7x:2x2x1 (8 devices): a full compile of a few minutes on 2 cores, the cell's layer pattern.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def compile_at(recipe: str, overrides: list[str], layers: int, target: str, folder: Path) -> dict:
    out = folder / f"L{layers}.json"
    argv = [sys.executable, "-m", "hybridmoe", "inspect", f"recipe={recipe}", *overrides,
            f"model.num_layers={layers}", "--target", target, "--out", str(out)]
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(argv[3:])}", flush=True)
    done = subprocess.run(argv, cwd=harness.ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{layers} layers failed ({done.returncode}):\n{done.stderr[-4000:]}")
    prog = json.loads(out.read_text())["programs"]["base"]
    row = {"layers": layers, "compile_s": prog["compile_s"],
           **{k: prog["memory"][k] for k in ("argument", "temp", "total")},
           "default_space": prog["memory"].get("default_space"), "step_estimate": prog["step_estimate"]}
    print(f"  {layers} layers: temps {row['temp'] / 2**20:.2f} MiB, total {row['total'] / 2**20:.2f} MiB, "
          f"{row['compile_s']:.0f} s", flush=True)
    return row


def main(argv=None) -> int:
    from hybridmoe.recipe import load_config
    from hybridmoe.tools import depth

    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--recipe", default="small")
    p.add_argument("--target", default="tpu7x:2x2x1")
    p.add_argument("--layers", default="8,12,16,20", help="the shallow depths compiled (neighbours one block apart)")
    p.add_argument("--full", type=int, default=32, help="the model's depth: compiled whole, the reference")
    p.add_argument("--set", nargs="*", default=["train.batch_size=8"], metavar="OVERRIDE")
    args = p.parse_args(argv)
    harness.configure()
    overrides = [*args.set, "mesh.cpu_devices=0"]
    cfg = load_config(args.recipe, [*overrides, f"model.num_layers={args.full}"], platform="tpu")
    block = len(cfg.model.layer_pattern)
    shallow = [int(n) for n in args.layers.split(",")]
    with tempfile.TemporaryDirectory(prefix="hybridmoe-depth-") as tmp:
        rows = {n: compile_at(args.recipe, overrides, n, args.target, Path(tmp)) for n in [*shallow, args.full]}
    full = rows[args.full]
    extrapolations = []
    for n in shallow:
        if n + block not in rows or n + block == args.full:
            continue
        d = depth.extrapolate({k: rows[k] for k in (n, n + block)}, block, args.full, hbm=None)
        # default_space: only where the compiler reports one (a TPU target's)
        err = {k: (d["extrapolated"][k] - full[k]) / full[k] for k in depth.KEYS
               if d["extrapolated"][k] is not None and full.get(k)}
        extrapolations.append({"layers_flag": n, "compiled": [n, n + block], "per_block": d["per_block"],
                               "extrapolated": d["extrapolated"], "relative_error": err,
                               "compile_s": rows[n]["compile_s"] + rows[n + block]["compile_s"]})
        if full["step_estimate"] and rows[n]["step_estimate"] and rows[n + block]["step_estimate"]:
            # The step-time estimate along the same line, against the full compile's own estimate.
            e = depth.extrapolate_estimate({k: rows[k]["step_estimate"] for k in (n, n + block)}, block, args.full,
                                           full["step_estimate"]["model_flops_per_device"])
            want = full["step_estimate"]
            extrapolations[-1]["step_estimate"] = {
                "step_s": e["serial"]["step_s"], "full_step_s": want["serial"]["step_s"],
                "relative_error": (e["serial"]["step_s"] - want["serial"]["step_s"]) / want["serial"]["step_s"],
                "category_relative_error": {c: (r["s"] - want["categories"][c]["s"]) / want["categories"][c]["s"]
                                            for c, r in e["categories"].items() if want["categories"][c]["s"]}}
            print(f"  step estimate {e['serial']['step_s']:.4g} s vs {want['serial']['step_s']:.4g} s "
                  f"({100 * extrapolations[-1]['step_estimate']['relative_error']:+.2f}%)")
        print(f"--layers {n}: total {d['extrapolated']['total'] / 2**20:.2f} MiB vs {full['total'] / 2**20:.2f} "
              f"({100 * err['total']:+.2f}%), temps {100 * err['temp']:+.2f}%")
    harness.write(args.out, "inspect_depth", recipe=args.recipe, overrides=overrides, target=args.target,
                  block_layers=block, full_layers=args.full,
                  depths=[{**{k: v for k, v in rows[n].items() if k != "step_estimate"},
                           "step_s": (rows[n]["step_estimate"] or {}).get("serial", {}).get("step_s")}
                          for n in sorted(rows)],
                  extrapolations=extrapolations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
