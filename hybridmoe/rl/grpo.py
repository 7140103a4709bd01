"""The GRPO policy update (design/RL.md, steps 3-5) on the mesh.

Shape legend: M micro-batches, b rows per micro-batch, T tokens per row (prompt + completion),
P prompts, G completions per prompt.

A step's P * G rollout rows are split into M micro-batches [M, b, T]. Per micro-batch: the decoder's
hidden states, per-token log-probs and entropies by `chunked_token_logprobs` (never the
[tokens, vocab] logits), the clipped objective with the BATCH-wide normaliser (so the micro-batch
losses and gradients sum to exactly those of one big batch), optionally the k3 KL to a frozen
reference policy. `train.step.accumulate_grads` sums losses, metric numerators and gradients over
the micro-batches; then clipping and AdamW as in supervised training.

A step whose batch keeps no token (every group zero-variance or masked) or whose gradient is not
finite leaves params and optimizer state unchanged: AdamW's momentum would otherwise move the
weights on a zero gradient, and a NaN would poison them for good. `update_applied` records which.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.model.forward import decoder_hidden, lm_head_at_use
from hybridmoe.rl.logprobs import chunked_token_logprobs
from hybridmoe.rl.objective import clipped_policy_loss
from hybridmoe.train.step import accumulate_grads, make_optimizer

# Per-micro-batch sums; each metric is a ratio of two of them over the whole step.
_SUM_KEYS = ("kept_tokens", "completion_tokens", "entropy_sum", "logp_sum", "kl_sum", "clipped_sum",
             "clipped_high_sum", "clipped_low_sum", "ratio_sum", "pg_loss")


def rl_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The supervised optimizer (train.* betas, clip, decay) at the GRPO phase's learning rate."""
    return make_optimizer(cfg.train.model_copy(update={"learning_rate": cfg.rl.learning_rate,
                                                       "warmup_steps": cfg.rl.lr_warmup_steps}))


def sequence_logprobs(params, cfg: Config, tokens_BT, segment_ids_BT, positions_BT):
    """(log p of each next token, entropy of each next-token distribution), float32 [B, T-1]."""
    h = decoder_hidden(params, cfg, tokens_BT, segment_ids_BT, positions_BT)
    return chunked_token_logprobs(h[:, :-1], lm_head_at_use(params).astype(h.dtype), tokens_BT[:, 1:],
                                  chunk_tokens=cfg.rl.logprob_chunk_tokens, chunk_vocab=cfg.rl.logprob_chunk_vocab)


def micro_batch_loss(params, ref_params, cfg: Config, mb):
    """(this micro-batch's share of the step loss, its metric sums)."""
    r = cfg.rl
    logp, entropy = sequence_logprobs(params, cfg, mb["tokens"], mb["segment_ids"], mb["positions"])
    logp_ref = None
    if ref_params is not None:
        logp_ref, _ = sequence_logprobs(jax.lax.stop_gradient(ref_params), cfg, mb["tokens"], mb["segment_ids"],
                                        mb["positions"])
    loss, m = clipped_policy_loss(logp, mb["logp_old"], mb["advantages"], mb["mask"], eps=r.eps, eps_high=r.eps_high,
                                  beta=r.beta, logp_ref_BT=logp_ref, aggregation=r.aggregation, keep_B=mb["keep"],
                                  normalizer=mb["normalizer"])
    kept = m["num_tokens"]
    completion = mb["mask"].astype(jnp.float32)
    sg = jax.lax.stop_gradient
    sums = {
        "kept_tokens": kept,
        "completion_tokens": completion.sum(),
        # Entropy and log-prob over every completion token, kept or not: what the policy does.
        "entropy_sum": sg((entropy * completion).sum()),
        "logp_sum": sg((logp * completion).sum()),
        "kl_sum": m["kl"] * kept,
        "clipped_sum": m["pg_clipfrac"] * kept,
        "clipped_high_sum": m["pg_clipfrac_high"] * kept,
        "clipped_low_sum": m["pg_clipfrac_low"] * kept,
        "ratio_sum": m["ratio_mean"] * kept,
        "pg_loss": m["pg_loss"],
    }
    return loss, sums


