"""The decoder with a cache: prefill a batch of prompts, then extend it one token at a time.

Shape legend: B batch, T new tokens of this call, S cache slots (prompt + completion), D model,
V vocab, G attention key/value heads, A attention head dim, K GDN key heads, U GDN value heads,
k GDN key dim, v GDN value dim, W conv width, L stacked blocks (the layer scan's axis).

The cache mirrors the weight tree: `layers[p]` holds the state of layer-pattern position p for
every block, stacked on a leading L axis, so the layer stack is the same `lax.scan` over blocks as
the trainer's forward and each layer runs the trainer's own layer functions:
  attention  k, v [L, B, S, G, A]: the projected keys/values of every slot written so far;
  gdn        conv_q, conv_k [L, B, W-1, K, k], conv_v [L, B, W-1, U, v] (pre-conv tails) and
             ssm [L, B, U, k, v] float32 (the delta-rule state), what `gdn_layer(state=...)` carries.
Shared by all attention layers: kv_pos, kv_seg [B, S] (position and segment of each slot; segment
-1 marks a slot not written yet, which no query matches) and `slot`, the next slot to write.

Prompts are left-padded (segment 0) so that every row writes the same slot at each step; padding
never enters a state: the GDN layer zeroes padded inputs and resets at the first real token, and
attention masks padded keys by segment.

A prompt is prefilled (`prefill`) in chunks of at most `chunk_tokens` through the same update a
decode step runs (`cached_hidden`): each chunk appends its keys/values to the cache and carries the
GDN conv tails and delta-rule state on, so attention scores are [chunk, cache slots], never
[prompt, prompt]. `cache_rows` copies each prompt's state to the rows that continue it (the G
completions of a GRPO group share one prefill); `grow_cache` then makes room for the completion, so
a sampler prefills and copies caches of the prompt's length only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.config.schema import Config
from hybridmoe.kernels.attention import attention
from hybridmoe.model.attention import gated_output, project_qkv
from hybridmoe.quant import LayerWeights
from hybridmoe.model.forward import decoder_layer, embed_tokens, lm_head_at_use, routing_from_blocks
from hybridmoe.model.gdn import gdn_layer
from hybridmoe.model.norms import rms_norm
from hybridmoe.model.params import layer_axes

UNWRITTEN_SEGMENT = -1


def init_cache(cfg: Config, batch: int, num_slots: int):
    """An empty cache for `batch` rows of up to `num_slots` tokens (prompt + completion)."""
    m = cfg.model
    dt = jnp.dtype(m.compute_dtype)
    L, W = m.num_blocks, m.gdn_conv_kernel
    layers = []
    for kind in m.layer_pattern:
        if kind == "attention":
            kv = jnp.zeros((L, batch, num_slots, m.num_kv_heads, m.head_dim), dt)
            layers.append({"k": kv, "v": kv})
        elif kind == "gdn":
            K, U, k, v = m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_dim, m.gdn_value_dim
            layers.append({
                "conv_q": jnp.zeros((L, batch, W - 1, K, k), dt),
                "conv_k": jnp.zeros((L, batch, W - 1, K, k), dt),
                "conv_v": jnp.zeros((L, batch, W - 1, U, v), dt),
                "ssm": jnp.zeros((L, batch, U, k, v), jnp.float32),
            })
        else:
            raise ValueError(f"unknown layer kind {kind!r}")
    return {
        "layers": layers,
        "kv_pos": jnp.zeros((batch, num_slots), jnp.int32),
        "kv_seg": jnp.full((batch, num_slots), UNWRITTEN_SEGMENT, jnp.int32),
        "slot": jnp.int32(0),
    }


def _cached_mixer(kind: str, p, h_BTD, layer_cache, ctx, cfg: Config):
    """The one dispatch on layer kind: (mixer output, the layer's new cache)."""
    m = cfg.model
    positions_BT, segment_ids_BT, kv_pos_BS, kv_seg_BS, slot = ctx
    if kind == "attention":
        q, gate, k, v = project_qkv(p, h_BTD, positions_BT, m)
        k_BSGA = jax.lax.dynamic_update_slice_in_dim(layer_cache["k"], k.astype(layer_cache["k"].dtype), slot, axis=1)
        v_BSGA = jax.lax.dynamic_update_slice_in_dim(layer_cache["v"], v.astype(layer_cache["v"].dtype), slot, axis=1)
        o_BTNA = attention(q, k_BSGA.astype(q.dtype), v_BSGA.astype(q.dtype), q_pos_BT=positions_BT,
                           kv_pos_BS=kv_pos_BS, q_seg_BT=segment_ids_BT, kv_seg_BS=kv_seg_BS,
                           scale=m.head_dim ** -0.5)
        return gated_output(p, o_BTNA, gate), {"k": k_BSGA, "v": v_BSGA}
    if kind == "gdn":
        # One new token: chunk size 1 is the plain recurrence (no padding to a whole chunk), in XLA
        # (the Pallas kernel is a chunked sequence kernel; Mosaic refuses its chunk-1 dots).
        one_token = h_BTD.shape[1] == 1
        chunk = 1 if one_token else cfg.gdn.chunk_size
        backend = "xla" if one_token else cfg.kernels.gdn.backend
        y, state = gdn_layer(p, h_BTD, segment_ids_BT, m, chunk_size=chunk, backend=backend,
                             interpret=cfg.kernels.interpret, state=layer_cache, precision=cfg.kernels.gdn.precision,
                             layout=cfg.kernels.gdn.layout)
        return y, jax.tree.map(lambda new, old: new.astype(old.dtype), state, layer_cache)
    raise ValueError(f"unknown layer kind {kind!r}")


def cached_hidden(params, cfg: Config, cache, tokens_BT, segment_ids_BT, positions_BT, *, with_routing: bool = False):
    """Run T new tokens (a prompt, or one decode token) through the decoder, writing them to cache
    slots [slot, slot + T). Returns (final-normed hidden states [B, T, D], the new cache), with_routing
    also the experts each token went to in each layer, int32 [B, T, layers, k] (routing replay)."""
    m = cfg.model
    slot = cache["slot"]
    kv_pos_BS = jax.lax.dynamic_update_slice_in_dim(cache["kv_pos"], positions_BT.astype(jnp.int32), slot, axis=1)
    kv_seg_BS = jax.lax.dynamic_update_slice_in_dim(cache["kv_seg"], segment_ids_BT.astype(jnp.int32), slot, axis=1)
    ctx = (positions_BT, segment_ids_BT, kv_pos_BS, kv_seg_BS, slot)
    dt = jnp.dtype(m.compute_dtype)
    x = embed_tokens(params, tokens_BT, dt)

    weights = LayerWeights(cfg, layer_axes(m))

    def block(x_BTD, xs):
        block_params, block_cache = xs
        new_cache, routing = [], []
        for i, (kind, lp, lc) in enumerate(zip(m.layer_pattern, block_params, block_cache)):
            lp = weights.for_sampling(lp, i)
            mix = lambda p, h, kind=kind, lc=lc: _cached_mixer(kind, p, h, lc, ctx, cfg)
            out = decoder_layer(lp, x_BTD, mix, cfg, with_routing=with_routing)
            x_BTD, lc = out[:2]
            new_cache.append(lc)
            routing.extend(out[2:])
        return x_BTD, ((new_cache, jnp.stack(routing)) if with_routing else new_cache)

    x, ys = jax.lax.scan(block, x, (params["blocks"], cache["layers"]))
    layers, routing = ys if with_routing else (ys, None)
    hidden = rms_norm(x, params["final_norm"], m.rms_norm_eps)
    new_cache = {"layers": layers, "kv_pos": kv_pos_BS, "kv_seg": kv_seg_BS,
                 "slot": slot + jnp.int32(tokens_BT.shape[1])}
    if with_routing:
        return hidden, new_cache, routing_from_blocks(routing)
    return hidden, new_cache


def prefill(params, cfg: Config, cache, tokens_BP, segment_ids_BP, positions_BP, *, chunk_tokens: int,
            with_routing: bool = False):
    """Run the prompts [B, P] into the cache, at most `chunk_tokens` tokens per call of `cached_hidden`.

    A prompt within one chunk is one call (the program of a one-piece prefill). A longer one runs
    its whole chunks in a `lax.scan` (one compiled chunk) and the remainder, if any, last, so the
    chunks start where a one-piece prefill's GDN chunks do when chunk_tokens is a multiple of
    gdn.chunk_size. Returns (the final-normed hidden state of each row's last prompt token [B, D],
    the cache, with_routing the experts of every prompt token int32 [B, P, layers, k] else None).
    """
    B, P = tokens_BP.shape
    C = chunk_tokens
    if P <= C:
        out = cached_hidden(params, cfg, cache, tokens_BP, segment_ids_BP, positions_BP, with_routing=with_routing)
        return out[0][:, -1], out[1], (out[2] if with_routing else None)
    whole = P // C
    chunks = lambda a_BP: a_BP[:, :whole * C].reshape(B, whole, C).swapaxes(0, 1)  # noqa: E731 [whole, B, C]

    def chunk(cache, xs):
        out = cached_hidden(params, cfg, cache, *xs, with_routing=with_routing)
        return out[1], (out[0][:, -1], out[2] if with_routing else None)

    cache, (last_NBD, routing_NBCLk) = jax.lax.scan(
        chunk, cache, (chunks(tokens_BP), chunks(segment_ids_BP), chunks(positions_BP)))
    hidden_BD = last_NBD[-1]
    routing = [] if not with_routing else [routing_NBCLk.swapaxes(0, 1).reshape(B, whole * C, *routing_NBCLk.shape[3:])]
    if P > whole * C:
        rest = lambda a_BP: a_BP[:, whole * C:]  # noqa: E731
        out = cached_hidden(params, cfg, cache, rest(tokens_BP), rest(segment_ids_BP), rest(positions_BP),
                            with_routing=with_routing)
        hidden_BD, cache = out[0][:, -1], out[1]
        routing += list(out[2:])
    return hidden_BD, cache, (jnp.concatenate(routing, axis=1) if with_routing else None)


def cache_rows(cache, rows_R):
    """The cache of rows `rows_R` (int [R]): row r continues row rows_R[r]'s state (its keys and
    values, kv positions and segments, GDN conv tails and delta-rule state), at the same slot."""
    take = lambda a, axis: jnp.take(a, rows_R, axis=axis)  # noqa: E731
    return {"layers": jax.tree.map(lambda a: take(a, 1), cache["layers"]),  # [L, B, ...]
            "kv_pos": take(cache["kv_pos"], 0), "kv_seg": take(cache["kv_seg"], 0), "slot": cache["slot"]}


def grow_cache(cache, num_slots: int):
    """The cache with room for `num_slots` slots: the attention layers' keys and values and the
    slots' positions and segments padded with unwritten slots (GDN states have no slot axis)."""
    more = num_slots - cache["kv_pos"].shape[1]
    if more < 0:
        raise ValueError(f"cannot shrink a cache of {cache['kv_pos'].shape[1]} slots to {num_slots}")
    pad = lambda a, axis, value=0: jnp.pad(a, [(0, more if i == axis else 0) for i in range(a.ndim)],  # noqa: E731
                                           constant_values=value)
    layers = [{k: pad(a, 2) for k, a in lc.items()} if "k" in lc else lc for lc in cache["layers"]]
    return {"layers": layers, "kv_pos": pad(cache["kv_pos"], 1),
            "kv_seg": pad(cache["kv_seg"], 1, UNWRITTEN_SEGMENT), "slot": cache["slot"]}


def next_token_logits(params, hidden_BD):
    """float32 logits [B, V] of the next token from final-normed hidden states."""
    return jnp.dot(hidden_BD, lm_head_at_use(params).astype(hidden_BD.dtype), preferred_element_type=jnp.float32)
