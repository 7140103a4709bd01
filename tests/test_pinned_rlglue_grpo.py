"""The GRPO update's host-side glue pinned on tiny hand-made arrays: the logged ratios from the step's
sums, the rows and normaliser handed to the step, the mini-batch schedule, the updates of a rollout
with a fake step, and `generate`'s figures with a fake sampler and clock. No model is built."""

import types

import numpy as np
import pytest

from hybridmoe.rl import grpo
from hybridmoe.rl.grpo import (combine_update_metrics, mini_batch_rows, policy_updates, split_update_batch,
                               step_metrics, step_normalizer, update_rows)


def _cfg(**rl):
    base = dict(aggregation="token_mean", max_new_tokens=3, fewest_micro_batches=1, mini_batches=1,
                epochs_per_rollout=1, updates_per_rollout=1)
    return types.SimpleNamespace(rl=types.SimpleNamespace(**{**base, **rl}),
                                 moe=types.SimpleNamespace(routing_replay=False), train=types.SimpleNamespace(seed=0))


SUMS = {"kept_tokens": 8.0, "completion_tokens": 10.0, "entropy_sum": 15.0, "logp_sum": -20.0, "kl_sum": 2.0,
        "clipped_sum": 4.0, "clipped_high_sum": 1.0, "clipped_low_sum": 3.0, "ratio_sum": 9.0, "pg_loss": 0.25,
        "gap_sum": 5.0, "is_weight_sum": 6.0, "is_masked_rows": 1.0, "rows_with_tokens": 4.0,
        "ratio_max": 1.5, "ratio_min": 0.5, "gap_max": 0.75}


def test_step_metrics_divide_each_sum_by_its_own_count():
    m = step_metrics(SUMS, True)
    # Over all completion tokens (10): entropy 15/10, logp -20/10, sampler gap 5/10.
    assert (m["entropy"], m["logp_mean"], m["sampler_gap_mean"]) == (1.5, -2.0, 0.5)
    # Over the kept tokens (8): kl 2/8, clip fractions 4/8, 1/8, 3/8, ratio 9/8, is weight 6/8.
    assert (m["kl"], m["pg_clipfrac"], m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == (0.25, 0.5, 0.125, 0.375)
    assert (m["ratio_mean"], m["is_weight_mean"]) == (1.125, 0.75)
    assert (m["ratio_max"], m["ratio_min"], m["sampler_gap_max"]) == (1.5, 0.5, 0.75)
    assert m["is_masked_frac"] == 0.25  # 1 masked row of 4 with tokens


def test_step_metrics_of_an_update_that_kept_nothing_are_neutral():
    m = step_metrics({**SUMS, "kept_tokens": 0.0, "rows_with_tokens": 0.0, "is_masked_rows": 0.0}, False)
    assert (m["ratio_mean"], m["ratio_max"], m["ratio_min"], m["is_weight_mean"]) == (1.0, 1.0, 1.0, 1.0)
    assert m["kl"] == 2.0 and m["is_masked_frac"] == 0.0  # divided by max(0, 1) = 1


def test_combined_updates_add_sums_and_average_the_loss_and_grad_norm():
    one = {**SUMS, "loss": 1.0, "grad_norm": 3.0, "update_applied": 1.0, "update_skipped": 0.0}
    two = {**SUMS, "kept_tokens": 2.0, "completion_tokens": 6.0, "entropy_sum": 1.0, "ratio_sum": 3.0,
           "ratio_max": 1.25, "ratio_min": 0.25, "gap_max": 1.0, "pg_loss": 0.75, "loss": 2.0, "grad_norm": 5.0,
           "update_applied": 0.0, "update_skipped": 1.0}
    m = combine_update_metrics([one, two])
    assert m["kept_tokens"] == 10.0 and m["completion_tokens"] == 16.0
    assert m["entropy"] == 16.0 / 16.0 and m["ratio_mean"] == 12.0 / 10.0
    assert (m["ratio_max"], m["ratio_min"], m["sampler_gap_max"]) == (1.5, 0.25, 1.0)
    assert (m["loss"], m["pg_loss"], m["grad_norm"], m["update_applied"]) == (1.5, 0.5, 4.0, 0.5)
    assert (m["grad_norm_max"], m["update_skipped"], m["updates"]) == (5.0, 1.0, 2.0)


def test_the_normaliser_counts_kept_tokens_or_kept_sequences_with_a_token():
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], np.float32)
    keep = np.array([1, 1, 0, 1], np.float32)
    assert step_normalizer(_cfg(), mask, keep) == 5.0  # 2 + 0 + (dropped) + 3
    assert step_normalizer(_cfg(aggregation="seq_mean_token_mean"), mask, keep) == 2.0  # rows 0 and 3


