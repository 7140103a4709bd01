"""Masked grouped-query attention in plain XLA ops.

Shape legend: B batch, T query tokens, S key tokens, N query heads, G key/value heads,
A head dim. Queries attend to keys with kv_pos <= q_pos in the same segment (packed documents;
a decode step passes its cache positions). Softmax in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.kernels.attention import flash_block as fb


def attention(q_BTNA, k_BSGA, v_BSGA, *, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale: float):
    B, T, N, A = q_BTNA.shape
    G = k_BSGA.shape[2]
    q_BTGRA = q_BTNA.reshape(B, T, G, N // G, A)
    s_BGRTS = jnp.einsum("btgra,bsga->bgrts", q_BTGRA, k_BSGA,
                         preferred_element_type=jnp.float32) * scale
    ok_BTS = (kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None]) & (kv_seg_BS[:, None, :] == q_seg_BT[:, :, None])
    s_BGRTS = jnp.where(ok_BTS[:, None, None], s_BGRTS, -jnp.inf)
    # A query with no visible key (padding) would give NaN from an all -inf row: give it zeros.
    any_BTS = jnp.any(ok_BTS, axis=-1)[:, None, None, :, None]
    p = jax.nn.softmax(jnp.where(any_BTS, s_BGRTS, 0.0), axis=-1)
    p = jnp.where(any_BTS & ok_BTS[:, None, None], p, 0.0)
    o_BTGRA = jnp.einsum("bgrts,bsga->btgra", p.astype(v_BSGA.dtype), v_BSGA,
                         preferred_element_type=jnp.float32)
    return o_BTGRA.reshape(B, T, N, A).astype(q_BTNA.dtype)


# ---------------------------------------------------------------------------------------------
# Flash attention in plain XLA ops: the backend `xla` of ops.flash_attention (the CPU path and the
# oracle the Pallas drivers are checked against). Query heads grouped under their kv head
# ([B, G, R, T, A], flash_block.group_heads); the R heads of a group fold into the rows of a query
# block. A sequential map over (batch row, query block) runs a while loop over the key blocks of
# its schedule (flash_block.schedule: fully masked blocks are never visited, fully visible ones are
# not masked); the backward's dq pass does the same, its dk/dv pass maps over key blocks and loops
# over their query blocks. Live memory: one block pair's [G, R * block_q, block_k] scores, never
# [T, S].


def _query_block(x_BGRTA, b, i, block_q: int):
    """[G, R * block_q, A]: query block i of batch row b, the group's heads folded into rows."""
    G, R, _, A = x_BGRTA.shape[1:]
    x = jax.lax.dynamic_slice_in_dim(x_BGRTA[b], i * block_q, block_q, axis=2)
    return x.reshape(G, R * block_q, x.shape[-1])


def _key_block(x_BGSA, b, j, block_k: int):
    return jax.lax.dynamic_slice_in_dim(x_BGSA[b], j * block_k, block_k, axis=1)


