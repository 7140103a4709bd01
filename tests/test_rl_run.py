"""The RL run end to end on the 8-device CPU mesh: outputs, exact resume after a kill, bad input."""

import json
import math
import zlib

import jax
import numpy as np
import pytest

from helpers import TWO_LAYERS, tiny_config
from hybridmoe.config import ConfigError
from hybridmoe.model.params import abstract_params
from hybridmoe.rl.loop import run_rl
from hybridmoe.data.arithmetic import ArithmeticTask, Example
from hybridmoe.run.checkpoint import Checkpoints
from hybridmoe.run.run_dir import RunError
from hybridmoe.run.metrics import read_metrics
from hybridmoe.run.setup import build

TIMING_KEYS = {"tokens_per_s", "step_time_s", "rollout_time_s", "update_time_s", "old_logprobs_time_s",
               "rollout_tokens_per_s"}
# 2 warm-up steps then 4 GRPO steps; checkpoints after steps 2 and 5 (done = 3, 6).
OVERRIDES = ("rl.warmup_steps=2", "rl.steps=4", "rl.checkpoint_every=3", "rl.prompts_per_step=2", "rl.group_size=4",
             "rl.max_prompt_len=6", "rl.max_new_tokens=3", "rl.beta=0.05", "train.batch_size=8", "train.seq_len=32",
             "gdn.chunk_size=8", *TWO_LAYERS)


class OneLongPrompt(ArithmeticTask):
    """Arithmetic whose first prompt of each draw is longer than rl.max_prompt_len (a counted skip)."""

    def sample(self, rng, num_examples):
        examples = super().sample(rng, num_examples)
        if examples and num_examples < 64:  # the GRPO prompts, not the warm-up's solved examples
            examples[0] = Example("000000" + examples[0].prompt, examples[0].reference)
        return examples


def flaky_reward(prompt: str, completion: str) -> float:
    """Deterministic in its input: raises on about a fifth of the samples, NaN on another fifth."""
    h = zlib.crc32((prompt + "|" + completion).encode()) % 5
    if h == 0:
        raise ValueError("flaky reward")
    return float("nan") if h == 1 else 0.0


class HardKill(BaseException):
    """Stands in for SIGKILL: not an Exception, so the run's error handling does not see it."""


def _rewards(task, kill_at_call=None):
    calls = {"n": 0}

    def killing_reward(prompt, completion):
        calls["n"] += 1
        if kill_at_call is not None and calls["n"] > kill_at_call:
            raise HardKill()
        return 0.0

    return [(task.reward, 1.0), (flaky_reward, 0.5), (killing_reward, 1.0)]


def _final_params(cfg, out):
    ckpt = Checkpoints(out / "checkpoints")
    setup = build(cfg)
    abstract = {"train": setup.abstract_state(), "ref_params": abstract_params(setup.specs, setup.param_shardings)}
    state, meta = ckpt.restore(ckpt.latest_step(), abstract)
    ckpt.close()
    return jax.device_get(state["train"]["params"]), meta


def _comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def cfg():
    return tiny_config(*OVERRIDES)


@pytest.fixture(scope="module")
def finished_run(cfg, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "run"
    task = OneLongPrompt(digits=1)
    history = run_rl(cfg, out, progress=False, task=task, reward_fns=_rewards(task))
    return out, history


def test_run_writes_metrics_plot_tensorboard_checkpoints_and_counts_bad_samples(finished_run):
    out, history = finished_run
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6)) == [h["step"] for h in history]
    assert [r["phase"] for r in records] == [0, 0, 1, 1, 1, 1]
    for r in records[2:]:
        for key in ("reward_mean", "reward_max", "reward_min", "loss", "kl", "entropy", "kept_frac", "grad_norm",
                    "pg_clipfrac", "completion_len_mean", "tokens_per_s", "step_time_s"):
            assert key in r and r[key] is not None and math.isfinite(r[key]), key
        assert r["prompts_skipped"] == 1  # the over-long prompt: its group is skipped, counted
    # The flaky reward's raises and NaNs (about 2 in 5 of the 4 scored rows of each step).
    assert sum(r["rewards_skipped"] for r in records[2:]) >= 2
    assert (out / "metrics.png").stat().st_size > 0
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert Checkpoints(out / "checkpoints").latest_step() == 6


