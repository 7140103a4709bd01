"""Attention kernels: reference (tests' oracle), the masked XLA core, blocked causal self-attention,
and flash attention (ops.py: xla, pallas_tpu and pallas_gpu backends); limits.py says which core
kernels.attention.backend names on each platform and what block sizes each accepts."""

from hybridmoe.kernels.attention import limits
from hybridmoe.kernels.attention.blocked import causal_attention_blocked
from hybridmoe.kernels.attention.ops import attention_bwd, attention_fwd, flash_attention, platform_default
from hybridmoe.kernels.attention.xla import attention

__all__ = ["attention", "attention_bwd", "attention_fwd", "causal_attention_blocked", "flash_attention", "limits",
           "platform_default"]
