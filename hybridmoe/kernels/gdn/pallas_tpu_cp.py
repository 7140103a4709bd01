"""The context-parallel shard's own passes as Mosaic TPU kernels on the chunk kernels' layout (gdn.cp_terms_in_kernel).

Sequence-sharded GDN (docs/gdn.md section 3) needs, before a shard's outputs, its pass 1: the end
state from a zero start (S_ext) and the product of its chunks' transitions (M_r); and, before its
backward, its local state cotangent (dS_loc, the cotangent at its start from its outputs alone).
Here each is one walk over the chunks that forms the chunk terms in VMEM from the raw inputs, as
pallas_tpu's forward and backward kernels do, on their layout (each key head once, its value heads
in the step):

  gdn_cp_transition       k, v, the gates -> S_ext [B, G, Hg, K, V] and M_r [B, G, Hg, K, K]: two
                          chains per value head, the state's and the transition product's
                          (tpu_chunk.transition_step), at the chunk kernels' precision.
  gdn_cp_local_cotangent  q, k, the gates, each chunk's T (the forward's residual) and dO ->
                          dS_loc [B, G, Hg, K, V], walking the chunks in reverse
                          (tpu_chunk.state_cotangent_step).

No chunk term goes through HBM; the XLA form (context_parallel.py with gdn.cp_terms_in_kernel off)
forms them in float32 XLA ops on a layout that repeats q and k per value head.

Grid (B, G, N / chunks_per_step) as pallas_tpu's: batch and key heads "parallel", the chunk axis
"arbitrary". Layouts are pallas_tpu's (kernel_layout); a sequence padded to whole grid steps with
tokens that leave the state alone leaves S_ext, M_r and dS_loc alone too (k = 0, g = 0, and their dO
is zero).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gdn import limits, tpu_chunk
from hybridmoe.kernels.gdn.pallas_tpu import (Keys, Settings, block_specs, carry, chunks_of, compiler_params, cost,
                                              dims_of, head_rows, kernel_rows)
from hybridmoe.kernels.gdn.tpu_chunk import PRECISIONS

_F32 = jnp.float32
KERNEL_NAMES = dict(zip(("transition", "state_cotangent"), limits.CP_KERNELS))


def _identity(size: int):
    row, col = tpu_chunk.positions(size)
    return jnp.where(row == col, 1.0, 0.0)


def _transition_kernel(k_ref, k_scale_ref, v_ref, g_ref, beta_ref, end_ref, transition_ref, state_scratch,
                       product_scratch, *, settings: Settings):
    size, group, per_step = settings.chunk_size, g_ref.shape[1], settings.chunks_per_step
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _():
        state_scratch[...] = jnp.zeros(state_scratch.shape, _F32)
        for h in range(group):
            product_scratch[h] = _identity(product_scratch.shape[-1])

    states, products = tpu_chunk.transition_step(
        chunks_of(None, (k_ref, k_scale_ref), v_ref, g_ref, beta_ref, size, per_step),
        [state_scratch[h] for h in range(group)],
        [product_scratch[h] for h in range(group)], PRECISIONS[settings.precision])
    carry(state_scratch, states, end_ref)
    carry(product_scratch, products, transition_ref)


def transition(k: Keys, v, g_BGNHC, beta_BGNHC, settings: Settings):
    """(S_ext [B, G, Hg, K, V], M_r [B, G, Hg, K, K]) of the shard in pallas_tpu's layouts."""
    d = dims_of(k, v, g_BGNHC, settings)
    s = block_specs(d, reverse=False)
    per_head = lambda width: pl.BlockSpec((None, None, d.group, d.key_dim, width),  # noqa: E731
                                          lambda b, g, j: (b, g, 0, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((d.batch, d.key_heads, d.group, d.key_dim, width), _F32)
                 for width in (d.value_dim, d.key_dim)]
    operands = (kernel_rows(k, settings), k.scale, v, g_BGNHC, beta_BGNHC)
    return pl.pallas_call(
        functools.partial(_transition_kernel, settings=settings),
        name=KERNEL_NAMES["transition"], grid=(d.batch, d.key_heads, d.steps),
        in_specs=[s["tokens"](d.key_dim), s["row_per_chunk"], s["heads"](d.value_dim), s["chunks"](d.chunk),
                  s["chunks"](d.chunk)],
        out_specs=[per_head(d.value_dim), per_head(d.key_dim)], out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((d.group, d.key_dim, d.value_dim), _F32),
                        pltpu.VMEM((d.group, d.key_dim, d.key_dim), _F32)],
        compiler_params=compiler_params(KERNEL_NAMES["transition"], d, settings, jnp.dtype(v.dtype).itemsize),
        cost_estimate=cost("transition", d, settings.precision, operands, out_shape),
        interpret=settings.interpret,
    )(*operands)


def _state_cotangent_kernel(q_ref, q_scale_ref, k_ref, k_scale_ref, g_ref, beta_ref, inverses_ref, do_ref,
                            d_local_ref, d_state_scratch, *, settings: Settings):
    size, group, per_step = settings.chunk_size, g_ref.shape[1], settings.chunks_per_step
    step = pl.program_id(2)  # the step-th block from the end

    @pl.when(step == 0)
    def _():
        d_state_scratch[...] = jnp.zeros(d_state_scratch.shape, _F32)

    d_states = tpu_chunk.state_cotangent_step(
        chunks_of((q_ref, q_scale_ref), (k_ref, k_scale_ref), None, g_ref, beta_ref, size, per_step),
        [[inverses_ref[c * group + h] for h in range(group)] for c in range(per_step)],
        [[do_ref[head_rows(do_ref, h, pl.ds(c * size, size), group)] for h in range(group)] for c in range(per_step)],
        [d_state_scratch[h] for h in range(group)], PRECISIONS[settings.precision])
    carry(d_state_scratch, d_states, d_local_ref)


def local_state_cotangent(q: Keys, k: Keys, g_BGNHC, beta_BGNHC, inverses, do, settings: Settings):
    """dS_loc [B, G, Hg, K, V]: the cotangent at the shard's start from its outputs' cotangent dO
    alone (zero after its last chunk); inverses: each chunk's T, the forward's residual
    [B, G, N Hg, C, C]."""
    d = dims_of(q, do, g_BGNHC, settings)
    s = block_specs(d, reverse=True)
    out_shape = jax.ShapeDtypeStruct((d.batch, d.key_heads, d.group, d.key_dim, d.value_dim), _F32)
    operands = (kernel_rows(q, settings), q.scale, kernel_rows(k, settings), k.scale, g_BGNHC, beta_BGNHC, inverses, do)
    return pl.pallas_call(
        functools.partial(_state_cotangent_kernel, settings=settings),
        name=KERNEL_NAMES["state_cotangent"], grid=(d.batch, d.key_heads, d.steps),
        in_specs=[*[s["tokens"](d.key_dim), s["row_per_chunk"]] * 2, s["chunks"](d.chunk), s["chunks"](d.chunk),
                  s["items"](d.chunk, d.chunk), s["heads"](d.value_dim)],
        out_specs=s["state"], out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((d.group, d.key_dim, d.value_dim), _F32)],
        compiler_params=compiler_params(KERNEL_NAMES["state_cotangent"], d, settings,
                                        jnp.dtype(do.dtype).itemsize),
        cost_estimate=cost("state_cotangent", d, settings.precision, operands, [out_shape]),
        interpret=settings.interpret,
    )(*operands)
