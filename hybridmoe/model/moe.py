"""The routed-experts block with its gated shared expert.

Shape legend: T tokens (flattened batch x sequence, local to a shard), D model, E experts,
F expert hidden, S shared hidden, k experts per token, M = T * k routed rows.

Routing: softmax router in float32, top-k, optional renormalisation. The sparse path is
dropless sort-and-group: rows sorted by expert, grouped matmuls over contiguous groups, unsorted
and summed per token (a gather, not a scatter-add, so the sum order is fixed). The dense path runs
every expert on every token and is the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from hybridmoe.config.schema import ModelConfig, MoEConfig
from hybridmoe.parallel.rules import logical_to_spec


def route(router_DE, x_TD, m: ModelConfig):
    """Top-k experts and their weights (float32) per token."""
    logits_TE = jnp.einsum("td,de->te", x_TD, router_DE.astype(x_TD.dtype), preferred_element_type=jnp.float32)
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    w_Tk, idx_Tk = jax.lax.top_k(probs_TE, m.num_experts_per_tok)
    if m.norm_topk_prob:
        w_Tk = w_Tk / jnp.sum(w_Tk, axis=-1, keepdims=True)
    return w_Tk, idx_Tk, probs_TE


def swiglu(h_M2F):
    gate, up = jnp.split(h_M2F, 2, axis=-1)
    gate = checkpoint_name(gate, "moe_gate")
    up = checkpoint_name(up, "moe_up")
    return jax.nn.silu(gate) * up


def sparse_experts(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD):
    """Dropless sort-and-group dispatch through grouped matmuls."""
    T, k = idx_Tk.shape
    E = wi_ED2F.shape[0]
    flat_e = idx_Tk.reshape(-1)
    order_M = jnp.argsort(flat_e, stable=True)
    group_sizes_E = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    x_MD = x_TD[order_M // k]
    dt = x_TD.dtype
    h_M2F = jax.lax.ragged_dot(x_MD, wi_ED2F.astype(dt), group_sizes_E)
    a_MF = swiglu(h_M2F)
    y_MD = jax.lax.ragged_dot(a_MF, wo_EFD.astype(dt), group_sizes_E)
    w_M = w_Tk.reshape(-1)[order_M]
    y_MD = (y_MD.astype(jnp.float32) * w_M[:, None]).astype(dt)
    inverse_M = jnp.argsort(order_M)
    return jnp.sum(y_MD[inverse_M].reshape(T, k, -1).astype(jnp.float32), axis=1).astype(dt)


def dense_experts(x_TD, w_Tk, idx_Tk, wi_ED2F, wo_EFD):
    """Every expert on every token, weighted by the (mostly zero) dense routing matrix."""
    E = wi_ED2F.shape[0]
    dt = x_TD.dtype
    combine_TE = jnp.sum(jax.nn.one_hot(idx_Tk, E, dtype=jnp.float32) * w_Tk[..., None], axis=1)
    h_ET2F = jnp.einsum("td,edf->etf", x_TD, wi_ED2F.astype(dt))
    y_ETD = jnp.einsum("etf,efd->etd", swiglu(h_ET2F), wo_EFD.astype(dt))
    return jnp.einsum("etd,te->td", y_ETD.astype(jnp.float32), combine_TE).astype(dt)


def shared_expert(p, x_TD):
    dt = x_TD.dtype
    a = swiglu(x_TD @ p["shared_wi"].astype(dt))
    y = a @ p["shared_wo"].astype(dt)
    gate_T = jax.nn.sigmoid((x_TD @ p["shared_gate"].astype(dt)).astype(jnp.float32))
    return (y.astype(jnp.float32) * gate_T[:, None]).astype(dt)


def moe_local(p, x_TD, m: ModelConfig, moe: MoEConfig):
    """The block on the tokens a shard holds (every expert weight visible)."""
    w_Tk, idx_Tk, _ = route(p["router"], x_TD, m)
    experts = sparse_experts if moe.impl == "sparse" else dense_experts
    y = experts(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"])
    if "shared_wi" in p:
        y = y + shared_expert(p, x_TD)
    return y


def moe_layer(p, x_BTD, m: ModelConfig, moe: MoEConfig):
    """Tokens stay on their shard; expert weights are gathered to every shard (FSDP style)."""
    B, T, D = x_BTD.shape

    def local(p, x_btd):
        b, t, _ = x_btd.shape
        return moe_local(p, x_btd.reshape(b * t, D), m, moe).reshape(b, t, D)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(p, x_BTD)
    token_spec = logical_to_spec(("batch", "seq", None))
    weight_specs = jax.tree.map(lambda _: PartitionSpec(), p)
    return jax.shard_map(local, in_specs=(weight_specs, token_spec), out_specs=token_spec)(p, x_BTD)
