"""Triton (Pallas GPU) driver of the Pallas GDN core: grid (B, H), one program per (batch, value head)
looping over its chunks.

Triton programs run in parallel and keep nothing between grid steps, so the chunk walk that the TPU
driver spreads over a sequential grid axis is a fori_loop inside one program here, with the float32
[K, V] state (forward) or its cotangent (backward, chunks in reverse) as the loop carry. Each
program's blocks span the whole sequence of its (batch, head); the loop reads and writes one chunk
at a time through ref views, so only [C, K]-sized values are ever formed. Triton wants
power-of-two value shapes and matmul dims >= 16: chunk size, dk and dv powers of two >= 16 on a GPU.

Dimension letters as in xla.py: B batch, N chunks, H value heads, C position in a chunk, K key
dim, V value dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hybridmoe.kernels.gdn.pallas_chunk import KERNEL_NAMES, backward_chunk, forward_chunk

_F32 = jnp.float32


def _sequence_spec(block_tail, num_chunks: int, per_head: bool = True):
    """Every chunk of one (batch, head): block (1, N, 1, *tail) of a [B, N, H, ...] array
    (per_head=False: (1, N, *tail) of a [B, N, ...] array that every head reads)."""
    zeros = (0,) * len(block_tail)
    if not per_head:
        return pl.BlockSpec((None, num_chunks, *block_tail), lambda b, h: (b, 0, *zeros))
    return pl.BlockSpec((None, num_chunks, None, *block_tail), lambda b, h: (b, 0, h, *zeros))


def _state_spec(key_dim: int, value_dim: int):
    return pl.BlockSpec((None, None, key_dim, value_dim), lambda b, h: (b, h, 0, 0))


def _specs(dims):
    num_chunks, chunk_size, key_dim, value_dim = dims
    spec = lambda tail, per_head=True: _sequence_spec(tail, num_chunks, per_head)
    return [spec((chunk_size, key_dim)), spec((chunk_size, key_dim)), spec((chunk_size, value_dim)),
            spec((chunk_size, 1)), spec((1, chunk_size)), spec((chunk_size, 1)),
            spec((chunk_size, 1), per_head=False), spec((1, chunk_size), per_head=False)], spec


def _chunk_order(n, num_chunks: int, reverse: bool):
    return num_chunks - 1 - n if reverse else n


def _forward_kernel(*refs):
    *chunk_refs, initial, o_out, chunk_start_out, final_out = refs
    num_chunks = chunk_refs[0].shape[0]

    def step(n, state_KV):
        return forward_chunk([r.at[n] for r in chunk_refs], state_KV, o_out.at[n], chunk_start_out.at[n])

    final_out[...] = lax.fori_loop(0, num_chunks, step, initial[...])


def _backward_kernel(*refs):
    *chunk_refs, chunk_start, do, d_final = refs[:11]
    *grad_outs, d_initial_out = refs[11:]
    num_chunks = chunk_refs[0].shape[0]

    def step(i, d_state_KV):
        n = _chunk_order(i, num_chunks, reverse=True)
        return backward_chunk([r.at[n] for r in chunk_refs], chunk_start.at[n], do.at[n], d_state_KV,
                              [g.at[n] for g in grad_outs])

    d_initial_out[...] = lax.fori_loop(0, num_chunks, step, d_final[...])


def forward(chunk_inputs, initial_BHKV, *, interpret: bool):
    """(o [B, N, H, C, V], the state at every chunk start [B, N, H, K, V], final state [B, H, K, V])."""
    batch, num_chunks, heads, chunk_size, key_dim = chunk_inputs[0].shape
    value_dim = chunk_inputs[2].shape[-1]
    in_specs, spec = _specs((num_chunks, chunk_size, key_dim, value_dim))
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, _F32)
    return pl.pallas_call(
        _forward_kernel, name=KERNEL_NAMES["_forward_kernel"], grid=(batch, heads),
        in_specs=in_specs + [_state_spec(key_dim, value_dim)],
        out_specs=[spec((chunk_size, value_dim)), spec((key_dim, value_dim)), _state_spec(key_dim, value_dim)],
        out_shape=[shape(batch, num_chunks, heads, chunk_size, value_dim),
                   shape(batch, num_chunks, heads, key_dim, value_dim), shape(batch, heads, key_dim, value_dim)],
        compiler_params=plgpu.CompilerParams(), interpret=interpret,
    )(*chunk_inputs, initial_BHKV)


def backward(chunk_inputs, states_BNHKV, do_BNHCV, d_final_BHKV, *, interpret: bool):
    """(dq, dk, dv, dg column, dg row, dbeta) in the inputs' layouts, and d(initial state)."""
    batch, num_chunks, heads, chunk_size, key_dim = chunk_inputs[0].shape
    value_dim = chunk_inputs[2].shape[-1]
    in_specs, spec = _specs((num_chunks, chunk_size, key_dim, value_dim))
    like = lambda a: jax.ShapeDtypeStruct(a.shape, _F32)
    return pl.pallas_call(
        _backward_kernel, name=KERNEL_NAMES["_backward_kernel"], grid=(batch, heads),
        in_specs=in_specs + [spec((key_dim, value_dim)), spec((chunk_size, value_dim)),
                             _state_spec(key_dim, value_dim)],
        out_specs=in_specs[:6] + [_state_spec(key_dim, value_dim)],
        out_shape=[like(a) for a in chunk_inputs[:6]] + [like(d_final_BHKV)],
        compiler_params=plgpu.CompilerParams(), interpret=interpret,
    )(*chunk_inputs, states_BNHKV, do_BNHCV, d_final_BHKV)
