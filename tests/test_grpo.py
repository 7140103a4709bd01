"""The GRPO policy update on the 8-device CPU mesh: its loss is the objective of unchunked log-probs,
and micro-batch accumulation equals one big batch."""

import jax
import jax.numpy as jnp
import numpy as np

from helpers import tiny_config, tiny_params
from hybridmoe.model.forward import decoder_hidden
from hybridmoe.rl.grpo import build_update_batch, jit_grpo_step, rl_optimizer
from hybridmoe.rl.logprobs import token_logprobs_reference
from hybridmoe.rl.objective import clipped_policy_loss
from hybridmoe.rl.sampler import left_pad_prompts
from hybridmoe.train.setup import build

PROMPT_LEN, NEW_TOKENS, ROWS = 6, 5, 16


def _config(*overrides):
    return tiny_config(f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW_TOKENS}", "rl.prompts_per_step=4",
                       "rl.group_size=4", "rl.logprob_chunk_tokens=24", "rl.logprob_chunk_vocab=100",
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
    cfg = _config("rl.beta=0.05", "rl.eps_high=0.28", "rl.micro_batches=1")
    params, ref_params = tiny_params(cfg, seed=0), tiny_params(cfg, seed=5)
    rollout = _rollout(cfg)
    adv, keep = _advantages()
    batch = build_update_batch(cfg, rollout, adv, keep)
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
        cfg = _config(f"rl.micro_batches={m}", "rl.aggregation=seq_mean_token_mean")
        outs[m] = jax.device_get(_run_step(cfg, params, None, build_update_batch(cfg, rollout, adv, keep)))
    (s1, m1), (s2, m2) = outs[1], outs[2]
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "pg_clipfrac", "kept_tokens"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=2e-5, err_msg=key)
    # Adam's first step is nearly sign(g) * lr: where g is ~0, float-order noise in g moves the
    # update by up to lr; 5e-5 is 5% of lr = 1e-3, far below a wrong accumulation (O(lr) everywhere).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), s2["params"], s1["params"])
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(params)))

    # Nothing kept: the update is skipped (params unchanged), not an AdamW step on a zero gradient.
    cfg = _config("rl.micro_batches=2", "rl.aggregation=seq_mean_token_mean")
    state, metrics = jax.device_get(_run_step(cfg, params, None, build_update_batch(
        cfg, rollout, np.zeros(ROWS, np.float32), np.zeros(ROWS, bool))))
    assert metrics["update_applied"] == 0.0 and metrics["loss"] == 0.0
    jax.tree.map(np.testing.assert_array_equal, state["params"], jax.device_get(params))
