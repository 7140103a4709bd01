"""Per-token log-probabilities of given token ids under a Hugging Face checkpoint.

The way to check a conversion against the reference implementation (and sampler/trainer parity):
the same tokens scored here and by the reference must agree to float32 rounding.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.recipe.load import hf_model_section
from hybridmoe.config.schema import Config, ModelConfig, RLConfig, TrainConfig
from hybridmoe.recipe.validate import check_requirements
from hybridmoe.model.forward import token_logprobs
from hybridmoe.hf import load_hf_checkpoint


def check_tokens(tokens: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"{where}: token ids must be [batch, length >= 2], got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{where}: token ids must be integers, got {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}); found {tokens.min()}..{tokens.max()}")
    return tokens.astype(np.int32)


def load_token_file(path: Path) -> np.ndarray:
    """A .npy of token ids, or a ValueError naming the file and what it holds instead."""
    if not path.is_file():
        raise ValueError(f"--tokens {path}: no such file")
    if path.stat().st_size == 0:
        raise ValueError(f"--tokens {path}: the file is empty; expected a .npy of int token ids [batch, length]")
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ValueError(f"--tokens {path}: not a .npy file (it lacks the NumPy header); write the int token ids "
                             "[batch, length] with numpy.save")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"--tokens {path}: not a .npy array file ({e}); write one with numpy.save") from None


def score_tokens(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    """[B, T-1] float32: log p(tokens[:, t+1] | tokens[:, :t+1]), computed in float32."""
    section = hf_model_section(hf_dir)  # the path `recipe=hf:DIR` and `--init-hf` read config.json by
    tokens = check_tokens(np.asarray(tokens), section["vocab_size"], "--tokens")
    _, tree = load_hf_checkpoint(str(hf_dir))
    # The run sections keep their defaults except the sequence length, taken from the file: the
    # model must take this length and the defaults' sequences, whichever is longer.
    length = tokens.shape[1]
    model = ModelConfig(**{**section, "max_seq_len": max(length, TrainConfig().seq_len, RLConfig().sequence_len),
                           "param_dtype": "float32", "compute_dtype": "float32"})
    cfg = Config(model=model, train=TrainConfig(seq_len=length))
    check_requirements(cfg)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)
    return np.asarray(jax.jit(lambda p, t: token_logprobs(p, cfg, t))(params, tokens), np.float32)
