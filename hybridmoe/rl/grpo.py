"""The GRPO policy update (docs/rl.md, "One GRPO step", steps 3-5) on the mesh.

Shape legend: M micro-batches, b rows per micro-batch, T tokens per row (prompt + completion),
P prompts, G completions per prompt.

The trainer's policy is the model at the sampling temperature (rl.temperature): the log-probs of
the distribution the sampler draws from before top-p/top-k truncation. The ratio's denominator
pi_old is the trainer's own log-prob under the parameters the rollout came from. The first update of every
rollout runs on those parameters, so its pi_old is the update's own log-prob with its gradient
stopped, and its ratio is exactly 1 on every path (one or several updates, epochs, micro-batches,
routing replay; any temperature): the batch's `on_policy` flag says so. Later updates
(rl.updates_per_rollout > 1, PPO-style mini-batches x epochs) have moved the parameters: they
read pi_old recomputed once per rollout, before the first update, by `jit_old_logprobs` (the same
policy at the same temperature and routing, in another program: equal to float rounding). The sampler's log-probs (the distribution actually sampled, truncation included) enter only
the importance correction (rl.importance_correction) and the logged train/sampler gap.

One update's rows are split into M micro-batches [M, b, T]. Per micro-batch: the decoder's hidden
states, per-token log-probs and entropies by `model.forward.next_token_logprobs` (never the [tokens, vocab]
logits), the clipped objective with the update-wide normaliser (so the micro-batch losses and
gradients sum to exactly those of one big batch), optionally the k3 KL to a frozen reference
policy. `run.step.accumulate_grads` sums losses, metric numerators and gradients over the
micro-batches (the ratio's max and min reduce by max and min); then clipping and AdamW as in
supervised training. `combine_update_metrics` reduces the metrics of a rollout's updates the same way.

A step whose batch keeps no token (every group zero-variance or masked) or whose gradient is not
finite (unless train.on_nonfinite=off) leaves params and optimizer state unchanged: AdamW's momentum
would otherwise move the weights on a zero gradient, and a NaN would poison them for good.
`update_applied` records which; `update_skipped` counts the non-finite ones (what the run's guard counts).
"""

from __future__ import annotations

import time

import numpy as np
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.model import scopes
from hybridmoe.model.forward import next_token_logprobs
from hybridmoe.rl.objective import clipped_policy_loss, importance_weights
from hybridmoe.run.step import accumulate_grads, guarded, keep_if_not, make_optimizer, skip_if_nonfinite

# Per-micro-batch sums; each metric is a ratio of two of them over the whole step.
_SUM_KEYS = ("kept_tokens", "completion_tokens", "entropy_sum", "logp_sum", "kl_sum", "clipped_sum",
             "clipped_high_sum", "clipped_low_sum", "ratio_sum", "pg_loss", "gap_sum", "is_weight_sum",
             "is_masked_rows", "rows_with_tokens")
# Per-micro-batch extremes: (how two combine, the identity).
_EXTREMES = {"ratio_max": (jnp.maximum, -jnp.inf), "ratio_min": (jnp.minimum, jnp.inf),
             "gap_max": (jnp.maximum, 0.0)}
SHUFFLE_STREAM = 3  # the rng stream of the mini-batch shuffles (the prompts use warmup.PROMPT_STREAM)


def rl_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The supervised optimizer (train.* betas, clip, decay) at the GRPO phase's learning rate."""
    return make_optimizer(cfg.train.model_copy(update={"learning_rate": cfg.rl.learning_rate,
                                                       "warmup_steps": cfg.rl.lr_warmup_steps}))


def sequence_logprobs(params, cfg: Config, tokens_BT, segment_ids_BT, positions_BT, routing_BTLk=None):
    """(log p of each next token, entropy of each next-token distribution), float32 [B, T-1], of
    the policy at the sampling temperature; routing_BTLk: the sampler's experts (routing replay)."""
    return next_token_logprobs(params, cfg, tokens_BT, segment_ids_BT, positions_BT, routing_BTLk=routing_BTLk,
                               temperature=cfg.rl.temperature or 1.0)


