"""Numerics guards: a step with a NaN/inf loss or gradient keeps the old weights (inside the jitted
step), is counted, and after train.max_nonfinite_skips in a row (or at once under
train.on_nonfinite=stop) the run checkpoints its last good state and exits with a clear message.
While values are finite the guard changes no bit: `skip` equals the unguarded step (`off`) exactly,
for the supervised and the GRPO step, and sabotaged guards are caught."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridmoe.rl.grpo as grpo_module
import hybridmoe.train.loop as loop
import hybridmoe.run.step as step_module
from helpers import ATTENTION_LAYERS, tiny_config, tiny_params
from hybridmoe.analysis.program import primitive_counts
from hybridmoe.cli import main
from hybridmoe.config.schema import TrainConfig
from hybridmoe.parallel.host import put_global
from hybridmoe.rl.grpo import build_update_batch, jit_grpo_step, rl_optimizer
from hybridmoe.run.setup import build, init_state, jit_train_step
from hybridmoe.run.checkpoint import finished_steps
from hybridmoe.run.guard import NonFiniteGuard, NonFiniteStop
from hybridmoe.run.metrics import read_metrics
from test_grpo import _advantages, _config as grpo_config, _rollout

# The guard selects over the state's leaves whatever the layers are: attention layers only
# (helpers.ATTENTION_LAYERS, the supervised and the GRPO step alike), about half of a two-mixer
# model's compile for each of the file's step programs.
OVER = ("train.batch_size=8", "train.seq_len=16", "train.checkpoint_every=0", "train.warmup_steps=0", *ATTENTION_LAYERS)
MARK = 0  # a first token of 0 (padding) never starts a real batch: it marks a poisoned step


@pytest.fixture
def poisoned_steps(monkeypatch):
    """Steps whose batch carries MARK get a NaN loss (and so NaN gradients) from the real step."""
    steps: set[int] = set()
    real_nll, real_source = step_module.nll_sum, loop.training_source

    def nll_sum(params, cfg, batch, **kw):
        loss, *rest = real_nll(params, cfg, batch, **kw)
        return (loss * jnp.where(batch["tokens"][0, 0] == MARK, jnp.nan, 1.0), *rest)

    class MarkedSource:
        def __init__(self, cfg):
            self.source = real_source(cfg)
            self.host_local = self.source.host_local

        def batch(self, step, position):
            rows, position = self.source.batch(step, position)
            if step in steps:
                rows["tokens"][:, 0, 0] = MARK
            return rows, position

    monkeypatch.setattr(step_module, "nll_sum", nll_sum)
    monkeypatch.setattr(loop, "training_source", MarkedSource)
    return steps


def test_the_jitted_step_keeps_the_old_state_on_a_nan(poisoned_steps):
    cfg = tiny_config(*OVER)
    setup = build(cfg)
    step_fn = jit_train_step(setup)
    poisoned_steps.add(0)
    with setup.context():
        state = init_state(setup, jax.random.key(0))
        before = jax.device_get(state)
        source = loop.training_source(cfg)
        state, m = step_fn(state, put_global(source.batch(0, 0)[0], setup.batch_sharding(1)))
        assert int(m["update_skipped"]) == 1 and not np.isfinite(float(m["loss"]))
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), before["params"])
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["opt_state"]), before["opt_state"])
        state, m = step_fn(state, put_global(source.batch(1, 0)[0], setup.batch_sharding(1)))
        assert int(m["update_skipped"]) == 0
        moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), jax.device_get(state["params"]),
                             before["params"])
        assert any(jax.tree.leaves(moved))  # a finite step does update


def test_skips_are_counted_and_consecutive_skips_stop_with_a_checkpoint(poisoned_steps, tmp_path):
    poisoned_steps.update({1, 3, 4})
    out = tmp_path / "run"
    with pytest.raises(NonFiniteStop, match="2 consecutive steps"):
        loop.train(tiny_config(*OVER, "train.steps=8", "train.max_nonfinite_skips=2"), out, progress=False)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["update_skipped"] for r in records] == [0, 1, 0, 1, 1]  # step 1 skipped, then recovered
    assert records[1]["loss"] is None  # NaN is null in the record
    assert finished_steps(out / "checkpoints") == [5]  # the last good state, after step 4


def test_on_nonfinite_stop_exits_2_with_a_clear_message(poisoned_steps, tmp_path, capsys):
    poisoned_steps.add(1)
    out = tmp_path / "run"
    assert main(["train", *OVER, "train.steps=4", "train.on_nonfinite=stop", "--out", str(out)]) == 2
    assert "on_nonfinite=stop" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert finished_steps(out / "checkpoints") == [2]


def test_guard_counts_only_consecutive_skips():
    guard = NonFiniteGuard(TrainConfig(max_nonfinite_skips=3))
    flags = [True, True, False, True, True, True]
    stops = [guard.observe(i, f) for i, f in enumerate(flags)]
    assert [s is not None for s in stops] == [False] * 5 + [True]
    never = NonFiniteGuard(TrainConfig(max_nonfinite_skips=0))
    assert all(never.observe(i, True) is None for i in range(50))


# ---------------------------------------------------------------------------------------------
# The guard against the guard removed (`off`, whose step has no such select), for the supervised
# and the GRPO step, a few finite steps each. The first step's metrics are bit-identical (same state
# in, same loss and gradients). The state out is not: on the CPU backend the select changes how
# XLA fuses the optimizer update, which then rounds the last bit differently (measured: at most
# ~2e-6 of a leaf's largest value at LLVM -O2, 3.4e-5 at the suite's -O0; an optimization barrier
# before the select, or a lax.cond instead of it, did not make it bit-exact either), so the later
# steps' metrics, computed from that state, may differ in their last bits too. The state is held to
# STATE_TOL, the later metrics to METRIC_TOL; every sabotage of the guard lands at ~1.

GUARD_STEPS = 2
STATE_TOL = 1e-4  # per leaf: max |guarded - unguarded| / max |unguarded|
METRIC_TOL = 1e-4  # per metric: |guarded - unguarded| / max(|unguarded|, 1)


def _select_inverted(loss, grad_norm, new, old):
    return step_module.keep_if_not(~(jnp.isfinite(loss) & jnp.isfinite(grad_norm)), new, old), jnp.int32(0)


def _opt_state_kept(loss, grad_norm, new, old):
    (params, _), skipped = _REAL_GUARD(loss, grad_norm, new, old)
    return (params, old[1]), skipped


_REAL_GUARD = step_module.skip_if_nonfinite
# Sabotages of the guard alone (the `off` arm never calls it), each patched into both steps and
# run through one of them (the steps call the same guard; one compile per sabotage):
BROKEN_GUARDS = {
    "select_inverted": (_select_inverted, "train"),  # a finite step keeps the old state
    "opt_state_kept": (_opt_state_kept, "grpo"),  # ... or the old optimizer state only (Adam frozen)
}


def _train_steps(policy: str):
    """((state, metrics per step) after GUARD_STEPS finite steps, the step's primitive counts)."""
    cfg = tiny_config(*OVER, f"train.on_nonfinite={policy}")
    setup = build(cfg)
    step_fn, source, position = jit_train_step(setup), loop.training_source(cfg), 0
    with setup.context():
        state, history = init_state(setup, jax.random.key(0)), []
        batch = None
        for i in range(GUARD_STEPS):
            rows, position = source.batch(i, position)
            batch = put_global(rows, setup.batch_sharding(1))
            state, m = step_fn(state, batch)
            history.append(m)
        prims = primitive_counts(step_fn.trace(state, batch).jaxpr)  # the program it ran (traced once)
        return jax.device_get((state, history)), prims


def _grpo_steps(policy: str):
    cfg = grpo_config(*ATTENTION_LAYERS, f"train.on_nonfinite={policy}")
    setup, opt = build(cfg), rl_optimizer(cfg)
    step_fn = jit_grpo_step(setup, with_reference=False)
    init = jax.jit(lambda p: {"params": p, "opt_state": opt.init(p), "step": jnp.int32(0)},
                   out_shardings=setup.state_shardings)
    with setup.context():
        state, history = init(tiny_params(cfg)), []
        for i in range(GUARD_STEPS):
            state, m = step_fn(state, None, build_update_batch(cfg, _rollout(cfg, seed=i), *_advantages(seed=i)))
            history.append(m)
        return jax.device_get((state, history))


def _state_error(got, want) -> float:
    """The largest per-leaf max |got - want| / max |want| over params and optimizer state."""
    errs = [0.0]
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.max(np.abs(x - y), initial=0.0) / max(np.max(np.abs(y), initial=0.0), 1e-30)))
    return max(errs)


