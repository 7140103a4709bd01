"""Attention kernels: reference (tests' oracle), the XLA path, and blocked causal self-attention."""

import jax

from hybridmoe.kernels.attention.blocked import causal_attention_blocked
from hybridmoe.kernels.attention.xla import attention


def self_attention_core(platform: str | None = None):
    """The core of a layer's causal self-attention (no context parallelism), per platform.

    CPU: query blocks that skip the key blocks after them (blocked.py; the masked half of the
    score matrix is never computed). GPU/TPU: the full masked core (xla.py), as before.
    Both take attention's arguments.
    """
    return causal_attention_blocked if (platform or jax.default_backend()) == "cpu" else attention


__all__ = ["attention", "causal_attention_blocked", "self_attention_core"]