def test_update_rows_put_completion_token_j_at_index_p_minus_1_plus_j():
    # Prompt slots P = 5 - 3 = 2; targets T - 1 = 4: index 0 predicts prompt token 1, then completion.
    rollout = {"tokens": np.arange(10).reshape(2, 5), "segment_ids": np.ones((2, 5), np.int32),
               "positions": np.tile(np.arange(5), (2, 1)), "lengths": np.array([1, 3]),
               "logprobs": np.array([[-0.5, -0.25, -2.0], [-1.0, -2.0, -3.0]], np.float32)}
    out = update_rows(_cfg(), rollout, np.array([0.5, -0.5]), np.array([True, False]))
    assert out["mask"].tolist() == [[0, 1, 0, 0], [0, 1, 1, 1]]
    # The sampler's log-probs of the completion, zero past each row's length.
    assert out["logp_sampler"].tolist() == [[0, -0.5, 0, 0], [0, -1.0, -2.0, -3.0]]
    assert out["advantages"].tolist() == [0.5, -0.5] and out["keep"].tolist() == [True, False]
    assert "routing" not in out
    replay = _cfg()
    replay.moe.routing_replay = True
    routing = np.arange(2 * 5 * 1 * 2).reshape(2, 5, 1, 2)
    out = update_rows(replay, {**rollout, "routing": routing}, np.array([0.5, -0.5]), np.array([True, False]))
    assert out["routing"].dtype == np.int32 and out["routing"].tolist() == routing.tolist()  # aligned with tokens


def test_an_update_batch_is_split_in_order_with_the_update_wide_normaliser():
    rows = {"tokens": np.arange(8).reshape(4, 2), "mask": np.array([[1, 0], [1, 1], [0, 0], [1, 1]], np.float32),
            "keep": np.array([True, True, True, False])}
    out = split_update_batch(_cfg(), rows, micro_batches=2)
    assert out["tokens"].tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert out["normalizer"].tolist() == [3.0, 3.0] and "on_policy" not in out  # 1 + 2, row 3 dropped
    with_old = split_update_batch(_cfg(), {**rows, "logp_old": np.zeros((4, 2))}, on_policy=True, micro_batches=2)
    assert with_old["on_policy"].tolist() == [True, True]
    with pytest.raises(ValueError, match="rl.micro_batches=3 does not divide an update's 4 rows"):
        split_update_batch(_cfg(), rows, micro_batches=3)


def test_mini_batches_cover_every_row_once_per_epoch():
    assert [p.tolist() for p in mini_batch_rows(_cfg(epochs_per_rollout=2), 4, step=0)] == [[0, 1, 2, 3]] * 2
    parts = mini_batch_rows(_cfg(mini_batches=3, epochs_per_rollout=2), 6, step=1)
    assert [len(p) for p in parts] == [2] * 6
    assert sorted(np.concatenate(parts[:3]).tolist()) == sorted(np.concatenate(parts[3:]).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="4 mini-batches do not divide the 6 rollouts"):
        mini_batch_rows(_cfg(mini_batches=4), 6, step=0)


def _metric(loss, kept):
    return {**SUMS, "kept_tokens": kept, "loss": loss, "grad_norm": 1.0, "update_applied": 1.0,
            "update_skipped": 0.0}


def test_one_update_per_rollout_steps_once_on_the_whole_rollout(monkeypatch):
    rows = {"tokens": np.zeros((4, 2)), "mask": np.ones((4, 2), np.float32), "keep": np.ones(4, bool)}
    seen = []

    def step(state, ref, batch):
        seen.append(batch)
        return state + 1, _metric(0.5, 8.0)
    state, m = policy_updates(_cfg(), rows, 0, 0, None, step, None, lambda b, old: b, lambda x: x)
    assert state == 1 and len(seen) == 1 and seen[0]["normalizer"].tolist() == [8.0]
    assert m["old_logprobs_time_s"] == 0.0 and m["updates"] == 1.0 and m["loss"] == 0.5


