"""Our side of the exported checkpoints' log-probs in float32 against float64: how much of the gap
to transformers (benchmarks/records/hf_exports.json) float32 rounding on our side explains.

    .venv/bin/python benchmarks/export_float64.py [--out benchmarks/records/export_float64.json]

The text and tied layouts of tests/hf_layouts.py are fine-tuned and exported as
scripts/check_hf_exports.sh does (2 steps on tests/fixtures/data/sft.jsonl, --init-hf SRC
--export-hf OUT), then each export's next-token log-probs of tests/fixtures/hf_tiny/tokens.npy are
computed twice by the model code `hybridmoe score` runs (model.forward.token_logprobs): in float32,
as `hybridmoe score` does, and in float64 with jax_enable_x64 and every float32 the model casts to
(norms, softmax, the log-prob head: `jnp.float32` in the source) read as float64 — a measuring
device for this script only, set after every float32 result is taken. The record holds per layout
the mean log-prob and max / mean |float32 - float64| (absolute, and relative to max(1, |logp|)).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8, cpu_only=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = harness.ROOT
TOKENS = ROOT / "tests" / "fixtures" / "hf_tiny" / "tokens.npy"
LAYOUTS = ("text", "tied")


def float64_logprobs(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    from hybridmoe.config.schema import Config, ModelConfig, TrainConfig
    from hybridmoe.hf import load_hf_checkpoint
    from hybridmoe.model.forward import token_logprobs
    from hybridmoe.tools.score import hf_model_section
    _, tree = load_hf_checkpoint(str(hf_dir))
    section = hf_model_section(hf_dir)
    # model_copy skips validation: float64 is no DType a run may ask for, only this measurement.
    model = ModelConfig(**{**section, "max_seq_len": max(tokens.shape[1], 256)}).model_copy(
        update={"param_dtype": "float64", "compute_dtype": "float64"})
    cfg = Config(model=model, train=TrainConfig(seq_len=tokens.shape[1]))
    out = token_logprobs(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree), cfg, jnp.asarray(tokens))
    assert out.dtype == jnp.float64, out.dtype
    return np.asarray(out)


def main() -> None:
    args = harness.parser(__doc__, "export_float64").parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import hf_layouts

    from hybridmoe.cli import main as cli
    from hybridmoe.tools.score import score_tokens
    tokens = np.load(TOKENS)
    work = Path(tempfile.mkdtemp(prefix="export-float64-"))
    exports, f32 = {}, {}
    for layout in LAYOUTS:
        src = hf_layouts.build(layout, work / "sources" / layout)
        exports[layout] = work / "exports" / layout
        assert cli(["train", "train.data=files", f"data.path={ROOT / 'tests/fixtures/data/sft.jsonl'}", "train.steps=2",
                    "train.warmup_steps=0", "train.batch_size=8", "train.seq_len=64", "--init-hf", str(src),
                    "--export-hf", str(exports[layout])]) == 0
        f32[layout] = score_tokens(exports[layout], tokens).astype(np.float64)
    # From here on the model's float32 casts are float64 (every float32 figure is already taken).
    jax.config.update("jax_enable_x64", True)
    jnp.float32 = jnp.float64
    rows = {}
    for layout in LAYOUTS:
        f64 = float64_logprobs(exports[layout], tokens)
        diff = np.abs(f32[layout] - f64)
        rel = diff / np.maximum(1.0, np.abs(f64))
        rows[layout] = {"mean_logprob_float64": float(f64.mean()), "max_abs_float32_vs_float64": float(diff.max()),
                        "mean_abs_float32_vs_float64": float(diff.mean()),
                        "max_rel_float32_vs_float64": float(rel.max()),
                        "logprob_at_max_abs": float(f64.flat[int(diff.argmax())])}
        print(layout, rows[layout])
    harness.write(args.out, "export_float64", tokens_shape=list(tokens.shape), layouts=rows,
                  what="hybridmoe's own float32 log-probs of the text and tied exports against the same model code "
                       "in float64")


if __name__ == "__main__":
    main()
