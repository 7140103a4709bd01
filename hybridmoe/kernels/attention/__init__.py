"""Attention kernels: reference (tests' oracle) and the XLA path."""

from hybridmoe.kernels.attention.xla import attention

__all__ = ["attention"]
