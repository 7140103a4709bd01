"""quant.fp8_gmm trains like bfloat16: the `tiny` recipe, 60 steps, both arms from the same seed.

Arms: bf16 (model.compute_dtype=bfloat16) and fp8_gmm (the same plus quant.fp8_gmm=true: the MoE
grouped matmuls' forward, input gradient and weight gradient in fp8). Records both loss curves
and the gap of the final loss (mean of the last 10 steps), and plots docs/fp8_gmm_loss.png.
The fp8 vs bf16 grouped-matmul TFLOP/s needs fp8 hardware: not measured (no GPU was lent).

  .venv/bin/python benchmarks/fp8_gmm_train.py [--steps 60]

Prints the final losses and writes benchmarks/records/fp8_gmm_train.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8)
from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.train.loop import train  # noqa: E402

COMMON = ["model.compute_dtype=bfloat16"]
ARMS = {"bf16": [], "fp8_gmm": ["quant.fp8_gmm=true"]}
FINAL_WINDOW = 10
MARGIN = 0.05  # the fp8 arm's final loss may exceed bf16's by at most this (nats)


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--plot", default=str(harness.ROOT / "docs" / "fp8_gmm_loss.png"))
    args = ap.parse_args()
    arms = {}
    for name, over in ARMS.items():
        cfg = load_config("tiny", [*COMMON, *over, f"train.steps={args.steps}"])
        t0 = time.perf_counter()
        hist = train(cfg, None, progress=False)
        losses = [float(h["loss"]) for h in hist]
        arms[name] = {"overrides": [*COMMON, *over], "losses": losses, "wall_s": time.perf_counter() - t0,
                      "final_loss": sum(losses[-FINAL_WINDOW:]) / FINAL_WINDOW}
    gap = arms["fp8_gmm"]["final_loss"] - arms["bf16"]["final_loss"]
    for name, a in arms.items():
        print(f"{name:<8} first {a['losses'][0]:.4f}  final(mean of last {FINAL_WINDOW}) {a['final_loss']:.4f}")
    print(f"gap {gap:+.4f} (margin {MARGIN})")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, a in arms.items():
        ax.plot(range(len(a["losses"])), a["losses"], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"tiny recipe: bf16 vs quant.fp8_gmm (final gap {gap:+.4f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    harness.write(args.out, "fp8_gmm_train", recipe="tiny", steps=args.steps, arms=arms, final_gap=gap, margin=MARGIN,
                  within_margin=gap <= MARGIN, gpu_tflops="not measured here (needs fp8 hardware)")


if __name__ == "__main__":
    main()
