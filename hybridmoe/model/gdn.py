"""The Gated DeltaNet layer of Qwen3.5 around the delta-rule core (GDN.md section 4).

Shape legend: B batch, T tokens, D model, K key heads, U value heads, k key dim, v value dim,
W conv width. Packed documents: the conv never reads across a document boundary and the core
resets its state at each document start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hybridmoe.config.schema import ModelConfig
from hybridmoe.kernels.gdn import gated_delta_rule
from hybridmoe.model.norms import gated_rms_norm
from hybridmoe.parallel.rules import constrain


def causal_conv(x_BTHC, taps_WHC, segment_ids_BT, tail_BSHC=None):
    """Depthwise causal conv (tap W-1 on the current token) then SiLU; returns (y, new tail).

    A tap reads token t - s only when it lies in t's document. `tail` holds the previous W-1
    pre-conv tokens of a continuing sequence (decode), taken to be in the first token's document.
    """
    W = taps_WHC.shape[0]
    B, T = x_BTHC.shape[:2]
    if tail_BSHC is None:
        tail_BSHC = jnp.zeros((B, W - 1) + x_BTHC.shape[2:], x_BTHC.dtype)
        tail_seg = jnp.full((B, W - 1), -1, segment_ids_BT.dtype)  # matches no document
    else:
        tail_seg = jnp.broadcast_to(segment_ids_BT[:, :1], (B, W - 1))
    xp = jnp.concatenate([tail_BSHC.astype(x_BTHC.dtype), x_BTHC], axis=1)
    segp = jnp.concatenate([tail_seg, segment_ids_BT], axis=1)
    acc = jnp.zeros(x_BTHC.shape, jnp.float32)
    for j in range(W):
        shift = W - 1 - j  # tap j reads token t - shift
        xs = jax.lax.dynamic_slice_in_dim(xp, W - 1 - shift, T, axis=1)
        same = jax.lax.dynamic_slice_in_dim(segp, W - 1 - shift, T, axis=1) == segment_ids_BT
        acc = acc + jnp.where(same[..., None, None], xs.astype(jnp.float32), 0.0) * taps_WHC[j].astype(jnp.float32)
    return jax.nn.silu(acc).astype(x_BTHC.dtype), xp[:, -(W - 1):] if W > 1 else xp[:, :0]


def gdn_gates(p, x_BTD):
    """beta = sigmoid(b) and the log gate g = -exp(A_log) softplus(a + dt_bias), float32."""
    b_BTU = jnp.einsum("btd,du->btu", x_BTD, p["wb"].astype(x_BTD.dtype))
    a_BTU = jnp.einsum("btd,du->btu", x_BTD, p["wa"].astype(x_BTD.dtype))
    beta = jax.nn.sigmoid(b_BTU.astype(jnp.float32))
    # float32: softplus of large a and exp(A_log) give gates near -1e3 that bf16 cannot resolve.
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a_BTU.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    return g, beta


def gdn_layer(p, x_BTD, segment_ids_BT, m: ModelConfig, *, chunk_size: int, backend: str = "xla",
              state=None):
    """Returns the layer output, and the new recurrent state when `state` is given (decode/prefill).

    state: {"conv_q", "conv_k", "conv_v": [B, W-1, heads, dim] pre-conv tails, "ssm": [B, U, k, v]}.
    """
    dt = x_BTD.dtype
    x_BTD = x_BTD * (segment_ids_BT > 0)[..., None].astype(dt)
    q = jnp.einsum("btd,dhc->bthc", x_BTD, p["wq"].astype(dt))
    k = jnp.einsum("btd,dhc->bthc", x_BTD, p["wk"].astype(dt))
    v = jnp.einsum("btd,dhc->bthc", x_BTD, p["wv"].astype(dt))
    z = jnp.einsum("btd,dhc->bthc", x_BTD, p["wz"].astype(dt))
    q, k, v = (checkpoint_name(t, n) for t, n in ((q, "gdn_q"), (k, "gdn_k"), (v, "gdn_v")))
    st = state or {}
    q, tail_q = causal_conv(q, p["conv_q"], segment_ids_BT, st.get("conv_q"))
    k, tail_k = causal_conv(k, p["conv_k"], segment_ids_BT, st.get("conv_k"))
    v, tail_v = causal_conv(v, p["conv_v"], segment_ids_BT, st.get("conv_v"))
    g, beta = gdn_gates(p, x_BTD)
    o_BTUv, ssm = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids_BT, initial_state=st.get("ssm"),
                                   chunk_size=chunk_size, normalize_qk=True, backend=backend)
    o_BTUv = checkpoint_name(constrain(o_BTUv, "batch", "seq", "heads", None), "gdn_core_out")
    y = gated_rms_norm(o_BTUv, z, p["norm"], m.rms_norm_eps)
    out = jnp.einsum("btuv,uvd->btd", y.astype(dt), p["wo"].astype(dt))
    if state is None:
        return out
    return out, {"conv_q": tail_q, "conv_k": tail_k, "conv_v": tail_v, "ssm": ssm}
