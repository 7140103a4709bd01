"""Group advantages for GRPO: rewards [P prompts, G completions each] -> advantages, keep mask.

Estimators (r_i the reward of completion i, statistics over the group's valid samples):
  grpo:   (r_i - mean) / (std + 1e-6)
  rloo:   r_i - mean_{j != i} r_j  =  n / (n - 1) * (r_i - mean)   (leave-one-out baseline)
  drgrpo: r_i - mean                                                (no std: no difficulty bias)

std is the POPULATION standard deviation (divide by n, ddof=0), not the sample one (n - 1) that
torch's default gives some other trainers. Why: groups shrink when samples are masked, and ddof=0
stays defined at n = 1 (std 0, a zero-variance group) where ddof=1 divides by zero; and with ddof=0
a group's normalised advantages have a root-mean-square of exactly 1 whatever G is, so the gradient
scale does not drift with the group size. (ddof=1 would shrink every grpo advantage by
sqrt((n - 1) / n), 0.935 at G = 8.)

Which samples count where:
  - valid (not reward-skipped): only these enter the group mean/std; a skipped sample's reward is
    a placeholder, not an outcome.
  - truncated (no EOS within max new tokens): its reward is a real outcome, so it stays in the
    statistics, but with `mask_truncated` it carries no loss (its text was cut, not chosen).
  - zero-variance groups (every valid reward equal, checked exactly as max == min so that float
    noise in the mean cannot hide it): no learning signal; with `mask_zero_variance` the group is
    dropped, so it does not dilute the token mean of the groups that do teach something.
  - rloo with fewer than two valid samples has no leave-one-out baseline: dropped.
Dropped samples get advantage 0 and keep False; kept_frac = kept / (P * G).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

Estimator = Literal["grpo", "rloo", "drgrpo"]
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "rloo", "drgrpo")
STD_EPS = 1e-6


def group_advantages(
    rewards_PG: jnp.ndarray,
    *,
    estimator: Estimator = "grpo",
    skipped_PG: jnp.ndarray | None = None,
    truncated_PG: jnp.ndarray | None = None,
    mask_truncated: bool = False,
    mask_zero_variance: bool = True,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Returns (advantages float32 [P, G], keep bool [P, G], kept_frac float32 scalar)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {rewards_PG.shape}")

    rewards_PG = rewards_PG.astype(jnp.float32)
    valid_PG = jnp.ones(rewards_PG.shape, bool) if skipped_PG is None else ~skipped_PG.astype(bool)
    # Skipped rewards are placeholders (often 0.0, possibly anything): keep them out of every sum.
    r_PG = jnp.where(valid_PG, rewards_PG, 0.0)
    n_P1 = valid_PG.sum(axis=1, keepdims=True).astype(jnp.float32)
    mean_P1 = r_PG.sum(axis=1, keepdims=True) / jnp.maximum(n_P1, 1.0)
    centred_PG = jnp.where(valid_PG, r_PG - mean_P1, 0.0)

    if estimator == "grpo":
        var_P1 = (centred_PG**2).sum(axis=1, keepdims=True) / jnp.maximum(n_P1, 1.0)  # population
        adv_PG = centred_PG / (jnp.sqrt(var_P1) + STD_EPS)
    elif estimator == "rloo":
        adv_PG = centred_PG * n_P1 / jnp.maximum(n_P1 - 1.0, 1.0)
    else:  # drgrpo
        adv_PG = centred_PG

    keep_PG = valid_PG
    if estimator == "rloo":
        keep_PG = keep_PG & (n_P1 >= 2)
    if mask_zero_variance:
        big = jnp.finfo(jnp.float32).max
        r_max_P1 = jnp.where(valid_PG, r_PG, -big).max(axis=1, keepdims=True)
        r_min_P1 = jnp.where(valid_PG, r_PG, big).min(axis=1, keepdims=True)
        keep_PG = keep_PG & (r_max_P1 > r_min_P1)
    if mask_truncated and truncated_PG is not None:
        keep_PG = keep_PG & ~truncated_PG.astype(bool)

    adv_PG = jnp.where(keep_PG, adv_PG, 0.0)
    kept_frac = keep_PG.mean(dtype=jnp.float32)
    return adv_PG, keep_PG, kept_frac


def advantage_stats(advantages_PG: jnp.ndarray, keep_PG: jnp.ndarray) -> dict[str, jnp.ndarray]:
    """Mean, std, min and max of the kept advantages (zeros when nothing is kept), for logging."""
    n = jnp.maximum(keep_PG.sum(), 1).astype(jnp.float32)
    mean = jnp.where(keep_PG, advantages_PG, 0.0).sum() / n
    var = jnp.where(keep_PG, (advantages_PG - mean) ** 2, 0.0).sum() / n
    any_kept = keep_PG.any()
    big = jnp.finfo(jnp.float32).max
    return {
        "adv_mean": mean,
        "adv_std": jnp.sqrt(var),
        "adv_min": jnp.where(any_kept, jnp.where(keep_PG, advantages_PG, big).min(), 0.0),
        "adv_max": jnp.where(any_kept, jnp.where(keep_PG, advantages_PG, -big).max(), 0.0),
    }