def micro_batch_loss(params, ref_params, cfg: Config, mb):
    """(this micro-batch's share of the step loss, its metric sums and extremes)."""
    r = cfg.rl
    sg = jax.lax.stop_gradient
    rows = (mb["tokens"], mb["segment_ids"], mb["positions"], mb.get("routing"))
    logp, entropy = sequence_logprobs(params, cfg, *rows)
    # On policy (the rollout's own params: one update per rollout, or the first of several),
    # pi_old is logp itself, so the ratio is exp(0) = 1 exactly; later updates read the recomputed one.
    logp_old = sg(logp) if "logp_old" not in mb else jnp.where(mb["on_policy"], sg(logp), mb["logp_old"])
    logp_ref = None
    if ref_params is not None:
        logp_ref, _ = sequence_logprobs(sg(ref_params), cfg, *rows)
    completion = mb["mask"].astype(jnp.float32)
    is_weight = importance_weights(r.importance_correction, r.importance_cap, logp_old, mb["logp_sampler"], completion)
    loss, m = clipped_policy_loss(logp, logp_old, mb["advantages"], mb["mask"], eps=r.eps, eps_high=r.eps_high,
                                  beta=r.beta, logp_ref_BT=logp_ref, aggregation=r.aggregation, keep_B=mb["keep"],
                                  normalizer=mb["normalizer"], is_weight_BT=is_weight)
    kept = m["num_tokens"]
    kept_BT = completion * mb["keep"].astype(jnp.float32)[:, None]
    gap_BT = jnp.abs(sg(logp_old) - mb["logp_sampler"]) * completion
    rows_with_tokens_B = completion.sum(axis=1) > 0
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
        "gap_sum": gap_BT.sum(),
        "is_weight_sum": (kept_BT if is_weight is None else is_weight * kept_BT).sum(),
        "is_masked_rows": (jnp.float32(0) if is_weight is None
                           else (rows_with_tokens_B & (is_weight[:, 0] == 0)).sum().astype(jnp.float32)),
        "rows_with_tokens": rows_with_tokens_B.sum().astype(jnp.float32),
        "ratio_max": jnp.where(kept > 0, m["ratio_max"], -jnp.inf),
        "ratio_min": jnp.where(kept > 0, m["ratio_min"], jnp.inf),
        "gap_max": gap_BT.max(),
    }
    return loss, sums


def grpo_step(cfg: Config, optimizer: optax.GradientTransformation):
    """(state, ref_params or None, batch [M, ...]) -> (state, metrics)."""

    def step(state, ref_params, batch):
        params = state["params"]
        loss, sums, grads = accumulate_grads(lambda p, mb: micro_batch_loss(p, ref_params, cfg, mb), params, batch,
                                             reducers=_EXTREMES)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        with jax.named_scope(scopes.OPTIMIZER):
            updates, opt_state = optimizer.update(grads, state["opt_state"], params)
            new = (optax.apply_updates(params, updates), opt_state)
        any_kept = sums["kept_tokens"] > 0
        old = (params, state["opt_state"])
        new_params, opt_state = keep_if_not(any_kept, new, old)
        apply, skipped = any_kept, jnp.int32(0)
        if guarded(cfg.train):
            (new_params, opt_state), skipped = skip_if_nonfinite(loss, grad_norm, (new_params, opt_state), old)
            apply = apply & (skipped == 0)
        metrics = {"loss": loss, "grad_norm": grad_norm, "update_applied": apply.astype(jnp.float32),
                   "update_skipped": skipped.astype(jnp.float32),
                   **{k: sums[k] for k in (*_SUM_KEYS, *_EXTREMES)}}
        metrics.update(step_metrics(metrics, any_kept, jnp.where, jnp.maximum))
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics

    return step


def step_metrics(sums, any_kept, where=np.where, maximum=np.maximum) -> dict:
    """The logged ratios from the sums and extremes (of one update, or of all updates of a rollout)."""
    kept = maximum(sums["kept_tokens"], 1.0)
    completion = maximum(sums["completion_tokens"], 1.0)
    return {
        "entropy": sums["entropy_sum"] / completion, "logp_mean": sums["logp_sum"] / completion,
        "kl": sums["kl_sum"] / kept, "pg_clipfrac": sums["clipped_sum"] / kept,
        "pg_clipfrac_high": sums["clipped_high_sum"] / kept, "pg_clipfrac_low": sums["clipped_low_sum"] / kept,
        "ratio_mean": where(any_kept, sums["ratio_sum"] / kept, 1.0),
        "ratio_max": where(any_kept, sums["ratio_max"], 1.0), "ratio_min": where(any_kept, sums["ratio_min"], 1.0),
        "sampler_gap_mean": sums["gap_sum"] / completion, "sampler_gap_max": sums["gap_max"],
        "is_weight_mean": where(any_kept, sums["is_weight_sum"] / kept, 1.0),
        "is_masked_frac": sums["is_masked_rows"] / maximum(sums["rows_with_tokens"], 1.0),
    }