def test_several_updates_read_pi_old_once_and_only_the_first_is_on_policy(monkeypatch):
    clock = iter([10.0, 12.5])
    monkeypatch.setattr(grpo.time, "perf_counter", lambda: next(clock))
    cfg = _cfg(updates_per_rollout=2, mini_batches=2)
    rows = {"tokens": np.arange(8).reshape(4, 2), "mask": np.ones((4, 2), np.float32), "keep": np.ones(4, bool)}
    old_calls, seen = [], []

    def old(params, batch):
        old_calls.append(batch["tokens"].shape)
        return batch["tokens"] * 10.0  # pi_old per target: [M, b, T] -> reshaped to [B, T]

    def step(state, ref, batch):
        seen.append(batch)
        return state, _metric(float(len(seen)), 2.0)
    _, m = policy_updates(cfg, rows, 0, {"params": None}, None, step, old, lambda b, with_old: b, lambda x: x,
                          old_micro_batches=2)
    assert old_calls == [(2, 2, 2)]  # once, in the 2 micro-batches asked for
    assert [b["on_policy"].tolist() for b in seen] == [[True], [False]]
    for b in seen:  # each row's pi_old travels with it through the shuffle
        np.testing.assert_array_equal(b["logp_old"][0], b["tokens"][0] * 10.0)
    assert m["old_logprobs_time_s"] == 2.5 and m["updates"] == 2.0 and m["loss"] == 1.5


# ------------------------------------------------------------------------------------------------
# generate's figures, with a fake sampler, mesh and clock


def test_generate_counts_real_rows_tokens_over_generation_seconds_without_the_compile(monkeypatch):
    from hybridmoe.data.tokenizer import CharTokenizer
    from hybridmoe.rl import policy_io

    tok = CharTokenizer()
    calls = []

    def compiled(params, tokens, seg, pos, key):
        calls.append(tokens.shape)
        B = tokens.shape[0]
        # Every row generates 3 + its index tokens (the padding rows too: they must not be counted).
        lengths = np.array([3 + i for i in range(B)])
        return {"lengths": lengths, "completion": np.full((B, 8), tok.encode("a")[0]), "truncated": lengths == 8}

    fake_gen = types.SimpleNamespace(lower=lambda *a: types.SimpleNamespace(compile=lambda: compiled))
    monkeypatch.setattr(policy_io, "make_generate", lambda *a, **k: fake_gen)
    monkeypatch.setattr(policy_io, "put_global", lambda x, sh: x)
    monkeypatch.setattr(policy_io, "fetch_global", lambda x: x)
    monkeypatch.setattr(policy_io, "NamedSharding", lambda *a: None)
    # compile 100 -> 104 (4 s), batch 1 200 -> 201 (1 s), batch 2 300 -> 303 (3 s)
    clock = iter([100.0, 104.0, 200.0, 201.0, 300.0, 303.0])
    monkeypatch.setattr(policy_io, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    setup = types.SimpleNamespace(batch_sharding=lambda i: types.SimpleNamespace(spec=(("data", "fsdp"),)),
                                  mesh=types.SimpleNamespace(shape={"data": 2, "fsdp": 2}), param_shardings=None,
                                  context=lambda: __import__("contextlib").nullcontext())
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(max_seq_len=64))
    policy = policy_io.Policy(cfg, setup, None, tok)
    prompts = ["ab", "c", "de", "f", "gh"]
    records, figures = policy_io.generate_texts(policy, prompts, max_new_tokens=8, temperature=0.0, top_p=1.0,
                                                batch_size=3)
    # 4 batch shards: 3 rows round up to 4. Five prompts: a batch of 4, then one of 1 (+ 3 padding rows).
    assert figures["rows_per_batch"] == 4 and figures["batches"] == 2 and calls == [(4, 3)] * 2
    # Real rows: 3+4+5+6 = 18 in batch 1, 3 in batch 2: 21 tokens in 1 + 3 s; the compile's 4 s apart.
    assert (figures["new_tokens"], figures["seconds"], figures["compile_s"]) == (21, 4.0, 4.0)
    assert figures["tokens_per_s"] == 21 / 4.0
    assert [r["tokens"] for r in records] == [3, 4, 5, 6, 3]
    assert [r["prompt"] for r in records] == prompts and records[4]["completion"] == "aaa"
    assert records[0]["prompt_ids"] == [tok.bos_id, *tok.encode("ab")]


def test_generate_refuses_a_prompt_that_leaves_no_room_for_the_new_tokens():
    from hybridmoe.data.tokenizer import CharTokenizer
    from hybridmoe.rl import policy_io
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(max_seq_len=10))
    policy = policy_io.Policy(cfg, None, None, CharTokenizer())
    # bos + 4 characters = 5 tokens, + 6 new = 11 > 10; with 5 new it is exactly 10 and would pass this check.
    with pytest.raises(ValueError, match=r"the longest prompt \(5 tokens\) \+ --max-new-tokens 6 exceeds "
                                         r"model.max_seq_len=10"):
        policy_io.generate_texts(policy, ["abcd", "a"], max_new_tokens=6, temperature=0.0, top_p=1.0, batch_size=1)
    with pytest.raises(AttributeError):  # exactly 10 passes the check and reaches the (absent) mesh
        policy_io.generate_texts(policy, ["abcd", "a"], max_new_tokens=5, temperature=0.0, top_p=1.0, batch_size=1)


