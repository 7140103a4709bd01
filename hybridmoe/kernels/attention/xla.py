"""Masked grouped-query attention in plain XLA ops.

Shape legend: B batch, T query tokens, S key tokens, N query heads, G key/value heads,
A head dim. Queries attend to keys with kv_pos <= q_pos in the same segment (packed documents;
a decode step passes its cache positions). Softmax in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