def test_resume_after_a_kill_continues_exactly(cfg, finished_run, tmp_path):
    out_full, _ = finished_run
    out = tmp_path / "killed"
    task = OneLongPrompt(digits=1)
    # Killed inside step 5 (the 4th GRPO step; 4 scored rows per step, the long prompt's group is
    # not scored): the last checkpoint is after step 2.
    with pytest.raises(HardKill):
        run_rl(cfg, out, progress=False, task=task, reward_fns=_rewards(task, kill_at_call=3 * 4))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert Checkpoints(out / "checkpoints").latest_step() == 3
    resumed = run_rl(cfg, out, resume=True, progress=False, task=task, reward_fns=_rewards(task))
    assert [h["step"] for h in resumed] == [3, 4, 5]
    assert _comparable(read_metrics(out / "metrics.jsonl")) == _comparable(read_metrics(out_full / "metrics.jsonl"))
    params_full, meta_full = _final_params(cfg, out_full)
    params_resumed, meta_resumed = _final_params(cfg, out)
    jax.tree.map(np.testing.assert_array_equal, params_resumed, params_full)
    assert meta_resumed["rng_key"] == meta_full["rng_key"] and meta_resumed["phase"] == 1


def test_wrong_shape_checkpoints_are_clear_errors(cfg, finished_run, tmp_path):
    out, _ = finished_run
    with pytest.raises(RunError, match="another shape"):
        run_rl(tiny_config(*OVERRIDES, "model.d_model=32"), out, resume=True, progress=False)
    with pytest.raises(RunError, match="already holds a run"):
        run_rl(cfg, out, progress=False)
    from hybridmoe.hf import hf_config_from_model_fields
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    fields = {**cfg.model.model_dump(), "d_model": 32, "num_experts": 4}
    (hf_dir / "config.json").write_text(json.dumps(hf_config_from_model_fields(fields)))
    with pytest.raises(ConfigError, match=r"model\.d_model: the checkpoint's shapes disagree .* recipe 64, checkpoint 32") as e:
        run_rl(cfg, tmp_path / "from_hf", init_hf=hf_dir, progress=False)
    assert "model.num_experts" in str(e.value)


def test_empty_prompt_set_stops_with_a_clear_error_keeping_checkpoints_and_metrics(tmp_path):
    class NoPrompts(ArithmeticTask):
        def sample(self, rng, num_examples):
            return super().sample(rng, num_examples) if num_examples >= 64 else []

    cfg = tiny_config(*OVERRIDES, "rl.warmup_steps=1", "rl.checkpoint_every=0")
    out = tmp_path / "run"
    with pytest.raises(RunError, match="gave 0 prompts"):
        run_rl(cfg, out, progress=False, task=NoPrompts(digits=1))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0]
    assert Checkpoints(out / "checkpoints").latest_step() == 1  # the warm-up step, saved on the way out


def test_prompt_and_completion_longer_than_the_context_is_a_config_error():
    with pytest.raises(ConfigError, match="rl.max_new_tokens"):
        tiny_config("model.max_seq_len=16", "rl.max_prompt_len=12", "rl.max_new_tokens=8")


def test_steps_that_score_nothing_are_counted_then_stop_the_run_with_one_clear_error(tmp_path, caplog):
    # rl.max_prompt_len=2 is shorter than every arithmetic prompt: nothing can be scored, ever. The
    # config's own task is refused for it before the run starts (tests/test_refusals.py); handed in
    # as the caller's task, the run meets it step by step.
    from hybridmoe.data.arithmetic import task_from_config

    cfg = tiny_config(*OVERRIDES, "rl.warmup_steps=1", "rl.steps=5", "rl.checkpoint_every=0", "rl.max_prompt_len=2",
                      "rl.beta=0")
    out = tmp_path / "run"
    with pytest.raises(RunError, match=r"3 GRPO steps in a row scored no sample \(last: step 3;.*raise rl.max_prompt_len"):
        run_rl(cfg, out, progress=False, task=task_from_config(cfg))
    # The warning names the same step as the error, and the checkpoint it saved.
    assert "stopped by an error in step 3; checkpointed the state after step 2 (checkpoint 3)" in caplog.text
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["scored_samples"] == 0 and r["prompts_skipped"] == 2 and r["update_applied"] == 0
               for r in records[1:])
    assert Checkpoints(out / "checkpoints").latest_step() == 3  # the last completed step, saved on the way out


