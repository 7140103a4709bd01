"""The gated full-attention layer of Qwen3.5.

Shape legend: B batch, T tokens, D model, N query heads, G key/value heads, A head dim.
The query projection carries a per-head output gate ([q_h | gate_h] per head); q and k get a
per-head RMSNorm, then partial rotary embedding; the attention output is scaled by
sigmoid(gate) before the output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hybridmoe.config.schema import ModelConfig
from hybridmoe.kernels.attention import attention
from hybridmoe.model.norms import apply_partial_rope, rms_norm, rope_tables
from hybridmoe.parallel.rules import constrain


def project_qkv(p, x_BTD, positions_BT, m: ModelConfig):
    """q (normed, rotated), the output gate, k (normed, rotated), v."""
    dt = x_BTD.dtype
    qg_BTNA2 = jnp.einsum("btd,dnh->btnh", x_BTD, p["wq"].astype(dt))
    qg_BTNA2 = checkpoint_name(qg_BTNA2, "attn_q")
    q_BTNA, gate_BTNA = jnp.split(qg_BTNA2, 2, axis=-1)
    k_BTGA = jnp.einsum("btd,dga->btga", x_BTD, p["wk"].astype(dt))
    v_BTGA = jnp.einsum("btd,dga->btga", x_BTD, p["wv"].astype(dt))
    q_BTNA = rms_norm(q_BTNA, p["q_norm"], m.rms_norm_eps)
    k_BTGA = rms_norm(k_BTGA, p["k_norm"], m.rms_norm_eps)
    cos, sin = rope_tables(positions_BT, m.rotary_dim, m.rope_theta)
    q_BTNA = apply_partial_rope(q_BTNA, cos, sin)
    k_BTGA = apply_partial_rope(k_BTGA, cos, sin)
    return (constrain(q_BTNA, "batch", "seq", "heads", None), gate_BTNA,
            constrain(k_BTGA, "batch", "seq", "kv_heads", None), constrain(v_BTGA, "batch", "seq", "kv_heads", None))


def gated_output(p, o_BTNA, gate_BTNA):
    o_BTNA = o_BTNA * jax.nn.sigmoid(gate_BTNA.astype(jnp.float32)).astype(o_BTNA.dtype)
    y_BTD = jnp.einsum("btna,nad->btd", o_BTNA, p["wo"].astype(o_BTNA.dtype))
    return checkpoint_name(y_BTD, "attn_out")


def attention_layer(p, x_BTD, positions_BT, segment_ids_BT, m: ModelConfig):
    q, gate, k, v = project_qkv(p, x_BTD, positions_BT, m)
    o_BTNA = attention(q, k, v, q_pos_BT=positions_BT, kv_pos_BS=positions_BT, q_seg_BT=segment_ids_BT,
                       kv_seg_BS=segment_ids_BT, scale=m.head_dim ** -0.5)
    return gated_output(p, o_BTNA, gate)
