"""The decoder: embedding, the layer stack as a scan over repeating blocks, final norm, LM head.

Shape legend: B batch, T tokens, D model, V vocab. The layer pattern (e.g. three GDN layers then
one attention layer) is data: `_mixer` is the one place a layer kind is dispatched.
Packed rows: segment ids 0 = padding, 1, 2, ... documents; positions restart per document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.config.schema import Config, ModelConfig
from hybridmoe.kernels.logprobs import chunked_token_logprobs
from hybridmoe.model import scopes
from hybridmoe.model.attention import attention_layer
from hybridmoe.quant import LayerWeights
from hybridmoe.model.gdn import gdn_layer
from hybridmoe.model.moe import moe_layer
from hybridmoe.model.norms import rms_norm
from hybridmoe.model.params import layer_axes
from hybridmoe.model.remat import checkpointed
from hybridmoe.parallel.rules import constrain, constrain_at_use, logical_to_spec, splits_evenly


def default_batch_fields(tokens_BT):
    B, T = tokens_BT.shape
    return (jnp.ones((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))


def _mixer(kind: str, p, x, positions, segment_ids, cfg: Config, packed: bool = True):
    if kind == "attention":
        with jax.named_scope(scopes.ATTENTION):
            return attention_layer(p, x, positions, segment_ids, cfg.model, cfg.attention, packed=packed,
                                   kernels=cfg.kernels)
    if kind == "gdn":
        with jax.named_scope(scopes.GDN):
            return gdn_layer(p, x, segment_ids, cfg.model, chunk_size=cfg.gdn.chunk_size,
                             backend=cfg.kernels.gdn.backend, interpret=cfg.kernels.interpret,
                             cp_m_scan=cfg.gdn.cp_m_scan, cp_dh_scan=cfg.gdn.cp_dh_scan,
                             cp_terms_in_kernel=cfg.gdn.cp_terms_in_kernel, precision=cfg.kernels.gdn.precision,
                             layout=cfg.kernels.gdn.layout)
    raise ValueError(f"unknown layer kind {kind!r}")


def embed_tokens(params, tokens_BT, dtype):
    with jax.named_scope(scopes.EMBEDDING):
        table_VD = constrain_at_use(params["embed"], ("vocab", "embed"))
        return constrain(table_VD.astype(dtype)[tokens_BT], "batch", "seq", None)


def lm_head_at_use(params):
    """The output projection [D, V] where it is used. A tree declared with model.tie_word_embeddings
    has no lm_head leaf: the head is then the embedding table's transpose, so that one tensor's
    gradient is the sum of its two uses."""
    if "lm_head" not in params:
        return constrain_at_use(params["embed"], ("vocab", "embed")).T
    return constrain_at_use(params["lm_head"], ("embed", "vocab"))


def decoder_layer(lp, x_BTD, mix, cfg: Config, *, with_moe_dropped: bool = False, replay_BTk=None,
                  with_routing: bool = False):
    """One layer around its token mixer: x + mix(norm x), then x + moe(norm x).

    `mix(mixer_params, h_BTD) -> (y_BTD, aux)` is the token mixer (the full-sequence one here, the
    cached one in decode.py); returns (x_BTD, aux), and with_moe_dropped also the MoE block's
    dropped (token, expert) rows (int32; see moe.capacity_factor), or with_routing the expert ids
    it routed by (int32 [B, T, k]). replay_BTk: route by these experts (moe.routing_replay).
    """
    return one_after_the_other(lambda x: mixer_sublayer(lp, x, mix, cfg),
                               lambda x: moe_sublayer(lp, x, cfg, with_moe_dropped=with_moe_dropped,
                                                      replay_BTk=replay_BTk, with_routing=with_routing), x_BTD)


def one_after_the_other(mixer, moe, x_BTD):
    """A layer from its two sublayers: mixer(x) -> (x, aux), moe(x) -> (x, *extra); (x, aux, *extra)."""
    x_BTD, aux = mixer(x_BTD)
    out = moe(x_BTD)
    return (out[0], aux, *out[1:])


MIXER_KEYS, MOE_KEYS = ("input_norm", "mixer"), ("post_norm", "moe")  # a layer's weights, by sublayer


@jax.custom_vjp
def gradients_leave_together(x_BTD, weights):
    """The identity on (x, weights); in the backward, x's cotangent is handed on only after the
    weights' (remat.expert_grad_barrier): whatever needs x's cotangent (the layers below) waits for
    the weights' gradient, reduced to its shards, to be done.

    The barrier holds the weights' gradient and a float zero; x's cotangent plus that zero (exact)
    depends on it. x's cotangent itself is kept out of the barrier: a barrier operand takes the
    default layout, and at the 397B cell that made the compiler convert the layout of six of the
    layer loop's saved stacks (11.25 GiB of copies at the peak; docs/levers.md)."""
    return x_BTD, weights


