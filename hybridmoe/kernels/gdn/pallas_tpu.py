"""Mosaic TPU driver of the Pallas GDN core: grid (B, H, N), the chunk axis innermost and sequential.

Each grid step is one chunk of one (batch, value head). The forward carries the float32 [K, V]
state from chunk to chunk in a VMEM scratch; the backward visits the chunks in reverse (its index
maps read chunk N - 1 - n) and carries the state cotangent the same way. Every block's last two
dims are full array dims ([C, K], [C, V], [K, V], [C, 1], [1, C]), which Mosaic accepts for any
size; the state blocks keep one index across the chunk axis, so they stay resident and are
written back once.

Dimension letters as in xla.py: B batch, N chunks, H value heads, C position in a chunk, K key
dim, V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gdn.pallas_chunk import KERNEL_NAMES, backward_chunk, chunk_macs, forward_chunk
from hybridmoe.kernels.vmem import tpu_limit_bytes

_F32 = jnp.float32


def _chunk_spec(block_tail, reverse: bool, num_chunks: int, per_head: bool = True):
    """One chunk of one (batch, head): block (1, 1, 1, *tail) of a [B, N, H, ...] array
    (per_head=False: (1, 1, *tail) of a [B, N, ...] array that every head reads)."""
    chunk = (lambda n: num_chunks - 1 - n) if reverse else (lambda n: n)
    zeros = (0,) * len(block_tail)
    if not per_head:
        return pl.BlockSpec((None, None, *block_tail), lambda b, h, n: (b, chunk(n), *zeros))
    return pl.BlockSpec((None, None, None, *block_tail), lambda b, h, n: (b, chunk(n), h, *zeros))


def _state_spec(key_dim: int, value_dim: int):
    """The [K, V] state of one (batch, head), the same block for every chunk (resident)."""
    return pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))


def _specs(dims, reverse: bool):
    """Specs of the chunk inputs (q, k, v, g column, g row, beta, starts column, starts row), and the
    per-chunk spec maker."""
    num_chunks, chunk_size, key_dim, value_dim = dims
    spec = functools.partial(_chunk_spec, reverse=reverse, num_chunks=num_chunks)
    return [spec((chunk_size, key_dim)), spec((chunk_size, key_dim)), spec((chunk_size, value_dim)),
            spec((chunk_size, 1)), spec((1, chunk_size)), spec((chunk_size, 1)),
            spec((chunk_size, 1), per_head=False), spec((1, chunk_size), per_head=False)], spec


def cost(name: str, grid, operands, out_shape, chunk_size: int, key_dim: int, value_dim: int) -> pl.CostEstimate:
    """The kernel's stated cost: `chunk_macs` x 2 per grid step (one chunk of one head; the FLOPs
    of the math, not the 6 MXU passes HIGHEST costs), one exp per decay entry (C^2 + 3 C), every
    operand and result moved once (the state blocks stay resident)."""
    steps = grid[0] * grid[1] * grid[2]
    nbytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in (*operands, *out_shape))
    return pl.CostEstimate(flops=int(2 * chunk_macs(name, chunk_size, key_dim, value_dim) * steps),
                           transcendentals=int((chunk_size**2 + 3 * chunk_size) * steps), bytes_accessed=int(nbytes))


def _call(kernel, grid, in_specs, out_specs, out_shape, key_dim, value_dim, interpret, operands=(), vmem_limit_mib=0.0):
    name = KERNEL_NAMES[kernel.__name__]
    chunk_size = operands[0].shape[3]
    return pl.pallas_call(
        kernel, name=name, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, cost_estimate=cost(name, grid, operands, out_shape, chunk_size, key_dim, value_dim),
        scratch_shapes=[pltpu.VMEM((key_dim, value_dim), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=tpu_limit_bytes(vmem_limit_mib)),
        interpret=interpret)


def _forward_kernel(*refs):
    *chunk_refs, initial, o_out, chunk_start_out, final_out, state_scratch = refs
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        state_scratch[...] = initial[...]

    end_KV = forward_chunk(chunk_refs, state_scratch[...], o_out, chunk_start_out)
    state_scratch[...] = end_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        final_out[...] = end_KV


def _backward_kernel(*refs):
    *chunk_refs, chunk_start, do, d_final = refs[:11]
    *grad_outs, d_initial_out, d_state_scratch = refs[11:]
    n = pl.program_id(2)  # the n-th chunk from the end

    @pl.when(n == 0)
    def _():
        d_state_scratch[...] = d_final[...]

    d_start_KV = backward_chunk(chunk_refs, chunk_start, do, d_state_scratch[...], grad_outs)
    d_state_scratch[...] = d_start_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        d_initial_out[...] = d_start_KV


def forward(chunk_inputs, initial_BHKV, *, interpret: bool, vmem_limit_mib: float = 0.0):
    """(o [B, N, H, C, V], the state at every chunk start [B, N, H, K, V], final state [B, H, K, V])."""
    batch, num_chunks, heads, chunk_size, key_dim = chunk_inputs[0].shape
    value_dim = chunk_inputs[2].shape[-1]
    in_specs, spec = _specs((num_chunks, chunk_size, key_dim, value_dim), reverse=False)
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, _F32)
    return _call(
        _forward_kernel, (batch, heads, num_chunks), in_specs + [_state_spec(key_dim, value_dim)],
        [spec((chunk_size, value_dim)), spec((key_dim, value_dim)), _state_spec(key_dim, value_dim)],
        [shape(batch, num_chunks, heads, chunk_size, value_dim), shape(batch, num_chunks, heads, key_dim, value_dim),
         shape(batch, heads, key_dim, value_dim)], key_dim, value_dim, interpret, (*chunk_inputs, initial_BHKV),
        vmem_limit_mib,
    )(*chunk_inputs, initial_BHKV)


def backward(chunk_inputs, states_BNHKV, do_BNHCV, d_final_BHKV, *, interpret: bool, vmem_limit_mib: float = 0.0):
    """(dq, dk, dv, dg column, dg row, dbeta) in the inputs' layouts, and d(initial state)."""
    batch, num_chunks, heads, chunk_size, key_dim = chunk_inputs[0].shape
    value_dim = chunk_inputs[2].shape[-1]
    in_specs, spec = _specs((num_chunks, chunk_size, key_dim, value_dim), reverse=True)
    like = lambda a: jax.ShapeDtypeStruct(a.shape, _F32)
    return _call(
        _backward_kernel, (batch, heads, num_chunks),
        in_specs + [spec((key_dim, value_dim)), spec((chunk_size, value_dim)), _state_spec(key_dim, value_dim)],
        in_specs[:6] + [_state_spec(key_dim, value_dim)],
        [like(a) for a in chunk_inputs[:6]] + [like(d_final_BHKV)], key_dim, value_dim, interpret,
        (*chunk_inputs, states_BNHKV, do_BNHCV, d_final_BHKV), vmem_limit_mib,
    )(*chunk_inputs, states_BNHKV, do_BNHCV, d_final_BHKV)
