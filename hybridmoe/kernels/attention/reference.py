"""Obviously-correct attention: one query at a time against every key, Python loop over queries.

Used only by tests: the oracle of values (attention_reference), of the log-sum-exp the flash
primitives return (attention_reference_lse), and of gradients (attention_reference_grads: autodiff
of the masked XLA core, xla.attention, in float32 at HIGHEST matmul precision).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _visible(kv_pos_BS, kv_seg_BS, q_pos_BT, q_seg_BT, b, t):
    return (np.asarray(kv_pos_BS[b]) <= int(q_pos_BT[b, t])) & (np.asarray(kv_seg_BS[b]) == int(q_seg_BT[b, t]))


def attention_reference(q_BTNA, k_BSGA, v_BSGA, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q_BTNA, k_BSGA, v_BSGA))
    B, T, N, _ = q.shape
    G = k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(B):
        for t in range(T):
            for n in range(N):
                g = n // (N // G)
                ok = _visible(kv_pos_BS, kv_seg_BS, q_pos_BT, q_seg_BT, b, t)
                if not ok.any():
                    continue
                s = k[b, :, g] @ q[b, t, n] * scale
                s = np.where(ok, s, -np.inf)
                p = np.exp(s - s.max())
                out[b, t, n] = (p / p.sum()) @ v[b, :, g]
    return jnp.asarray(out, jnp.float32)


def attention_reference_lse(q_BTNA, k_BSGA, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale) -> np.ndarray:
    """[B, N, T] float64: log sum over the visible keys of exp(scaled score); -inf with none visible."""
    q, k = (np.asarray(a, np.float64) for a in (q_BTNA, k_BSGA))
    B, T, N, _ = q.shape
    G = k.shape[2]
    lse = np.full((B, N, T), -np.inf)
    for b in range(B):
        for t in range(T):
            ok = _visible(kv_pos_BS, kv_seg_BS, q_pos_BT, q_seg_BT, b, t)
            if not ok.any():
                continue
            for n in range(N):
                s = (k[b, :, n // (N // G)] @ q[b, t, n] * scale)[ok]
                lse[b, n, t] = s.max() + np.log(np.exp(s - s.max()).sum())
    return lse


def attention_reference_grads(q_BTNA, k_BSGA, v_BSGA, do_BTNA, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale):
    """(dq, dk, dv) float32 of sum(o * do) by autodiff of xla.attention at HIGHEST precision."""
    from hybridmoe.kernels.attention.xla import attention

    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    core = lambda q, k, v: attention(q, k, v, q_pos_BT=q_pos_BT, kv_pos_BS=kv_pos_BS, q_seg_BT=q_seg_BT,  # noqa: E731
                                     kv_seg_BS=kv_seg_BS, scale=scale)
    with jax.default_matmul_precision("highest"):
        return jax.vjp(core, f32(q_BTNA), f32(k_BSGA), f32(v_BSGA))[1](f32(do_BTNA))
