"""The GRPO policy update on the 8-device CPU mesh: its loss, metrics and gradient equal an independent
numpy re-derivation on unchunked log-probs at T = 0.7, micro-batch accumulation equals one big batch,
the first update of a rollout has ratio exactly 1 on every path that computes pi_old (one update,
several: mini-batches x epochs, micro-batches, routing replay; T = 0.7), the pi_old later updates
read is the rollout policy at the sampling temperature (broken variants caught), and several updates
per rollout make the clip act."""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridmoe.rl.grpo as grpo_module
from helpers import ATTENTION_LAYERS, tiny_config, tiny_params
from hybridmoe.model.forward import decoder_hidden
from hybridmoe.rl.grpo import (build_update_batch, combine_update_metrics, jit_grpo_step, jit_old_logprobs,
                               mini_batch_rows, policy_updates, rl_optimizer, split_update_batch,
                               update_batch_shardings, update_rows)
from hybridmoe.kernels.logprobs import token_logprobs_reference
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
from hybridmoe.run.setup import build

PROMPT_LEN, NEW_TOKENS, ROWS = 6, 5, 16


def _config(*overrides):
    # Attention layers only (helpers.ATTENTION_LAYERS): the objective, pi_old and the update act on the
    # trainer's log-probs whatever the mixers (the sampler against the trainer on both mixers:
    # tests/test_sampler.py), at about half of a two-mixer model's compile per program.
    return tiny_config(*ATTENTION_LAYERS, f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW_TOKENS}", "rl.prompts_per_step=4",
                       "rl.group_size=4", "kernels.logprobs.chunk_tokens=24", "kernels.logprobs.chunk_vocab=100",
                       "gdn.chunk_size=4", *overrides)


def _rollout(cfg, seed=0, rows=ROWS):
    """A rollout as the sampler returns it, with made-up tokens, lengths and old log-probs."""
    rng = np.random.default_rng(seed)
    V = cfg.model.vocab_size
    prompts = [rng.integers(3, V, size=int(n)).tolist() for n in rng.integers(1, PROMPT_LEN + 1, size=rows)]
    tokens, seg, pos = left_pad_prompts(prompts, PROMPT_LEN, pad_id=0)
    lengths = rng.integers(1, NEW_TOKENS + 1, size=rows)
    lengths[3] = NEW_TOKENS
    in_completion = np.arange(NEW_TOKENS)[None] < lengths[:, None]
    completion = np.where(in_completion, rng.integers(3, V, size=(rows, NEW_TOKENS)), 0)
    comp_pos = pos[:, -1:] + 1 + np.arange(NEW_TOKENS)
    return {
        "tokens": np.concatenate([tokens, completion], 1).astype(np.int32),
        "segment_ids": np.concatenate([seg, in_completion], 1).astype(np.int32),
        "positions": np.concatenate([pos, np.where(in_completion, comp_pos, 0)], 1).astype(np.int32),
        "lengths": lengths.astype(np.int32),
        # A stale sampler: old log-probs far enough off that both clip branches engage.
        "logprobs": np.where(in_completion, -5.5 + rng.normal(0, 0.4, (rows, NEW_TOKENS)), 0.0).astype(np.float32),
    }


def _advantages(seed=0, rows=ROWS):
    rng = np.random.default_rng(seed + 10)
    keep = rng.random(rows) > 0.2
    return np.where(keep, rng.normal(size=rows), 0.0).astype(np.float32), keep


_COMPILED = {}


def _run_step(cfg, params, ref_params, batch):
    """One step from a fresh optimizer state; compiled once per config."""
    key = (cfg.model_dump_json(), ref_params is not None)
    if key not in _COMPILED:
        setup, opt = build(cfg), rl_optimizer(cfg)
        init = jax.jit(lambda p: {"params": p, "opt_state": opt.init(p), "step": jnp.int32(0)},
                       out_shardings=setup.state_shardings)
        _COMPILED[key] = setup, init, jit_grpo_step(setup, with_reference=ref_params is not None)
    setup, init, step = _COMPILED[key]
    with setup.context():
        return step(init(params), ref_params, batch)


def _stale(batch, logp_old):
    """The batch of a later update of a rollout: pi_old from the batch, not the step's own."""
    return {**batch, "logp_old": logp_old, "on_policy": np.zeros(batch["tokens"].shape[0], bool)}


