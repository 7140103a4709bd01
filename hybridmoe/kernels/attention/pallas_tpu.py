"""Mosaic TPU driver of flash attention: three kernels over the block schedule of flash_block.py.

forward   grid (B, G, I, J): query block i of kv head g's folded rows ([R * block_q, A]: the R
          query heads reading g, one K/V fetch for all of them) against the j-th key block of its
          schedule; running max, sum and output in VMEM scratch; o and lse written at the last step.
dq        grid (B, G, I, J), the same walk; dq accumulated in VMEM, written once.
dk / dv   grid (B, G, J, I): key block j against the i-th query block of its schedule (keys x
          query rows, so the sum over rows is the sum over the group's query heads); dk and dv
          accumulated in VMEM, written once.
The inner axis is sequential ("arbitrary"); the others parallel. The schedules come in by scalar
prefetch (SMEM): the index maps fetch the scheduled block, so a SKIP block is never fetched (past
the visible count the index repeats and the pipeline fetches nothing), and the kernel body runs
the FULL (no mask) or PARTIAL (masked) variant of the block math, or nothing.

Layouts (every block's last two dims are full dims or (8, 128)-aligned, as Mosaic asks): q, do, o,
dq [B, G, R, T, A] with block (R, block_q, A), read as [R * block_q, A]; k, v, dk, dv [B, G, S, A];
ids [B, blocks, 2, width] (positions, segment ids; the query block's repeated R times); lse and
delta [B, G, I, 2, R * block_q] (per folded row). Per-row values are columns inside the kernel; a
row read from HBM becomes a column by expand_dims, a column becomes a row for the lse store by a
masked sublane reduction (no transpose).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import limits
from hybridmoe.kernels.vmem import tpu_bytes, tpu_limit_bytes

F32 = jnp.float32
KERNEL_NAMES = ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv")


def _column(ids_ref, k: int):
    """Row k of a [2, width] ref as a column [width, 1]."""
    return jnp.expand_dims(ids_ref[k], -1)


def _row(ids_ref, k: int):
    return ids_ref[pl.ds(k, 1), :]


def _store_column_as_row(x_col, out_ref):
    """out_ref[0, :] = x_col[:, 0], 128 rows at a time through a masked sublane reduction."""
    rows = x_col.shape[0]
    chunk = 128 if rows % 128 == 0 else rows
    eye = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0) == lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    for start in range(0, rows, chunk):
        part = x_col[start:start + chunk]
        out_ref[:, pl.ds(start, chunk)] = jnp.sum(jnp.where(eye, part, 0.0), axis=0, keepdims=True)


def _at(table_ref, b, outer, inner, num_outer: int, num_inner: int):
    return table_ref[(b * num_outer + outer) * num_inner + inner]


def _forward_kernel(order_ref, count_ref, cls_ref, q_ref, k_ref, v_ref, q_ids_ref, kv_ids_ref, o_ref, lse_ref,
                    m_scratch, l_scratch, acc_scratch, *, scale, nq, nk):
    b, i, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    R, block_q, A = q_ref.shape

    @pl.when(n == 0)
    def _():
        m_scratch[...], l_scratch[...], acc_scratch[...] = fb.forward_init(R * block_q, A)

    run = n < count_ref[b * nq + i]
    cls = _at(cls_ref, b, i, n, nq, nk)

    def step(masked: bool):
        mask = (fb.visible(_column(q_ids_ref, 0), _column(q_ids_ref, 1), _row(kv_ids_ref, 0), _row(kv_ids_ref, 1))
                if masked else None)
        m_scratch[...], l_scratch[...], acc_scratch[...] = fb.forward_block(
            q_ref[...].reshape(R * block_q, A), k_ref[...], v_ref[...], mask,
            (m_scratch[...], l_scratch[...], acc_scratch[...]), scale)

    pl.when(run & (cls == fb.FULL))(lambda: step(False))
    pl.when(run & (cls != fb.FULL))(lambda: step(True))

    @pl.when(n == nk - 1)
    def _():
        o, lse = fb.forward_finish((m_scratch[...], l_scratch[...], acc_scratch[...]))
        o_ref[...] = o.reshape(R, block_q, A).astype(o_ref.dtype)
        _store_column_as_row(lse, lse_ref)


def _dq_kernel(order_ref, count_ref, cls_ref, q_ref, k_ref, v_ref, do_ref, q_ids_ref, kv_ids_ref, stats_ref,
               dq_ref, dq_scratch, *, scale, nq, nk):
    b, i, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    R, block_q, A = q_ref.shape

    @pl.when(n == 0)
    def _():
        dq_scratch[...] = jnp.zeros_like(dq_scratch)

    run = n < count_ref[b * nq + i]
    cls = _at(cls_ref, b, i, n, nq, nk)

    def step(masked: bool):
        mask = (fb.visible(_column(q_ids_ref, 0), _column(q_ids_ref, 1), _row(kv_ids_ref, 0), _row(kv_ids_ref, 1))
                if masked else None)
        rows = R * block_q
        dq_scratch[...] += fb.dq_block(q_ref[...].reshape(rows, A), k_ref[...], v_ref[...],
                                       do_ref[...].reshape(rows, A), _column(stats_ref, 0), _column(stats_ref, 1),
                                       mask, scale)

    pl.when(run & (cls == fb.FULL))(lambda: step(False))
    pl.when(run & (cls != fb.FULL))(lambda: step(True))

    @pl.when(n == nk - 1)
    def _():
        dq_ref[...] = dq_scratch[...].reshape(R, block_q, A).astype(dq_ref.dtype)


def _dkv_kernel(order_ref, count_ref, cls_ref, q_ref, k_ref, v_ref, do_ref, q_ids_ref, kv_ids_ref, stats_ref,
                dk_ref, dv_ref, dk_scratch, dv_scratch, *, scale, nq, nk):
    b, j, n = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    R, block_q, A = q_ref.shape

    @pl.when(n == 0)
    def _():
        dk_scratch[...] = jnp.zeros_like(dk_scratch)
        dv_scratch[...] = jnp.zeros_like(dv_scratch)

    run = n < count_ref[b * nk + j]
    cls = _at(cls_ref, b, j, n, nk, nq)

    def step(masked: bool):
        mask_t = (fb.visible(_row(q_ids_ref, 0), _row(q_ids_ref, 1), _column(kv_ids_ref, 0), _column(kv_ids_ref, 1))
                  if masked else None)
        rows = R * block_q
        dk, dv = fb.dkv_block(k_ref[...], v_ref[...], q_ref[...].reshape(rows, A), do_ref[...].reshape(rows, A),
                              _row(stats_ref, 0), _row(stats_ref, 1), mask_t, scale)
        dk_scratch[...] += dk
        dv_scratch[...] += dv

    pl.when(run & (cls == fb.FULL))(lambda: step(False))
    pl.when(run & (cls != fb.FULL))(lambda: step(True))

    @pl.when(n == nq - 1)
    def _():
        dk_ref[...] = dk_scratch[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def visited_blocks(T: int, S: int, block_q: int, block_k: int, query_runs=None) -> int:
    """Query x key blocks the schedule visits, as the cost estimate counts them: causal blocks (key
    block j for query block i when its first key is at or before the block's last query) where the
    queries' global positions are known statically: with as many keys as queries, one document in
    position order; under context parallelism, `query_runs` ((start, length) of each run of this
    rank's queries among the S keys, the layout the caller built); otherwise every block. The real
    schedule is data (documents skip more blocks); this is the static count a compiler can see."""
    nq, nk = T // block_q, S // block_k
    if query_runs is None and T == S:
        query_runs = ((0, T),)
    if query_runs is None or sum(n for _, n in query_runs) != T or any(n % block_q for _, n in query_runs):
        return nq * nk
    return sum(min(nk, -(-(start + (i + 1) * block_q) // block_k))
               for start, n in query_runs for i in range(n // block_q))


def cost(kernel: str, B: int, G: int, R: int, T: int, S: int, A: int, block_q: int, block_k: int,
         itemsize: int, query_runs=None) -> pl.CostEstimate:
    """The kernels' stated cost: per visited block of R x block_q query rows and block_k keys, the
    forward's 2 matmuls (q k^T, p v), dq's 3 (q k^T, do v^T, ds k), dk/dv's 4 (k q^T, p^T do,
    v do^T, ds^T q), 2 R block_q block_k A FLOPs each, one exp per score; bytes: the outer block's
    rows once, the inner operand's blocks once per visit, the outputs once."""
    matmuls = {"flash_attention_forward": 2, "flash_attention_dq": 3, "flash_attention_dkv": 4}[kernel]
    blocks = B * G * visited_blocks(T, S, block_q, block_k, query_runs)
    flops = matmuls * 2 * R * block_q * block_k * A * blocks
    q_rows, kv_rows = B * G * R * T * A * itemsize, B * G * S * A * itemsize
    if kernel == "flash_attention_forward":  # q in, o out once; k, v per visit
        nbytes = 2 * q_rows + blocks * 2 * block_k * A * itemsize + B * G * R * T * 4
    elif kernel == "flash_attention_dq":  # q, do in, dq out once; k, v per visit
        nbytes = 3 * q_rows + blocks * 2 * block_k * A * itemsize + B * G * R * T * 8
    else:  # k, v in, dk, dv out once; q, do and the row stats per visit
        nbytes = 4 * kv_rows + blocks * (2 * R * block_q * A * itemsize + R * block_q * 8)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(R * block_q * block_k * blocks),
                           bytes_accessed=int(nbytes))


