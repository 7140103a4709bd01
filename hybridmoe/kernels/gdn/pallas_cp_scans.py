"""The context-parallel scans of docs/gdn.md section 3 as Mosaic TPU kernels (gdn.cp_m_scan, gdn.cp_dh_scan).

A shard's transition product M_r = M_{N-1} ... M_0 (M_c = c I - K_bwd^T W) and its local state
cotangent dS_loc (the reverse recurrence dS_in = c dS_out + Q_dec^T dO - W^T (A^T dO + K_bwd dS_out)
from dS = 0 after the last chunk) are each one walk over the chunks, keeping one running [K, K]
product (or [K, V] cotangent) per head in VMEM scratch: they read the chunk terms once and form no
[N, H, K, K] stack (the tree form's cost). Grid (B, H / heads_per_step, N / chunks_per_step):
batch and head blocks "parallel", the chunk axis "arbitrary" (the dh scan walks it in reverse
through its index maps). A step holds `heads_per_step` heads x `chunks_per_step` chunks, unrolled:
the heads are independent chains, written product by product over all heads so that the MXU
pipelines them.

Every product is float32 (six bfloat16 passes, tpu_chunk.mxu): these are cross-chunk products
(docs/gdn.md keeps them float32), and the tests hold the scans to 1e-5 of a HIGHEST tree.

Inputs are xla.ChunkTerms ([B, N, H, C, K] and friends, float32), as the XLA scans take them;
a sequence that the step does not divide is padded with chunks that change nothing (W = K_bwd = 0,
decay 1; for dh also dO = 0).

VMEM: at Qwen3.5-397B's cell (C 64, K = V 128) and the defaults (8 heads x 2 chunks) the M scan's
blocks are 2 x 2 x 8 x 2 x 32 KiB (W, K_bwd) + the decays + 2 x 8 x 64 KiB out + 8 x 64 KiB scratch,
about 3.6 MiB; the dh scan adds A, Q_dec and dO (about 7 MiB): under v5e's 16 MiB default.

Dimension letters: B batch, N chunks, H value heads, C position in a chunk, K key dim, V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.gdn.pallas_tpu import carry
from hybridmoe.kernels.gdn.tpu_chunk import mxu

_F32 = jnp.float32
_NN, _TN = ((1,), (0,)), ((0,), (0,))
_FLOAT32 = 3  # bfloat16 parts per operand: float32 products
KERNEL_NAMES = {"m": "gdn_cp_m_scan", "dh": "gdn_cp_dh_scan"}
HEADS_PER_STEP, CHUNKS_PER_STEP = 8, 2


def _heads_per_step(heads: int) -> int:
    return max(d for d in range(1, min(heads, HEADS_PER_STEP) + 1) if heads % d == 0)


def _pad_chunks(a, pad: int, value=0.0):
    return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=value)


def _cost(macs_per_chunk_head: int, chunks: int, heads: int, batch: int, operands, result) -> pl.CostEstimate:
    """Every bfloat16 pass counted (six per float32 product); each operand and the result moved once."""
    nbytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in (*operands, result))
    return pl.CostEstimate(flops=int(2 * 6 * macs_per_chunk_head * chunks * heads * batch), transcendentals=0,
                           bytes_accessed=int(nbytes))


def _m_scan_kernel(w_ref, k_ref, decay_ref, m_out, m_scratch, *, chunks_per_step: int):
    heads, key_dim = m_scratch.shape[0], m_scratch.shape[1]
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _():
        row = jax.lax.broadcasted_iota(jnp.int32, (key_dim, key_dim), 0)
        col = jax.lax.broadcasted_iota(jnp.int32, (key_dim, key_dim), 1)
        for h in range(heads):
            m_scratch[h] = jnp.where(row == col, 1.0, 0.0)

    products = [m_scratch[h] for h in range(heads)]
    for c in range(chunks_per_step):  # M <- c M - K_bwd^T (W M): the chunk's transition applied on the left
        # Each product over all heads before the next: the heads' chains interleave on the MXU.
        w_m = [mxu(w_ref[c, h], products[h], _NN, _FLOAT32) for h in range(heads)]
        products = [decay_ref[c, h] * products[h] - mxu(k_ref[c, h], w_m[h], _TN, _FLOAT32) for h in range(heads)]
    carry(m_scratch, products, m_out)


def m_scan_product(t, *, interpret: bool = False):
    """M_r [B, H, K, K] of ChunkTerms t (context_parallel.cp_m_scan_product's kernel)."""
    batch, chunks, heads, size, key_dim = t.w.shape
    per_step, hb = CHUNKS_PER_STEP, _heads_per_step(heads)
    pad = -chunks % per_step
    w, k = _pad_chunks(t.w, pad), _pad_chunks(t.k_to_end, pad)
    decay = _pad_chunks(t.decay, pad, 1.0)[..., None, None]
    steps = (chunks + pad) // per_step
    block = lambda *tail: pl.BlockSpec((None, per_step, hb, *tail), lambda b, h, j: (b, j, h, 0, 0))  # noqa: E731
    out_shape = jax.ShapeDtypeStruct((batch, heads, key_dim, key_dim), _F32)
    return pl.pallas_call(
        functools.partial(_m_scan_kernel, chunks_per_step=per_step), name=KERNEL_NAMES["m"],
        grid=(batch, heads // hb, steps),
        in_specs=[block(size, key_dim), block(size, key_dim), block(1, 1)],
        out_specs=pl.BlockSpec((None, hb, key_dim, key_dim), lambda b, h, j: (b, h, 0, 0)),
        out_shape=out_shape, scratch_shapes=[pltpu.VMEM((hb, key_dim, key_dim), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(2 * size * key_dim * key_dim, chunks + pad, heads, batch, (w, k, decay), out_shape),
        interpret=interpret,
    )(w, k, decay)


def _dh_scan_kernel(do_ref, w_ref, attn_ref, q_ref, k_ref, decay_ref, d_out, d_scratch, *, chunks_per_step: int):
    heads = d_scratch.shape[0]
    step = pl.program_id(2)  # the step-th block from the end

    @pl.when(step == 0)
    def _():
        d_scratch[...] = jnp.zeros(d_scratch.shape, _F32)

    d_states = [d_scratch[h] for h in range(heads)]
    for c in reversed(range(chunks_per_step)):  # each product over all heads before the next
        local = [mxu(q_ref[c, h], do_ref[c, h], _TN, _FLOAT32) for h in range(heads)]
        attn_do = [mxu(attn_ref[c, h], do_ref[c, h], _TN, _FLOAT32) for h in range(heads)]
        d_v_new = [attn_do[h] + mxu(k_ref[c, h], d_states[h], _NN, _FLOAT32) for h in range(heads)]
        d_states = [decay_ref[c, h] * d_states[h] + local[h] - mxu(w_ref[c, h], d_v_new[h], _TN, _FLOAT32)
                    for h in range(heads)]
    carry(d_scratch, d_states, d_out)


def dh_scan_cotangent(t, do_BNHCV, *, interpret: bool = False):
    """dS_loc [B, H, K, V] of ChunkTerms t and the outputs' cotangent (cp_dh_scan_cotangent's kernel)."""
    batch, chunks, heads, size, key_dim = t.w.shape
    value_dim = do_BNHCV.shape[-1]
    per_step, hb = CHUNKS_PER_STEP, _heads_per_step(heads)
    pad = -chunks % per_step
    operands = (_pad_chunks(do_BNHCV.astype(_F32), pad), _pad_chunks(t.w, pad), _pad_chunks(t.attn, pad),
                _pad_chunks(t.q_decayed, pad), _pad_chunks(t.k_to_end, pad),
                _pad_chunks(t.decay, pad, 1.0)[..., None, None])
    steps = (chunks + pad) // per_step
    block = lambda *tail: pl.BlockSpec((None, per_step, hb, *tail),  # noqa: E731
                                       lambda b, h, j: (b, steps - 1 - j, h, 0, 0))
    out_shape = jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), _F32)
    macs = size * size * value_dim + 3 * size * key_dim * value_dim
    return pl.pallas_call(
        functools.partial(_dh_scan_kernel, chunks_per_step=per_step), name=KERNEL_NAMES["dh"],
        grid=(batch, heads // hb, steps),
        in_specs=[block(size, value_dim), block(size, key_dim), block(size, size), block(size, key_dim),
                  block(size, key_dim), block(1, 1)],
        out_specs=pl.BlockSpec((None, hb, key_dim, value_dim), lambda b, h, j: (b, h, 0, 0)),
        out_shape=out_shape, scratch_shapes=[pltpu.VMEM((hb, key_dim, value_dim), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(macs, chunks + pad, heads, batch, operands, out_shape),
        interpret=interpret,
    )(*operands)