def combine_update_metrics(per_update: list[dict]) -> dict:
    """One record for a rollout's updates: sums add up, extremes take the max of the maxima (min of
    the minima), loss and grad_norm are the mean over the updates, update_applied the fraction,
    update_skipped the number of updates the numerics guard skipped."""
    total = {k: float(sum(u[k] for u in per_update)) for k in _SUM_KEYS}
    total["ratio_max"] = max(u["ratio_max"] for u in per_update)
    total["ratio_min"] = min(u["ratio_min"] for u in per_update)
    total["gap_max"] = max(u["gap_max"] for u in per_update)
    for k in ("loss", "pg_loss", "grad_norm", "update_applied"):
        total[k] = float(np.mean([u[k] for u in per_update]))
    total["grad_norm_max"] = float(max(u["grad_norm"] for u in per_update))
    total["update_skipped"] = float(sum(u["update_skipped"] for u in per_update))
    total["updates"] = float(len(per_update))
    total.update({k: float(v) for k, v in step_metrics(total, total["kept_tokens"] > 0).items()})
    return total


def step_normalizer(cfg: Config, mask_BT: np.ndarray, keep_B: np.ndarray) -> float:
    """The batch-wide denominator of the loss: kept completion tokens (token_mean) or kept
    sequences with a completion token (seq_mean_token_mean)."""
    kept_BT = mask_BT * keep_B[:, None]
    if cfg.rl.aggregation == "token_mean":
        return float(kept_BT.sum())
    return float((kept_BT.sum(axis=1) > 0).sum())


def update_rows(cfg: Config, rollout: dict, advantages_B: np.ndarray, keep_B: np.ndarray) -> dict:
    """Host arrays [B, ...] of one rollout (rows [B, P + N], B = P * G), indexed as the trainer's
    targets: token t + 1 is predicted at index t, so completion token j sits at index P - 1 + j."""
    r = cfg.rl
    tokens = np.asarray(rollout["tokens"])
    B, T = tokens.shape
    P = T - r.max_new_tokens
    lengths = np.asarray(rollout["lengths"])
    mask_BN = np.arange(r.max_new_tokens)[None, :] < lengths[:, None]
    mask_BT = np.concatenate([np.zeros((B, P - 1), np.float32), mask_BN.astype(np.float32)], axis=1)
    logp_sampler_BT = np.concatenate([np.zeros((B, P - 1), np.float32),
                                      np.asarray(rollout["logprobs"], np.float32)], axis=1)
    out = {"tokens": tokens, "segment_ids": np.asarray(rollout["segment_ids"]),
           "positions": np.asarray(rollout["positions"]), "logp_sampler": logp_sampler_BT * mask_BT,
           "mask": mask_BT, "advantages": np.asarray(advantages_B, np.float32), "keep": np.asarray(keep_B, bool)}
    if cfg.moe.routing_replay:  # [B, T, layers, k]: the experts of token t, aligned with tokens
        out["routing"] = np.asarray(rollout["routing"], np.int32)
    return out