def _call(kernel, name, grid, in_specs, out_specs, out_shape, scratch, interpret, cost_estimate=None,
          vmem_limit_mib: float = 0.0, vmem_need_bytes: int | None = None):
    return pl.pallas_call(
        kernel, name=name, out_shape=out_shape, interpret=interpret, cost_estimate=cost_estimate,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=tpu_limit_bytes(vmem_limit_mib, vmem_need_bytes)))


def _vmem_need(name: str, q_BGRTA, block_q: int, block_k: int, grad_dtype=None) -> int:
    """The kernel's VMEM need at its blocks (limits.tpu_buffers), which `auto` asks for."""
    _, _, R, _, A = q_BGRTA.shape
    return tpu_bytes(limits.tpu_buffers(name, block_q=block_q, block_k=block_k, group=R, head_dim=A,
                                        itemsize=jnp.dtype(q_BGRTA.dtype).itemsize,
                                        grad_itemsize=grad_dtype and jnp.dtype(grad_dtype).itemsize))


def _check_blocks(block_q: int, block_k: int, T: int, S: int, interpret: bool):
    rule = limits.block_rule("pallas_tpu", hardware=not interpret)
    for name, block, length, what in (("block_q", block_q, T, "queries"), ("block_k", block_k, S, "keys")):
        problem = limits.block_problem(name, block, length, what, rule)
        if problem:
            raise ValueError(f"flash attention pallas_tpu: {problem}")


