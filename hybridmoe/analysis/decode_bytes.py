"""The bytes one decode step of the sampler must move through HBM, and the rollout speed that bounds.

A decode step (rl/sampler.py's loop body: one new token for each of R rows in flight) is memory
bound: its matmuls are [R, D] against whole weight matrices. What it cannot avoid reading or
writing, on one device holding the whole model (the one-chip recipe):

- expert weights: the routed experts its R x k routed tokens hit, per MoE layer. At most
  min(E, R k) of them (every one at R k >= E, which R = 128 rows at k = 8 of 16 experts are), each
  its wi [D, 2F] and wo [F, D];
- dense weights: every other weight of every layer (the mixers, norms, the router, the shared
  expert), the final norm and the LM head [D, V]; of an untied embedding only the R rows gathered
  (a tied one is read whole as the head);
- KV cache: each attention layer's keys and values of the slots written so far, read, plus the new
  slot written (a decode step at cache length S reads S slots: the bound takes the mean S over the
  rollout; the sampler's XLA attention reads the whole P + N slot cache, masked, which is more);
- GDN states: each Gated DeltaNet layer's delta-rule state [R, U, k, v] float32, read and written;
- conv tails: each GDN layer's [R, W-1, heads, dim] tails of q, k and v, read and written.

Activations (the [R, D] hidden states, the [R, V] logits) are left out: a fused decode need not
write them to HBM. The bound of a rollout is then R tokens per step at (these bytes / the chip's
HBM rate) per step: new tokens per second the chip could reach if every decode step ran at its
HBM rate (rows that stopped early still decode in lock-step, so a measured rate below it counts
them as waste too). Legend as model/decode.py: D model, V vocab, E experts, k experts per token,
F expert hidden, G kv heads, A head dim, K / U GDN key / value heads, k / v their dims, W conv width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hybridmoe.config.schema import ModelConfig
from hybridmoe.model.params import declare_params, is_spec

# Routed expert weights: per MoE layer, one matrix per expert of each of these.
ROUTED = ("wi", "wo")


def _bytes(spec) -> int:
    return math.prod(spec.shape) * jnp.dtype(spec.dtype).itemsize


def decode_step_bytes(m: ModelConfig, rows: int, kv_slots: float) -> dict[str, float]:
    """Bytes one decode step of `rows` rows in flight moves, by kind (module docstring), whose
    attention reads `kv_slots` slots (those written before it and its own); `total` their sum."""
    specs = declare_params(m)
    per_expert = sum(_bytes(layer["moe"][name]) for layer in specs["blocks"] for name in ROUTED) / m.num_experts
    experts_hit = min(m.num_experts, rows * m.num_experts_per_tok)
    dense = 0
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        names = [getattr(p, "key", None) for p in path]
        if names[0] == "embed":
            # Tied: the head reads the whole table; else each row gathers its token's D values.
            dense += _bytes(spec) if m.tie_word_embeddings else rows * m.d_model * jnp.dtype(spec.dtype).itemsize
        elif not ("moe" in names and names[-1] in ROUTED):
            dense += _bytes(spec)
    cache = jnp.dtype(m.compute_dtype).itemsize
    attention_layers = sum(kind == "attention" for kind in m.layer_kinds)
    gdn_layers = sum(kind == "gdn" for kind in m.layer_kinds)
    K, U, dk, dv, W = (m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_dim, m.gdn_value_dim,
                       m.gdn_conv_kernel)
    # Keys and values: kv_slots slots read, the step's own one written.
    kv = attention_layers * 2 * rows * (kv_slots + 1) * m.num_kv_heads * m.head_dim * cache
    # float32 delta-rule state, read and written.
    gdn_states = gdn_layers * 2 * rows * U * dk * dv * 4
    conv_tails = gdn_layers * 2 * rows * (W - 1) * (2 * K * dk + U * dv) * cache
    out = {"expert_weights": float(experts_hit * per_expert), "dense_weights": float(dense), "kv_cache": float(kv),
           "gdn_states": float(gdn_states), "conv_tails": float(conv_tails)}
    return {**out, "total": sum(out.values())}


def mean_kv_slots(prompt_slots: int, decode_steps: float) -> float:
    """The mean number of slots a decode step's attention reads over `decode_steps` steps after a
    prompt of `prompt_slots` slots: step t (from 0) reads the prompt's, the t written before it and
    its own."""
    return prompt_slots + (decode_steps + 1) / 2


def rollout_bound(m: ModelConfig, rows: int, prompt_slots: int, decode_steps: float, hbm_bytes_per_s: float) -> dict:
    """The HBM bound of a rollout whose `rows` rows in flight decode `decode_steps` steps after a
    prompt of `prompt_slots` slots: bytes per decode step (by kind, at the mean cache length), its
    seconds at `hbm_bytes_per_s`, and the new tokens per second that allows (rows per step)."""
    kv_slots = mean_kv_slots(prompt_slots, decode_steps)
    by_kind = decode_step_bytes(m, rows, kv_slots)
    step_s = by_kind["total"] / hbm_bytes_per_s
    return {"rows_in_flight": rows, "mean_kv_slots": kv_slots, "bytes_per_decode_step": by_kind,
            "hbm_bytes_per_s": hbm_bytes_per_s, "decode_step_s": step_s, "tokens_per_s": rows / step_s}
