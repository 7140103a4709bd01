"""Numerics guards: a step with a NaN/inf loss or gradient keeps the old weights (inside the jitted
step), is counted, and after train.max_nonfinite_skips in a row (or at once under
train.on_nonfinite=stop) the run checkpoints its last good state and exits with a clear message."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridmoe.train.loop as loop
import hybridmoe.train.step as step_module
from helpers import tiny_config
from hybridmoe.cli import main
from hybridmoe.config.schema import TrainConfig
from hybridmoe.train.checkpoint import finished_steps
from hybridmoe.train.guard import NonFiniteGuard, NonFiniteStop
from hybridmoe.train.metrics import read_metrics

OVER = ("train.batch_size=8", "train.seq_len=16", "train.checkpoint_every=0", "train.warmup_steps=0")
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
    from hybridmoe.parallel.host import put_global
    from hybridmoe.train.setup import build, init_state, jit_train_step
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