def forward(q_BGRTA, k_BGSA, v_BGSA, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, *, scale: float, block_q: int,
            block_k: int, interpret: bool = False, vmem_limit_mib: float = 0.0, query_runs=None):
    """(o [B, G, R, T, A] in q's dtype, lse [B, G, R, T] float32). query_runs: the queries' global
    positions where the caller knows them (visited_blocks; the stated cost only)."""
    B, G, R, T, A = q_BGRTA.shape
    S = k_BGSA.shape[2]
    _check_blocks(block_q, block_k, T, S, interpret)
    nq, nk, rows = T // block_q, S // block_k, R * block_q
    by_q, _ = fb.schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q, block_k)
    q_ids, kv_ids = fb.id_blocks(q_pos_BT, q_seg_BT, block_q, R), fb.id_blocks(kv_pos_BS, kv_seg_BS, block_k)
    key = lambda b, i, n, order, *_: order[(b * nq + i) * nk + n]  # noqa: E731
    q_spec = pl.BlockSpec((None, None, R, block_q, A), lambda b, g, i, n, *_: (b, g, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, A), lambda b, g, i, n, *pf: (b, g, key(b, i, n, *pf), 0))
    in_specs = [q_spec, kv_spec, kv_spec,
                pl.BlockSpec((None, None, 2, rows), lambda b, g, i, n, *_: (b, i, 0, 0)),
                pl.BlockSpec((None, None, 2, block_k), lambda b, g, i, n, *pf: (b, key(b, i, n, *pf), 0, 0))]
    out_specs = [q_spec, pl.BlockSpec((None, None, None, 1, rows), lambda b, g, i, n, *_: (b, g, i, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct(q_BGRTA.shape, q_BGRTA.dtype), jax.ShapeDtypeStruct((B, G, nq, 1, rows), F32)]
    scratch = [pltpu.VMEM((rows, 1), F32), pltpu.VMEM((rows, 1), F32), pltpu.VMEM((rows, A), F32)]
    kernel = functools.partial(_forward_kernel, scale=scale, nq=nq, nk=nk)
    estimate = cost(KERNEL_NAMES[0], B, G, R, T, S, A, block_q, block_k, jnp.dtype(q_BGRTA.dtype).itemsize,
                    query_runs)
    o, lse = _call(kernel, KERNEL_NAMES[0], (B, G, nq, nk), in_specs, out_specs, out_shape, scratch, interpret,
                   estimate, vmem_limit_mib, _vmem_need(KERNEL_NAMES[0], q_BGRTA, block_q, block_k))(
        *fb.flat_schedule(by_q), q_BGRTA, k_BGSA, v_BGSA, q_ids, kv_ids)
    return o, fb.blocks_to_rows(lse[:, :, :, 0], R)


def backward(q_BGRTA, k_BGSA, v_BGSA, do_BGRTA, lse_BGRT, delta_BGRT, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, *,
             scale: float, block_q: int, block_k: int, grad_dtypes=(F32, F32, F32), interpret: bool = False,
             vmem_limit_mib: float = 0.0, query_runs=None):
    """(dq [B, G, R, T, A], dk [B, G, S, A], dv [B, G, S, A]) in grad_dtypes, given the global lse
    and delta = rowsum(do * o)."""
    B, G, R, T, A = q_BGRTA.shape
    S = k_BGSA.shape[2]
    _check_blocks(block_q, block_k, T, S, interpret)
    nq, nk, rows = T // block_q, S // block_k, R * block_q
    by_q, by_k = fb.schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q, block_k)
    q_ids, kv_ids = fb.id_blocks(q_pos_BT, q_seg_BT, block_q, R), fb.id_blocks(kv_pos_BS, kv_seg_BS, block_k)
    stats = jnp.stack([fb.rows_to_blocks(lse_BGRT, block_q), fb.rows_to_blocks(delta_BGRT, block_q)], axis=3)
    inputs = (q_BGRTA, k_BGSA, v_BGSA, do_BGRTA, q_ids, kv_ids, stats)
    dq_dtype, dk_dtype, dv_dtype = grad_dtypes

    # dq: outer query block i, inner the n-th key block of its schedule.
    key = lambda b, i, n, order, *_: order[(b * nq + i) * nk + n]  # noqa: E731
    q_spec = pl.BlockSpec((None, None, R, block_q, A), lambda b, g, i, n, *_: (b, g, 0, i, 0))
    kv_spec = pl.BlockSpec((None, None, block_k, A), lambda b, g, i, n, *pf: (b, g, key(b, i, n, *pf), 0))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec,
                pl.BlockSpec((None, None, 2, rows), lambda b, g, i, n, *_: (b, i, 0, 0)),
                pl.BlockSpec((None, None, 2, block_k), lambda b, g, i, n, *pf: (b, key(b, i, n, *pf), 0, 0)),
                pl.BlockSpec((None, None, None, 2, rows), lambda b, g, i, n, *_: (b, g, i, 0, 0))]
    dq = _call(functools.partial(_dq_kernel, scale=scale, nq=nq, nk=nk), KERNEL_NAMES[1], (B, G, nq, nk), in_specs,
               q_spec, jax.ShapeDtypeStruct(q_BGRTA.shape, dq_dtype), [pltpu.VMEM((rows, A), F32)], interpret,
               cost(KERNEL_NAMES[1], B, G, R, T, S, A, block_q, block_k, jnp.dtype(q_BGRTA.dtype).itemsize,
                    query_runs),
               vmem_limit_mib, _vmem_need(KERNEL_NAMES[1], q_BGRTA, block_q, block_k, dq_dtype))(
        *fb.flat_schedule(by_q), *inputs)

    # dk, dv: outer key block j, inner the n-th query block of its schedule.
    query = lambda b, j, n, order, *_: order[(b * nk + j) * nq + n]  # noqa: E731
    q_spec = pl.BlockSpec((None, None, R, block_q, A), lambda b, g, j, n, *pf: (b, g, 0, query(b, j, n, *pf), 0))
    kv_spec = pl.BlockSpec((None, None, block_k, A), lambda b, g, j, n, *_: (b, g, j, 0))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec,
                pl.BlockSpec((None, None, 2, rows), lambda b, g, j, n, *pf: (b, query(b, j, n, *pf), 0, 0)),
                pl.BlockSpec((None, None, 2, block_k), lambda b, g, j, n, *_: (b, j, 0, 0)),
                pl.BlockSpec((None, None, None, 2, rows), lambda b, g, j, n, *pf: (b, g, query(b, j, n, *pf), 0, 0))]
    dk, dv = _call(functools.partial(_dkv_kernel, scale=scale, nq=nq, nk=nk), KERNEL_NAMES[2], (B, G, nk, nq),
                   in_specs, [kv_spec, kv_spec],
                   [jax.ShapeDtypeStruct(k_BGSA.shape, dk_dtype), jax.ShapeDtypeStruct(v_BGSA.shape, dv_dtype)],
                   [pltpu.VMEM((block_k, A), F32), pltpu.VMEM((block_k, A), F32)], interpret,
                   cost(KERNEL_NAMES[2], B, G, R, T, S, A, block_q, block_k, jnp.dtype(q_BGRTA.dtype).itemsize,
                        query_runs),
                   vmem_limit_mib, _vmem_need(KERNEL_NAMES[2], q_BGRTA, block_q, block_k, dk_dtype))(
        *fb.flat_schedule(by_k), *inputs)
    return dq, dk, dv
