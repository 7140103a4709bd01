"""Triton (Pallas GPU) driver of flash attention: three kernels over the block schedule of
flash_block.py, the same per-block math as the XLA and Mosaic drivers.

forward   grid (B, N, I): one query head's query block i ([block_q, A]) loops over the key blocks
          of its schedule (a fori_loop of `count` trips: skipped blocks are never read); running
          max, sum and output as the loop carry; o and lse written once.
dq        grid (B, N, I), the same walk; dq the carry, written once.
dk / dv   grid (B, G, J): key block j of kv head g loops over its group's R query heads and, for
          each, the query blocks of its schedule; dk and dv the carry (the sum over the group's
          heads happens here, in the loop), written once.
Triton programs run in parallel and keep nothing between grid steps, so each inner walk is a loop
inside one program (the TPU driver's sequential grid axis). No atomics: every output block has
one writer. FULL pairs run the block math unmasked, PARTIAL ones masked (lax.cond on the pair's
class, read from the schedule with the block index).

Layouts: q, do, o, dq [B, G, R, T, A] (a program sees one head's [T, A] and slices its blocks);
k, v, dk, dv [B, G, S, A]; positions and segment ids [B, T] / [B, S]; lse and delta [B, G, R, T];
the schedules flat int32 (order and class [B, outer, inner], count [B, outer]). Triton wants
power-of-two block shapes: block_q, block_k and the head dim powers of two (>= 16 for tl.dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import limits

F32 = jnp.float32
KERNEL_NAMES = ("flash_attention_forward_gpu", "flash_attention_dq_gpu", "flash_attention_dkv_gpu")


def _masked_or_full(cls, run_block):
    """run_block(masked) for a PARTIAL pair, run_block(False) for a FULL one."""
    return lax.cond(cls == fb.FULL, lambda: run_block(False), lambda: run_block(True))


def _forward_kernel(order_ref, count_ref, cls_ref, q_ref, k_ref, v_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref,
                    o_ref, lse_ref, *, scale, nq, nk, block_q, block_k):
    b, i = pl.program_id(0), pl.program_id(2)
    q = q_ref[pl.ds(i * block_q, block_q), :]
    q_pos = q_pos_ref[pl.ds(i * block_q, block_q)][:, None]
    q_seg = q_seg_ref[pl.ds(i * block_q, block_q)][:, None]
    at = (b * nq + i) * nk

    def key_block(n, carry):
        j = order_ref[at + n]
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]

        def run(masked):
            mask = fb.visible(q_pos, q_seg, kv_pos_ref[keys][None, :], kv_seg_ref[keys][None, :]) if masked else None
            return fb.forward_block(q, k, v, mask, carry, scale)

        return _masked_or_full(cls_ref[at + n], run)

    carry = lax.fori_loop(0, count_ref[b * nq + i], key_block, fb.forward_init(block_q, q.shape[-1]))
    o, lse = fb.forward_finish(carry)
    o_ref[pl.ds(i * block_q, block_q), :] = o.astype(o_ref.dtype)
    lse_ref[pl.ds(i * block_q, block_q)] = lse[:, 0]


def _dq_kernel(order_ref, count_ref, cls_ref, q_ref, k_ref, v_ref, do_ref, q_pos_ref, q_seg_ref, kv_pos_ref,
               kv_seg_ref, lse_ref, delta_ref, dq_ref, *, scale, nq, nk, block_q, block_k):
    b, i = pl.program_id(0), pl.program_id(2)
    rows = pl.ds(i * block_q, block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    lse, delta = lse_ref[rows][:, None], delta_ref[rows][:, None]
    q_pos, q_seg = q_pos_ref[rows][:, None], q_seg_ref[rows][:, None]
    at = (b * nq + i) * nk

    def key_block(n, dq):
        j = order_ref[at + n]
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]

        def run(masked):
            mask = fb.visible(q_pos, q_seg, kv_pos_ref[keys][None, :], kv_seg_ref[keys][None, :]) if masked else None
            return dq + fb.dq_block(q, k, v, do, lse, delta, mask, scale)

        return _masked_or_full(cls_ref[at + n], run)

    dq = lax.fori_loop(0, count_ref[b * nq + i], key_block, jnp.zeros(q.shape, F32))
    dq_ref[rows, :] = dq.astype(dq_ref.dtype)


def _dkv_kernel(order_ref, count_ref, cls_ref, q_ref, k_ref, v_ref, do_ref, q_pos_ref, q_seg_ref, kv_pos_ref,
                kv_seg_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, nq, nk, block_q, block_k, group):
    b, j = pl.program_id(0), pl.program_id(2)
    keys = pl.ds(j * block_k, block_k)
    k, v = k_ref[keys, :], v_ref[keys, :]
    kv_pos, kv_seg = kv_pos_ref[keys][:, None], kv_seg_ref[keys][:, None]  # columns: keys x query rows
    at = (b * nk + j) * nq

    def query_block(n, dkv):
        i = order_ref[at + n]
        rows = pl.ds(i * block_q, block_q)
        q_pos, q_seg = q_pos_ref[rows][None, :], q_seg_ref[rows][None, :]

        def head(r, dkv):
            q, do = q_ref[r, rows, :], do_ref[r, rows, :]
            lse, delta = lse_ref[r, rows][None, :], delta_ref[r, rows][None, :]

            def run(masked):
                mask_t = fb.visible(q_pos, q_seg, kv_pos, kv_seg) if masked else None
                dk, dv = fb.dkv_block(k, v, q, do, lse, delta, mask_t, scale)
                return dkv[0] + dk, dkv[1] + dv

            return _masked_or_full(cls_ref[at + n], run)

        # The group's query heads (fb.query_heads_of: rows r of kv head g) summed into this kv head.
        return lax.fori_loop(0, group, head, dkv)

    zeros = jnp.zeros(k.shape, F32)
    dk, dv = lax.fori_loop(0, count_ref[b * nk + j], query_block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _check(block_q: int, block_k: int, T: int, S: int, head_dim: int, interpret: bool):
    rule = limits.block_rule("pallas_gpu", hardware=not interpret)
    problems = [limits.block_problem(name, block, length, what, rule)
                for name, block, length, what in (("block_q", block_q, T, "queries"), ("block_k", block_k, S, "keys"))]
    problems.append(limits.head_dim_problem(head_dim, "pallas_gpu", hardware=not interpret))
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"flash attention pallas_gpu: {'; '.join(problems)}")


def _head_spec(R: int, T: int, A: int):
    """One query head's [T, A] of a [B, G, R, T, A] array, on grid (B, N, I)."""
    return pl.BlockSpec((None, None, None, T, A), lambda b, n, i: (b, n // R, n % R, 0, 0))


def _call(kernel, name, grid, in_specs, out_specs, out_shape, interpret):
    return pl.pallas_call(kernel, name=name, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=plgpu.CompilerParams(), interpret=interpret)


def forward(q_BGRTA, k_BGSA, v_BGSA, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, *, scale: float, block_q: int,
            block_k: int, interpret: bool = False):
    """(o [B, G, R, T, A] in q's dtype, lse [B, G, R, T] float32)."""
    B, G, R, T, A = q_BGRTA.shape
    S = k_BGSA.shape[2]
    _check(block_q, block_k, T, S, A, interpret)
    nq, nk = T // block_q, S // block_k
    by_q, _ = fb.schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q, block_k)
    flat = lambda n: pl.BlockSpec((n,), lambda b, h, i: (0,))  # noqa: E731
    kv_spec = pl.BlockSpec((None, None, S, A), lambda b, n, i: (b, n // R, 0, 0))
    q_ids, kv_ids = (pl.BlockSpec((None, L), lambda b, n, i: (b, 0)) for L in (T, S))
    lse_spec = pl.BlockSpec((None, None, None, T), lambda b, n, i: (b, n // R, n % R, 0))
    in_specs = [flat(B * nq * nk), flat(B * nq), flat(B * nq * nk), _head_spec(R, T, A), kv_spec, kv_spec,
                q_ids, q_ids, kv_ids, kv_ids]
    kernel = functools.partial(_forward_kernel, scale=scale, nq=nq, nk=nk, block_q=block_q, block_k=block_k)
    return _call(kernel, KERNEL_NAMES[0], (B, G * R, nq), in_specs, [_head_spec(R, T, A), lse_spec],
                 [jax.ShapeDtypeStruct(q_BGRTA.shape, q_BGRTA.dtype), jax.ShapeDtypeStruct((B, G, R, T), F32)],
                 interpret)(*fb.flat_schedule(by_q), q_BGRTA, k_BGSA, v_BGSA, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS)


def backward(q_BGRTA, k_BGSA, v_BGSA, do_BGRTA, lse_BGRT, delta_BGRT, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, *,
             scale: float, block_q: int, block_k: int, grad_dtypes=(F32, F32, F32), interpret: bool = False):
    """(dq [B, G, R, T, A], dk [B, G, S, A], dv [B, G, S, A]) in grad_dtypes, given the global lse
    and delta = rowsum(do * o)."""
    B, G, R, T, A = q_BGRTA.shape
    S = k_BGSA.shape[2]
    _check(block_q, block_k, T, S, A, interpret)
    nq, nk = T // block_q, S // block_k
    by_q, by_k = fb.schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q, block_k)
    inputs = (q_BGRTA, k_BGSA, v_BGSA, do_BGRTA, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, lse_BGRT.astype(F32),
              delta_BGRT.astype(F32))
    dq_dtype, dk_dtype, dv_dtype = grad_dtypes
    flat = lambda n: pl.BlockSpec((n,), lambda b, h, x: (0,))  # noqa: E731
    ids = lambda L: pl.BlockSpec((None, L), lambda b, h, x: (b, 0))  # noqa: E731

    # dq: grid (B, N, I), one query head's block i against the key blocks of its schedule.
    kv_spec = pl.BlockSpec((None, None, S, A), lambda b, n, i: (b, n // R, 0, 0))
    stats = pl.BlockSpec((None, None, None, T), lambda b, n, i: (b, n // R, n % R, 0))
    in_specs = [flat(B * nq * nk), flat(B * nq), flat(B * nq * nk), _head_spec(R, T, A), kv_spec, kv_spec,
                _head_spec(R, T, A), ids(T), ids(T), ids(S), ids(S), stats, stats]
    kernel = functools.partial(_dq_kernel, scale=scale, nq=nq, nk=nk, block_q=block_q, block_k=block_k)
    dq = _call(kernel, KERNEL_NAMES[1], (B, G * R, nq), in_specs, _head_spec(R, T, A),
               jax.ShapeDtypeStruct(q_BGRTA.shape, dq_dtype), interpret)(*fb.flat_schedule(by_q), *inputs)

    # dk, dv: grid (B, G, J), key block j against the group's heads' query blocks of its schedule.
    group_spec = pl.BlockSpec((None, None, R, T, A), lambda b, g, j: (b, g, 0, 0, 0))
    kv_block = pl.BlockSpec((None, None, S, A), lambda b, g, j: (b, g, 0, 0))
    group_stats = pl.BlockSpec((None, None, R, T), lambda b, g, j: (b, g, 0, 0))
    in_specs = [flat(B * nk * nq), flat(B * nk), flat(B * nk * nq), group_spec, kv_block, kv_block, group_spec,
                ids(T), ids(T), ids(S), ids(S), group_stats, group_stats]
    out_block = pl.BlockSpec((None, None, block_k, A), lambda b, g, j: (b, g, j, 0))
    kernel = functools.partial(_dkv_kernel, scale=scale, nq=nq, nk=nk, block_q=block_q, block_k=block_k, group=R)
    dk, dv = _call(kernel, KERNEL_NAMES[2], (B, G, nk), in_specs, [out_block, out_block],
                   [jax.ShapeDtypeStruct(k_BGSA.shape, dk_dtype), jax.ShapeDtypeStruct(v_BGSA.shape, dv_dtype)],
                   interpret)(*fb.flat_schedule(by_k), *inputs)
    return dq, dk, dv
