"""Helpers shared by tests/test_rl_glue.py and tests/test_rl_normalisers.py: the numpy re-derivation
of the group advantages (advantages.py's contract, written out: statistics over the valid samples
only, population std, leave-one-out baseline for rloo), the reward-error policies, and the policy as
a table of log-probs, and a run on fixed prompts with fixed completions (the normalisers' cases and
the step-time checks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from helpers import tiny_config
from hybridmoe.data.arithmetic import Example
from hybridmoe.data.tokenizer import CharTokenizer

TOK = CharTokenizer()

def reference_advantages(rewards_B, skipped_B, truncated_B, G, *, estimator="grpo", mask_truncated=False,
                         mask_zero_variance=True):
    """(advantages float64 [B], keep bool [B]) of rows in groups of G consecutive rows."""
    B = len(rewards_B)
    adv, keep = np.zeros(B), np.zeros(B, bool)
    for g in range(B // G):
        rows = np.arange(g * G, (g + 1) * G)
        valid = [int(r) for r in rows if not skipped_B[r]]
        values = np.asarray([rewards_B[r] for r in valid], np.float64)
        if not valid:
            continue
        for i, r in enumerate(valid):
            others = np.delete(values, i)
            if estimator == "grpo":
                a = (values[i] - values.mean()) / (values.std() + 1e-6)
            elif estimator == "rloo":
                a = values[i] - others.mean() if len(others) else 0.0
            else:
                a = values[i] - values.mean()
            kept = (estimator != "rloo" or len(valid) >= 2)
            kept &= not mask_zero_variance or values.max() > values.min()
            kept &= not (mask_truncated and truncated_B[r])
            adv[r], keep[r] = (a if kept else 0.0), kept
    return adv, keep


def reward_error_policy(failed_B, G, policy):
    if policy == "skip_sample":
        return failed_B.copy()
    if policy == "skip_group":
        return np.repeat(failed_B.reshape(-1, G).any(axis=1), G)
    return np.zeros_like(failed_B)


def logp_table(B, T, seed=1):
    return (-np.random.default_rng(seed).exponential(1.0, (B, T - 1))).astype(np.float32)


def table_policy(params, cfg, tokens, *rest):
    """The policy as a table: the log-probs of a micro-batch's targets are `params` itself."""
    return params, jnp.zeros_like(params)


def flat_rows(batch):
    """An update batch's [M, b, ...] arrays as rows [M * b, ...] (host numpy)."""
    return {k: np.asarray(v).reshape(-1, *np.shape(v)[2:]) for k, v in jax.device_get(batch).items()
            if np.ndim(v) >= 2}


# A run on fixed prompts with fixed completions: the rows the sampler stub writes and their rewards.

NORM_P, NORM_G, NORM_PROMPT, NORM_N = 8, 4, 6, 6
# Each row's completion text; the reward is its value as a number ("x": the reward raises). A text
# of NORM_N characters has no room for EOS: truncated. Groups: 0 plain; 1 zero variance (every
# value 1, at four lengths); 2 a reward error; 3, 5 and 7 truncated rows; 4 one valid sample; 6 a
# prompt too long for rl.max_prompt_len (its rows are placeholders, never scored).
COMPLETIONS = ("1", "0.5", "2", "0.25",
               "1", "1.0", "01", "1.00",
               "3", "x", "0", "12",
               "2", "0", "000004", "1.5",
               "x", "x", "x", "5",
               "0.5", "000001", "3.5", "0",
               "7", "7", "0.5", "x",
               "000002", "000009", "1", "4")


def number_reward(prompt: str, completion: str) -> float:
    return float(completion)  # raises ValueError on "x": a counted reward error


class FixedPrompts:
    name = "fixed"
    max_completion_chars = NORM_N

    def sample(self, rng, num_examples):
        return [Example(prompt_text(i), "") for i in range(num_examples)]


def prompt_text(i: int) -> str:
    return "too long" if i == SKIPPED_PROMPT else f"p{i}"


SKIPPED_PROMPT = 6


def sampler_logprobs(texts, N, seed=0):
    """float32 [B, N]: a made-up sampling distribution's log-prob of each completion token, 0 past the end."""
    lengths = np.asarray([min(len(t) + 1, N) for t in texts])
    logprobs = -np.random.default_rng(seed).exponential(1.0, (len(texts), N))
    return np.where(np.arange(N)[None] < lengths[:, None], logprobs, 0.0).astype(np.float32)


def sampler_stub(texts, G, N, seed=0):
    """The sampler's contract (rl/sampler.py) for fixed completion texts: rows [B, P + N] = the left-
    padded prompt then the completion (EOS after the text when it fits, padding after EOS), segment 1
    on the prompt and the completion through EOS, positions counting on; the sampling distribution's
    log-probs (0 past the end)."""
    def generate(params, tokens_QP, seg_QP, pos_QP, key):
        tokens_QP, seg_QP, pos_QP = (np.asarray(a) for a in (tokens_QP, seg_QP, pos_QP))
        B = tokens_QP.shape[0] * G
        completion = np.full((B, N), TOK.pad_id, np.int32)
        for b, text in enumerate(texts):
            ids = TOK.encode(text) + ([TOK.eos_id] if len(text) < N else [])
            completion[b, :len(ids)] = ids
        lengths = np.asarray([min(len(t) + 1, N) for t in texts], np.int32)
        in_completion = np.arange(N)[None] < lengths[:, None]
        rows = np.arange(B) // G
        comp_pos = pos_QP[rows, -1:] + 1 + np.arange(N)
        return {"completion": completion, "logprobs": sampler_logprobs(texts, N, seed),
                "lengths": lengths, "truncated": np.asarray([len(t) == N for t in texts]),
                "tokens": np.concatenate([tokens_QP[rows], completion], 1),
                "segment_ids": np.concatenate([seg_QP[rows], in_completion], 1).astype(np.int32),
                "positions": np.concatenate([pos_QP[rows], np.where(in_completion, comp_pos, 0)], 1).astype(np.int32)}
    return generate


def norm_config(estimator, aggregation, reward_error, mask_truncated, mask_zero_variance, micro_batches,
                correction="none"):
    return tiny_config(f"rl.prompts_per_step={NORM_P}", f"rl.group_size={NORM_G}",
                       f"rl.max_prompt_len={NORM_PROMPT}", f"rl.max_new_tokens={NORM_N}",
                       f"rl.estimator={estimator}", f"rl.aggregation={aggregation}", f"rl.reward_error={reward_error}",
                       f"rl.mask_truncated={str(mask_truncated).lower()}",
                       f"rl.mask_zero_variance={str(mask_zero_variance).lower()}", f"rl.micro_batches={micro_batches}",
                       f"rl.importance_correction={correction}", "rl.importance_cap=1.5")
