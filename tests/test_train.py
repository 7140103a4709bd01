"""The supervised trainer: the loss falls, checkpoints resume exactly, accumulation is exact."""

import json

import jax
import numpy as np
import pytest

from helpers import ATTENTION_LAYERS, TWO_LAYERS, assert_rel_l2, tiny_config, tiny_params
from hybridmoe.data.synthetic import synthetic_batch
from hybridmoe.run.run_dir import RunError
from hybridmoe.train.loop import train
from hybridmoe.run.step import accumulate_grads, nll_sum


def test_loss_falls_on_8_devices():
    cfg = tiny_config("train.steps=40", "train.learning_rate=3e-3", *TWO_LAYERS)
    hist = train(cfg, None, progress=False)
    first = np.mean([h["loss"] for h in hist[:5]])
    last = np.mean([h["loss"] for h in hist[-5:]])
    print(f"loss over the first 5 steps {first:.3f}, the last 5 {last:.3f}")
    assert last < first - 0.5, (first, last)


def test_resume_after_a_stop_continues_exactly(tmp_path):
    # The step program of the two tests below (train.steps and checkpoint_every are not in it): a
    # cold run compiles it once, and the others read it from the compile cache. Attention layers
    # only (helpers.ATTENTION_LAYERS): what a resume, or a set-up kept, carries over does not depend
    # on the mixers (the loss falling above is the hybrid's; a hybrid run resumes exactly in
    # tests/test_rl_run.py and tests/test_data.py).
    over = ("train.steps=6", "train.checkpoint_every=3", "train.batch_size=8", "train.seq_len=16", *ATTENTION_LAYERS)
    straight = train(tiny_config(*over), tmp_path / "a", progress=False)
    # A run that stops after step 3 (as if killed after its checkpoint), then resumes.
    train(tiny_config(*over[:1], "train.steps=3", *over[1:]), tmp_path / "b", progress=False)
    resumed = train(tiny_config(*over), tmp_path / "b", resume=True, progress=False)
    assert [h["step"] for h in resumed] == [3, 4, 5]
    for a, b in zip(straight[3:], resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    records = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))


def test_a_run_of_an_equal_config_in_the_same_process_reuses_its_programs(tmp_path, monkeypatch):
    """build() keeps the last set-ups by config and devices, and the loop keeps its jitted step on
    the set-up: a second run of an equal config makes no step (nothing traced or compiled again)
    and gives the same bits; another config, or a forgotten set-up, makes its own."""
    from hybridmoe.run.setup import forget_setups
    from hybridmoe.train import loop as train_loop

    made, real = [], train_loop.jit_train_step
    monkeypatch.setattr(train_loop, "jit_train_step", lambda setup: made.append(setup.cfg) or real(setup))
    over = ("train.steps=2", "train.batch_size=8", "train.seq_len=16", *ATTENTION_LAYERS)
    first = train(tiny_config(*over), tmp_path / "a", progress=False)
    second = train(tiny_config(*over), tmp_path / "b", progress=False)
    assert len(made) == 1, made
    assert [(r["loss"], r["grad_norm"]) for r in first] == [(r["loss"], r["grad_norm"]) for r in second]
    other = train(tiny_config(*over, "train.seed=1"), None, progress=False)
    assert len(made) == 2 and made[1].train.seed == 1 and other[0]["loss"] != first[0]["loss"], made
    forget_setups()
    train(tiny_config(*over), None, progress=False)
    assert len(made) == 3, made


def test_existing_run_is_not_overwritten(tmp_path):
    over = ("train.steps=1", "train.batch_size=8", "train.seq_len=16", *ATTENTION_LAYERS)
    train(tiny_config(*over), tmp_path / "a", progress=False)
    before = (tmp_path / "a" / "metrics.jsonl").read_text()
    with pytest.raises(RunError, match="--resume"):
        train(tiny_config(*over), tmp_path / "a", progress=False)
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == before


def test_micro_batch_accumulation_equals_one_big_batch():
    cfg = tiny_config(*ATTENTION_LAYERS)  # accumulation is the model's business only through its loss
    params = tiny_params(cfg)
    two = synthetic_batch(0, 0, 2, 2, 32, cfg.model.vocab_size)
    one = {k: v.reshape(1, 4, 32) for k, v in two.items()}
    f = jax.jit(lambda p, b: accumulate_grads(lambda p, mb: nll_sum(p, cfg, mb), p, b))
    la, ca, ga = f(params, two)
    lb, cb, gb = f(params, one)
    assert int(ca) == int(cb)
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
    assert_rel_l2(ga, gb, 1e-5)


def test_batch_that_does_not_split_over_the_mesh_names_the_key():
    from hybridmoe.config import ConfigError
    from hybridmoe.run.setup import build
    with pytest.raises(ConfigError, match="train.batch_size"):
        build(tiny_config("train.batch_size=4"))



def test_a_steps_rate_is_its_tokens_over_its_own_time(monkeypatch):
    """tokens_per_s is the step's tokens over its seconds, not its trained targets (loss_tokens): the
    step (its metrics: 200 tokens, 150 targets) and its clock (each reading 0.5 s after the last)
    stubbed, on a config of its own so that no other test's compiled step is taken."""
    import types

    import jax.numpy as jnp

    import hybridmoe.train.loop as train_loop

    clock = {"now": 0.0}

    def perf_counter():
        clock["now"] += 0.5
        return clock["now"]

    metrics = {"loss": 2.0, "grad_norm": 1.0, "tokens": 200.0, "loss_tokens": 150.0, "update_skipped": 0.0}
    monkeypatch.setattr(train_loop, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(train_loop, "jit_train_step", lambda setup: lambda state, batch: (
        state, {k: jnp.float32(v) for k, v in metrics.items()}))
    hist = train(tiny_config("train.steps=1", "train.batch_size=8", "train.seq_len=16", "train.seed=1234",
                             *TWO_LAYERS), None, progress=False)
    rec = hist[0]
    assert (rec["tokens"], rec["loss_tokens"], rec["step_time_s"]) == (200, 150, 0.5)
    assert rec["tokens_per_s"] == 200 / 0.5