def _leave_together_fwd(x_BTD, weights):
    return (x_BTD, weights), None


def _leave_together_bwd(_, cotangents):
    dx_BTD, d_weights = cotangents
    d_weights, zero = jax.lax.optimization_barrier((d_weights, jnp.zeros((), dx_BTD.dtype)))
    return dx_BTD + zero, d_weights


gradients_leave_together.defvjp(_leave_together_fwd, _leave_together_bwd)


def expert_grad_ties(position: int, layers: int, lag: int) -> list[int]:
    """The layers of a block whose MoE weights' gradient the input of the layer at `position` is tied
    to (gradients_leave_together) under remat.expert_grad_lag = `lag`: the layer `lag` above it, so
    that gradient's reduction runs under the backward of the `lag` layers from it down; the block's
    first layer also takes the block's first `lag` layers (none is that far above the input of
    another layer of the block)."""
    if position == 0:
        return list(range(min(lag, layers - 1) + 1))
    return [position + lag] if position + lag < layers else []


def mixer_sublayer(lp, x_BTD, mix, cfg: Config):
    """The layer's first residual sublayer: (x + mix(norm x), the mixer's aux). Reads MIXER_KEYS."""
    h = rms_norm(x_BTD, lp["input_norm"], cfg.model.rms_norm_eps)
    y_BTD, aux = mix(lp["mixer"], h)
    return x_BTD + y_BTD, aux


def moe_sublayer(lp, x_BTD, cfg: Config, *, with_moe_dropped: bool = False, replay_BTk=None,
                 with_routing: bool = False):
    """The layer's second residual sublayer: (x + moe(norm x),) and decoder_layer's extra output.
    Reads MOE_KEYS."""
    m = cfg.model
    h = rms_norm(x_BTD, lp["post_norm"], m.rms_norm_eps)
    with jax.named_scope(scopes.MOE):
        y_BTD = moe_layer(lp["moe"], h, m, cfg.moe, cfg.kernels, return_dropped=with_moe_dropped,
                          replay_BTk=replay_BTk, return_routing=with_routing, quant=cfg.quant)
    if with_moe_dropped or with_routing:
        y_BTD, extra = y_BTD
    x_BTD = constrain(x_BTD + y_BTD, "batch", "seq", None)
    return (x_BTD, extra) if with_moe_dropped or with_routing else (x_BTD,)


