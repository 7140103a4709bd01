"""Gated DeltaNet, chunked form (docs/gdn.md section 2) as Pallas kernels, with the XLA core's backward contract.

The forward kernel walks the chunks of each (batch, value head) in order from the initial state,
writing each chunk's output, the state at its start (the backward's only residual besides the
inputs) and the final state. The backward kernel walks them in reverse, replays each chunk from
its saved start state and takes the chunk's vjp with the cotangents of its output and of its end
state: dq, dk, dv, dbeta, dg of the chunk and the cotangent of its start state (docs/gdn.md section 2's
adjoint recurrence), down to dL/d(initial state). The per-chunk math is pallas_chunk.py's; the two
drivers differ in how they walk the chunks:
  pallas_tpu (pallas_tpu.py): Mosaic TPU, grid (B, H, N) with the chunk axis sequential, the
      state in VMEM scratch;
  pallas_gpu (pallas_gpu.py): Triton, grid (B, H), a fori_loop over chunks in each program.
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
_DRIVERS = {"pallas_tpu": pallas_tpu, "pallas_gpu": pallas_gpu}


def _kernel_inputs(x: ChunkInputs, starts_BNC):
    """q, k, v; g as column [B, N, H, C, 1] and row [B, N, H, 1, C]; beta as column; the document
    starts (float 0 / 1, no head axis) as column [B, N, C, 1] and row [B, N, 1, C]."""
    starts_BNC = starts_BNC.astype(jnp.float32)
    column = lambda a: a[..., :, None]
    row = lambda a: a[..., None, :]
    return (x.q, x.k, x.v, column(x.g), row(x.g), column(x.beta), column(starts_BNC), row(starts_BNC))


def core_forward(x: ChunkInputs, starts_BNC, initial_BHKV, *, backend: str, interpret: bool):
    """(o [B, N, H, C, V], final state) and the residuals (inputs, the state at every chunk start)."""
    o_BNHCV, states_BNHKV, final_BHKV = _DRIVERS[backend].forward(
        _kernel_inputs(x, starts_BNC), initial_BHKV, interpret=interpret)
    return (o_BNHCV, final_BHKV), (x, starts_BNC, states_BNHKV)


def core_backward(residuals, do_BNHCV, d_final_BHKV, *, backend: str, interpret: bool):
    """Cotangents of (ChunkInputs, initial state) by one reverse pass over the chunks."""
    x, starts_BNC, states_BNHKV = residuals
    dq, dk, dv, dg_col, dg_row, dbeta, d_initial_BHKV = _DRIVERS[backend].backward(
        _kernel_inputs(x, starts_BNC), states_BNHKV, do_BNHCV, d_final_BHKV, interpret=interpret)
    return ChunkInputs(dq, dk, dv, dg_col[..., 0] + dg_row[..., 0, :], dbeta[..., 0]), d_initial_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_core(x: ChunkInputs, starts_BNC, initial_BHKV, backend: str = "pallas_tpu", interpret: bool = False):
    """The chunked recurrence on prepared chunk-layout inputs: (o [B, N, H, C, V], final state)."""
    return core_forward(x, starts_BNC, initial_BHKV, backend=backend, interpret=interpret)[0]


def _core_fwd(x, starts_BNC, initial_BHKV, backend, interpret):
    return core_forward(x, starts_BNC, initial_BHKV, backend=backend, interpret=interpret)


def _core_bwd(backend, interpret, residuals, cotangents):
    dx, d_initial_BHKV = core_backward(residuals, *cotangents, backend=backend, interpret=interpret)
    return dx, None, d_initial_BHKV


chunked_core.defvjp(_core_fwd, _core_bwd)
