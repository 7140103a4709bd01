"""Normalisation and rotary embedding shared by the layers.

Numerics: norms compute in float32 and cast back, as the Hugging Face reference does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, w, eps: float):
    """Qwen RMSNorm: x / rms(x) * (1 + w), in float32 (w is stored as an offset from one)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x, z, w, eps: float):
    """GDN output norm: w * x / rms(x) * silu(z), float32; w multiplies directly (no 1 + w)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def rope_tables(positions_BT, rotary_dim: int, theta: float):
    """cos, sin [B, T, rotary_dim] for the half-split (rotate_half) convention."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rope(x_BTNA, cos_BTR, sin_BTR):
    """Rotate the first R dims of each head (rotate_half pairs i and i + R/2); pass the rest."""
    R = cos_BTR.shape[-1]
    rot, rest = x_BTNA[..., :R].astype(jnp.float32), x_BTNA[..., R:]
    half = R // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
    out = rot * cos + rotated * sin
    return jnp.concatenate([out.astype(x_BTNA.dtype), rest], axis=-1)