def split_update_batch(cfg: Config, rows: dict, on_policy: bool = False, micro_batches: int | None = None) -> dict:
    """One update's rows [B', ...] as [M, B' / M, ...] micro-batches (M: `micro_batches`, default
    rl.micro_batches) with the update-wide normaliser; with a recomputed pi_old
    (rows["logp_old"]) also the flag [M] of the rollout's first update (`on_policy`: the step takes
    its own log-probs as pi_old)."""
    # rl.micro_batches=auto outside a run's plan (rl/memory_plan.py; a test, the gates): the fewest, 1.
    M = cfg.rl.fewest_micro_batches if micro_batches is None else micro_batches
    B = rows["tokens"].shape[0]
    if B % M:
        raise ValueError(f"rl.micro_batches={M} does not divide an update's {B} rows")
    split = lambda x: np.asarray(x).reshape(M, B // M, *np.shape(x)[1:])
    normalizer = step_normalizer(cfg, rows["mask"], rows["keep"].astype(np.float32))
    out = {**{k: split(v) for k, v in rows.items()}, "normalizer": np.full((M,), normalizer, np.float32)}
    if "logp_old" in rows:
        out["on_policy"] = np.full((M,), on_policy, bool)
    return out


def build_update_batch(cfg: Config, rollout: dict, advantages_B: np.ndarray, keep_B: np.ndarray) -> dict:
    """Host arrays [M, b, ...] for one update on the whole rollout."""
    return split_update_batch(cfg, update_rows(cfg, rollout, advantages_B, keep_B))


def mini_batch_rows(cfg: Config, num_rows: int, step: int) -> list[np.ndarray]:
    """The row indices of each update of a rollout: rl.epochs_per_rollout passes, each a fresh
    shuffle (a pure function of (seed, step, pass)) cut into rl.mini_batches equal mini-batches."""
    r = cfg.rl
    if num_rows % r.mini_batches:
        raise ValueError(f"{r.mini_batches} mini-batches do not divide the {num_rows} rollouts of a step")
    size = num_rows // r.mini_batches
    out = []
    for epoch in range(r.epochs_per_rollout):
        order = (np.arange(num_rows) if r.mini_batches == 1 else
                 np.random.default_rng([cfg.train.seed, SHUFFLE_STREAM, step, epoch]).permutation(num_rows))
        out.extend(order[i * size:(i + 1) * size] for i in range(r.mini_batches))
    return out


def update_batch_shardings(setup, with_old_logprobs: bool = False) -> dict:
    """Token rows [M, b, T] as training batches (batch axes, and the sequence over mesh.context);
    per-row [M, b] and per-target [M, b, T - 1] arrays over the batch axes only (T - 1 cannot split
    over the context ranks that split T); the normaliser replicated."""
    rows = setup.batch_sharding(1)  # [M, b, T]
    per_row = NamedSharding(setup.mesh, PartitionSpec(*rows.spec[:2]))  # [M, b] and [M, b, T - 1]
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    out = {"tokens": rows, "segment_ids": rows, "positions": rows, "logp_sampler": per_row, "mask": per_row,
           "advantages": per_row, "keep": per_row, "normalizer": replicated}
    if setup.cfg.moe.routing_replay:
        out["routing"] = NamedSharding(setup.mesh, PartitionSpec(*rows.spec, None, None))
    return {**out, "logp_old": per_row, "on_policy": replicated} if with_old_logprobs else out


def jit_grpo_step(setup, with_reference: bool):
    """The compiled step, with rl_optimizer(setup.cfg); the reference params (when held) use the
    policy's shardings and are not donated. Above one update per rollout the batch carries the
    recomputed pi_old (logp_old) and the rollout's-first-update flag (on_policy)."""
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    ref_sh = setup.param_shardings if with_reference else None
    batch_sh = update_batch_shardings(setup, with_old_logprobs=setup.cfg.rl.updates_per_rollout > 1)
    return jax.jit(grpo_step(setup.cfg, rl_optimizer(setup.cfg)),
                   in_shardings=(setup.state_shardings, ref_sh, batch_sh),
                   out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,))


def jit_old_logprobs(setup):
    """(params, batch [M, b, ...]) -> pi_old's log-probs [M, b, T-1]: the rollout policy as the
    trainer computes it, once per rollout before several updates move the params."""
    cfg = setup.cfg

    def old(params, batch):
        return jax.lax.map(lambda mb: sequence_logprobs(params, cfg, mb["tokens"], mb["segment_ids"],
                                                        mb["positions"], mb.get("routing"))[0], batch)

    per_target = update_batch_shardings(setup)["mask"]  # [M, b, T - 1]
    return jax.jit(old, in_shardings=(setup.param_shardings, update_batch_shardings(setup)), out_shardings=per_target)


def policy_updates(cfg: Config, rows: dict, step: int, state, ref_params, step_fn, old_logprobs_fn, put, fetch,
                   old_micro_batches: int | None = None):
    """All updates of one rollout: `put(host batch, with_old_logprobs)` places a batch on the mesh,
    `fetch` brings arrays back; the pi_old pass runs in `old_micro_batches` micro-batches (default
    rl.micro_batches). Returns (state, the combined metrics of the updates, with
    old_logprobs_time_s: the seconds of the pi_old pass, 0 with one update per rollout)."""
    B = rows["tokens"].shape[0]
    to_floats = lambda m: {k: float(v) for k, v in fetch(m).items()}  # noqa: E731
    if cfg.rl.updates_per_rollout == 1:
        state, m = step_fn(state, ref_params, put(split_update_batch(cfg, rows), False))
        return state, {**combine_update_metrics([to_floats(m)]), "old_logprobs_time_s": 0.0}
    t0 = time.perf_counter()
    old_batch = split_update_batch(cfg, rows, micro_batches=old_micro_batches)
    logp_old = np.asarray(fetch(old_logprobs_fn(state["params"], put(old_batch, False))))
    old_logprobs_s = time.perf_counter() - t0
    rows = {**rows, "logp_old": logp_old.reshape(B, -1)}
    per_update = []
    for update, index in enumerate(mini_batch_rows(cfg, B, step)):
        batch = split_update_batch(cfg, {k: v[index] for k, v in rows.items()}, on_policy=update == 0)
        state, m = step_fn(state, ref_params, put(batch, True))
        per_update.append(to_floats(m))
    return state, {**combine_update_metrics(per_update), "old_logprobs_time_s": old_logprobs_s}
