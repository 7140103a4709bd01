"""Attention kernels: reference (tests' oracle), the XLA path, blocked causal self-attention, and flash
attention (ops.py: xla, pallas_tpu and pallas_gpu backends)."""

import jax

from hybridmoe.kernels.attention.blocked import causal_attention_blocked
from hybridmoe.kernels.attention.ops import attention_bwd, attention_fwd, flash_attention, platform_default
from hybridmoe.kernels.attention.xla import attention


def self_attention_core(platform: str | None = None):
    """The core of a layer's causal self-attention (no context parallelism), per platform.

    CPU: query blocks that skip the key blocks after them (blocked.py; the masked half of the
    score matrix is never computed). GPU/TPU: the full masked core (xla.py), as before.
    Both take attention's arguments.
    """
    return causal_attention_blocked if (platform or jax.default_backend()) == "cpu" else attention


__all__ = ["attention", "attention_bwd", "attention_fwd", "causal_attention_blocked", "flash_attention",
           "platform_default", "self_attention_core"]