def _metric_bits(metrics: dict) -> dict:
    return {k: np.asarray(v).tobytes() for k, v in metrics.items()}


def _metric_error(got: list[dict], want: list[dict]) -> float:
    assert [m.keys() for m in got] == [m.keys() for m in want]
    return max(float(np.max(np.abs(np.asarray(g[k], np.float64) - np.asarray(w[k], np.float64))
                            / np.maximum(np.abs(np.asarray(w[k], np.float64)), 1.0)))
               for g, w in zip(got, want) for k in w)


@pytest.fixture(scope="module")
def unguarded():
    return {"train": _train_steps("off"), "grpo": _grpo_steps("off")}


def test_the_guard_changes_nothing_in_finite_steps(unguarded):
    (off_out, off_prims), (skip_out, skip_prims) = unguarded["train"], _train_steps("skip")
    grpo_skip, grpo_off = _grpo_steps("skip"), unguarded["grpo"]
    assert _metric_bits(skip_out[1][0]) == _metric_bits(off_out[1][0])
    assert _metric_bits(grpo_skip[1][0]) == _metric_bits(grpo_off[1][0])
    metric_errors = {"train": _metric_error(skip_out[1], off_out[1]), "grpo": _metric_error(grpo_skip[1], grpo_off[1])}
    assert max(metric_errors.values()) < METRIC_TOL, metric_errors
    errors = {"train": _state_error(skip_out[0], off_out[0]), "grpo": _state_error(grpo_skip[0], grpo_off[0])}
    assert max(errors.values()) < STATE_TOL, errors
    assert all(int(m["update_skipped"]) == 0 for m in skip_out[1])
    assert all(float(m["update_applied"]) == 1.0 for m in grpo_skip[1])
    # And `off` is the program without the guard: one select per params and optimizer-state leaf fewer.
    leaves = len(jax.tree.leaves((skip_out[0]["params"], skip_out[0]["opt_state"])))
    assert skip_prims["select_n"] - off_prims["select_n"] == leaves, (skip_prims["select_n"], off_prims["select_n"])


