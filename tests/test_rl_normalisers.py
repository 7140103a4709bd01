"""GRPO's loss normalisers against an independent re-derivation (tests/test_rl_glue.py has the
other bookkeeping between the parts): every aggregation and estimator with dropped sequences present
(zero-variance groups, truncated completions, reward errors under skip_sample / skip_group), through
the real loop from rewards to micro-batches, against a numpy re-derivation of the loss and of its
gradient with respect to every token's log-prob; with the one-line bugs the check catches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridmoe.rl.advantages as advantages_module
import hybridmoe.rl.grpo as grpo_module
import hybridmoe.rl.loop as rl_loop
from broken_variants import mutated
from hybridmoe.run.setup import build
from rl_glue_shared import (COMPLETIONS, NORM_G, NORM_N, NORM_P, NORM_PROMPT, SKIPPED_PROMPT, TOK, FixedPrompts, flat_rows,
                            logp_table, norm_config, number_reward, reference_advantages, reward_error_policy,
                            sampler_logprobs, sampler_stub, table_policy)


# ---------------------------------------------------------------------------------------------
# Loss normalisers. The real loop from the sampler's rows to the micro-batch losses
# (loop._grpo_step: scoring, the reward-error policy, group advantages, update rows, micro-batches,
# each micro-batch's loss), with the model replaced by a table: the sampler stub writes fixed
# completions and the policy's log-prob of every target is a free array, so the gradient of the
# summed micro-batch losses is each token's weight in the loss, compared with a numpy re-derivation.

# Every estimator and aggregation; every kind of dropped sequence; 1, 2 and 4 micro-batches.
NORM_CASES = {
    "grpo_token_mean_skip_sample": ("grpo", "token_mean", "skip_sample", True, True, 2),
    "grpo_seq_mean_skip_group_tis": ("grpo", "seq_mean_token_mean", "skip_group", True, True, 4, "tis"),
    "rloo_token_mean_skip_group_tis": ("rloo", "token_mean", "skip_group", False, True, 4, "tis"),
    "rloo_seq_mean_skip_sample": ("rloo", "seq_mean_token_mean", "skip_sample", True, False, 1),
    "drgrpo_seq_mean_zero": ("drgrpo", "seq_mean_token_mean", "zero", False, True, 2),
    "drgrpo_token_mean_skip_sample": ("drgrpo", "token_mean", "skip_sample", True, True, 4),
}
NORM_TOL = 1e-5  # relative, float32 against float64 (measured clean: ~1e-7)


def step_weights(cfg, monkeypatch) -> dict:
    """One GRPO step through loop._grpo_step with the sampler stub and a log-prob table as the policy:
    (the summed micro-batch losses, d loss / d logp [B, T - 1], the rows as the step received them)."""
    B, T = NORM_P * NORM_G, NORM_PROMPT + NORM_N
    logp_BT = logp_table(B, T)
    seen = {}
    monkeypatch.setattr(grpo_module, "sequence_logprobs", table_policy)

    def table_step(state, ref_params, batch):
        batch = jax.device_get(batch)
        M = batch["tokens"].shape[0]
        b = B // M
        loss, grads, sums = 0.0, [], []
        for m in range(M):
            mb = {k: jnp.asarray(v[m]) for k, v in batch.items()}
            (loss_m, sums_m), g = jax.value_and_grad(
                lambda lp: grpo_module.micro_batch_loss(lp, None, cfg, mb), has_aux=True)(logp_BT[m * b:(m + 1) * b])
            loss, grads, sums = loss + float(loss_m), grads + [np.asarray(g)], sums + [jax.device_get(sums_m)]
        seen.update(loss=loss, grad=np.concatenate(grads), rows=flat_rows(batch))
        metrics = {k: sum(s[k] for s in sums) for k in grpo_module._SUM_KEYS}
        metrics.update(ratio_max=max(s["ratio_max"] for s in sums), ratio_min=min(s["ratio_min"] for s in sums),
                       gap_max=max(s["gap_max"] for s in sums), loss=loss, update_skipped=0.0, update_applied=1.0,
                       grad_norm=float(np.linalg.norm(seen["grad"])))
        return state, metrics

    run = rl_loop._Run(cfg, FixedPrompts(), TOK, [(number_reward, 1.0)], build(cfg), None, table_step,
                       sampler_stub(COMPLETIONS, NORM_G, NORM_N), None)
    rl_loop._grpo_step(run, {"params": None}, None, 0, jax.random.key(0))
    return {**seen, "logp": logp_BT}


def reference_weights(cfg, logp_BT) -> dict:
    """The loss and d loss / d logp re-derived from the completion texts (on policy: ratio 1, so
    each kept token's pg term is -A times its importance weight)."""
    r, G, N, P = cfg.rl, NORM_G, NORM_N, NORM_PROMPT
    failed = np.asarray([t == "x" for t in COMPLETIONS])
    rewards = np.asarray([0.0 if f else float(t) for t, f in zip(COMPLETIONS, failed)])
    truncated = np.asarray([len(t) == N for t in COMPLETIONS])
    skipped = reward_error_policy(failed, G, r.reward_error)
    skipped[SKIPPED_PROMPT * G:(SKIPPED_PROMPT + 1) * G] = True
    adv, keep = reference_advantages(rewards, skipped, truncated, G, estimator=r.estimator,
                                     mask_truncated=r.mask_truncated, mask_zero_variance=r.mask_zero_variance)
    B = len(COMPLETIONS)
    lengths = np.asarray([len(t) + (len(t) < N) for t in COMPLETIONS])  # the text, then EOS when it fits
    mask = np.zeros((B, P + N - 1))
    for b, n in enumerate(lengths):
        mask[b, P - 1:P - 1 + n] = 1.0  # completion token j is predicted at index P - 1 + j
    kept = mask * keep[:, None]
    if r.aggregation == "token_mean":
        weight = kept / kept.sum()
    else:
        per_row = kept.sum(axis=1)
        weight = kept / np.maximum(per_row, 1)[:, None] / (per_row > 0).sum()
    is_weight = np.ones_like(mask)
    if r.importance_correction == "tis":
        sampler = np.zeros_like(mask)
        sampler[:, P - 1:] = sampler_logprobs(COMPLETIONS, N)
        is_weight = np.minimum(np.exp(np.asarray(logp_BT, np.float64) - sampler), r.importance_cap)
    grad = -adv[:, None] * is_weight * weight
    return {"loss": float(grad.sum()), "grad": grad, "advantages": adv, "keep": keep, "dropped": int((~keep).sum())}


def normaliser_errors(monkeypatch, cases=NORM_CASES) -> dict:
    """Per case: the loss's and the per-token weights' error relative to the re-derivation's largest
    value, and the advantages' largest error."""
    out = {}
    for name, case in cases.items():
        cfg = norm_config(*case)
        got = step_weights(cfg, monkeypatch)
        want = reference_weights(cfg, got["logp"])
        assert want["dropped"] >= 4, (name, want["dropped"])  # the case holds dropped sequences with tokens
        scale = np.abs(want["grad"]).max()
        out[name] = max(abs(got["loss"] - want["loss"]) / max(abs(want["loss"]), 1e-3),
                        float(np.abs(got["grad"] - want["grad"]).max() / scale),
                        float(np.abs(got["rows"]["advantages"] - want["advantages"]).max()),
                        float(np.sum(got["rows"]["keep"] != want["keep"])))
    return out


def test_every_normaliser_counts_kept_sequences_only(monkeypatch):
    errors = normaliser_errors(monkeypatch)
    assert max(errors.values()) < NORM_TOL, errors


# One-line bugs in the normalisers: the estimators' group statistics, the loop's masks, the
# update's denominator and its split into micro-batches.
NORM_BROKEN = {
    "dropped_sequence_in_the_denominator": (grpo_module, "step_normalizer", "kept_BT = mask_BT * keep_B[:, None]",
                                            "kept_BT = mask_BT + 0 * keep_B[:, None]"),
    "seq_mean_over_all_sequences": (grpo_module, "step_normalizer", "return float((kept_BT.sum(axis=1) > 0).sum())",
                                    "return float(kept_BT.shape[0])"),
    "normaliser_per_micro_batch": (grpo_module, "split_update_batch",
                                   '"normalizer": np.full((M,), normalizer, np.float32)',
                                   '"normalizer": np.asarray([step_normalizer(cfg, m, k) for m, k in zip('
                                   'split(rows["mask"]), split(rows["keep"].astype(np.float32)))], np.float32)'),
    "group_mean_over_skipped_samples": (advantages_module, "group_advantages",
                                        "mean_P1 = r_PG.sum(axis=1, keepdims=True) / jnp.maximum(n_P1, 1.0)",
                                        "mean_P1 = r_PG.mean(axis=1, keepdims=True)"),
    "sample_std": (advantages_module, "group_advantages",
                   "(centred_PG**2).sum(axis=1, keepdims=True) / jnp.maximum(n_P1, 1.0)",
                   "(centred_PG**2).sum(axis=1, keepdims=True) / jnp.maximum(n_P1 - 1.0, 1.0)"),
    "rloo_baseline_over_the_whole_group": (advantages_module, "group_advantages",
                                           "centred_PG * n_P1 / jnp.maximum(n_P1 - 1.0, 1.0)",
                                           "centred_PG * rewards_PG.shape[1] / (rewards_PG.shape[1] - 1.0)"),
    "truncated_rows_not_masked": (rl_loop, "_grpo_step", "mask_truncated=r.mask_truncated",
                                  "mask_truncated=False"),
}


@pytest.mark.parametrize("variant", list(NORM_BROKEN))
def test_broken_normalisers_are_caught(variant, monkeypatch):
    module, name, old, new = NORM_BROKEN[variant]
    broken = mutated(module, name, old, new)
    # The loop holds its own references to the advantage function and its step.
    monkeypatch.setattr(rl_loop if module is advantages_module else module, name, broken)
    errors = normaliser_errors(monkeypatch)
    assert max(errors.values()) >= 10 * NORM_TOL, f"{variant}: {errors}"
