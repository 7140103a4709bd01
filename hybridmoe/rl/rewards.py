"""Reward functions: (prompt, completion) -> float, combined by weight, failures counted not fatal.

A reward function is user code run on model output; it will eventually meet a completion it does
not expect. One bad sample must not end a run that has hours of checkpoints behind it, and it must
not poison a group's statistics with NaN either: the sample is masked out (`skipped`), its reward
set to 0.0 so every downstream array stays finite, and the failure counted by kind for the step's
metrics.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

RewardFn = Callable[[str, str], float]

log = logging.getLogger(__name__)


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def score_completions(
    fns_with_weights: Sequence[tuple[RewardFn, float]],
    prompts: Sequence[str],
    completions: Sequence[str],
    examples: Sequence[dict] | None = None,
) -> tuple[np.ndarray, np.ndarray, Counter[str]]:
    """Weighted sum of every reward function on each (prompt, completion) pair.

    A function marked `takes_example` (user rewards, see reward_loading.py) is called with the
    sample's example fields as a third argument (`examples[i]`, or {} when none are given).

    Returns (rewards float32 [N], skipped bool [N], counts). A sample is skipped when any function
    raises or returns something that is not a finite number; its reward is 0.0. `counts` holds
    "scored", "skipped", "nonfinite" and one "raised:<ExceptionType>" entry per exception type
    (a sample where two functions fail counts in both kinds but once in "skipped").
    """
    if not fns_with_weights:
        raise ValueError("score_completions needs at least one (reward function, weight) pair")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")

    num_samples = len(prompts)
    rewards_N = np.zeros(num_samples, np.float32)
    skipped_N = np.zeros(num_samples, bool)
    counts: Counter[str] = Counter(scored=0, skipped=0)
    warned: set[str] = set()

    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        total = 0.0
        for fn, weight in fns_with_weights:
            try:
                # float(): a str or None lands in TypeError/ValueError
                value = float(fn(prompt, completion, examples[i] if examples is not None else {})
                              if getattr(fn, "takes_example", False) else fn(prompt, completion))
            except Exception as e:  # noqa: BLE001 -- any failure of user code is a counted skip
                kind = f"raised:{type(e).__name__}"
                counts[kind] += 1
                skipped_N[i] = True
                if kind not in warned:  # once per kind per call: the count carries the rest
                    warned.add(kind)
                    log.warning("reward function %s raised on sample %d (%r): %s; sample skipped",
                                _name(fn), i, completion[:80], e)
                continue
            if not math.isfinite(value):
                counts["nonfinite"] += 1
                skipped_N[i] = True
                if "nonfinite" not in warned:
                    warned.add("nonfinite")
                    log.warning("reward function %s returned %r on sample %d; sample skipped",
                                _name(fn), value, i)
                continue
            total += weight * value
        if skipped_N[i]:
            counts["skipped"] += 1
        else:
            rewards_N[i] = total
            counts["scored"] += 1
    return rewards_N, skipped_N, counts


def apply_reward_error_policy(policy: str, failed_N: np.ndarray, prompt_skipped_N: np.ndarray,
                              group_size: int) -> np.ndarray:
    """Which samples carry no loss, given the samples whose reward failed (rl.reward_error):
    skip_sample masks them out; zero keeps them with reward 0.0; skip_group masks their whole
    group. Samples of a skipped prompt (never scored) stay masked whatever the policy."""
    if policy == "skip_sample":
        return failed_N
    if policy == "zero":
        return prompt_skipped_N.copy()
    if policy == "skip_group":
        return np.repeat(failed_N.reshape(-1, group_size).any(axis=1), group_size) | prompt_skipped_N
    raise ValueError(f"rl.reward_error={policy!r}: expected skip_sample, zero or skip_group")