# ------------------------------------------------------------------------------------------------
# advantages and the objective's logged figures


def test_advantage_stats_are_over_the_kept_samples_only():
    import jax.numpy as jnp
    from hybridmoe.rl.advantages import advantage_stats
    adv = jnp.array([[1.0, -1.0, 0.5], [2.0, 0.0, -3.0]])
    keep = jnp.array([[True, True, True], [False, True, False]])
    s = {k: float(v) for k, v in advantage_stats(adv, keep).items()}
    # Kept: 1, -1, 0.5, 0 -> mean 0.5 / 4 = 0.125; deviations 0.875, -1.125, 0.375, -0.125;
    # population variance (0.765625 + 1.265625 + 0.140625 + 0.015625) / 4 = 0.546875.
    assert s["adv_mean"] == 0.125 and s["adv_std"] == pytest.approx(0.546875 ** 0.5, rel=1e-6)
    assert (s["adv_min"], s["adv_max"]) == (-1.0, 1.0)  # not the dropped 2 and -3
    none = {k: float(v) for k, v in advantage_stats(adv, jnp.zeros((2, 3), bool)).items()}
    assert none == {"adv_mean": 0.0, "adv_std": 0.0, "adv_min": 0.0, "adv_max": 0.0}


def test_group_advantages_leave_out_skipped_rewards_and_mask_truncated_rows():
    import jax.numpy as jnp
    from hybridmoe.rl.advantages import group_advantages
    rewards = jnp.array([[1.0, 0.0, 0.0, 5.0]])
    skipped = jnp.array([[False, False, False, True]])
    # Valid 1, 0, 0: mean 1/3, centred 2/3, -1/3, -1/3; rloo scales by n / (n - 1) = 3 / 2.
    adv, keep, frac = group_advantages(rewards, estimator="rloo", skipped_PG=skipped)
    np.testing.assert_allclose(np.asarray(adv), [[1.0, -0.5, -0.5, 0.0]], rtol=1e-6)
    assert np.asarray(keep).tolist() == [[True, True, True, False]] and float(frac) == 0.75
    # drgrpo: centred only; the truncated row 1 keeps its place in the mean but carries no loss.
    adv, keep, frac = group_advantages(rewards, estimator="drgrpo", skipped_PG=skipped, mask_truncated=True,
                                       truncated_PG=jnp.array([[False, True, False, False]]))
    np.testing.assert_allclose(np.asarray(adv), [[2 / 3, 0.0, -1 / 3, 0.0]], rtol=1e-6)
    assert float(frac) == 0.5
    # grpo: std of 1, 0 (population) is 0.5, so the advantages are +-0.5 / (0.5 + 1e-6).
    adv, _, _ = group_advantages(jnp.array([[1.0, 0.0]]))
    np.testing.assert_allclose(np.asarray(adv), [[0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)]], rtol=1e-6)
    # One valid sample: no leave-one-out baseline (rloo drops it); a single distinct value is zero variance.
    _, keep, _ = group_advantages(jnp.array([[1.0, 3.0]]), estimator="rloo", skipped_PG=jnp.array([[False, True]]),
                                  mask_zero_variance=False)
    assert np.asarray(keep).tolist() == [[False, False]]


def _objective_case(**kw):
    import jax.numpy as jnp
    from hybridmoe.rl.objective import clipped_policy_loss
    # Row 0 (advantage +1): ratios 1.5, 0.5, 1.1; row 1 (advantage -1): 0.5, 1.1 and a masked 3.0.
    ratios = np.array([[1.5, 0.5, 1.1], [0.5, 1.1, 3.0]], np.float32)
    logp = jnp.log(jnp.asarray(ratios))
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    return clipped_policy_loss(logp, jnp.zeros((2, 3)), jnp.array([1.0, -1.0]), mask, eps=0.2, **kw)