def _unfold(x_QGWA, B: int, R: int):
    """[B * I, G, R * block_q, ...] (one entry per query block) -> [B, G, R, T, ...]."""
    BI, G, W = x_QGWA.shape[:3]
    x = x_QGWA.reshape(B, BI // B, G, R, W // R, *x_QGWA.shape[3:])
    x = jnp.moveaxis(x, 1, 3)  # [B, G, R, I, block_q, ...]
    return x.reshape(B, G, R, (BI // B) * (W // R), *x_QGWA.shape[3:])


def flash_forward(q_BGRTA, k_BGSA, v_BGSA, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, *, scale: float,
                  block_q: int, block_k: int):
    """(o [B, G, R, T, A] in q's dtype, lse [B, G, R, T] float32)."""
    B, G, R, T, A = q_BGRTA.shape
    nq = T // block_q
    by_q, _ = fb.schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q, block_k)
    q_ids, kv_ids = fb.id_blocks(q_pos_BT, q_seg_BT, block_q, R), fb.id_blocks(kv_pos_BS, kv_seg_BS, block_k)
    varying = (q_BGRTA, k_BGSA, v_BGSA, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS)

    def query_block(bi):
        b, i = bi // nq, bi % nq
        q = _query_block(q_BGRTA, b, i, block_q)
        q_pos, q_seg = q_ids[b, i, 0][:, None], q_ids[b, i, 1][:, None]

        def key_block(n, carry):
            j = by_q.order[b, i, n]
            k, v = _key_block(k_BGSA, b, j, block_k), _key_block(v_BGSA, b, j, block_k)
            kv_pos, kv_seg = kv_ids[b, j, 0][None, :], kv_ids[b, j, 1][None, :]
            return jax.lax.cond(
                by_q.cls[b, i, n] == fb.FULL,
                lambda c: fb.forward_block(q, k, v, None, c, scale),
                lambda c: fb.forward_block(q, k, v, fb.visible(q_pos, q_seg, kv_pos, kv_seg), c, scale), carry)

        init = fb.vary_like(fb.forward_init(R * block_q, A, (G,)), *varying)
        carry = jax.lax.fori_loop(0, by_q.count[b, i], key_block, init)
        o, lse = fb.forward_finish(carry)
        return o.astype(q_BGRTA.dtype), lse[..., 0]

    o, lse = jax.lax.map(query_block, jnp.arange(B * nq))
    return _unfold(o, B, R), _unfold(lse, B, R)


def flash_backward(q_BGRTA, k_BGSA, v_BGSA, do_BGRTA, lse_BGRT, delta_BGRT, q_pos_BT, q_seg_BT, kv_pos_BS,
                   kv_seg_BS, *, scale: float, block_q: int, block_k: int,
                   grad_dtypes=(jnp.float32, jnp.float32, jnp.float32)):
    """(dq [B, G, R, T, A], dk [B, G, S, A], dv [B, G, S, A]) in grad_dtypes, given the global lse
    and delta = rowsum(do * o)."""
    B, G, R, T, A = q_BGRTA.shape
    S = k_BGSA.shape[2]
    nq, nk = T // block_q, S // block_k
    by_q, by_k = fb.schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q, block_k)
    q_ids, kv_ids = fb.id_blocks(q_pos_BT, q_seg_BT, block_q, R), fb.id_blocks(kv_pos_BS, kv_seg_BS, block_k)
    lse_BGIW, delta_BGIW = fb.rows_to_blocks(lse_BGRT, block_q), fb.rows_to_blocks(delta_BGRT, block_q)
    varying = (q_BGRTA, k_BGSA, v_BGSA, do_BGRTA, lse_BGRT, delta_BGRT, q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS)

    def dq_query_block(bi):
        b, i = bi // nq, bi % nq
        q, do = _query_block(q_BGRTA, b, i, block_q), _query_block(do_BGRTA, b, i, block_q)
        lse, delta = lse_BGIW[b, :, i][..., None], delta_BGIW[b, :, i][..., None]  # [G, rows, 1]
        q_pos, q_seg = q_ids[b, i, 0][:, None], q_ids[b, i, 1][:, None]

        def key_block(n, dq):
            j = by_q.order[b, i, n]
            k, v = _key_block(k_BGSA, b, j, block_k), _key_block(v_BGSA, b, j, block_k)
            kv_pos, kv_seg = kv_ids[b, j, 0][None, :], kv_ids[b, j, 1][None, :]
            return dq + jax.lax.cond(
                by_q.cls[b, i, n] == fb.FULL,
                lambda: fb.dq_block(q, k, v, do, lse, delta, None, scale),
                lambda: fb.dq_block(q, k, v, do, lse, delta, fb.visible(q_pos, q_seg, kv_pos, kv_seg), scale))

        zeros = fb.vary_like(jnp.zeros((G, R * block_q, A), jnp.float32), *varying)
        return jax.lax.fori_loop(0, by_q.count[b, i], key_block, zeros)

    def dkv_key_block(bj):
        b, j = bj // nk, bj % nk
        k, v = _key_block(k_BGSA, b, j, block_k), _key_block(v_BGSA, b, j, block_k)
        kv_pos, kv_seg = kv_ids[b, j, 0][:, None], kv_ids[b, j, 1][:, None]  # columns

        def query_block(n, dkv):
            i = by_k.order[b, j, n]
            q, do = _query_block(q_BGRTA, b, i, block_q), _query_block(do_BGRTA, b, i, block_q)
            lse, delta = lse_BGIW[b, :, i][:, None, :], delta_BGIW[b, :, i][:, None, :]  # [G, 1, rows]
            q_pos, q_seg = q_ids[b, i, 0][None, :], q_ids[b, i, 1][None, :]
            dk, dv = jax.lax.cond(
                by_k.cls[b, j, n] == fb.FULL,
                lambda: fb.dkv_block(k, v, q, do, lse, delta, None, scale),
                lambda: fb.dkv_block(k, v, q, do, lse, delta, fb.visible(q_pos, q_seg, kv_pos, kv_seg), scale))
            return dkv[0] + dk, dkv[1] + dv

        zeros = fb.vary_like(jnp.zeros((G, block_k, A), jnp.float32), *varying)
        return jax.lax.fori_loop(0, by_k.count[b, j], query_block, (zeros, zeros))

    dq = _unfold(jax.lax.map(dq_query_block, jnp.arange(B * nq)), B, R)
    dk, dv = jax.lax.map(dkv_key_block, jnp.arange(B * nk))
    to_BGSA = lambda x: jnp.moveaxis(x.reshape(B, nk, G, block_k, A), 1, 2).reshape(B, G, S, A)  # noqa: E731
    return tuple(x.astype(dt) for x, dt in zip((dq, to_BGSA(dk), to_BGSA(dv)), grad_dtypes))