def grpo_step(cfg: Config, optimizer: optax.GradientTransformation):
    """(state, ref_params or None, batch [M, ...]) -> (state, metrics)."""

    def step(state, ref_params, batch):
        params = state["params"]
        loss, sums, grads = accumulate_grads(lambda p, mb: micro_batch_loss(p, ref_params, cfg, mb), params, batch)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        apply = (sums["kept_tokens"] > 0) & jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        keep_old = lambda new, old: jnp.where(apply, new, old)
        kept = jnp.maximum(sums["kept_tokens"], 1.0)
        completion = jnp.maximum(sums["completion_tokens"], 1.0)
        metrics = {
            "loss": loss, "pg_loss": sums["pg_loss"], "grad_norm": grad_norm,
            "entropy": sums["entropy_sum"] / completion, "logp_mean": sums["logp_sum"] / completion,
            "kl": sums["kl_sum"] / kept, "pg_clipfrac": sums["clipped_sum"] / kept,
            "pg_clipfrac_high": sums["clipped_high_sum"] / kept, "pg_clipfrac_low": sums["clipped_low_sum"] / kept,
            "ratio_mean": jnp.where(sums["kept_tokens"] > 0, sums["ratio_sum"] / kept, 1.0),
            "kept_tokens": sums["kept_tokens"], "update_applied": apply.astype(jnp.float32),
        }
        new_state = {"params": jax.tree.map(keep_old, new_params, params),
                     "opt_state": jax.tree.map(keep_old, opt_state, state["opt_state"]),
                     "step": state["step"] + 1}
        return new_state, metrics

    return step


def step_normalizer(cfg: Config, mask_BT: np.ndarray, keep_B: np.ndarray) -> float:
    """The batch-wide denominator of the loss: kept completion tokens (token_mean) or kept
    sequences with a completion token (seq_mean_token_mean)."""
    kept_BT = mask_BT * keep_B[:, None]
    if cfg.rl.aggregation == "token_mean":
        return float(kept_BT.sum())
    return float((kept_BT.sum(axis=1) > 0).sum())


def build_update_batch(cfg: Config, rollout: dict, advantages_B: np.ndarray, keep_B: np.ndarray) -> dict:
    """Host arrays [M, b, ...] for the step from one rollout (rows [B, P + N], B = P * G)."""
    r = cfg.rl
    tokens = np.asarray(rollout["tokens"])
    B, T = tokens.shape
    P = T - r.max_new_tokens
    lengths = np.asarray(rollout["lengths"])
    # Target t + 1 is completion token j = t + 1 - P: logp_old and the mask sit at index t.
    mask_BN = np.arange(r.max_new_tokens)[None, :] < lengths[:, None]
    mask_BT = np.concatenate([np.zeros((B, P - 1), np.float32), mask_BN.astype(np.float32)], axis=1)
    logp_old_BT = np.concatenate([np.zeros((B, P - 1), np.float32), np.asarray(rollout["logprobs"], np.float32)],
                                 axis=1)
    M = r.micro_batches
    split = lambda x: np.asarray(x).reshape(M, B // M, *np.shape(x)[1:])
    normalizer = step_normalizer(cfg, mask_BT, keep_B.astype(np.float32))
    return {"tokens": split(tokens), "segment_ids": split(rollout["segment_ids"]),
            "positions": split(rollout["positions"]), "logp_old": split(logp_old_BT), "mask": split(mask_BT),
            "advantages": split(advantages_B.astype(np.float32)), "keep": split(keep_B.astype(bool)),
            "normalizer": np.full((M,), normalizer, np.float32)}


def update_batch_shardings(setup) -> dict:
    """Rows over the batch axes, micro-batch and token axes unsharded; the normaliser replicated."""
    rows = setup.batch_sharding(1)  # [M, b, T]
    per_row = NamedSharding(setup.mesh, PartitionSpec(*rows.spec[:2]))  # [M, b]
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return {"tokens": rows, "segment_ids": rows, "positions": rows, "logp_old": rows, "mask": rows,
            "advantages": per_row, "keep": per_row, "normalizer": replicated}


def jit_grpo_step(setup, optimizer: optax.GradientTransformation, with_reference: bool):
    """The compiled step; the reference params (when held) use the policy's shardings and are not donated."""
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    ref_sh = setup.param_shardings if with_reference else None
    return jax.jit(grpo_step(setup.cfg, optimizer),
                   in_shardings=(setup.state_shardings, ref_sh, update_batch_shardings(setup)),
                   out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,))