STEP_TOL = 1e-4  # the step (float32, chunked, 8 devices) against numpy float64 on unchunked log-probs


def _objective_case():
    """(cfg, params, reference params, a later update's batch: pi_old stale) of the objective test."""
    cfg = _config("rl.beta=0.05", "rl.eps_high=0.28", "rl.micro_batches=1", "rl.updates_per_rollout=2",
                  "rl.temperature=0.7")
    params, ref_params = tiny_params(cfg, seed=0), tiny_params(cfg, seed=5)
    adv, keep = _advantages()
    adv = np.where(keep, adv, 1.5).astype(np.float32)  # dropped rows carry an advantage: it must not count
    batch = build_update_batch(cfg, _rollout(cfg), adv, keep)
    return cfg, params, ref_params, _stale(batch, batch["logp_sampler"])


def test_step_equals_the_independent_objective_at_temperature():
    """The step's loss, metrics and gradient norm against tests/grpo_reference.py (numpy, float64,
    d loss / d logp written out) on log-probs of the unchunked definition at T = 0.7, chained to the
    params by the log-probs' own VJP. A stale pi_old (a later update of a rollout) makes both clip
    sides act; masked prompt slots (pi_old 0 there, ratio ~e^-5) and a dropped row whose advantage
    is not 0 would clip if they counted."""
    from grpo_reference import grpo_reference

    cfg, params, ref_params, batch = _objective_case()
    _, metrics = jax.device_get(_run_step(cfg, params, ref_params, batch))

    mb = jax.tree.map(lambda x: jnp.asarray(x[0]), batch)

    def logp_of(p):
        h = decoder_hidden(p, cfg, mb["tokens"], mb["segment_ids"], mb["positions"])
        return token_logprobs_reference(h[:, :-1], p["lm_head"], mb["tokens"][:, 1:], temperature=0.7)

    # Compiled once each (eager, the model's ops would dispatch one by one).
    logp_jit = jax.jit(logp_of)
    logp, entropy = logp_jit(params)
    logp_ref, _ = logp_jit(ref_params)
    pullback = jax.jit(lambda p, ct: jax.vjp(logp_of, p)[1]((ct, jnp.zeros_like(ct)))[0])
    kw = dict(eps=0.2, eps_high=0.28, keep=np.asarray(mb["keep"]))
    want = grpo_reference(logp, mb["logp_old"], mb["advantages"], mb["mask"], beta=0.05, logp_ref=logp_ref, **kw)
    # The case exercises what it claims: both clip sides, and masked or dropped tokens that would clip.
    assert want["pg_clipfrac_high"] > 0 and want["pg_clipfrac_low"] > 0 and want["kl"] > 0
    everything = grpo_reference(logp, mb["logp_old"], mb["advantages"], np.ones_like(mb["mask"]), eps=0.2,
                                eps_high=0.28)
    assert everything["pg_clipfrac"] * everything["num_tokens"] > want["pg_clipfrac"] * want["num_tokens"] + 10
    grads = pullback(params, jnp.asarray(want["grad"], jnp.float32))
    mask = np.asarray(mb["mask"], np.float64)
    want.update(grad_norm=float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))),
                entropy=float((np.asarray(entropy, np.float64) * mask).sum() / mask.sum()),
                kept_tokens=want["num_tokens"])
    keys = ("loss", "pg_loss", "kl", "pg_clipfrac", "pg_clipfrac_high", "pg_clipfrac_low", "ratio_mean", "ratio_max",
            "ratio_min", "entropy", "grad_norm", "kept_tokens")
    errors = {k: abs(float(metrics[k]) - want[k]) / max(abs(want[k]), 1e-3) for k in keys}
    assert max(errors.values()) < STEP_TOL, {k: f"{metrics[k]:.6g} vs {want[k]:.6g}" for k in keys}
    assert float(metrics["update_applied"]) == 1.0


def on_policy_metrics(run_step) -> dict:
    """The step's ratio metrics on the objective case's batch flagged as a rollout's first update."""
    cfg, params, ref_params, batch = _objective_case()
    m = jax.device_get(run_step(cfg, params, ref_params, {**batch, "on_policy": np.ones_like(batch["on_policy"])})[1])
    return {k: float(m[k]) for k in ("ratio_min", "ratio_max", "ratio_mean", "pg_clipfrac")}


