"""Gated DeltaNet, chunked form (docs/gdn.md section 2) as Pallas kernels: the dispatch on backend.

  pallas_tpu (pallas_tpu.py, math in tpu_chunk.py): Mosaic TPU. A grid step holds one key head,
      its value heads and several chunks; the intra-chunk work runs on the MXU in bfloat16 passes,
      only the [K, V] state is carried from chunk to chunk (in VMEM). It takes the inputs in its
      own layouts (each key head once) through `pallas_tpu.gated_delta_rule`; here only the chunk-
      layout API that the context-parallel pass 2 calls.
  pallas_gpu (pallas_gpu.py, math in pallas_chunk.py): Triton, grid (B, H), a fori_loop over
      chunks in each program, one chunk of one value head at a time; the forward saves each
      chunk's start state, the backward walks the chunks in reverse and takes each chunk's vjp from
      it. It runs under xla.gated_delta_rule_chunked with `chunked_core` below as its core.
On CPU either runs with interpret=True (kernels.interpret, as for the gmm Pallas backends).

Dimension letters as in xla.py: B batch, N chunks, H value heads, C position in a chunk, K key
dim, V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybridmoe.kernels.gdn import pallas_gpu, pallas_tpu
from hybridmoe.kernels.gdn.xla import ChunkInputs

BACKENDS = ("pallas_tpu", "pallas_gpu")
_DRIVERS = {"pallas_gpu": pallas_gpu}


def _kernel_inputs(x: ChunkInputs, starts_BNC):
    """q, k, v; g as column [B, N, H, C, 1] and row [B, N, H, 1, C]; beta as column; the document
    starts (float 0 / 1, no head axis) as column [B, N, C, 1] and row [B, N, 1, C]."""
    starts_BNC = starts_BNC.astype(jnp.float32)
    column = lambda a: a[..., :, None]
    row = lambda a: a[..., None, :]
    return (x.q, x.k, x.v, column(x.g), row(x.g), column(x.beta), column(starts_BNC), row(starts_BNC))


def core_forward(x: ChunkInputs, starts_BNC, initial_BHKV, *, backend: str, interpret: bool, precision="float32"):
    """(o [B, N, H, C, V], final state) and the residuals of `core_backward` (opaque). precision: the
    Mosaic kernels' (tpu_chunk.PRECISIONS; ChunkInputs are float32 whatever the model's dtype)."""
    if backend == "pallas_tpu":
        return pallas_tpu.chunk_inputs_forward(x, starts_BNC, initial_BHKV, interpret=interpret, precision=precision)
    o_BNHCV, states_BNHKV, final_BHKV = _DRIVERS[backend].forward(
        _kernel_inputs(x, starts_BNC), initial_BHKV, interpret=interpret)
    return (o_BNHCV, final_BHKV), (x, starts_BNC, states_BNHKV)


def core_backward(residuals, do_BNHCV, d_final_BHKV, *, backend: str, interpret: bool, precision="float32"):
    """Cotangents of (ChunkInputs, initial state) by one reverse pass over the chunks."""
    if backend == "pallas_tpu":
        return pallas_tpu.chunk_inputs_backward(residuals, do_BNHCV, d_final_BHKV, interpret=interpret,
                                                precision=precision)
    x, starts_BNC, states_BNHKV = residuals
    dq, dk, dv, dg_col, dg_row, dbeta, d_initial_BHKV = _DRIVERS[backend].backward(
        _kernel_inputs(x, starts_BNC), states_BNHKV, do_BNHCV, d_final_BHKV, interpret=interpret)
    return ChunkInputs(dq, dk, dv, dg_col[..., 0] + dg_row[..., 0, :], dbeta[..., 0]), d_initial_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_core(x: ChunkInputs, starts_BNC, initial_BHKV, backend: str = "pallas_gpu", interpret: bool = False):
    """The chunked recurrence on prepared chunk-layout inputs: (o [B, N, H, C, V], final state)."""
    return core_forward(x, starts_BNC, initial_BHKV, backend=backend, interpret=interpret)[0]


def _core_fwd(x, starts_BNC, initial_BHKV, backend, interpret):
    return core_forward(x, starts_BNC, initial_BHKV, backend=backend, interpret=interpret)


def _core_bwd(backend, interpret, residuals, cotangents):
    dx, d_initial_BHKV = core_backward(residuals, *cotangents, backend=backend, interpret=interpret)
    return dx, None, d_initial_BHKV


chunked_core.defvjp(_core_fwd, _core_bwd)
