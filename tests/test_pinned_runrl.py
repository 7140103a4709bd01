"""Run glue pinned on tiny hand-made inputs: the metrics file's warnings and records, and other
single checks of hybridmoe/run found unpinned by trying slips."""

import json
import logging

import pytest


def test_an_unreadable_metrics_line_is_named_by_its_one_based_line_number(tmp_path, caplog):
    from hybridmoe.run.metrics import read_metrics
    f = tmp_path / "metrics.jsonl"
    # Line 1 a record, line 2 torn, line 3 blank (skipped silently), line 4 a record.
    f.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo\n\n{"step": 2, "loss": 0.5}\n')
    with caplog.at_level(logging.WARNING, logger="hybridmoe.run.metrics"):
        records = read_metrics(f)
    assert [r["step"] for r in records] == [0, 2]
    assert f"{f}:2: unreadable metrics line dropped" in caplog.text
    assert f"{f}:3:" not in caplog.text


def test_a_record_holds_the_step_and_each_metric_as_a_float_with_nonfinite_as_null(tmp_path):
    import numpy as np
    from hybridmoe.run.metrics import MetricsWriter
    with MetricsWriter(tmp_path) as w:
        w.write(3, {"loss": np.float32(0.25), "n": 7, "bad": float("inf"), "nan": float("nan")})
        with pytest.raises(ValueError, match="'step' is the record's key"):
            w.write(4, {"step": 1})
        with pytest.raises(TypeError, match="metric 'x' must be a scalar number, got list"):
            w.write(4, {"x": [1, 2]})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 3, "loss": 0.25, "n": 7.0, "bad": None, "nan": None}]


# ------------------------------------------------------------------------------------------------
# session


class _Ckpt:
    def __init__(self):
        self.saved = []

    def save(self, step, tree, meta):
        self.saved.append((step, tree, meta))

    def close(self):
        pass


def _session(tmp_path, monkeypatch, start=0):
    import contextlib
    import types

    from hybridmoe.config.schema import TrainConfig
    from hybridmoe.run.session import Session
    monkeypatch.setattr("hybridmoe.run.session.Session.meta", property(lambda self: {"config": "c", "pos": -1}))
    setup = types.SimpleNamespace(context=contextlib.nullcontext)
    return Session(types.SimpleNamespace(train=TrainConfig()), tmp_path, None, setup, 0, start, None, _Ckpt())


def _step(tree, step):
    return tree + 1, {"update_skipped": 0, "loss": float(step)}, {}


def test_a_session_writes_a_record_every_step_by_default_and_follows_each_with_on_write(tmp_path, monkeypatch):
    s = _session(tmp_path, monkeypatch)
    written, closed = [], []
    s.run(_step, 3, checkpoint_every=0, step_meta=lambda done: {"pos": done}, progress=False, desc="t",
          on_write=lambda w, done: written.append(done), on_close=lambda w: closed.append(w.jsonl_path.name))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert written == [1, 2, 3]  # steps done after each record
    assert closed == ["metrics.jsonl"]
    # checkpoint_every=0: only the save after the last step, its meta the session's and the loop's
    # (the loop's fields win: pos is the steps done, not the session's -1).
    assert s.ckpt.saved == [(3, 3, {"config": "c", "pos": 3})]


# ------------------------------------------------------------------------------------------------
# compile cache, policy folders, the RL loop's phases


def test_the_compile_cache_is_pruned_past_8_gib_down_to_4_gib():
    import inspect

    from hybridmoe.run.compile_cache import prune
    params = inspect.signature(prune).parameters
    assert params["above"].default == 8 * 2**30 and params["to"].default == 4 * 2**30


def test_prune_stops_as_soon_as_what_remains_is_at_most_the_target(tmp_path):
    import os

    from hybridmoe.run.compile_cache import prune
    for i, name in enumerate("abc"):  # 100 bytes each, a written first
        (tmp_path / name).write_bytes(b"x" * 100)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    assert prune(tmp_path, above=299, to=200) == 100  # 300 > 299: a goes, 200 remain (at the target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]
    assert prune(tmp_path, above=200, to=0) == 0  # 200 is not past 200


def test_a_runs_policy_is_its_latest_numbered_checkpoint(tmp_path):
    from hybridmoe.config.schema import Config
    from hybridmoe.rl.policy_io import PolicyError, run_config
    with pytest.raises(PolicyError, match="no checkpoint under"):
        run_config(tmp_path)
    for step in (2, 10, 9):
        meta = tmp_path / "checkpoints" / str(step) / "meta"
        meta.mkdir(parents=True)
        cfg = Config().model_dump(mode="json")
        cfg["train"]["seed"] = step
        (meta / "metadata").write_text(json.dumps({"config": cfg, "phase": 1, "step": step}))
    (tmp_path / "checkpoints" / "tmp_11").mkdir()  # not a step: never taken
    cfg, step, meta = run_config(tmp_path)
    assert step == 10 and cfg.train.seed == 10 and meta["step"] == 10  # 10 sorts after 9 as a number


def test_the_rl_records_phase_is_0_for_the_warm_up_and_1_for_grpo():
    from hybridmoe.rl import loop
    assert (loop.WARMUP, loop.GRPO) == (0, 1)
    assert loop.MAX_EMPTY_STEPS == 3


# ------------------------------------------------------------------------------------------------
# the supervised loop's record, with its step, data and clock stubbed