def test_a_first_update_takes_its_own_logprobs_as_pi_old_whatever_the_batch_holds():
    # The batch's pi_old is stale (both clip sides act on it, see the test above); flagged on
    # policy, the step's ratio is exp(0) = 1 on every token.
    assert on_policy_metrics(_run_step) == {"ratio_min": 1.0, "ratio_max": 1.0, "ratio_mean": 1.0, "pg_clipfrac": 0.0}


def test_broken_on_policy_flag_is_caught(monkeypatch):
    """Broken variant: the step reads the batch's recomputed pi_old on the first update too (the
    README's "exactly 1" then fails by float rounding of another program: ratios 1 +- 2e-6
    measured on the multi-update run, here by the stale pi_old's whole distance)."""
    from broken_variants import mutated
    monkeypatch.setattr(grpo_module, "micro_batch_loss", mutated(
        grpo_module, "micro_batch_loss", 'jnp.where(mb["on_policy"], sg(logp), mb["logp_old"])', 'mb["logp_old"]'))
    monkeypatch.setattr(sys.modules[__name__], "_COMPILED", {})
    m = on_policy_metrics(_run_step)
    assert m["ratio_min"] != 1.0 or m["ratio_max"] != 1.0, m


def _sampled_rollout(cfg, params, seed=0, eos_id=-1, stop_ids=()):
    """A real rollout of the sampler at cfg's temperature and top-p (by default no EOS: every slot
    sampled)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, cfg.model.vocab_size, size=int(n)).tolist()
               for n in rng.integers(1, PROMPT_LEN + 1, size=ROWS)]
    rows = left_pad_prompts(prompts, PROMPT_LEN, pad_id=0)
    opts = SamplingOptions(NEW_TOKENS, cfg.rl.temperature, cfg.rl.top_p, eos_id=eos_id, stop_ids=stop_ids)
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


# ---------------------------------------------------------------------------------------------
# Several updates per rollout: every path that computes pi_old at once (two shuffled mini-batches
# x two epochs, two micro-batches, routing replay with experts the trainer's router would not
# pick), at T = 0.7. The rollout's routing is random, so pi_old without it would be another policy.

MULTI = ("rl.temperature=0.7", "rl.top_p=0.9", "moe.routing_replay=true", "rl.updates_per_rollout=4",
         "rl.epochs_per_rollout=2", "rl.micro_batches=2", "rl.learning_rate=0.01", "rl.prompts_per_step=8",
         "rl.aggregation=seq_mean_token_mean")
MULTI_ROWS = 32  # 8 prompts x 4: a micro-batch of 8 rows, one per batch shard
PI_OLD_TOL = 3e-4  # max |pi_old - reference| over completion tokens, in nats (measured clean: 1.0e-5)


def _random_routing(cfg, seed):
    m = cfg.model
    draws = np.random.default_rng(seed).random((MULTI_ROWS, PROMPT_LEN + NEW_TOKENS, m.num_layers, m.num_experts))
    return np.argsort(draws, axis=-1)[..., :m.num_experts_per_tok].astype(np.int32)


@pytest.fixture(scope="module")
def multi_update():
    cfg = _config(*MULTI)
    params = tiny_params(cfg)
    rollout = {**_rollout(cfg, seed=2, rows=MULTI_ROWS), "routing": _random_routing(cfg, 3)}
    adv, keep = _advantages(seed=2, rows=MULTI_ROWS)
    setup, opt = build(cfg), rl_optimizer(cfg)
    init = jax.jit(lambda p: {"params": p, "opt_state": opt.init(p), "step": jnp.int32(0)},
                   out_shardings=setup.state_shardings)
    step, old = jit_grpo_step(setup, with_reference=False), jit_old_logprobs(setup)
    put = lambda b, with_old: jax.device_put(b, update_batch_shardings(setup, with_old))  # noqa: E731
    rows = update_rows(cfg, rollout, adv, keep)
    per_update = []

    def recording_step(state, ref, batch):
        state, m = step(state, ref, batch)
        per_update.append(jax.device_get(m))
        return state, m

    with setup.context():
        _, combined = policy_updates(cfg, rows, 0, init(params), None, recording_step, old, put, jax.device_get)
    return types.SimpleNamespace(cfg=cfg, params=params, rollout=rollout, adv=adv, keep=keep, rows=rows, setup=setup,
                                 init=init, step=step, old=old, put=put, per_update=per_update, combined=combined)


def test_first_update_of_a_rollout_has_ratio_exactly_one_on_every_pi_old_path(multi_update):
    first = multi_update.per_update[0]
    # The trainer's own metrics: the rollout's params, so pi_old is the update's own log-prob.
    assert first["ratio_min"] == 1.0 and first["ratio_max"] == 1.0 and first["pg_clipfrac"] == 0.0, first
    assert first["ratio_mean"] == 1.0 and first["kept_tokens"] > 0


_NO_METRICS = dict.fromkeys((*grpo_module._SUM_KEYS, *grpo_module._EXTREMES, "loss", "grad_norm", "update_applied",
                             "update_skipped"), 0.0)


def pi_old_errors(run) -> dict:
    """{"pi_old": max |pi_old each update reads - the reference| over completion tokens, "flags": the
    updates' on_policy flags}. The reference is the unchunked definition at T = 0.7 on each batch's
    own rows and replayed experts; the updates are policy_updates' with a step that only records."""
    seen = []

    def recording_only(state, ref, batch):
        seen.append(jax.device_get(batch))
        return state, _NO_METRICS

    with run.setup.context():
        grpo_module.policy_updates(run.cfg, run.rows, 0, {"params": run.params}, None, recording_only, run.old,
                                   run.put, jax.device_get)
    flat = lambda k: np.concatenate([b[k].reshape(-1, *b[k].shape[2:]) for b in seen])  # noqa: E731
    h = jax.jit(lambda p, t, s, q, r: decoder_hidden(p, run.cfg, t, s, q, routing_BTLk=r))(
        run.params, flat("tokens"), flat("segment_ids"), flat("positions"), flat("routing"))
    want, _ = token_logprobs_reference(h[:, :-1], run.params["lm_head"], flat("tokens")[:, 1:], temperature=0.7)
    mask = flat("mask") > 0
    return {"pi_old": float(np.abs(flat("logp_old") - np.asarray(want))[mask].max()),
            "flags": [b["on_policy"].tolist() for b in seen]}


def test_recomputed_pi_old_is_the_rollout_policy_at_the_sampling_temperature(multi_update):
    errors = pi_old_errors(multi_update)
    assert errors["pi_old"] < PI_OLD_TOL, errors
    assert errors["flags"] == [[True, True]] + [[False, False]] * 3, errors  # the first update only, every micro-batch


# One-line bugs on the pi_old paths, each patched in: pi_old_errors must catch it (>= 10x the clean error).
PI_OLD_BROKEN = {
    "pi_old_at_temperature_1": ("jit_old_logprobs", "sequence_logprobs(params, cfg,",
                                "sequence_logprobs(params, cfg.model_copy(update={'rl': cfg.rl.model_copy("
                                "update={'temperature': 1.0})}),"),
    "pi_old_without_the_replayed_experts": ("jit_old_logprobs", 'mb["positions"], mb.get("routing"))',
                                            'mb["positions"], None)'),
    "pi_old_rows_in_micro_batch_order": ("policy_updates", 'logp_old.reshape(B, -1)',
                                         'np.swapaxes(logp_old, 0, 1).reshape(B, -1)'),
    "no_update_flagged_on_policy": ("policy_updates", "on_policy=update == 0", "on_policy=False"),
}


@pytest.mark.parametrize("variant", list(PI_OLD_BROKEN))
def test_broken_pi_old_is_caught(variant, multi_update, monkeypatch):
    from broken_variants import mutated
    clean = pi_old_errors(multi_update)
    name, old, new = PI_OLD_BROKEN[variant]
    monkeypatch.setattr(grpo_module, name, mutated(grpo_module, name, old, new))
    run = multi_update
    if name == "jit_old_logprobs":
        run = types.SimpleNamespace(**{**vars(run), "old": grpo_module.jit_old_logprobs(run.setup)})
    broken = pi_old_errors(run)
    assert (broken["pi_old"] >= max(PI_OLD_TOL, 10 * clean["pi_old"]) or broken["flags"] != clean["flags"]), (
        f"{variant}: clean {clean}, broken {broken}")


def test_micro_batches_accumulate_to_one_big_batch_and_empty_batches_do_not_step(multi_update):
    """The run's second update (its compiled two-micro-batch step, seq_mean_token_mean, a stale
    pi_old: clipping acts on some tokens) against the same update in one micro-batch."""
    run = multi_update
    cfg1 = _config(*MULTI, "rl.micro_batches=1")
    rows = {k: v[mini_batch_rows(run.cfg, MULTI_ROWS, 0)[1]] for k, v in run.rows.items()}
    rows["logp_old"] = rows["logp_sampler"]
    with run.setup.context():
        s2, m2 = jax.device_get(run.step(run.init(run.params), None, run.put(split_update_batch(run.cfg, rows), True)))
    s1, m1 = jax.device_get(_run_step(cfg1, run.params, None, split_update_batch(cfg1, rows)))
    assert m1["pg_clipfrac"] > 0, m1
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "pg_clipfrac", "kept_tokens"):
        np.testing.assert_allclose(m2[key], m1[key], rtol=2e-5, err_msg=key)
    # Adam's first step is nearly sign(g) * lr: where g is ~0, float-order noise in g can move
    # that element's update by up to 2 lr (measured: 1 element of the tree 1.2e-3 off at lr 1e-2),
    # so the params are compared by how many elements differ by more than 10% of lr: a wrong
    # direction of the accumulated gradient moves a large fraction of them (its scale is the
    # metrics' check above).
    atol = 0.1 * run.cfg.rl.learning_rate
    pairs = list(zip(jax.tree.leaves(s2["params"]), jax.tree.leaves(s1["params"])))
    far = sum(int(np.sum(np.abs(a - b) > atol + 1e-4 * np.abs(b))) for a, b in pairs)
    total = sum(a.size for a, _ in pairs)
    assert far <= 1e-3 * total, f"{far} of {total} params differ by more than {atol:g} (bound {1e-3 * total:.0f})"
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(run.params)))

    # Nothing kept: the update is skipped (params unchanged), not an AdamW step on a zero gradient.
    empty = {**rows, "advantages": np.zeros_like(rows["advantages"]), "keep": np.zeros_like(rows["keep"])}
    state, metrics = jax.device_get(_run_step(cfg1, run.params, None, split_update_batch(cfg1, empty)))
    assert metrics["update_applied"] == 0.0 and metrics["loss"] == 0.0
    jax.tree.map(np.testing.assert_array_equal, state["params"], jax.device_get(run.params))


