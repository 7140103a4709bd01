"""The GRPO policy update on the 8-device CPU mesh: its loss is the objective of unchunked log-probs,
micro-batch accumulation equals one big batch, the first update of a rollout sampled at T = 0.7 and
top-p 0.9 has ratio exactly 1, and several updates per rollout make the clip act."""

import jax
import jax.numpy as jnp
import numpy as np

from helpers import tiny_config, tiny_params
from hybridmoe.model.forward import decoder_hidden
from hybridmoe.rl.grpo import (build_update_batch, combine_update_metrics, jit_grpo_step, jit_old_logprobs,
                               mini_batch_rows, policy_updates, rl_optimizer, update_batch_shardings, update_rows)
from hybridmoe.kernels.logprobs import token_logprobs_reference
from hybridmoe.rl.objective import clipped_policy_loss
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
from hybridmoe.run.setup import build

PROMPT_LEN, NEW_TOKENS, ROWS = 6, 5, 16


def _config(*overrides):
    return tiny_config(f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW_TOKENS}", "rl.prompts_per_step=4",
                       "rl.group_size=4", "kernels.logprobs.chunk_tokens=24", "kernels.logprobs.chunk_vocab=100",
                       "gdn.chunk_size=4", *overrides)


def _rollout(cfg, seed=0):
    """A rollout as the sampler returns it, with made-up tokens, lengths and old log-probs."""
    rng = np.random.default_rng(seed)
    V = cfg.model.vocab_size
    prompts = [rng.integers(3, V, size=int(n)).tolist() for n in rng.integers(1, PROMPT_LEN + 1, size=ROWS)]
    tokens, seg, pos = left_pad_prompts(prompts, PROMPT_LEN, pad_id=0)
    lengths = rng.integers(1, NEW_TOKENS + 1, size=ROWS)
    lengths[3] = NEW_TOKENS
    in_completion = np.arange(NEW_TOKENS)[None] < lengths[:, None]
    completion = np.where(in_completion, rng.integers(3, V, size=(ROWS, NEW_TOKENS)), 0)
    comp_pos = pos[:, -1:] + 1 + np.arange(NEW_TOKENS)
    return {
        "tokens": np.concatenate([tokens, completion], 1).astype(np.int32),
        "segment_ids": np.concatenate([seg, in_completion], 1).astype(np.int32),
        "positions": np.concatenate([pos, np.where(in_completion, comp_pos, 0)], 1).astype(np.int32),
        "lengths": lengths.astype(np.int32),
        # A stale sampler: old log-probs far enough off that both clip branches engage.
        "logprobs": np.where(in_completion, -5.5 + rng.normal(0, 0.4, (ROWS, NEW_TOKENS)), 0.0).astype(np.float32),
    }


def _advantages(seed=0):
    rng = np.random.default_rng(seed + 10)
    keep = rng.random(ROWS) > 0.2
    return np.where(keep, rng.normal(size=ROWS), 0.0).astype(np.float32), keep


_COMPILED = {}


def _run_step(cfg, params, ref_params, batch):
    """One step from a fresh optimizer state; compiled once per config."""
    key = (cfg.model_dump_json(), ref_params is not None)
    if key not in _COMPILED:
        setup, opt = build(cfg), rl_optimizer(cfg)
        init = jax.jit(lambda p: {"params": p, "opt_state": opt.init(p), "step": jnp.int32(0)},
                       out_shardings=setup.state_shardings)
        _COMPILED[key] = setup, init, jit_grpo_step(setup, opt, with_reference=ref_params is not None)
    setup, init, step = _COMPILED[key]
    with setup.context():
        return step(init(params), ref_params, batch)


def test_step_loss_equals_objective_of_unchunked_logprobs():
    # Two updates per rollout: the step takes pi_old from the batch (here a stale one, so that both
    # clip branches engage) instead of its own log-probs.
    cfg = _config("rl.beta=0.05", "rl.eps_high=0.28", "rl.micro_batches=1", "rl.updates_per_rollout=2")
    params, ref_params = tiny_params(cfg, seed=0), tiny_params(cfg, seed=5)
    rollout = _rollout(cfg)
    adv, keep = _advantages()
    batch = build_update_batch(cfg, rollout, adv, keep)
    batch["logp_old"] = batch["logp_sampler"]
    state, metrics = _run_step(cfg, params, ref_params, batch)

    mb = jax.tree.map(lambda x: jnp.asarray(x[0]), batch)

    def logp_of(p):
        h = decoder_hidden(p, cfg, mb["tokens"], mb["segment_ids"], mb["positions"])
        return token_logprobs_reference(h[:, :-1], p["lm_head"], mb["tokens"][:, 1:])

    def loss_fn(p):
        logp, entropy = logp_of(p)
        logp_ref, _ = logp_of(ref_params)
        loss, m = clipped_policy_loss(logp, mb["logp_old"], mb["advantages"], mb["mask"], eps=0.2, eps_high=0.28,
                                      beta=0.05, logp_ref_BT=logp_ref, keep_B=mb["keep"])
        return loss, (m, entropy)

    (loss, (m, entropy)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    assert float(m["pg_clipfrac_high"]) > 0 and float(m["pg_clipfrac_low"]) > 0 and float(m["kl"]) > 0
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["kl"]), float(m["kl"]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["pg_clipfrac"]), float(m["pg_clipfrac"]), rtol=1e-6)
    mask = mb["mask"]
    np.testing.assert_allclose(float(metrics["entropy"]), float((entropy * mask).sum() / mask.sum()), rtol=1e-5)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
    np.testing.assert_allclose(float(metrics["grad_norm"]), grad_norm, rtol=1e-4)
    assert float(metrics["update_applied"]) == 1.0


