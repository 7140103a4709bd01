"""The token-level clipped policy objective of GRPO (docs/rl.md, "One GRPO step", step 4).

Per completion token t of sequence b (A_b the sequence's advantage):
  log_ratio = clip(logp - logp_old, -20, 20)        clipped before exp: one stale token must not
  r         = exp(log_ratio)                         overflow to inf and NaN the whole step
  pg        = max(-A r, -A clip(r, 1 - eps, 1 + eps_high))
  kl        = exp(ref - logp) - (ref - logp) - 1     k3 estimator of KL(policy || reference):
                                                     non-negative, unbiased, low variance
  per_token = pg + beta * kl
Aggregation over the completion tokens (mask):
  token_mean:           sum over all valid tokens / number of valid tokens (long completions
                        weigh more: every token counts once)
  seq_mean_token_mean:  each sequence's token mean, then the mean over sequences with any valid
                        token (every completion counts once, whatever its length)

Importance correction (the sampler and the trainer disagree: top-p/top-k truncation, other
kernels, other precision), with w = pi_old / pi_sampler per token (pi_old: the trainer's policy the
rollout came from; pi_sampler: what the sampler actually drew from), as a weight on pg, no gradient:
  none:  weight 1 (the mismatch is ignored; its size is still logged)
  tis:   min(w, C)                                  token-level truncated importance sampling
  mis:   1 if prod_t w <= C else 0 per sequence     sequence-level masked importance sampling

Gradient accumulation: the mean of micro-batch means is not the batch mean when micro-batches hold
different numbers of tokens. Pass `normalizer` = the batch-wide count (valid tokens for token_mean,
sequences with a valid token for seq_mean_token_mean) and the micro-batch losses then sum exactly to
the batch loss.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Aggregation = Literal["token_mean", "seq_mean_token_mean"]
Correction = Literal["none", "tis", "mis"]
CORRECTIONS: tuple[Correction, ...] = ("none", "tis", "mis")
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean")
LOG_RATIO_CLIP = 20.0


def _aggregate(per_token_BT, mask_BT, aggregation: Aggregation, normalizer):
    if aggregation == "token_mean":
        denom = mask_BT.sum() if normalizer is None else normalizer
        return (per_token_BT * mask_BT).sum() / jnp.maximum(denom, 1.0)
    tokens_B = mask_BT.sum(axis=1)
    seq_mean_B = (per_token_BT * mask_BT).sum(axis=1) / jnp.maximum(tokens_B, 1.0)
    denom = (tokens_B > 0).sum() if normalizer is None else normalizer
    return seq_mean_B.sum() / jnp.maximum(denom, 1.0)


def importance_weights(correction: Correction, cap: float, logp_old_BT, logp_sampler_BT, completion_mask_BT):
    """The per-token weight of pg [B, T] float32 (no gradient), or None for `none`."""
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown importance correction {correction!r}; choose one of {CORRECTIONS}")
    if correction == "none":
        return None
    mask_BT = completion_mask_BT.astype(jnp.float32)
    log_w_BT = jax.lax.stop_gradient(jnp.clip(logp_old_BT.astype(jnp.float32) - logp_sampler_BT.astype(jnp.float32),
                                              -LOG_RATIO_CLIP, LOG_RATIO_CLIP)) * mask_BT
    if correction == "tis":
        return jnp.minimum(jnp.exp(log_w_BT), cap)
    keep_B = log_w_BT.sum(axis=1) <= jnp.log(cap)
    return jnp.broadcast_to(keep_B.astype(jnp.float32)[:, None], log_w_BT.shape)


def clipped_policy_loss(
    logp_BT: jnp.ndarray,
    logp_old_BT: jnp.ndarray,
    advantages_B: jnp.ndarray,
    completion_mask_BT: jnp.ndarray,
    *,
    eps: float = 0.2,
    eps_high: float | None = None,
    beta: float = 0.0,
    logp_ref_BT: jnp.ndarray | None = None,
    aggregation: Aggregation = "token_mean",
    keep_B: jnp.ndarray | None = None,
    normalizer: jnp.ndarray | float | None = None,
    is_weight_BT: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """Loss (float32 scalar, to minimise) and its metrics.

    logp_BT: current policy log-prob of each target token (differentiated); logp_old_BT: the
    sampling policy's (no gradient taken); advantages_B: one per sequence (or [B, T] per token);
    completion_mask_BT: 1 on completion tokens, 0 on prompt and padding; keep_B: the advantage
    step's keep mask (dropped sequences contribute nothing, not even to the token count);
    eps_high defaults to eps (symmetric clipping); logp_ref_BT is required when beta > 0;
    is_weight_BT: the importance-correction weight of each token's pg term (`importance_weights`).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    if beta > 0 and logp_ref_BT is None:
        raise ValueError("beta > 0 needs the reference policy's log-probs (logp_ref_BT)")
    eps_high = eps if eps_high is None else eps_high

    logp_BT = logp_BT.astype(jnp.float32)
    logp_old_BT = jax.lax.stop_gradient(logp_old_BT.astype(jnp.float32))
    mask_BT = completion_mask_BT.astype(jnp.float32)
    if keep_B is not None:
        mask_BT = mask_BT * keep_B.astype(jnp.float32)[:, None]
    adv_BT = advantages_B.astype(jnp.float32)
    if adv_BT.ndim == 1:
        adv_BT = adv_BT[:, None]
    adv_BT = jax.lax.stop_gradient(jnp.broadcast_to(adv_BT, logp_BT.shape))

    log_ratio_BT = jnp.clip(logp_BT - logp_old_BT, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    ratio_BT = jnp.exp(log_ratio_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - eps, 1.0 + eps_high)
    pg_BT = jnp.maximum(unclipped_BT, clipped_BT)
    if is_weight_BT is not None:
        pg_BT = jax.lax.stop_gradient(is_weight_BT.astype(jnp.float32)) * pg_BT
    per_token_BT = pg_BT

    if logp_ref_BT is not None:
        # Same +-20 guard as the ratio: exp of a large gap would overflow the k3 term.
        ref_gap_BT = jnp.clip(jax.lax.stop_gradient(logp_ref_BT.astype(jnp.float32)) - logp_BT,
                              -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        kl_BT = jnp.exp(ref_gap_BT) - ref_gap_BT - 1.0
        if beta > 0:
            per_token_BT = per_token_BT + beta * kl_BT
    else:
        kl_BT = jnp.zeros_like(logp_BT)

    loss = _aggregate(per_token_BT, mask_BT, aggregation, normalizer)

    # Metrics: plain token means over the valid tokens of this batch, whatever the aggregation,
    # so that they compare across runs that aggregate differently.
    sg = jax.lax.stop_gradient
    num_tokens = mask_BT.sum()
    denom = jnp.maximum(num_tokens, 1.0)
    clipped_high_BT = (adv_BT > 0) & (ratio_BT > 1.0 + eps_high)  # the clipped branch is active
    clipped_low_BT = (adv_BT < 0) & (ratio_BT < 1.0 - eps)
    big = jnp.finfo(jnp.float32).max
    valid_BT = mask_BT > 0
    metrics = {
        "pg_loss": sg(_aggregate(pg_BT, mask_BT, aggregation, normalizer)),
        "kl": sg((kl_BT * mask_BT).sum() / denom),
        "pg_clipfrac": sg(((clipped_high_BT | clipped_low_BT) * mask_BT).sum() / denom),
        "pg_clipfrac_high": sg((clipped_high_BT * mask_BT).sum() / denom),
        "pg_clipfrac_low": sg((clipped_low_BT * mask_BT).sum() / denom),
        "ratio_mean": sg((ratio_BT * mask_BT).sum() / denom),
        "ratio_max": sg(jnp.where(num_tokens > 0, jnp.where(valid_BT, ratio_BT, -big).max(), 1.0)),
        "ratio_min": sg(jnp.where(num_tokens > 0, jnp.where(valid_BT, ratio_BT, big).min(), 1.0)),
        "num_tokens": num_tokens,
    }
    return loss, metrics
