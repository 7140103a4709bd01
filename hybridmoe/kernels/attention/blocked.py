"""Causal self-attention in query blocks that skip the key blocks after them (XLA, for CPU).

Shape legend as in xla.py: B batch, T tokens (queries and keys are the same T), N query heads,
G key/value heads, A head dim; Q query blocks of T / Q tokens.

Query block i attends to keys [0, (i + 1) T / Q) only, through the same masked core as xla.py,
so the score matrix holds about half of the T x T entries (Q = 4: 10 / 16). Exact when keys after
a query are invisible to it, which holds for self-attention over packed rows (each document's
positions increase along the row; other documents are masked by segment) for every token of a
document. A padding token (segment 0, all at one position) sees only the padding before it here,
the full mask also the padding after it; nothing reads a padding token's output.
"""

from __future__ import annotations

import jax.numpy as jnp

from hybridmoe.kernels.attention.xla import attention

MIN_BLOCK = 64


def num_query_blocks(t: int, most: int = 4) -> int:
    """The most blocks (<= most, a power of two dividing T) of at least MIN_BLOCK tokens; 1 = no split."""
    q = most
    while q > 1 and (t % q or t // q < MIN_BLOCK):
        q //= 2
    return q


def causal_attention_blocked(q_BTNA, k_BSGA, v_BSGA, *, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS,
                             scale: float, num_blocks: int | None = None):
    """xla.attention's result for self-attention (S = T), skipping the fully masked key blocks."""
    T = q_BTNA.shape[1]
    if k_BSGA.shape[1] != T:
        raise ValueError(f"blocked causal attention is self-attention: {T} queries, {k_BSGA.shape[1]} keys")
    nq = num_query_blocks(T) if num_blocks is None else num_blocks
    if T % nq:
        raise ValueError(f"{nq} query blocks do not divide {T} tokens")
    b = T // nq
    outs = []
    for i in range(nq):
        q_sl, kv_sl = slice(i * b, (i + 1) * b), slice(0, (i + 1) * b)
        outs.append(attention(q_BTNA[:, q_sl], k_BSGA[:, kv_sl], v_BSGA[:, kv_sl],
                              q_pos_BT=q_pos_BT[:, q_sl], kv_pos_BS=kv_pos_BS[:, kv_sl],
                              q_seg_BT=q_seg_BT[:, q_sl], kv_seg_BS=kv_seg_BS[:, kv_sl], scale=scale))
    return outs[0] if nq == 1 else jnp.concatenate(outs, axis=1)
