"""Rollouts: prefill once per prompt, then token-by-token decode of its group under one `lax.while_loop`.

Shape legend: Q prompts, G completions per prompt, B = Q x G rows, P prompt slots (left-padded),
N max new tokens, V vocab.

Each row's prompt is left-padded to P with segment 0, so all rows decode in lock-step (the same
cache slot per step) and padding never enters a state. Sampling is greedy (temperature 0) or from
softmax(logits / temperature) restricted to the top-k tokens and the top-p nucleus. The returned
log-prob of each sampled token is that of the distribution it was actually drawn from: the
temperature-scaled softmax renormalised over the kept tokens (0 for greedy, a point mass). It is
the behaviour policy of importance correction (rl.importance_correction); where top-k and top-p
keep every token, it equals the trainer's log-prob at the same temperature on the same tokens.
A row stops
at EOS (EOS included in its completion); later slots hold padding. A row that reaches N tokens
without EOS is truncated.

The returned rows are ready for the trainer: tokens [B, P + N] = prompt then completion, with
segment 1 on the prompt's real tokens and the completion (through EOS), 0 elsewhere, and positions
counting from 0 at each row's first real token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.model.decode import cache_rows, cached_hidden, grow_cache, init_cache, next_token_logits, prefill
from hybridmoe.parallel.context import sequence_unsharded
from hybridmoe.parallel.rules import active_rules, mesh_axes_of, use_rules


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    eos_id: int = 2
    pad_id: int = 0
    top_k: int = 0  # 0 = off
    stop_ids: tuple[int, ...] = ()  # more ids that end a row (generation_config.json's eos_token_id list)


def ends_row(tokens, opts: SamplingOptions):
    """Whether each token ends its row: the EOS or one of the stop ids."""
    ids = jnp.asarray((opts.eos_id, *opts.stop_ids), jnp.int32)
    return jnp.any(tokens[..., None] == ids, axis=-1)


def left_pad_prompts(prompt_ids: Sequence[Sequence[int]], prompt_len: int, pad_id: int):
    """numpy (tokens, segment_ids, positions) [B, prompt_len]: each prompt right-aligned, segment 1,
    positions 0.. from its first token; the padding on the left has segment 0 and position 0."""
    B = len(prompt_ids)
    tokens = np.full((B, prompt_len), pad_id, np.int32)
    seg = np.zeros((B, prompt_len), np.int32)
    pos = np.zeros((B, prompt_len), np.int32)
    for i, ids in enumerate(prompt_ids):
        n = len(ids)
        if not 0 < n <= prompt_len:
            raise ValueError(f"prompt {i} has {n} tokens; a prompt needs 1 to {prompt_len} (rl.max_prompt_len)")
        tokens[i, prompt_len - n:] = ids
        seg[i, prompt_len - n:] = 1
        pos[i, prompt_len - n:] = np.arange(n)
    return tokens, seg, pos


def sampling_logits(logits_BV, temperature: float, top_p: float, top_k: int = 0):
    """float32 logits of the distribution a token is drawn from: logits / temperature with every
    token outside the top-k (k > 0) and the top-p nucleus (the fewest most likely tokens whose
    mass reaches top_p; ties at its edge stay in) set to -inf. The most likely token always stays."""
    scaled_BV = logits_BV / temperature
    if top_k > 0 and top_k < scaled_BV.shape[-1]:
        kth_B = jax.lax.top_k(scaled_BV, top_k)[0][:, -1]
        scaled_BV = jnp.where(scaled_BV >= kth_B[:, None], scaled_BV, -jnp.inf)
    if top_p < 1.0:
        sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        threshold_B = jnp.min(jnp.where(mass_before_BV < top_p, sorted_BV, jnp.inf), axis=-1)
        scaled_BV = jnp.where(scaled_BV >= threshold_B[:, None], scaled_BV, -jnp.inf)
    return scaled_BV


def choose_tokens(logits_BV, key, temperature: float, top_p: float, top_k: int = 0):
    """(token [B] int32, its log-prob under the distribution drawn from [B] float32). Greedy at
    temperature 0 (log-prob 0: a point mass); otherwise a draw from `sampling_logits`."""
    if temperature == 0:
        token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        return token_B, jnp.zeros(token_B.shape, jnp.float32)
    drawn_BV = sampling_logits(logits_BV, temperature, top_p, top_k)
    token_B = jax.random.categorical(key, drawn_BV, axis=-1).astype(jnp.int32)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(drawn_BV, axis=-1), token_B[:, None], axis=-1)[:, 0]
    return token_B, logp_B


def generate(params, cfg: Config, opts: SamplingOptions, tokens_QP, segment_ids_QP, positions_QP, key, *,
             group_size: int = 1):
    """Sample `group_size` completions of each of Q prompts [Q, P] (left-padded). Returns a dict of
    arrays over the B = Q * group_size rows, prompt q's completions in rows q * G .. q * G + G - 1:
    completion [B, N] int32 (padding after EOS), logprobs [B, N] float32 (the sampling distribution's,
    0 past the end),
    lengths [B] int32 (tokens through EOS), truncated [B] bool, and the trainer's rows
    tokens / segment_ids / positions [B, P + N]; with moe.routing_replay also routing int32
    [B, P + N, layers, k], the experts each row's tokens went to (what the trainer then replays).

    Each prompt is prefilled once (rl.prefill_chunk tokens at a time), on Q rows, and its cache and
    GDN state copied to its G rows, which then decode in lock-step.

    Under context parallelism the sampler runs without it (parallel/context.sequence_unsharded):
    the rows stay split over the batch axes and the context ranks decode the same rows."""
    with use_rules(sequence_unsharded(active_rules())):
        return _generate(params, cfg, opts, tokens_QP, segment_ids_QP, positions_QP, key, group_size)


def _batch_shards() -> int:
    """How many ways the active mesh splits the logical batch axis (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return math.prod(dict(mesh.shape)[a] for a in mesh_axes_of(active_rules()["batch"]))


def share_prompts(cache, logits_QV, routing_QPLk, rows_B):
    """Each row's copy of its prompt's prefilled state: the cache, the next-token logits and (routing
    replay) the prompt tokens' experts of prompt rows_B[b] for row b."""
    take = lambda a: None if a is None else jnp.take(a, rows_B, axis=0)  # noqa: E731
    return cache_rows(cache, rows_B), take(logits_QV), take(routing_QPLk)


def _generate(params, cfg: Config, opts: SamplingOptions, tokens_QP, segment_ids_QP, positions_QP, key,
              group_size: int):
    Q, P = tokens_QP.shape
    G = group_size
    B = Q * G
    N = opts.max_new_tokens
    replay = cfg.moe.routing_replay
    # The prefill's rows: the prompts, padded with copies of the last to a multiple of the batch
    # shards so every shard prefills as many (the copies are never read).
    shards = _batch_shards()
    prefill_rows = -(-Q // shards) * shards
    rows_B = np.arange(B) // G
    prompt = lambda a_QP: a_QP if prefill_rows == Q else a_QP[np.minimum(np.arange(prefill_rows), Q - 1)]  # noqa: E731
    # The prompts' cache holds their P slots only: the copies to each group's rows read P slots,
    # and the completion's N slots are added after them (a prefill cache of P + N slots copied
    # across the batch shards is what made the 397B cell's sampler need 120 GiB a device).
    cache = init_cache(cfg, prefill_rows, P)
    hidden_QD, cache, routing_QPLk = prefill(params, cfg, cache, prompt(tokens_QP), prompt(segment_ids_QP),
                                             prompt(positions_QP), chunk_tokens=cfg.rl.prefill_chunk,
                                             with_routing=replay)
    logits_BV = next_token_logits(params, hidden_QD)
    routing_BPLk = routing_QPLk
    tokens_BP, segment_ids_BP, positions_BP = tokens_QP, segment_ids_QP, positions_QP
    if G > 1 or prefill_rows != Q:
        cache, logits_BV, routing_BPLk = share_prompts(cache, logits_BV, routing_QPLk, rows_B)
        tokens_BP, segment_ids_BP, positions_BP = (a[rows_B] for a in (tokens_QP, segment_ids_QP, positions_QP))
    cache = grow_cache(cache, P + N)
    next_pos_B = positions_BP[:, -1] + 1
    # Routing replay: the experts of every token in every layer, [B, P + N, layers, k].
    k = cfg.model.num_experts_per_tok
    routing_BSLk = None
    if replay:
        routing_BSLk = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, P + N, cfg.model.num_layers, k))
        routing_BSLk = jax.lax.dynamic_update_slice_in_dim(routing_BSLk, routing_BPLk, 0, axis=1)

    def cond(carry):
        t, _, _, _, _, done_B, _, _ = carry
        return (t < N) & ~jnp.all(done_B)

    def body(carry):
        t, logits_BV, cache, completion_BN, logprobs_BN, done_B, pos_B, routing_BSLk = carry
        token_B, logp_B = choose_tokens(logits_BV, jax.random.fold_in(key, t), opts.temperature, opts.top_p,
                                        opts.top_k)
        token_B = jnp.where(done_B, opts.pad_id, token_B)
        logp_B = jnp.where(done_B, 0.0, logp_B)
        completion_BN = jax.lax.dynamic_update_slice_in_dim(completion_BN, token_B[:, None], t, axis=1)
        logprobs_BN = jax.lax.dynamic_update_slice_in_dim(logprobs_BN, logp_B[:, None], t, axis=1)
        done_B = done_B | ends_row(token_B, opts)
        # Finished rows keep decoding padding in their own segment; nothing reads their outputs.
        out = cached_hidden(params, cfg, cache, token_B[:, None], jnp.ones((B, 1), jnp.int32), pos_B[:, None],
                            with_routing=replay)
        hidden_B1D, cache = out[:2]
        if replay:
            routing_BSLk = jax.lax.dynamic_update_slice_in_dim(routing_BSLk, out[2], P + t, axis=1)
        return (t + 1, next_token_logits(params, hidden_B1D[:, 0]), cache, completion_BN, logprobs_BN, done_B,
                pos_B + 1, routing_BSLk)

    init = (jnp.int32(0), logits_BV, cache, jnp.full((B, N), opts.pad_id, jnp.int32), jnp.zeros((B, N), jnp.float32),
            jnp.zeros((B,), bool), next_pos_B, routing_BSLk)
    _, _, _, completion_BN, logprobs_BN, _, _, routing_BSLk = jax.lax.while_loop(cond, body, init)

    is_eos_BN = ends_row(completion_BN, opts)
    has_eos_B = jnp.any(is_eos_BN, axis=1)
    lengths_B = jnp.where(has_eos_B, jnp.argmax(is_eos_BN, axis=1) + 1, N).astype(jnp.int32)
    in_completion_BN = jnp.arange(N)[None, :] < lengths_B[:, None]
    rows_tokens = jnp.concatenate([tokens_BP, completion_BN], axis=1)
    rows_seg = jnp.concatenate([segment_ids_BP, in_completion_BN.astype(jnp.int32)], axis=1)
    completion_pos_BN = next_pos_B[:, None] + jnp.arange(N, dtype=jnp.int32)[None, :]
    rows_pos = jnp.concatenate([positions_BP, jnp.where(in_completion_BN, completion_pos_BN, 0)], axis=1)
    if replay:
        # Slots past a row's end hold experts 0..k-1 however long the loop ran (early stop changes
        # nothing but time); they are padding to the trainer.
        past_end_BS = jnp.concatenate([jnp.zeros((B, P), bool), ~in_completion_BN], axis=1)
        routing_BSLk = jnp.where(past_end_BS[:, :, None, None], jnp.arange(k, dtype=jnp.int32), routing_BSLk)
    out = {"completion": completion_BN, "logprobs": jnp.where(in_completion_BN, logprobs_BN, 0.0),
           "lengths": lengths_B, "truncated": ~has_eos_B,
           "tokens": rows_tokens, "segment_ids": rows_seg, "positions": rows_pos}
    return {**out, "routing": routing_BSLk} if replay else out


def make_generate(cfg: Config, opts: SamplingOptions, *, group_size: int = 1, in_shardings=None,
                  out_shardings=None):
    """The jitted sampler (compiled once per prompt shape): (params, prompt tokens, segment_ids,
    positions [Q, P], key) -> generate's dict over Q * group_size rows."""
    fn = lambda params, tokens, seg, pos, key: generate(params, cfg, opts, tokens, seg, pos, key,  # noqa: E731
                                                        group_size=group_size)
    if in_shardings is None:
        return jax.jit(fn)
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