def test_grpo_levers_together_run_and_log_what_they_do(tmp_path, monkeypatch):
    """T = 0.8 with top-p, TIS, two updates per rollout, dynamic sampling and routing replay; the
    first update of every rollout has ratio exactly 1 (the trainer's own metrics, update by update)."""
    from hybridmoe.rl import loop as rl_loop

    real_updates, per_step = rl_loop.policy_updates, []

    def recording_updates(cfg, rows, step, state, ref_params, step_fn, *rest):
        updates = []

        def recording_step(state, ref_params, batch):
            state, m = step_fn(state, ref_params, batch)
            updates.append({k: float(v) for k, v in jax.device_get(m).items()})
            return state, m

        out = real_updates(cfg, rows, step, state, ref_params, recording_step, *rest)
        per_step.append(updates)
        return out

    monkeypatch.setattr(rl_loop, "policy_updates", recording_updates)
    cfg = tiny_config(*OVERRIDES, "rl.warmup_steps=0", "rl.steps=2", "rl.checkpoint_every=0", "rl.beta=0",
                      "rl.temperature=0.8", "rl.top_p=0.95", "rl.importance_correction=tis",
                      "rl.updates_per_rollout=2", "rl.dynamic_sampling=true", "rl.dynamic_sampling_rounds=2",
                      "moe.routing_replay=true", "rl.prompts_per_step=2", "rl.group_size=8")
    task = ArithmeticTask(digits=1)
    noisy = lambda prompt, completion: float(zlib.crc32(completion.encode()) % 3)  # noqa: E731 -- varied rewards
    history = run_rl(cfg, tmp_path / "run", progress=False, task=task, reward_fns=[(noisy, 1.0)])
    assert len(per_step) == len(history) == 2 and all(len(u) == 2 for u in per_step)
    for r, (first, second) in zip(history, per_step):
        assert r["ds_rounds"] >= 1 and r["ds_rollouts"] == 16 * r["ds_rounds"], r
        assert 0 <= r["ds_informative_frac"] <= 1
        assert first["ratio_min"] == first["ratio_max"] == first["ratio_mean"] == 1.0 and first["pg_clipfrac"] == 0.0
        assert first["kept_tokens"] > 0, first
        # The record: min of the minima and max of the maxima of its two updates.
        assert (r["ratio_min"], r["ratio_max"]) == (min(first["ratio_min"], second["ratio_min"]),
                                                    max(first["ratio_max"], second["ratio_max"]))
        assert 0 < r["is_weight_mean"] <= 2.0
        assert r["sampler_gap_mean"] > 0 and r["sampler_gap_max"] >= r["sampler_gap_mean"]
        assert r["update_applied"] == 1.0


def test_a_nonfinite_grpo_step_is_skipped_counted_and_leaves_the_checkpointed_state(monkeypatch, tmp_path):
    """A NaN advantage injected into the second GRPO step (the programs are the finished run's): that
    step's update is skipped and counted (update_skipped), params and optimizer state are the
    first step's bit for bit, and the run goes on."""
    from hybridmoe.rl import loop as rl_loop

    real_updates = rl_loop.policy_updates

    def poisoning_updates(cfg, rows, step, *rest):
        if step == 1:
            rows = {**rows, "advantages": np.where(np.arange(len(rows["advantages"])) == 0, np.nan,
                                                   rows["advantages"]).astype(np.float32)}
        return real_updates(cfg, rows, step, *rest)

    monkeypatch.setattr(rl_loop, "policy_updates", poisoning_updates)
    cfg = tiny_config(*OVERRIDES, "rl.warmup_steps=0", "rl.steps=3", "rl.checkpoint_every=1")
    task = ArithmeticTask(digits=1)
    noisy = lambda prompt, completion: float(zlib.crc32(completion.encode()) % 3)  # noqa: E731 -- varied rewards
    out = tmp_path / "run"
    history = run_rl(cfg, out, progress=False, task=task, reward_fns=[(noisy, 1.0)])
    assert [h["update_skipped"] for h in history] == [0.0, 1.0, 0.0], history
    assert [h["update_applied"] for h in history] == [1.0, 0.0, 1.0] and history[1]["kept_frac"] > 0
    setup = build(cfg)
    abstract = {"train": setup.abstract_state(), "ref_params": abstract_params(setup.specs, setup.param_shardings)}
    ckpt = Checkpoints(out / "checkpoints")
    states = {s: jax.device_get(ckpt.restore(s, abstract)[0]["train"]) for s in (1, 2, 3)}
    ckpt.close()
    for key in ("params", "opt_state"):
        jax.tree.map(np.testing.assert_array_equal, states[2][key], states[1][key])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(states[3]["params"]),
                                                        jax.tree.leaves(states[2]["params"])))
