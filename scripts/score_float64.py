"""`hybridmoe score` in float64: our model code's next-token log-probs of a Hugging Face checkpoint with
every float32 it computes in read as float64. The float64 half of scripts/check_hf_exports.sh: how far
each side's float32 lies from its own float64, and whether the two sides' float64 agree.

    .venv/bin/python scripts/score_float64.py --hf DIR --tokens T.npy --out F.npy

The model code casts to float32 where bf16 would lose (norms, router and attention softmax, the gate
cumsum, the log-prob head: `jnp.float32` in the source); with jax_enable_x64 and `jnp.float32` read
as float64 those casts keep float64. This is a measuring device for this process only, never a dtype
a run may ask for (float64 is no DType of the config). The traced program is checked to hold no
float32 value, so a cast the substitution misses fails the run instead of skewing the figure.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jnp.float32 = jnp.float64  # before any model code runs: its float32 casts read this attribute when called


def float64_logprobs(hf_dir: Path, tokens_BT: np.ndarray) -> np.ndarray:
    """[B, T-1] float64 log-probs, the config built as `hybridmoe score` builds it but in float64."""
    from hybridmoe.config.schema import Config, ModelConfig, RLConfig, TrainConfig
    from hybridmoe.hf import load_hf_checkpoint
    from hybridmoe.model.forward import token_logprobs
    from hybridmoe.tools.score import check_tokens, hf_model_section

    section = hf_model_section(hf_dir)
    tokens_BT = check_tokens(np.asarray(tokens_BT), section["vocab_size"], "--tokens")
    _, tree = load_hf_checkpoint(str(hf_dir))
    length = tokens_BT.shape[1]
    # model_copy skips validation: float64 is no DType a run may ask for, only this measurement.
    model = ModelConfig(**{**section, "max_seq_len": max(length, TrainConfig().seq_len, RLConfig().sequence_len)}
                        ).model_copy(update={"param_dtype": "float64", "compute_dtype": "float64"})
    cfg = Config(model=model, train=TrainConfig(seq_len=length))
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)

    def run(p, t):
        return token_logprobs(p, cfg, t)

    program = str(jax.make_jaxpr(run)(params, tokens_BT))
    narrow = sorted(set(re.findall(r"\b(?:f32|bf16|f16)\[[^\]]*\]", program)))
    if narrow:
        raise RuntimeError(f"the float64 program still holds narrower floats {narrow[:8]}: a float32 cast in the "
                           "model code does not go through jnp.float32; make it do so, or this figure is not float64")
    out = np.asarray(jax.jit(run)(params, tokens_BT))
    assert out.dtype == np.float64, out.dtype
    return out


def main() -> int:
    from hybridmoe.tools.score import load_token_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, type=Path, help="Hugging Face checkpoint folder (config.json + safetensors)")
    parser.add_argument("--tokens", required=True, type=Path, help="int token ids [batch, length] (.npy)")
    parser.add_argument("--out", required=True, type=Path, help="write the float64 log-probs [batch, length-1] here (.npy)")
    args = parser.parse_args()
    out = float64_logprobs(args.hf, load_token_file(args.tokens))
    np.save(args.out, out)
    print(f"{args.hf}: float64 log-probs {list(out.shape)}, mean {out.mean():.6f} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
