"""The RL run end to end on the 8-device CPU mesh: outputs, exact resume after a kill, bad input, and
the state handed from the supervised warm-up to GRPO."""

import dataclasses
import json
import math
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hybridmoe.rl.loop as rl_loop
import hybridmoe.run.session as run_session
from helpers import ATTENTION_LAYERS, TWO_LAYERS, tiny_config
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
# 2 warm-up steps then 4 GRPO steps; checkpoints after steps 1, 3 and 5 (done = 2, 4, 6). The GRPO phase
# ramps its learning rate over its first 2 updates (0, then half, then the peak), so the phase
# boundary shows where its schedule starts. tests/test_rl_glue.py runs the same programs.
OVERRIDES = ("rl.warmup_steps=2", "rl.steps=4", "rl.checkpoint_every=2", "rl.prompts_per_step=2", "rl.group_size=4",
             "rl.max_prompt_len=6", "rl.max_new_tokens=3", "rl.beta=0.05", "rl.lr_warmup_steps=2", "train.batch_size=8",
             "train.seq_len=32", "gdn.chunk_size=8", *TWO_LAYERS)


class OneLongPrompt(ArithmeticTask):
    """Arithmetic whose first prompt of each draw is longer than rl.max_prompt_len (a counted skip)."""

    def sample(self, rng, num_examples):
        examples = super().sample(rng, num_examples)
        if examples and num_examples < 64:  # the GRPO prompts, not the warm-up's solved examples
            examples[0] = Example("000000" + examples[0].prompt, examples[0].reference)
        return examples


def flaky_reward(prompt: str, completion: str) -> float:
    """Deterministic in its input: raises on about a fifth of the samples, NaN on another fifth, and
    a value in [0, 1) on the rest (a group with two of those has reward variance: an update)."""
    h = zlib.crc32((prompt + "|" + completion).encode())
    if h % 5 == 0:
        raise ValueError("flaky reward")
    return float("nan") if h % 5 == 1 else h % 997 / 997


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


class StopRun(BaseException):
    """Ends a run after the steps a test needs (not an Exception: the run's error handling passes it on)."""


class StepRecorder:
    """What run_rl's step programs receive and return, as host copies: per step (phase, the train
    state handed in, the reference policy handed in (GRPO), the state returned, the step's metrics).
    Installed around rl.loop._build_run, so the run's own programs run; `setup` is the run's set-up.
    With stop_after, the run ends (StopRun) once that many steps are recorded."""

    def __init__(self, stop_after: int | None = None):
        self.steps, self.setup, self.stop_after = [], None, stop_after
        # Per GRPO update: how many arrays the phase's start replaced (the warm-up's train state,
        # the stand-in reference) are still alive on the device beside the update's arguments.
        self.replaced_alive = []

    def _record(self, *step):
        self.steps.append(step)
        if self.stop_after is not None and len(self.steps) >= self.stop_after:
            raise StopRun

    def install(self, mp):
        real_build_run = rl_loop._build_run

        def recording_build_run(cfg, setup, *rest):
            run = real_build_run(cfg, setup, *rest)
            self.setup, warm, grpo = setup, run.warmup_step, run.grpo_step
            replaced = []  # what the GRPO phase's start was handed: it has no further use for any of it

            def rl_init(state):
                replaced.extend(jax.tree.leaves(state))
                return run.rl_init(state)

            def reference_init(stand_in, params):
                replaced.extend(jax.tree.leaves(stand_in))
                return run.reference_init(stand_in, params)

            def warmup_step(state, batch):
                before = host_copy(state)  # the step donates its input
                state, m = warm(state, batch)
                self._record("warmup", before, None, *host_copy((state, m)))
                return state, m

            def grpo_step(state, ref_params, batch):
                kept = {id(x) for x in jax.tree.leaves((state, ref_params, batch))}
                self.replaced_alive.append(sum(not x.is_deleted() for x in replaced if id(x) not in kept))
                before, ref = host_copy((state, ref_params))
                state, m = grpo(state, ref_params, batch)
                self._record("grpo", before, ref, *host_copy((state, m)))
                return state, m

            return dataclasses.replace(run, warmup_step=warm and warmup_step, grpo_step=grpo and grpo_step,
                                       rl_init=rl_init, reference_init=reference_init)

        mp.setattr(rl_loop, "_build_run", recording_build_run)