def block_fn(cfg: Config, positions_BT, segment_ids_BT, *, with_moe_dropped: bool = False, packed: bool = True,
             replay: bool = False, with_routing: bool = False):
    """One repeating block (every position of the layer pattern) as a function (x, block xs) -> x
    (with_moe_dropped: -> (x, the block's dropped MoE rows)). The xs are the block's params, or
    (params, hoisted fp8 absmax) under quant.fp8_fake_quant_hoist (quant.LayerWeights). Routing
    replay: the xs are (those, expert ids [pattern, B, T, k]) and with_routing -> (x, the ids routed
    by, alike)."""
    m = cfg.model
    weights = LayerWeights(cfg, layer_axes(m))

    def layer_fn(i, kind):
        # One layer from its stored weights, gathered (and fp8-prepared) at use inside the layer: under
        # remat.unit=layer the backward gathers them again for this layer alone (sublayer: for each
        # of its two residual sublayers alone).
        mix = lambda p, h: (_mixer(kind, p, h, positions_BT, segment_ids_BT, cfg, packed), None)  # noqa: E731

        def at_use(lp, amax=None):
            with jax.named_scope(scopes.LAYER_WEIGHTS):
                return weights.at_use(lp, i, amax)

        def layer(x_BTD, lp, amax, replay_BTk):
            return decoder_layer(at_use(lp, amax), x_BTD, mix, cfg, with_moe_dropped=with_moe_dropped,
                                 with_routing=with_routing, replay_BTk=replay_BTk)

        if cfg.remat.unit != "sublayer":
            return checkpointed(layer, cfg, positions_BT.size, unit="layer")

        def mixer_half(x_BTD, lp):
            return mixer_sublayer(at_use(lp), x_BTD, mix, cfg)

        def moe_half(x_BTD, lp, amax, replay_BTk):
            return moe_sublayer(at_use(lp, amax), x_BTD, cfg, with_moe_dropped=with_moe_dropped,
                                with_routing=with_routing, replay_BTk=replay_BTk)

        mixer_half, moe_half = (checkpointed(f, cfg, positions_BT.size, unit="sublayer") for f in (mixer_half, moe_half))

        def sublayers(x_BTD, lp, amax, replay_BTk):
            return one_after_the_other(lambda x: mixer_half(x, {k: lp[k] for k in MIXER_KEYS}),
                                       lambda x: moe_half(x, {k: lp[k] for k in MOE_KEYS}, amax, replay_BTk), x_BTD)

        return sublayers

    layers = [layer_fn(i, kind) for i, kind in enumerate(m.layer_pattern)]

    def block(x_BTD, block_xs):
        dropped = jnp.int32(0)
        block_xs, replay_PBTk = block_xs if replay else (block_xs, None)
        routing = []
        block_params, block_absmax = weights.split(block_xs)
        block_params = list(block_params)  # a layer's MoE weights replaced by their tied copy (below)
        for i, (layer, amax) in enumerate(zip(layers, block_absmax)):
            tied = expert_grad_ties(i, len(layers), cfg.remat.expert_grad_lag) if cfg.remat.expert_grad_barrier else []
            if tied:
                x_BTD, held = gradients_leave_together(x_BTD, [block_params[j]["moe"] for j in tied])
                for j, moe_lp in zip(tied, held):
                    block_params[j] = {**block_params[j], "moe": moe_lp}
            out = layer(x_BTD, block_params[i], amax, None if replay_PBTk is None else replay_PBTk[i])
            x_BTD = out[0]
            if with_moe_dropped:
                dropped = dropped + out[2]
            if with_routing:
                routing.append(out[2])
        if with_routing:
            return x_BTD, jnp.stack(routing)
        return (x_BTD, dropped) if with_moe_dropped else x_BTD

    return block


def routing_to_blocks(routing_BTLk, cfg: Config):
    """Expert ids [B, T, layers, k] (layer = block * pattern length + position) as the layer scan's
    [blocks, pattern, B, T, k]."""
    B, T, _, k = routing_BTLk.shape
    m = cfg.model
    return routing_BTLk.reshape(B, T, m.num_blocks, len(m.layer_pattern), k).transpose(2, 3, 0, 1, 4)


def routing_from_blocks(routing_LPBTk):
    """The layer scan's [blocks, pattern, B, T, k] as [B, T, layers, k]."""
    Lb, Pp, B, T, k = routing_LPBTk.shape
    return routing_LPBTk.transpose(2, 3, 0, 1, 4).reshape(B, T, Lb * Pp, k)


def _batch_fields(tokens_BT, segment_ids_BT, positions_BT):
    """(segment ids, positions, packed): the defaults filled in; packed = segment ids were given."""
    packed = segment_ids_BT is not None
    if segment_ids_BT is None or positions_BT is None:
        seg, pos = default_batch_fields(tokens_BT)
        segment_ids_BT = seg if segment_ids_BT is None else segment_ids_BT
        positions_BT = pos if positions_BT is None else positions_BT
    return segment_ids_BT, positions_BT, packed