def test_the_objectives_clip_fractions_and_ratio_figures_by_hand():
    loss, m = _objective_case()
    m = {k: float(v) for k, v in m.items()}
    # High clip: advantage > 0 and ratio > 1.2: row 0's 1.5. Low: advantage < 0 and ratio < 0.8: row 1's 0.5.
    assert m["num_tokens"] == 5.0
    assert (m["pg_clipfrac"], m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == pytest.approx((0.4, 0.2, 0.2))
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.1) / 5, rel=1e-6)
    assert (m["ratio_max"], m["ratio_min"]) == pytest.approx((1.5, 0.5), rel=1e-6)  # the masked 3.0 left out
    # pg = max(-A r, -A clip(r, 0.8, 1.2)): row 0: -1.2, -0.5, -1.1; row 1: 0.8, 1.1. Token mean -0.9 / 5.
    assert float(loss) == pytest.approx(-0.18, rel=1e-5) and m["pg_loss"] == pytest.approx(-0.18, rel=1e-5)
    # A wider upper clip (1 + 0.6) no longer clips 1.5; the lower one still clips 0.5.
    wide_loss, wide = _objective_case(eps_high=0.6)
    # Row 0's first pg becomes max(-1.5, -clip(1.5, 0.8, 1.6)) = -1.5: (-1.5 - 0.5 - 1.1 + 0.8 + 1.1) / 5.
    assert float(wide_loss) == pytest.approx(-0.24, rel=1e-5)
    assert (float(wide["pg_clipfrac_high"]), float(wide["pg_clipfrac_low"])) == pytest.approx((0.0, 0.2))


def test_the_objectives_sequence_mean_and_kl_by_hand():
    import jax.numpy as jnp
    # Per sequence: row 0 (-1.2 - 0.5 - 1.1) / 3, row 1 (0.8 + 1.1) / 2; then their mean.
    loss, _ = _objective_case(aggregation="seq_mean_token_mean")
    assert float(loss) == pytest.approx((-2.8 / 3 + 1.9 / 2) / 2, rel=1e-5)
    # Row 1 dropped by the keep mask: it has no token left and is not counted; row 0's mean alone.
    dropped, _ = _objective_case(aggregation="seq_mean_token_mean", keep_B=jnp.array([True, False]))
    assert float(dropped) == pytest.approx(-2.8 / 3, rel=1e-5)
    # k3 KL to a reference at the old policy (log-prob 0): exp(-logp) + logp - 1 = 1 / r + log r - 1.
    k3 = lambda r: 1 / r + np.log(r) - 1  # noqa: E731
    loss_kl, m = _objective_case(beta=0.5, logp_ref_BT=jnp.zeros((2, 3)))
    kl = (k3(1.5) + k3(0.5) + k3(1.1) + k3(0.5) + k3(1.1)) / 5
    assert float(m["kl"]) == pytest.approx(kl, rel=1e-5)
    assert float(loss_kl) == pytest.approx(-0.18 + 0.5 * kl, rel=1e-5)
    assert float(m["pg_loss"]) == pytest.approx(-0.18, rel=1e-5)  # the pg part alone


# ------------------------------------------------------------------------------------------------
# a policy from a run's checkpoint: which tree is restored


@pytest.mark.parametrize("meta, beta, want_abstract", [
    ({}, 0.0, "state"),                                                      # a train run: the state itself
    ({"phase": "grpo"}, 0.0, {"train": "state"}),                            # an rl run: under "train"
    ({"phase": "grpo"}, 0.1, {"train": "state", "ref_params": "ref"}),       # with its reference policy
])
def test_a_runs_policy_restores_the_tree_the_run_saved(monkeypatch, meta, beta, want_abstract):
    import hybridmoe.model.params as params_mod
    import hybridmoe.run.checkpoint as checkpoint
    from hybridmoe.rl import policy_io
    restored = []

    class FakeCheckpoints:
        def __init__(self, directory):
            self.directory, self.closed = directory, False

        def restore(self, step, abstract):
            restored.append((str(self.directory), step, abstract))
            params = {"params": "P"}
            return ({"train": params} if "phase" in meta else params), {}

        def close(self):
            restored.append("closed")

    setup = types.SimpleNamespace(abstract_state=lambda: "state", specs=None, param_shardings=None)
    monkeypatch.setattr(policy_io, "build", lambda cfg: setup)
    monkeypatch.setattr(policy_io, "run_config", lambda run_dir: (None, 7, meta))
    monkeypatch.setattr(policy_io, "config_tokenizer", lambda cfg: "tok")
    monkeypatch.setattr(params_mod, "abstract_params", lambda specs, shardings=None: "ref")
    monkeypatch.setattr(checkpoint, "Checkpoints", FakeCheckpoints)
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(beta=beta))
    policy = policy_io.load_policy(cfg, run_dir="runs/x")
    assert policy.params == "P" and policy.tokenizer == "tok"
    assert restored == [("runs/x/checkpoints", 7, want_abstract), "closed"]