def host_copy(tree):
    """Host copies of a tree of device arrays, read from copies made on the device: on a CPU an
    array read to the host keeps a view of its own buffer, which a later program then cannot take
    as donated (the copy it makes instead would hide a missing donation from the tests)."""
    return jax.device_get(jax.tree.map(jnp.copy, tree))


def reuse_setup(mp, setup):
    """run_rl builds no set-up for setup's config but takes this one, whose programs are kept on it
    (RunSetup.kept): a run of the same config in this process traces and compiles nothing again, as
    when build() still holds the set-up (conftest forgets it after each test)."""
    real_build = run_session.build
    same = setup.cfg.model_dump_json()
    mp.setattr(run_session, "build", lambda cfg, *a, **k: setup if cfg.model_dump_json() == same and not (a or k)
               else real_build(cfg, *a, **k))


@pytest.fixture(scope="module")
def finished_run(cfg, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "run"
    task = OneLongPrompt(digits=1)
    recorder = StepRecorder()
    with pytest.MonkeyPatch.context() as mp:
        recorder.install(mp)
        history = run_rl(cfg, out, progress=False, task=task, reward_fns=_rewards(task))
    return types.SimpleNamespace(out=out, history=history, steps=recorder.steps, setup=recorder.setup,
                                 replaced_alive=recorder.replaced_alive)


def test_run_writes_metrics_plot_tensorboard_checkpoints_and_counts_bad_samples(finished_run):
    out, history = finished_run.out, finished_run.history
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


def test_each_grpo_step_samples_with_a_key_of_its_own(cfg, finished_run):
    """The run's key starts at key(train.seed + 1) and each GRPO step splits it (one half goes on,
    the other samples); the warm-up uses none. Checkpoints after 0, 2 and 4 GRPO steps (done = 2, 4,
    6) record the key then. One not advanced would sample every step with the same noise."""
    key, chain = jax.random.key(cfg.train.seed + 1), []
    for _ in range(cfg.rl.steps + 1):
        chain.append(np.asarray(jax.random.key_data(key)).tolist())
        key = jax.random.split(key)[0]
    got = {done: json.loads((finished_run.out / "checkpoints" / str(done) / "meta" / "metadata").read_text())["rng_key"]
           for done in (2, 4, 6)}
    assert got == {2: chain[0], 4: chain[2], 6: chain[4]}, got


def test_resume_after_a_kill_continues_exactly(cfg, finished_run, tmp_path, monkeypatch):
    """Killed twice and resumed each time: first from the checkpoint at the phase boundary (the
    warm-up done, GRPO's optimizer not made yet), then from one inside GRPO; the run ends as the
    uninterrupted one did, bit for bit."""
    out_full = finished_run.out
    reuse_setup(monkeypatch, finished_run.setup)
    out = tmp_path / "killed"
    task = OneLongPrompt(digits=1)
    # 4 scored rows per GRPO step (the long prompt's group is not scored); checkpoints every 2 steps.
    # Killed inside step 3 (the 2nd GRPO step): the last checkpoint is the warm-up's (done = 2).
    with pytest.raises(HardKill):
        run_rl(cfg, out, progress=False, task=task, reward_fns=_rewards(task, kill_at_call=1 * 4))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert Checkpoints(out / "checkpoints").latest_step() == cfg.rl.warmup_steps == 2
    # Resumed there, killed again inside step 5: the last checkpoint is after step 3 (done = 4).
    with pytest.raises(HardKill):
        run_rl(cfg, out, resume=True, progress=False, task=task, reward_fns=_rewards(task, kill_at_call=3 * 4))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert Checkpoints(out / "checkpoints").latest_step() == 4
    resumed = run_rl(cfg, out, resume=True, progress=False, task=task, reward_fns=_rewards(task))
    assert [h["step"] for h in resumed] == [4, 5]
    assert _comparable(read_metrics(out / "metrics.jsonl")) == _comparable(read_metrics(out_full / "metrics.jsonl"))
    params_full, meta_full = _final_params(cfg, out_full)
    params_resumed, meta_resumed = _final_params(cfg, out)
    jax.tree.map(np.testing.assert_array_equal, params_resumed, params_full)
    assert meta_resumed["rng_key"] == meta_full["rng_key"] and meta_resumed["phase"] == 1


# ---------------------------------------------------------------------------------------------
# The phase boundary. What the config says (rl/loop.py, rl.* and train.* in config/schema.py):
# steps are counted globally (the train state's step goes on from the warm-up); the warm-up steps
# with train.* (train.learning_rate, ramped over train.warmup_steps from 0); GRPO starts from the
# warmed-up policy with a fresh optimizer (Adam's count and moments 0) at rl.learning_rate,
# ramped over rl.lr_warmup_steps counted from its own first update; the frozen reference (rl.beta
# > 0) is the policy GRPO starts from. Every figure below comes from the config and the states
# the step programs were handed and returned, never from the run's optimizer:
# AdamW written out: update k of a phase (k = Adam's count before it) moves each parameter by
#   -lr_k (m / (1 - b1^(k+1)) / (sqrt(v / (1 - b2^(k+1))) + 1e-8) + weight_decay p),
#   lr_k = peak * min(k, ramp) / ramp (peak when ramp = 0),
# with m and v the moments it leaves. An update the step did not apply (nothing kept) leaves the
# parameters and the optimizer state as they were.

BOUNDARY_TOL = 1e-3  # a parameter's move against AdamW written out, in the phase's peak learning rate (clean: 1.3e-4)
ADAM_EPS = 1e-8
FIGURES = ("move", "fresh_moments")  # the errors that are float figures; every other one is a count


def bitwise_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def adam_state(opt_state) -> dict:
    """Adam's count, moments and the learning-rate schedule's count of a host optimizer state."""
    kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    (adam,), (schedule,) = ([n for n in nodes if isinstance(n, k)] for k in kinds)
    return {"count": int(adam.count), "schedule_count": int(schedule.count), "mu": jax.tree.leaves(adam.mu),
            "nu": jax.tree.leaves(adam.nu)}


def boundary_errors(cfg, steps) -> dict:
    """A run's recorded steps (the first ones, or all) against what the config says (above). Each
    entry is 0 on a correct run, except the FIGURES (float32 rounding)."""
    t, r, W = cfg.train, cfg.rl, cfg.rl.warmup_steps
    phases = {"warmup": (t.learning_rate, t.warmup_steps), "grpo": (r.learning_rate, r.lr_warmup_steps)}
    want_phases = (["warmup"] * W + ["grpo"] * r.steps)[:len(steps)]
    errors = {"phases": int([p for p, *_ in steps] != want_phases), "step_counter": 0,
              "fresh_optimizer": 0, "count": 0, "warmed_up_policy": 0, "reference": 0, "fresh_moments": 0.0,
              "move": 0.0, "not_applied_moved": 0}
    applied = {"warmup": 0, "grpo": 0}  # updates applied so far in each phase: Adam's count
    warmed_up = None
    for i, (phase, before, ref, after, metrics) in enumerate(steps):
        peak, ramp = phases[phase]
        a_in, a_out = adam_state(before["opt_state"]), adam_state(after["opt_state"])
        k = applied[phase]
        errors["step_counter"] += int(before["step"] != i) + int(after["step"] != i + 1)
        errors["count"] += int((a_in["count"], a_in["schedule_count"]) != (k, k))
        if k == 0:  # the phase's first step: Adam's moments start at 0
            errors["fresh_optimizer"] += sum(int(np.any(x != 0)) for x in a_in["mu"] + a_in["nu"])
        if phase == "grpo":
            # The policy GRPO starts from, and its frozen reference: the warmed-up policy, bit for bit.
            if i == W:
                warmed_up = steps[W - 1][3]["params"] if W else before["params"]
                errors["warmed_up_policy"] += int(not bitwise_equal(before["params"], warmed_up))
            if r.beta > 0:
                errors["reference"] += int(not bitwise_equal(ref, warmed_up))
        p_in, p_out = jax.tree.leaves(before["params"]), jax.tree.leaves(after["params"])
        if metrics["update_skipped"] or metrics.get("update_applied", 1.0) == 0.0:
            errors["not_applied_moved"] += int(a_out["count"] != k) + sum(
                int(not np.array_equal(x, y)) for x, y in zip(p_in, p_out))
            continue
        applied[phase] = k + 1
        errors["count"] += int((a_out["count"], a_out["schedule_count"]) != (k + 1, k + 1))
        if k == 0:  # after one gradient g from zero moments: m = (1 - b1) g, v = (1 - b2) g^2
            for m, v in zip(a_out["mu"], a_out["nu"]):
                m, v = np.asarray(m, np.float64), np.asarray(v, np.float64)
                want = (1 - t.b2) / (1 - t.b1) ** 2 * m * m
                worst = float(np.abs(v - want).max() / max(v.max(), 1e-30))
                errors["fresh_moments"] = max(errors["fresh_moments"], worst)
        lr = peak * min(k, ramp) / ramp if ramp else peak
        c = k + 1
        for p0, p1, m, v in zip(p_in, p_out, a_out["mu"], a_out["nu"]):
            p0, p1, m, v = (np.asarray(x, np.float64) for x in (p0, p1, m, v))
            want = -lr * (m / (1 - t.b1 ** c) / (np.sqrt(v / (1 - t.b2 ** c)) + ADAM_EPS) + t.weight_decay * p0)
            errors["move"] = max(errors["move"], float(np.abs(p1 - p0 - want).max() / peak))
    return errors


def test_grpo_starts_from_the_warmed_up_policy_with_a_fresh_optimizer_on_its_own_schedule(cfg, finished_run):
    steps, history = finished_run.steps, finished_run.history
    grpo_applied = [h["update_applied"] for h in history[cfg.rl.warmup_steps:]]
    # The run shows what it claims: GRPO updates at the ramp's 0 and half rates, after a warm-up
    # whose second step moved the weights.
    assert grpo_applied[:2] == [1.0, 1.0], grpo_applied
    errors = boundary_errors(cfg, steps)
    assert len(steps) == len(history) and not any(v for k, v in errors.items() if k not in FIGURES), errors
    assert errors["move"] < BOUNDARY_TOL and errors["fresh_moments"] < 1e-5, errors  # measured 1.3e-4, 1.7e-7


def test_each_grpo_update_has_the_device_its_memory_plan_counted_on(cfg, finished_run):
    # The update's plan (rl/memory_plan.py) counts its arguments: the train state, the reference and
    # the batch. What the GRPO phase's start replaced must be gone from the device by the first
    # update: on a chip the warm-up's optimizer state (two floats a weight) outlived it, and the
    # update's program no longer fit. Here the stand-in reference is replaced too (rl.beta > 0).
    assert cfg.rl.beta > 0 and finished_run.replaced_alive == [0] * cfg.rl.steps, finished_run.replaced_alive


# One-line bugs at the phase boundary, each patched into the loop: boundary_errors must catch it.
BOUNDARY_BROKEN = {
    "warmup_optimizer_state_carried_into_grpo": ("_build_run", '"opt_state": rl_opt.init(s["params"])',
                                                 '"opt_state": s["opt_state"]'),
    "step_counter_restarted_at_grpo": ("_build_run", '"step": s["step"]}', '"step": 0 * s["step"]}'),
    "grpo_optimizer_fresh_one_step_late": ("run_rl", "if i == r.warmup_steps:", "if i == r.warmup_steps + 1:"),
    "reference_is_the_initial_policy": ("run_rl", 'ref_params = released(tree["ref_params"], '
                                        'run.reference_init(ref_params, state["params"]))', "ref_params = ref_params"),
}


@pytest.mark.parametrize("variant", list(BOUNDARY_BROKEN))
def test_broken_phase_boundaries_are_caught(variant, cfg, finished_run, monkeypatch):
    from broken_variants import mutated
    name, old, new = BOUNDARY_BROKEN[variant]
    # The run's programs serve, but for the GRPO optimizer's init where the variant changes it.
    reuse_setup(monkeypatch, finished_run.setup)
    if name == "_build_run":
        monkeypatch.delitem(finished_run.setup._kept, "rl_optimizer_init")
    W = cfg.rl.warmup_steps
    recorder = StepRecorder(stop_after=W + 2)  # the warm-up and GRPO's first two updates (rates 0 and half)
    patches = [lambda: monkeypatch.setattr(rl_loop, name, mutated(rl_loop, name, old, new)),
               lambda: recorder.install(monkeypatch)]
    # The recorder wraps a broken _build_run; a broken run_rl, recompiled, must see the recorder's.
    for patch in (patches if name == "_build_run" else patches[::-1]):
        patch()
    task = OneLongPrompt(digits=1)
    with pytest.raises(StopRun):
        rl_loop.run_rl(cfg, None, progress=False, task=task, reward_fns=_rewards(task))
    assert len(recorder.steps) == W + 2  # the recorder saw the run
    errors = boundary_errors(cfg, recorder.steps)
    assert errors["move"] >= 10 * BOUNDARY_TOL or any(v for k, v in errors.items() if k not in FIGURES), (
        f"{variant}: {errors}")


def test_wrong_shape_checkpoints_are_clear_errors(cfg, finished_run, tmp_path):
    out = finished_run.out
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


def test_empty_prompt_set_stops_with_a_clear_error_keeping_checkpoints_and_metrics(cfg, finished_run, tmp_path,
                                                                                   monkeypatch):
    class PromptsOnce(ArithmeticTask):
        """The warm-up's examples, then one GRPO step's prompts, then none."""

        grpo_draws = 0

        def sample(self, rng, num_examples):
            if num_examples >= 64:  # the warm-up's solved examples
                return super().sample(rng, num_examples)
            self.grpo_draws += 1
            return super().sample(rng, num_examples) if self.grpo_draws == 1 else []

    # The finished run's config and programs (stopping and what is kept do not depend on them):
    # checkpointed by the schedule after step 1 (done = 2), stopped in step 3, saved on the way out.
    reuse_setup(monkeypatch, finished_run.setup)
    out = tmp_path / "run"
    with pytest.raises(RunError, match="step 3: .* gave 0 prompts"):
        run_rl(cfg, out, progress=False, task=PromptsOnce(digits=1))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert Checkpoints(out / "checkpoints").latest_step() == 3  # the GRPO step before, saved on the way out


def test_prompt_and_completion_longer_than_the_context_is_a_config_error():
    with pytest.raises(ConfigError, match="rl.max_new_tokens"):
        tiny_config("model.max_seq_len=16", "rl.max_prompt_len=12", "rl.max_new_tokens=8")


def test_steps_that_score_nothing_are_counted_then_stop_the_run_with_one_clear_error(cfg, finished_run, tmp_path,
                                                                                      monkeypatch, caplog):
    class TooLongAfterOneStep(ArithmeticTask):
        """The warm-up's examples, one GRPO step's prompts, then prompts longer than rl.max_prompt_len
        only: nothing can be scored any more."""

        grpo_draws = 0

        def sample(self, rng, num_examples):
            examples = super().sample(rng, num_examples)
            if num_examples >= 64:  # the warm-up's solved examples
                return examples
            self.grpo_draws += 1
            return examples if self.grpo_draws == 1 else [Example("0" * 8 + e.prompt, e.reference) for e in examples]

    # The finished run's config and programs (counting and stopping do not depend on them): GRPO
    # steps 3, 4 and 5 score nothing; the schedule checkpointed after step 3 (done = 4).
    reuse_setup(monkeypatch, finished_run.setup)
    out = tmp_path / "run"
    with pytest.raises(RunError, match=r"3 GRPO steps in a row scored no sample \(last: step 5;.*raise rl.max_prompt_len"):
        run_rl(cfg, out, progress=False, task=TooLongAfterOneStep(digits=1))
    # The warning names the same step as the error, and the checkpoint it saved.
    assert "stopped by an error in step 5; checkpointed the state after step 4 (checkpoint 5)" in caplog.text
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[2]["scored_samples"] > 0
    assert all(r["scored_samples"] == 0 and r["prompts_skipped"] == 2 and r["update_applied"] == 0
               for r in records[3:])
    assert Checkpoints(out / "checkpoints").latest_step() == 5  # the last completed step, saved on the way out


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
    # Attention layers only: the levers act on the rollout and the update whatever the mixers (the
    # hybrid's RL run is the module's finished_run).
    cfg = tiny_config(*OVERRIDES, *ATTENTION_LAYERS, "rl.warmup_steps=0", "rl.steps=2", "rl.checkpoint_every=0", "rl.beta=0",
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


def test_a_nonfinite_grpo_step_is_skipped_counted_and_leaves_the_checkpointed_state(cfg, finished_run, monkeypatch,
                                                                                    tmp_path):
    """A NaN advantage injected into the second GRPO step (step 3; the finished run's config and
    programs): that step's update is skipped and counted (update_skipped), params and optimizer
    state are the step before's bit for bit, and so is the checkpoint written after it (done = 4);
    the run goes on (step 4 updates)."""
    from hybridmoe.rl import loop as rl_loop

    real_updates, poisoned = rl_loop.policy_updates, cfg.rl.warmup_steps + 1

    def poisoning_updates(cfg, rows, step, *rest):
        if step == poisoned:
            rows = {**rows, "advantages": np.where(np.arange(len(rows["advantages"])) == 0, np.nan,
                                                   rows["advantages"]).astype(np.float32)}
        return real_updates(cfg, rows, step, *rest)

    monkeypatch.setattr(rl_loop, "policy_updates", poisoning_updates)
    reuse_setup(monkeypatch, finished_run.setup)
    recorder = StepRecorder(stop_after=poisoned + 2)  # through the step after the poisoned one
    recorder.install(monkeypatch)
    task = ArithmeticTask(digits=1)
    noisy = lambda prompt, completion: float(zlib.crc32(completion.encode()) % 3)  # noqa: E731 -- varied rewards
    out = tmp_path / "run"
    with pytest.raises(StopRun):
        run_rl(cfg, out, progress=False, task=task, reward_fns=[(noisy, 1.0)])
    grpo = recorder.steps[cfg.rl.warmup_steps:]
    assert [m["update_skipped"] for *_, m in grpo] == [0.0, 1.0, 0.0], grpo
    assert [m["update_applied"] for *_, m in grpo] == [1.0, 0.0, 1.0]
    assert read_metrics(out / "metrics.jsonl")[poisoned]["kept_frac"] > 0  # rows were kept: the NaN skipped it
    _, before, _, after, _ = grpo[1]
    for key in ("params", "opt_state"):
        jax.tree.map(np.testing.assert_array_equal, after[key], before[key])
    setup = finished_run.setup
    abstract = {"train": setup.abstract_state(), "ref_params": abstract_params(setup.specs, setup.param_shardings)}
    ckpt = Checkpoints(out / "checkpoints")
    assert ckpt.latest_step() == poisoned + 1
    saved = jax.device_get(ckpt.restore(poisoned + 1, abstract)[0]["train"])
    ckpt.close()
    for key in ("params", "opt_state"):
        jax.tree.map(np.testing.assert_array_equal, saved[key], before[key])
    _, before, _, after, _ = grpo[2]
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["params"]),
                                                        jax.tree.leaves(before["params"])))