def decoder_hidden(params, cfg: Config, tokens_BT, segment_ids_BT=None, positions_BT=None, *,
                   with_moe_dropped: bool = False, routing_BTLk=None, with_routing: bool = False):
    """Final-normed hidden states [B, T, D] (with_moe_dropped: and the MoE rows dropped in all layers).

    Routing replay (moe.routing_replay): routing_BTLk int32 [B, T, layers, k] are the experts each
    token goes to in each layer (the router only weights them); with_routing: also return the
    experts every layer routed by, alike."""
    if routing_BTLk is not None or with_routing:
        return _decoder_hidden_routed(params, cfg, tokens_BT, segment_ids_BT, positions_BT, routing_BTLk,
                                      with_routing)
    m = cfg.model
    segment_ids_BT, positions_BT, packed = _batch_fields(tokens_BT, segment_ids_BT, positions_BT)
    dt = jnp.dtype(m.compute_dtype)
    x = embed_tokens(params, tokens_BT, dt)
    block = block_fn(cfg, positions_BT, segment_ids_BT, with_moe_dropped=with_moe_dropped, packed=packed)
    block = checkpointed(block, cfg, tokens_BT.size, unit="block")
    xs = LayerWeights(cfg, layer_axes(m)).scan_xs(params)
    if with_moe_dropped:
        step = lambda carry, bp: ((lambda x, d: (x, carry[1] + d))(*block(carry[0], bp)), None)  # noqa: E731
        carry = (x, jnp.int32(0))
        with jax.named_scope(scopes.LAYERS):
            if cfg.remat.scan_layers:
                carry, _ = jax.lax.scan(step, carry, xs)
            else:
                for i in range(m.num_blocks):
                    carry, _ = step(carry, jax.tree.map(lambda a: a[i], xs))
        x, dropped = carry
        return rms_norm(x, params["final_norm"], m.rms_norm_eps), dropped
    with jax.named_scope(scopes.LAYERS):
        if cfg.remat.scan_layers:
            x, _ = jax.lax.scan(lambda x, bp: (block(x, bp), None), x, xs)
        else:
            for i in range(m.num_blocks):
                x = block(x, jax.tree.map(lambda a: a[i], xs))
    return rms_norm(x, params["final_norm"], m.rms_norm_eps)


def _decoder_hidden_routed(params, cfg: Config, tokens_BT, segment_ids_BT, positions_BT, routing_BTLk,
                           with_routing: bool):
    m = cfg.model
    segment_ids_BT, positions_BT, packed = _batch_fields(tokens_BT, segment_ids_BT, positions_BT)
    x = embed_tokens(params, tokens_BT, jnp.dtype(m.compute_dtype))
    replay = routing_BTLk is not None
    block = block_fn(cfg, positions_BT, segment_ids_BT, packed=packed, replay=replay, with_routing=with_routing)
    block = checkpointed(block, cfg, tokens_BT.size, unit="block")
    xs = LayerWeights(cfg, layer_axes(m)).scan_xs(params)
    xs = (xs, routing_to_blocks(routing_BTLk, cfg)) if replay else xs
    step = (lambda x, bp: block(x, bp)) if with_routing else (lambda x, bp: (block(x, bp), None))  # noqa: E731
    with jax.named_scope(scopes.LAYERS):
        if cfg.remat.scan_layers:
            x, ys = jax.lax.scan(step, x, xs)
        else:
            outs = []
            for i in range(m.num_blocks):
                x, y = step(x, jax.tree.map(lambda a: a[i], xs))
                outs.append(y)
            ys = jnp.stack(outs) if with_routing else None
    hidden = rms_norm(x, params["final_norm"], m.rms_norm_eps)
    return (hidden, routing_from_blocks(ys)) if with_routing else hidden