def test_micro_batches_accumulate_to_one_big_batch_and_empty_batches_do_not_step():
    params = tiny_params(_config())
    rollout = _rollout(_config(), seed=1)
    adv, keep = _advantages(seed=1)
    outs = {}
    for m in (1, 2):
        # A stale pi_old from the batch (several updates per rollout): clipping acts on some tokens.
        cfg = _config(f"rl.micro_batches={m}", "rl.aggregation=seq_mean_token_mean",
                      "rl.updates_per_rollout=2", "rl.epochs_per_rollout=2")
        batch = build_update_batch(cfg, rollout, adv, keep)
        batch["logp_old"] = batch["logp_sampler"]
        outs[m] = jax.device_get(_run_step(cfg, params, None, batch))
    (s1, m1), (s2, m2) = outs[1], outs[2]
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "pg_clipfrac", "kept_tokens"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=2e-5, err_msg=key)
    # Adam's first step is nearly sign(g) * lr: where g is ~0, float-order noise in g moves the
    # update by up to lr; 5e-5 is 5% of lr = 1e-3, far below a wrong accumulation (O(lr) everywhere).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), s2["params"], s1["params"])
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(params)))

    # Nothing kept: the update is skipped (params unchanged), not an AdamW step on a zero gradient.
    batch = build_update_batch(cfg, rollout, np.zeros(ROWS, np.float32), np.zeros(ROWS, bool))
    batch["logp_old"] = batch["logp_sampler"]
    state, metrics = jax.device_get(_run_step(cfg, params, None, batch))
    assert metrics["update_applied"] == 0.0 and metrics["loss"] == 0.0
    jax.tree.map(np.testing.assert_array_equal, state["params"], jax.device_get(params))