def test_later_updates_make_the_clip_act_and_clipped_tokens_carry_no_gradient(multi_update):
    run, m = multi_update, multi_update.combined
    # Later updates move the policy past the clip: clipping acts, max is the max of the maxima.
    assert m["pg_clipfrac"] > 0 and m["ratio_max"] > 1 + run.cfg.rl.eps and m["ratio_min"] < 1 - run.cfg.rl.eps, m
    assert m["ratio_max"] == max(float(u["ratio_max"]) for u in run.per_update)
    assert m["updates"] == 4.0 and m["update_applied"] == 1.0

    # Every kept token clipped (pi_old shifted so that r > 1 + eps where A > 0, r < 1 - eps
    # where A < 0): the clipped branch is a constant, so the gradient is exactly 0. The masked
    # prompt slots are shifted too: they would clip, and must not count.
    # The first update's rows and pi_old, so that the run's compiled programs serve.
    with run.setup.context():
        index = mini_batch_rows(run.cfg, MULTI_ROWS, 0)[0]
        rows = {k: v[index] for k, v in run.rows.items()}
        logp = np.asarray(run.old(run.params, run.put(split_update_batch(run.cfg, run.rows), False)))
        logp = logp.reshape(MULTI_ROWS, -1)[index]
        sign = np.sign(rows["advantages"])[:, None]
        for shift, all_clipped in ((-0.5, True), (-0.1, False)):
            stale = split_update_batch(run.cfg, {**rows, "logp_old": (logp + shift * sign).astype(np.float32)})
            _, mm = jax.device_get(run.step(run.init(run.params), None, run.put(stale, True)))
            if all_clipped:
                assert mm["pg_clipfrac"] == 1.0 and mm["grad_norm"] == 0.0, mm
            else:
                assert mm["pg_clipfrac"] == 0.0 and mm["grad_norm"] > 1e-3, mm