@pytest.mark.parametrize("variant", sorted(BROKEN_GUARDS))
def test_a_broken_guard_is_caught(variant, unguarded, monkeypatch):
    broken, through = BROKEN_GUARDS[variant]
    for module in (step_module, grpo_module):
        monkeypatch.setattr(module, "skip_if_nonfinite", broken)
    steps, state_of = {"train": (_train_steps, lambda out: out[0][0]), "grpo": (_grpo_steps, lambda out: out[0])}[through]
    error = _state_error(state_of(steps("skip")), state_of(unguarded[through]))
    assert error > 10 * STATE_TOL, (variant, through, error)


# ---------------------------------------------------------------------------------------------
# A non-finite gradient in a GRPO step (the loss stays finite): the step keeps params and optimizer
# state bit for bit and counts the skip; the next finite step updates again. The poison is data:
# a micro-batch whose first advantage is POISON gets a NaN gradient on every parameter (a custom
# VJP: the forward, and so the loss, are untouched), so one compiled step serves every batch.

POISON = 0.625


@jax.custom_vjp
def _nan_gradient_if(x, flag):
    return x


_nan_gradient_if.defvjp(lambda x, flag: (x, flag),
                        lambda flag, g: (g * jnp.where(flag, jnp.nan, 1.0).astype(g.dtype), None))


def _poisoned_micro_batch_loss(real):
    def loss(params, ref_params, cfg, mb):
        flag = mb["advantages"][0] == POISON
        return real(jax.tree.map(lambda p: _nan_gradient_if(p, flag), params), ref_params, cfg, mb)
    return loss


def _loss_only_guard(loss, grad_norm, new, old):
    """Broken: the guard looks at the loss alone (a NaN gradient under a finite loss goes through)."""
    finite = jnp.isfinite(loss)
    return step_module.keep_if_not(finite, new, old), (~finite).astype(jnp.int32)


GRPO_BROKEN_GUARDS = {"real_guard": None, "guard_reads_the_loss_only": _loss_only_guard}


@pytest.mark.parametrize("variant", list(GRPO_BROKEN_GUARDS))
def test_grpo_step_with_a_nonfinite_gradient_keeps_params_and_optimizer_state(variant, monkeypatch):
    monkeypatch.setattr(grpo_module, "micro_batch_loss", _poisoned_micro_batch_loss(grpo_module.micro_batch_loss))
    if GRPO_BROKEN_GUARDS[variant] is not None:
        monkeypatch.setattr(grpo_module, "skip_if_nonfinite", GRPO_BROKEN_GUARDS[variant])
    cfg = grpo_config(*ATTENTION_LAYERS, "rl.micro_batches=2")
    setup, opt = build(cfg), rl_optimizer(cfg)
    step_fn = jit_grpo_step(setup, with_reference=False)
    init = jax.jit(lambda p: {"params": p, "opt_state": opt.init(p), "step": jnp.int32(0)},
                   out_shardings=setup.state_shardings)

    def batch(seed, poisoned):
        adv, keep = _advantages(seed=seed)
        out = build_update_batch(cfg, _rollout(cfg, seed=seed), adv, keep)
        if poisoned:  # the second micro-batch only: one poisoned micro-batch poisons the step's sum
            out["advantages"][1, 0] = POISON
        return out

    with setup.context():
        state, m0 = step_fn(init(tiny_params(cfg)), None, batch(0, False))
        before = jax.device_get(state)
        state, m1 = step_fn(state, None, batch(1, True))
        after = jax.device_get(state)
        state, m2 = step_fn(state, None, batch(2, False))
    m0, m1, m2 = jax.device_get((m0, m1, m2))
    moved = lambda a, b: any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    if variant != "real_guard":
        assert moved(after["params"], before["params"]) or m1["update_skipped"] != 1.0, f"{variant} was not caught"
        return
    assert np.isfinite(m1["loss"]) and not np.isfinite(m1["grad_norm"]), m1  # the gradient alone is poisoned
    assert (m0["update_skipped"], m1["update_skipped"], m2["update_skipped"]) == (0.0, 1.0, 0.0)
    assert (m0["update_applied"], m1["update_applied"], m2["update_applied"]) == (1.0, 0.0, 1.0)
    jax.tree.map(np.testing.assert_array_equal, after["params"], before["params"])
    jax.tree.map(np.testing.assert_array_equal, after["opt_state"], before["opt_state"])
    assert moved(jax.device_get(state["params"]), after["params"])  # the next finite step updates