def test_a_train_record_holds_the_steps_figures_and_its_rate_over_the_stubbed_clock(monkeypatch):
    import types

    import hybridmoe.train.loop as train_loop
    from hybridmoe.data.text import LongDocuments

    cfg = types.SimpleNamespace(train=types.SimpleNamespace(fewest_micro_batches=2, steps=2, checkpoint_every=0,
                                                            log_every=1))
    counts = LongDocuments(documents=4, split=1, pieces=3, longest=99)
    source = types.SimpleNamespace(host_local=False, fields=(), text=types.SimpleNamespace(long_documents=counts),
                                   batch=lambda i, position: ({"tokens": i}, position + 1))
    clock = iter([10.0, 12.5, 20.0, 20.5])  # step 0 takes 2.5 s, step 1 0.5 s

    def step_fn(state, batch):
        return state + 1, {"loss": 1.5, "grad_norm": 0.25, "tokens": 100.0 + batch["tokens"], "loss_tokens": 60.0,
                           "update_skipped": 0.0, "moe_dropped": 7.0}

    class Session:
        saved_meta = None
        setup = types.SimpleNamespace(kept=lambda name, make: step_fn, batch_sharding=lambda axis: None)

        def run(self, step, total, **kw):
            out, state = [], 0
            for i in range(total):
                state, rec, _ = step(state, i)
                out.append(rec)
            return out

        def export(self, export_hf, params):
            pass

    monkeypatch.setattr(train_loop, "start_config", lambda cfg, out, **kw: cfg)
    monkeypatch.setattr(train_loop, "training_source", lambda cfg: source)
    monkeypatch.setattr(train_loop, "memory_budget_bytes", lambda cfg: None)
    monkeypatch.setattr(train_loop, "open_session", lambda *a, **kw: Session())
    monkeypatch.setattr(train_loop, "split_micro_batches", lambda rows, m: rows)
    monkeypatch.setattr(train_loop, "put_global", lambda rows, sharding: rows)
    monkeypatch.setattr(train_loop, "fetch_global", lambda m: m)
    monkeypatch.setattr(train_loop, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(Session, "tree", {"params": None}, raising=False)
    first, second = train_loop.train(cfg, None, progress=False)
    assert first == {"loss": 1.5, "grad_norm": 0.25, "tokens": 100, "loss_tokens": 60, "tokens_per_s": 40.0,
                     "step_time_s": 2.5, "moe_dropped": 7, "update_skipped": 0, "micro_batches": 2,
                     "data_docs_split": 1, "data_split_pieces": 3, "data_docs_truncated": 0, "data_targets_cut": 0,
                     "data_trained_targets_cut": 0, "data_longest_doc": 99}  # 100 tokens / 2.5 s
    # Step 1: 101 tokens in 0.5 s; the data counts are the first record's only.
    assert second == {"loss": 1.5, "grad_norm": 0.25, "tokens": 101, "loss_tokens": 60, "tokens_per_s": 202.0,
                      "step_time_s": 0.5, "moe_dropped": 7, "update_skipped": 0, "micro_batches": 2}


# ------------------------------------------------------------------------------------------------
# the memory budget and the data cursors


def test_the_memory_budget_is_the_set_gib_else_the_devices_free_bytes(monkeypatch):
    import types

    import jax

    from hybridmoe.run.memory_fit import memory_budget_bytes
    cfg = lambda gib: types.SimpleNamespace(run=types.SimpleNamespace(memory_budget_gib=gib))  # noqa: E731
    assert memory_budget_bytes(cfg(1.5)) == 3 * 2**29  # 1.5 GiB
    stats = {"bytes_limit": 1000, "bytes_in_use": 300}
    monkeypatch.setattr(jax, "local_devices", lambda: [types.SimpleNamespace(memory_stats=lambda: stats)])
    assert memory_budget_bytes(cfg(None)) == 700
    del stats["bytes_in_use"]
    assert memory_budget_bytes(cfg(None)) == 1000  # nothing in use reported: all of it free
    stats["bytes_limit"] = 0
    assert memory_budget_bytes(cfg(None)) is None  # no limit reported (a CPU)


def test_a_hosts_cursor_is_read_from_a_checkpoint_of_as_many_hosts(monkeypatch):
    from hybridmoe.data.records import DataError
    from hybridmoe.data.sources import position_record, start_position
    assert position_record(12) == [12]
    assert start_position({"data_position": [12]}) == 12
    assert start_position(None) == 0 and start_position({"data_position": [12]}, host_local=False) == 0
    with pytest.raises(DataError, match=r"those of 2 host\(s\).*this run has 1 process\(es\); resume it on 2"):
        start_position({"data_position": [12, 7]})


def test_on_three_hosts_the_second_reads_its_own_cursor_and_a_shorter_list_is_refused(monkeypatch):
    import hybridmoe.data.sources as sources
    from hybridmoe.data.records import DataError
    monkeypatch.setattr(sources.jax, "process_count", lambda: 3)
    monkeypatch.setattr(sources.jax, "process_index", lambda: 1)
    assert sources.start_position({"data_position": [12, 7, 5]}) == 7
    for positions in ([12, 7], [12, 7, 5, 1]):
        with pytest.raises(DataError, match=f"those of {len(positions)} host"):
            sources.start_position({"data_position": positions})


def test_an_error_stop_logs_the_step_that_failed_and_the_last_completed_one(tmp_path, monkeypatch, caplog):
    s = _session(tmp_path, monkeypatch)

    def failing(tree, step):
        if step == 2:
            raise RuntimeError("boom")
        return _step(tree, step)

    with caplog.at_level(logging.WARNING, logger="hybridmoe.run.session"), pytest.raises(RuntimeError):
        s.run(failing, 5, checkpoint_every=0, step_meta=lambda done: {"pos": done}, progress=False, desc="t")
    # Steps 0 and 1 done (done = 2); step 2 raised: checkpoint 2 holds the state after step 1.
    assert "run stopped by an error in step 2; checkpointed the state after step 1 (checkpoint 2)" in caplog.text
    assert s.ckpt.saved == [(2, 2, {"config": "c", "pos": 2})]