def logits(params, cfg: Config, tokens_BT, segment_ids_BT=None, positions_BT=None, *,
           with_moe_dropped: bool = False):
    h = decoder_hidden(params, cfg, tokens_BT, segment_ids_BT, positions_BT, with_moe_dropped=with_moe_dropped)
    if with_moe_dropped:
        h, dropped = h
    with jax.named_scope(scopes.LM_HEAD):
        out = jnp.einsum("btd,dv->btv", h, lm_head_at_use(params).astype(h.dtype), preferred_element_type=jnp.float32)
    return (out, dropped) if with_moe_dropped else out


def next_token_logprobs(params, cfg: Config, tokens_BT, segment_ids_BT=None, positions_BT=None, *,
                        temperature: float = 1.0, routing_BTLk=None, with_moe_dropped: bool = False):
    """(log p(token t+1 | tokens <= t), entropy of that next-token distribution), float32 [B, T-1],
    of softmax(logits / temperature), by the chunked LM head (kernels/logprobs.py: the [tokens,
    vocab] logits are never built; chunks from kernels.logprobs). with_moe_dropped: and the MoE rows
    dropped in all layers; routing_BTLk: route by these experts (moe.routing_replay)."""
    h = decoder_hidden(params, cfg, tokens_BT, segment_ids_BT, positions_BT, with_moe_dropped=with_moe_dropped,
                       routing_BTLk=routing_BTLk)
    if with_moe_dropped:
        h, dropped = h
    # Every position scores the next token; the last one's target is a stand-in (position 0's token)
    # whose results are cut off, so the token arrays keep the length the mesh splits.
    targets_BT = jnp.concatenate([tokens_BT[:, 1:], tokens_BT[:, :1]], axis=1)
    with jax.named_scope(scopes.LM_HEAD):
        logp_BT, entropy_BT = per_shard_token_logprobs(h, lm_head_at_use(params).astype(h.dtype), targets_BT, cfg,
                                                       temperature=temperature)
    out = (logp_BT[:, :-1], entropy_BT[:, :-1])
    return (*out, dropped) if with_moe_dropped else out


def per_shard_token_logprobs(h_BTD, lm_head_DV, targets_BT, cfg: Config, *, temperature: float = 1.0):
    """kernels/logprobs.chunked_token_logprobs on each device's own tokens. Its chunk loop is a scan
    over token chunks, which GSPMD cannot split: traced over the global [B, T] it gathers every
    token's hidden state onto every device (at the 397B cell, 64 x 65,536 x 4,096 bf16 = 32 GiB per
    device, twice). Under a mesh it runs in a shard_map over the token shards instead, the LM head
    gathered whole (its gradient summed over the shards by shard_map's transpose); where the tokens
    do not divide over their mesh axes, over the global arrays."""
    chunks = cfg.kernels.logprobs

    def local(h, w, t):
        return chunked_token_logprobs(h, w, t, chunk_tokens=chunks.chunk_tokens, chunk_vocab=chunks.chunk_vocab,
                                      temperature=temperature, save_logits=chunks.save_logits)

    if jax.sharding.get_abstract_mesh().empty:
        return local(h_BTD, lm_head_DV, targets_BT)
    hidden, ids = logical_to_spec(("batch", "seq", None)), logical_to_spec(("batch", "seq"))
    if not splits_evenly(ids, targets_BT.shape):
        return local(h_BTD, lm_head_DV, targets_BT)
    return jax.shard_map(local, in_specs=(hidden, jax.sharding.PartitionSpec(), ids), out_specs=(ids, ids),
                         check_vma=False)(h_BTD, lm_head_DV, targets_BT)


def token_logprobs(params, cfg, tokens_BT, segment_ids_BT=None, positions_BT=None):
    """log p(token t+1 | tokens <= t): [B, T-1] float32. `cfg` is a Config or a ModelConfig."""
    if isinstance(cfg, ModelConfig):
        cfg = Config(model=cfg)
    return next_token_logprobs(params, cfg, tokens_BT, segment_ids_BT, positions_BT)[0]
