"""The broken variants of the fused SwiGLU epilogues (LEVERS.md), shared by the kernel and the
MoE-layer tests: each is (name in kernels/gmm/epilogue.py, the broken function to patch in)."""

import jax.numpy as jnp

from hybridmoe.kernels.gmm import epilogue as epi

_ORIGINAL_READ_TILE = epi.read_tile


def _swap_halves(block, j, t):
    g, u = _ORIGINAL_READ_TILE(block, j, t)
    return u, g


def _contiguous_reader(block, j, t):
    f = block.shape[-1] // 2
    return block[..., j * t:(j + 1) * t], block[..., f + j * t:f + (j + 1) * t]


BROKEN = {
    "halves_swapped": ("read_tile", _swap_halves),
    "silu_grad_without_second_term": ("silu_grad", lambda x, sig: sig),
    "row_scale_dropped": ("row_scale_f32", lambda s: jnp.ones_like(s, jnp.float32)),
    "row_scale_bf16": ("row_scale_f32", lambda s: s.astype(jnp.bfloat16).astype(jnp.float32)),
    "contiguous_reader_on_interleaved_layout": ("read_tile", _contiguous_reader),
    "reversed_tile_order": ("tile_order", lambda n: list(range(n))[::-1]),
}

# The variants that live in a Pallas kernel's own code (its tile readers); the others are
# epilogue maths the backends share.
READER_VARIANTS = ("contiguous_reader_on_interleaved_layout", "reversed_tile_order")
