"""The GRPO objective re-derived in numpy (float64), independently of hybridmoe.rl.objective: the
loss, its derivative with respect to every token's log-prob (written out, not autodiff), and the
metrics. docs/rl.md, "One GRPO step", step 4:

  d = clip(logp - logp_old, -20, 20),  r = exp(d)
  pg = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)),  times the importance weight w (no gradient)
  kl = exp(e) - e - 1 with e = clip(logp_ref - logp, -20, 20)
  per-token = w pg + beta kl over the kept completion tokens, aggregated by token mean or by the
  mean over sequences of each sequence's token mean (with a batch-wide normaliser when given).

Derivatives: the clipped branch is a constant where it is the larger (A > 0 and r > 1 + eps_high,
or A < 0 and r < 1 - eps: "clipped"), so d pg / d logp = -A r elsewhere and 0 there; d r / d logp
is 0 where the log-ratio clip at +-20 acts; d kl / d logp = 1 - exp(e) (0 where e is clipped).
"""

from __future__ import annotations

import numpy as np

LOG_CLIP = 20.0


def grpo_reference(logp, logp_old, adv, mask, *, eps, eps_high=None, beta=0.0, logp_ref=None,
                   aggregation="token_mean", keep=None, normalizer=None, is_weight=None) -> dict:
    """{"loss", "grad" [B, T] (d loss / d logp), and the metrics} in float64."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    logp, logp_old, mask = f(logp), f(logp_old), f(mask)
    eps_high = eps if eps_high is None else eps_high
    if keep is not None:
        mask = mask * f(keep)[:, None]
    a = np.broadcast_to(f(adv)[:, None] if np.ndim(adv) == 1 else f(adv), logp.shape)
    raw = logp - logp_old
    d = np.clip(raw, -LOG_CLIP, LOG_CLIP)
    r = np.exp(d)
    high = (a > 0) & (r > 1 + eps_high)
    low = (a < 0) & (r < 1 - eps)
    clipped = high | low
    pg = np.where(clipped, -a * np.clip(r, 1 - eps, 1 + eps_high), -a * r)
    dpg = np.where(clipped | (np.abs(raw) > LOG_CLIP), 0.0, -a * r)
    w = np.ones_like(logp) if is_weight is None else f(is_weight)
    per_token, dper_token = w * pg, w * dpg
    kl = np.zeros_like(logp)
    if logp_ref is not None:
        e_raw = f(logp_ref) - logp
        e = np.clip(e_raw, -LOG_CLIP, LOG_CLIP)
        kl = np.exp(e) - e - 1
        if beta > 0:
            per_token = per_token + beta * kl
            dper_token = dper_token + beta * np.where(np.abs(e_raw) > LOG_CLIP, 0.0, 1 - np.exp(e))
    tokens_B = mask.sum(axis=1)
    if aggregation == "token_mean":
        denom = max(mask.sum() if normalizer is None else float(normalizer), 1.0)
        weight = mask / denom
    else:
        denom = max((tokens_B > 0).sum() if normalizer is None else float(normalizer), 1.0)
        weight = mask / np.maximum(tokens_B, 1.0)[:, None] / denom
    n = max(mask.sum(), 1.0)
    valid = mask > 0
    return {
        "loss": float((per_token * weight).sum()),
        "grad": dper_token * weight,
        "pg_loss": float((w * pg * weight).sum()),
        "kl": float((kl * mask).sum() / n),
        "pg_clipfrac": float((clipped * mask).sum() / n),
        "pg_clipfrac_high": float((high * mask).sum() / n),
        "pg_clipfrac_low": float((low * mask).sum() / n),
        "ratio_mean": float((r * mask).sum() / n),
        "ratio_max": float(r[valid].max()) if valid.any() else 1.0,
        "ratio_min": float(r[valid].min()) if valid.any() else 1.0,
        "num_tokens": float(mask.sum()),
    }


def tis_reference(logp_old, logp_sampler, mask, cap):
    """min(pi_old / pi_sampler, cap) per token (1 where masked)."""
    log_w = np.clip(np.asarray(logp_old, np.float64) - np.asarray(logp_sampler, np.float64), -LOG_CLIP, LOG_CLIP)
    return np.minimum(np.exp(log_w * np.asarray(mask, np.float64)), cap)
