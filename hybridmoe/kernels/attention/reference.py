"""Obviously-correct attention: one query at a time against every key, Python loop over queries.

Used only by tests as the oracle for the XLA path.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def attention_reference(q_BTNA, k_BSGA, v_BSGA, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q_BTNA, k_BSGA, v_BSGA))
    B, T, N, _ = q.shape
    G = k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(B):
        for t in range(T):
            for n in range(N):
                g = n // (N // G)
                ok = (np.asarray(kv_pos_BS[b]) <= int(q_pos_BT[b, t])) & (
                    np.asarray(kv_seg_BS[b]) == int(q_seg_BT[b, t]))
                if not ok.any():
                    continue
                s = k[b, :, g] @ q[b, t, n] * scale
                s = np.where(ok, s, -np.inf)
                p = np.exp(s - s.max())
                out[b, t, n] = (p / p.sum()) @ v[b, :, g]
    return jnp.asarray(out, jnp.float32)