def _sampled_rollout(cfg, params, seed=0):
    """A real rollout of the sampler at cfg's temperature and top-p (no EOS: every slot sampled)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, cfg.model.vocab_size, size=int(n)).tolist()
               for n in rng.integers(1, PROMPT_LEN + 1, size=ROWS)]
    rows = left_pad_prompts(prompts, PROMPT_LEN, pad_id=0)
    opts = SamplingOptions(NEW_TOKENS, cfg.rl.temperature, cfg.rl.top_p, eos_id=-1)
    with build(cfg).context():
        return jax.device_get(make_generate(cfg, opts)(params, *rows, jax.random.key(seed)))


def test_first_update_ratio_is_exactly_one_at_temperature_and_top_p():
    cfg = _config("rl.temperature=0.7", "rl.top_p=0.9", "rl.micro_batches=2")
    params = tiny_params(cfg)
    rollout = _sampled_rollout(cfg, params)
    adv, keep = _advantages()
    _, m = jax.device_get(_run_step(cfg, params, None, build_update_batch(cfg, rollout, adv, keep)))
    # pi_old is the trainer's own policy at T = 0.7: not an approximation of it.
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["pg_clipfrac"] == 0.0, m
    # The sampler's log-probs are those of the nucleus it drew from (renormalised: never below the
    # trainer's); the logged gap is that truncation, and what a gap from T = 1 would be is far off.
    assert 0.01 < m["sampler_gap_mean"] < 2.0 and m["sampler_gap_max"] >= m["sampler_gap_mean"]
    mb = jax.tree.map(lambda x: jnp.asarray(x.reshape(ROWS, -1)), {k: build_update_batch(cfg, rollout, adv, keep)[k]
                                                                  for k in ("tokens", "segment_ids", "positions")})
    h = decoder_hidden(params, cfg, mb["tokens"], mb["segment_ids"], mb["positions"])
    trainer, _ = token_logprobs_reference(h[:, :-1], params["lm_head"], mb["tokens"][:, 1:], temperature=0.7)
    trainer_BN = np.asarray(trainer)[:, PROMPT_LEN - 1:]
    assert np.all(rollout["logprobs"] >= trainer_BN - 1e-5)
    # Where the nucleus kept every token with any mass the two agree (the sampler's own ratio 1).
    np.testing.assert_allclose(m["sampler_gap_mean"], np.abs(rollout["logprobs"] - trainer_BN).mean(), rtol=1e-3)


def test_combined_metrics_take_max_of_max_and_token_weighted_means():
    one = {"kept_tokens": 10.0, "completion_tokens": 12.0, "entropy_sum": 12.0, "logp_sum": -12.0, "kl_sum": 1.0,
           "clipped_sum": 1.0, "clipped_high_sum": 1.0, "clipped_low_sum": 0.0, "ratio_sum": 10.0, "pg_loss": 0.5,
           "gap_sum": 1.2, "is_weight_sum": 10.0, "is_masked_rows": 0.0, "rows_with_tokens": 4.0,
           "ratio_max": 1.5, "ratio_min": 0.9, "gap_max": 0.3, "loss": 0.5, "grad_norm": 2.0, "update_applied": 1.0,
           "update_skipped": 0.0}
    two = {**one, "kept_tokens": 30.0, "clipped_sum": 9.0, "clipped_high_sum": 3.0, "clipped_low_sum": 6.0,
           "ratio_max": 1.1, "ratio_min": 0.5, "gap_max": 0.1, "loss": 1.5, "grad_norm": 4.0, "update_skipped": 1.0}
    m = combine_update_metrics([one, two])
    assert m["ratio_max"] == 1.5 and m["ratio_min"] == 0.5 and m["sampler_gap_max"] == 0.3
    assert m["pg_clipfrac"] == 10.0 / 40.0 and m["pg_clipfrac_low"] == 6.0 / 40.0  # not the mean of 0.1 and 0.3
    assert m["loss"] == 1.0 and m["grad_norm_max"] == 4.0 and m["updates"] == 2.0 and m["update_skipped"] == 1.0
    # Four updates as two passes of two shuffled mini-batches: each pass covers every row once.
    cfg = _config("rl.updates_per_rollout=4", "rl.epochs_per_rollout=2")
    parts = mini_batch_rows(cfg, ROWS, step=3)
    assert len(parts) == 4 and all(len(p) == ROWS // 2 for p in parts)
    for epoch in (0, 1):
        np.testing.assert_array_equal(np.sort(np.concatenate(parts[2 * epoch:2 * epoch + 2])), np.arange(ROWS))
    assert not np.array_equal(parts[0], parts[2])


def test_several_updates_per_rollout_make_the_clip_act_and_clipped_tokens_carry_no_gradient():
    cfg = _config("rl.updates_per_rollout=4", "rl.epochs_per_rollout=2", "rl.micro_batches=1",
                  "rl.learning_rate=0.01")
    params = tiny_params(cfg)
    rollout = _sampled_rollout(_config(), params, seed=2)
    adv, keep = _advantages(seed=2)
    setup, opt = build(cfg), rl_optimizer(cfg)
    init = jax.jit(lambda p: {"params": p, "opt_state": opt.init(p), "step": jnp.int32(0)},
                   out_shardings=setup.state_shardings)
    step, old = jit_grpo_step(setup, opt, with_reference=False), jit_old_logprobs(setup)
    put = lambda b, with_old: jax.device_put(b, update_batch_shardings(setup, with_old))  # noqa: E731
    per_update = []

    def recording_step(state, ref, batch):
        state, m = step(state, ref, batch)
        per_update.append(jax.device_get(m))
        return state, m

    rows = update_rows(cfg, rollout, adv, keep)
    with setup.context():
        _, m = policy_updates(cfg, rows, 0, init(params), None, recording_step, old, put, jax.device_get)

        # The first update: pi_old recomputed by another program on the same params, ratio 1.
        first = per_update[0]
        assert abs(first["ratio_max"] - 1) < 1e-5 and abs(first["ratio_min"] - 1) < 1e-5, first
        # Later updates move the policy past the clip: clipping acts, max is the max of the maxima.
        assert m["pg_clipfrac"] > 0 and m["ratio_max"] > 1 + cfg.rl.eps and m["ratio_min"] < 1 - cfg.rl.eps, m
        assert m["ratio_max"] == max(float(u["ratio_max"]) for u in per_update)
        assert m["updates"] == 4.0 and m["update_applied"] == 1.0

        # Every kept token clipped (pi_old shifted so that r > 1 + eps where A > 0, r < 1 - eps
        # where A < 0): the clipped branch is a constant, so the gradient is exactly 0.
        batch = build_update_batch(cfg, rollout, adv, keep)
        logp = np.asarray(old(params, put(batch, False)))
        sign = np.sign(batch["advantages"])[..., None]
        for shift, all_clipped in ((-0.5, True), (-0.1, False)):
            batch["logp_old"] = (logp + shift * sign).astype(np.float32)
            _, mm = jax.device_get(step(init(params), None, put(batch, True)))
            if all_clipped:
                assert mm["pg_clipfrac"] == 1.0 and mm["grad_norm"] == 0.0, mm
            else:
                assert mm["pg_clipfrac"] == 0.0 and mm["grad_norm"] > 1e-3, mm
