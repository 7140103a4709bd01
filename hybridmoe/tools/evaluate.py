"""`hybridmoe eval`: a prompt set's completions scored by reward functions, per task: mean reward and pass@k.

Each prompt is sampled `samples` times. A sample passes when its (weighted) reward reaches
`pass_threshold`. pass@k is the unbiased estimate from n samples with c passing,
1 - C(n - c, k) / C(n, k): the chance that at least one of k samples drawn from the n passes.
A sample whose reward raised or was not finite counts as failing and is reported in reward_errors.
Tasks are the prompt set's `task` field (all prompts are one task, "all", without it).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from hybridmoe.rl.rewards import score_completions


def pass_at_k(n: int, c: int, k: int) -> float:
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(policy, examples, reward_fns, *, samples: int, pass_threshold: float, generate_kwargs: dict) -> dict:
    from hybridmoe.rl.policy_io import generate_texts
    prompts = [e.prompt for e in examples for _ in range(samples)]
    records, timing = generate_texts(policy, prompts, **generate_kwargs)
    fields = [e.fields for e in examples for _ in range(samples)]
    rewards, failed, counts = score_completions(reward_fns, prompts, [r["completion"] for r in records], fields)
    rewards_PS = rewards.reshape(len(examples), samples)
    passed_PS = (rewards_PS >= pass_threshold) & ~failed.reshape(len(examples), samples)
    by_task = defaultdict(list)
    for i, e in enumerate(examples):
        by_task[str(e.fields.get("task", "all"))].append(i)
    ks = sorted({1, samples})
    failed_PS = failed.reshape(len(examples), samples)
    tasks = {}
    for name, idx in sorted(by_task.items()):
        c = passed_PS[idx].sum(axis=1)
        tasks[name] = {"prompts": len(idx), "samples": len(idx) * samples,
                       "mean_reward": float(rewards_PS[idx].mean()),
                       **{f"pass@{k}": float(np.mean([pass_at_k(samples, int(ci), k) for ci in c])) for k in ks},
                       "reward_errors": int(failed_PS[idx].sum())}
    kinds = {k: int(v) for k, v in counts.items() if k.startswith("raised:") or k == "nonfinite"}
    return {"tasks": tasks, "samples_per_prompt": samples, "pass_threshold": pass_threshold,
            "reward_errors": int(failed.sum()), "reward_error_kinds": kinds,
            "generation": timing, "completions": [{**r, "reward": float(x)} for r, x in zip(records, rewards)]}
