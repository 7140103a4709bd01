"""The README's demo curves: the demo recipe and its off-policy variant (demo-tis: T = 0.8, TIS, two
updates per rollout), each run from scratch on 8 simulated CPU devices, one after the other.

Per run: the GRPO phase's mean reward of the sampled completions, first and last step and averaged
per 10 steps, the warm-up loss first and last, wall time; a plot of both reward curves (per step and
10-step means) in docs/demo_curves.png; the record in benchmarks/records/demo_curves.json.

  .venv/bin/python benchmarks/demo_curves.py [--out-dir runs/demo_curves]
  (or the runs in parallel: --only demo & --only demo-tis, then --combine)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()

RECIPES = ("demo", "demo-tis")
PLOT = ROOT / "docs" / "demo_curves.png"
WINDOW = 10


def summary(history: list[dict]) -> dict:
    grpo = [h for h in history if h["phase"] == 1]
    warm = [h for h in history if h["phase"] == 0]
    rewards = [h["reward_mean"] for h in grpo]
    means = [sum(rewards[i:i + WINDOW]) / len(rewards[i:i + WINDOW]) for i in range(0, len(rewards), WINDOW)]
    keys = ("pg_clipfrac", "ratio_min", "ratio_max", "sampler_gap_mean", "is_weight_mean")
    return {"grpo_steps": len(grpo), "reward_first": rewards[0], "reward_last": rewards[-1],
            f"reward_mean_per_{WINDOW}_steps": means,
            "warmup_loss_first": warm[0]["warmup_loss"] if warm else None,
            "warmup_loss_last": warm[-1]["warmup_loss"] if warm else None,
            **{f"{k}_mean": sum(h[k] for h in grpo) / len(grpo) for k in keys},
            "steps": [h["step"] for h in grpo], "reward_mean": rewards}


def plot(results: dict) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for (name, r), color in zip(results.items(), ("tab:blue", "tab:orange")):
        ax.plot(r["steps"], r["reward_mean"], color=color, alpha=0.35, linewidth=1)
        centres = [r["steps"][0] + WINDOW * i + (WINDOW - 1) / 2 for i in range(len(r[f"reward_mean_per_{WINDOW}_steps"]))]
        ax.plot(centres, r[f"reward_mean_per_{WINDOW}_steps"], color=color, marker="o", label=f"{name} ({WINDOW}-step mean)")
    ax.set_xlabel("step (GRPO phase)")
    ax.set_ylabel("mean reward of the samples")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, format="png")


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--out-dir", default="runs/demo_curves")
    ap.add_argument("--only", choices=RECIPES, help="run this recipe only (its summary.json), no record")
    ap.add_argument("--combine", action="store_true", help="no run: the plot and record from the summaries")
    args = ap.parse_args()
    from hybridmoe.recipe import load_config
    from hybridmoe.parallel.mesh import configure_cpu_devices
    from hybridmoe.rl.loop import run_rl

    configure_cpu_devices(load_config(RECIPES[0], []).mesh)  # before JAX starts; both recipes share the mesh
    out_dir = Path(args.out_dir)
    for recipe in ([] if args.combine else [args.only] if args.only else RECIPES):
        cfg = load_config(recipe, [])
        out = out_dir / recipe
        if out.exists():
            shutil.rmtree(out)
        t0 = time.perf_counter()
        history = run_rl(cfg, out, progress=False)
        r = {**summary(history), "wall_s": time.perf_counter() - t0, "rl_config": json.loads(cfg.rl.model_dump_json())}
        (out / "summary.json").write_text(json.dumps(r))
        print(f"{recipe:9s} reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}; per {WINDOW} steps "
              + " ".join(f"{m:.3f}" for m in r[f"reward_mean_per_{WINDOW}_steps"]) + f"; {r['wall_s']:.0f} s")
    if args.only:
        return
    results = {recipe: json.loads((out_dir / recipe / "summary.json").read_text()) for recipe in RECIPES}
    plot(results)
    harness.write(args.out, "demo_curves", script="benchmarks/demo_curves.py", runs=results)


if __name__ == "__main__":
    main()
