"""Run glue and data plumbing pinned on tiny hand-made inputs: the non-finite guard's message, the
run folder's refusals, the session's checkpoint and record cadence, packing, record reading and the
reward sums. Every expectation is worked out by hand in the test."""

import json
import logging
import types
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.config.schema import TrainConfig
from hybridmoe.data.packing import pack_documents, split_micro_batches
from hybridmoe.data.records import BadLines, DataError, data_files, read_records, text_or_messages, prompt_or_messages
from hybridmoe.rl.rewards import apply_reward_error_policy, score_completions
from hybridmoe.run.guard import NonFiniteGuard
from hybridmoe.run.run_dir import RunError, check_paths, run_contents


# ------------------------------------------------------------------------------------------------
# guard


def test_the_guard_names_the_first_and_last_step_of_the_run_of_skips():
    guard = NonFiniteGuard(TrainConfig(max_nonfinite_skips=3))
    stops = [guard.observe(step, True) for step in (10, 11, 12)]
    assert stops[:2] == [None, None]
    # Three in a row ending at step 12: steps 12 - 3 + 1 = 10 .. 12.
    assert "steps 10..12: 3 consecutive steps" in str(stops[2])
    assert "train.max_nonfinite_skips=3" in str(stops[2])


def test_the_stop_policy_stops_at_the_first_nonfinite_step_and_off_never_does():
    stop = NonFiniteGuard(TrainConfig(on_nonfinite="stop", max_nonfinite_skips=5))
    assert stop.observe(0, False) is None
    err = stop.observe(1, True)
    assert err is not None and "step 1:" in str(err) and "on_nonfinite=stop" in str(err)
    off = NonFiniteGuard(TrainConfig(on_nonfinite="off", max_nonfinite_skips=1))
    assert all(off.observe(i, True) is None for i in range(4))


# ------------------------------------------------------------------------------------------------
# run folder


def test_run_paths_are_refused_before_anything_is_written(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(RunError, match="--resume continues"):
        check_paths(None, resume=True)
    with pytest.raises(RunError, match="contradict"):
        check_paths(tmp_path / "o", resume=True, overwrite=True)
    with pytest.raises(RunError, match="--out .* is a file"):
        check_paths(a_file)
    with pytest.raises(RunError, match="--export-hf .* is a file"):
        check_paths(tmp_path / "o", export_hf=a_file)
    with pytest.raises(RunError, match="--init-hf"):
        check_paths(tmp_path / "o", init_hf=tmp_path / "missing")
    # Accepted: folders, a path not there yet, a resume with --out, an --init-hf folder.
    check_paths(tmp_path / "o", resume=True, export_hf=tmp_path / "e", init_hf=tmp_path)
    check_paths(tmp_path, overwrite=True)
    assert list(tmp_path.iterdir()) == [a_file]


def test_a_run_is_its_metrics_its_events_or_a_finished_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("x")
    assert run_contents(tmp_path) == []
    (tmp_path / "checkpoints" / "4").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "tb").mkdir()
    assert run_contents(tmp_path) == ["metrics.jsonl", "tb", "checkpoints"]


# ------------------------------------------------------------------------------------------------
# session: the bookkeeping around the loop's step, with a fake step, set-up and checkpoints


class _FakeCkpt:
    def __init__(self):
        self.saved = []
        self.closed = False

    def save(self, step, tree, meta):
        self.saved.append((step, tree, meta["pos"]))

    def close(self):
        self.closed = True


def _session(tmp_path, start=0, *, out=True, **train):
    from hybridmoe.run.session import Session
    setup = types.SimpleNamespace(context=lambda: __import__("contextlib").nullcontext())
    cfg = types.SimpleNamespace(train=TrainConfig(**train))
    return Session(cfg, tmp_path if out else None, None, setup, 0, start, None, _FakeCkpt())


def _step(tree, step):
    return tree + 1, {"update_skipped": False, "loss": float(step) / 2}, {}


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_session_checkpoints_every_n_steps_and_after_the_last(tmp_path, monkeypatch):
    monkeypatch.setattr("hybridmoe.run.session.Session.meta", property(lambda self: {}))
    s = _session(tmp_path)
    ckpt = s.ckpt
    history = s.run(_step, 7, checkpoint_every=3, step_meta=lambda done: {"pos": done * 10}, progress=False,
                    desc="t", log_every=2)
    # Steps 0..6; done = 3 and 6 hit the cadence, then 7 (after the last step) is saved once more.
    # The tree counts steps from 0, so the tree saved at done is done; the meta is the loop's at done.
    assert ckpt.saved == [(3, 3, 30), (6, 6, 60), (7, 7, 70)] and ckpt.closed
    assert [h["step"] for h in history] == list(range(7)) and history[5]["loss"] == 2.5
    # A record every 2 steps, step 0 included: 0, 2, 4, 6.
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(0, 0.0), (2, 1.0), (4, 2.0), (6, 3.0)]


def test_a_resumed_session_starts_at_its_step_and_does_not_resave_it(tmp_path, monkeypatch):
    monkeypatch.setattr("hybridmoe.run.session.Session.meta", property(lambda self: {}))
    s = _session(tmp_path, start=4)
    s.tree = 4
    ckpt = s.ckpt
    history = s.run(_step, 6, checkpoint_every=3, step_meta=lambda done: {"pos": done}, progress=False, desc="t")
    # Steps 4, 5: done = 5 (not a multiple of 3), 6 (one): saved once at 6, nothing after.
    assert [h["step"] for h in history] == [4, 5]
    assert ckpt.saved == [(6, 6, 6)]
    s2 = _session(tmp_path, start=6)
    assert s2.run(_step, 6, checkpoint_every=3, step_meta=lambda d: {"pos": d}, progress=False, desc="t") == []
    assert s2.ckpt.saved == []  # nothing done: the checkpoint it started from is not written again


def test_a_session_stopped_by_an_error_checkpoints_the_last_completed_step(tmp_path, monkeypatch):
    monkeypatch.setattr("hybridmoe.run.session.Session.meta", property(lambda self: {}))
    s = _session(tmp_path)
    ckpt = s.ckpt

    def failing(tree, step):
        if step == 5:
            raise KeyboardInterrupt
        return _step(tree, step)

    with pytest.raises(KeyboardInterrupt):
        s.run(failing, 9, checkpoint_every=4, step_meta=lambda d: {"pos": d}, progress=False, desc="t")
    # done = 4 saved by the cadence; steps 4 done (done = 5), step 5 raised: saved at 5.
    assert ckpt.saved == [(4, 4, 4), (5, 5, 5)] and ckpt.closed
    # An error right after a cadence save (step 4 raises, done = 4 is saved): nothing saved twice.
    s = _session(tmp_path, out=False)
    with pytest.raises(KeyboardInterrupt):
        s.run(lambda tree, step: failing(tree, step + 1), 9, checkpoint_every=4, step_meta=lambda d: {"pos": d},
              progress=False, desc="t")
    assert s.ckpt.saved == [(4, 4, 4)]


def test_a_nonfinite_stop_is_recorded_off_cadence_and_checkpointed(tmp_path, monkeypatch):
    from hybridmoe.run.guard import NonFiniteStop
    monkeypatch.setattr("hybridmoe.run.session.Session.meta", property(lambda self: {}))
    s = _session(tmp_path, max_nonfinite_skips=2)
    ckpt = s.ckpt

    def bad_from_3(tree, step):
        tree, rec, shown = _step(tree, step)
        return tree, {**rec, "update_skipped": step >= 3}, shown

    with pytest.raises(NonFiniteStop, match="steps 3..4"):
        s.run(bad_from_3, 9, checkpoint_every=0, step_meta=lambda d: {"pos": d}, progress=False, desc="t",
              log_every=3)
    # Records at steps 0 and 3 (the cadence) and 4 (the stop, off the cadence); saved once, at done = 5.
    assert [(r["step"], r["update_skipped"]) for r in _records(tmp_path)] == [(0, 0.0), (3, 1.0), (4, 1.0)]
    assert ckpt.saved == [(5, 5, 5)]


# ------------------------------------------------------------------------------------------------
# packing


def test_packing_is_first_fit_with_segments_positions_and_masks():
    docs = [np.array([1, 2, 3]), np.array([4, 5, 6, 7]), np.array([8, 9]), np.array([10, 11, 12, 13, 14, 15, 16])]
    masks = [[1, 0, 1], [0, 1, 1, 1], [1, 1], [1] * 7]
    out = pack_documents(docs, rows=2, seq_len=5, pad_id=9, masks=masks)
    # doc0 (3) -> row 0 [0:3]; doc1 (4) does not fit row 0 (3 + 4 > 5) -> row 1 [0:4];
    # doc2 (2) fits row 0 exactly (3 + 2 = 5) -> row 0 [3:5]; doc3 cut to 5 tokens fits nowhere: dropped.
    assert out["tokens"].tolist() == [[1, 2, 3, 8, 9], [4, 5, 6, 7, 9]]
    assert out["segment_ids"].tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]]
    assert out["positions"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert out["loss_mask"].tolist() == [[1, 0, 1, 1, 1], [0, 1, 1, 1, 0]]
    # Row 0 too full (4 + 2 > 5), row 1 exactly full (3 + 2 = 5): the last document goes to row 1.
    exact = pack_documents([np.array([1, 1, 1, 1]), np.array([2, 2, 2]), np.array([3, 3])], rows=2, seq_len=5)
    assert exact["tokens"].tolist() == [[1, 1, 1, 1, 0], [2, 2, 2, 3, 3]]
    one = pack_documents([np.arange(1, 8)], rows=1, seq_len=4)  # longer than a row: its first 4 tokens
    assert one["tokens"].tolist() == [[1, 2, 3, 4]] and "loss_mask" not in one


def test_micro_batches_split_rows_in_order_and_refuse_an_uneven_split():
    rows = {"tokens": np.arange(12).reshape(6, 2)}
    out = split_micro_batches(rows, 3)["tokens"]
    assert out.shape == (3, 2, 2) and out[1].tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="6 rows do not split into 4"):
        split_micro_batches(rows, 4)


# ------------------------------------------------------------------------------------------------
# records


def test_bad_lines_keep_the_first_and_count_all():
    bad = BadLines()
    bad.add("a.jsonl", 3, "x")
    bad.add("a.jsonl", 7, "y")
    assert (bad.count, bad.first) == (2, "a.jsonl:3: x")


def test_read_records_names_the_first_bad_line_and_the_count(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n[1]\n\n{"text": 5}\n{"text": "b"}\n{"oops": \n')
    check = text_or_messages("text")
    with pytest.raises(DataError) as e:
        read_records(f, "data.path", check, "stop")
    # Line 2 (a list), 4 (no string), 6 (torn) are bad; line 3 is blank and not counted.
    assert f"3 bad line(s); the first is {f}:2: expected a JSON object, got list" in str(e.value)
    records, bad = read_records(f, "data.path", check, "skip")
    assert [(r.line, r.fields["text"]) for r in records] == [(1, "a"), (5, "b")]
    assert bad.count == 3


def test_a_json_error_is_placed_at_its_column_or_at_the_end_of_the_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": x}\n{"prompt": "a"\n')
    with pytest.raises(DataError) as e:
        read_records(f, "data.prompts", prompt_or_messages, "stop")
    # The 'x' is the 12th character: column 12.
    assert "2 bad line(s)" in str(e.value) and f"{f}:1: not valid JSON (Expecting value at column 12)" in str(e.value)
    f.write_text('{"prompt": "a"\n')
    with pytest.raises(DataError, match="at the end of the line"):
        read_records(f, "data.prompts", prompt_or_messages, "stop")


def test_messages_are_checked_item_by_item(tmp_path):
    assert prompt_or_messages({"messages": []}).startswith("'messages' must be a non-empty list")
    assert prompt_or_messages({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]}) == \
        "messages[1] must be an object with string 'role' and 'content'"
    assert prompt_or_messages({"b": 1, "a": 2}) == "no 'prompt' string and no 'messages' list (fields: a, b)"
    assert text_or_messages("body")({}) == "no 'body' string and no 'messages' list (fields: none)"


def test_data_files_are_the_folders_data_files_in_name_order(tmp_path):
    for name in ("b.jsonl", "a.parquet", "c.txt", "a.json"):
        (tmp_path / name).write_text("")
    assert [p.name for p in data_files(tmp_path, "data.path")] == ["a.json", "a.parquet", "b.jsonl"]
    with pytest.raises(DataError, match="expected a .jsonl/.json/.parquet file"):
        data_files(tmp_path / "c.txt", "data.path")
    with pytest.raises(DataError, match="no such file"):
        data_files(tmp_path / "none.jsonl", "data.path")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no"):
        data_files(empty, "data.path")


# ------------------------------------------------------------------------------------------------
# rewards


def test_rewards_are_the_weighted_sum_of_every_function():
    def length(prompt, completion):
        return len(completion)

    def matches(prompt, completion, example):
        return float(completion == example["answer"])
    matches.takes_example = True
    rewards, skipped, counts = score_completions([(length, 0.5), (matches, 2.0)], ["p", "p"], ["ab", "xyz"],
                                                 [{"answer": "ab"}, {"answer": "ab"}])
    # 0.5 * 2 + 2.0 * 1 = 3.0; 0.5 * 3 + 2.0 * 0 = 1.5
    assert rewards.tolist() == [3.0, 1.5] and not skipped.any()
    assert counts == {"scored": 2, "skipped": 0}


def test_a_sample_two_functions_fail_on_counts_in_both_kinds_but_is_skipped_once():
    def boom(prompt, completion):
        raise ValueError("no")

    def inf(prompt, completion):
        return float("inf") if completion == "b" else 1.0
    rewards, skipped, counts = score_completions([(boom, 1.0), (inf, 1.0)], ["p"] * 2, ["a", "b"])
    assert skipped.tolist() == [True, True] and rewards.tolist() == [0.0, 0.0]
    assert counts == {"scored": 0, "skipped": 2, "raised:ValueError": 2, "nonfinite": 1}
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        score_completions([(inf, 1.0)], ["p", "q"], ["a"])
    with pytest.raises(ValueError, match="expected skip_sample, zero or skip_group"):
        apply_reward_error_policy("skip", np.zeros(2, bool), np.zeros(2, bool), 2)


def test_skip_group_masks_each_group_with_a_failure_of_three():
    failed = np.array([False, False, True, False, False, False])
    got = apply_reward_error_policy("skip_group", failed, np.zeros(6, bool), 3)
    assert got.tolist() == [True, True, True, False, False, False]


# ------------------------------------------------------------------------------------------------
# opening a session: fresh start or resume, with fake checkpoints


class _Saved:
    def __init__(self, latest, meta, restore_error=None):
        self.latest, self.meta, self.restore_error, self.closed = latest, meta, restore_error, False

    def latest_step(self):
        return self.latest

    def restore_meta(self, step):
        assert step == self.latest
        return self.meta

    def restore(self, step, abstract):
        if self.restore_error:
            raise self.restore_error
        return ("restored", step, abstract), {}

    def close(self):
        self.closed = True


def _open(monkeypatch, ckpt, cfg_model="m", **kw):
    from hybridmoe.run import session
    monkeypatch.setattr(session, "read_hf_weights", lambda hf_dir, out, resume: "hf-tree")
    monkeypatch.setattr(session, "build", lambda cfg: "setup")
    monkeypatch.setattr(session, "open_checkpoints", lambda out, resume, overwrite: ckpt)
    monkeypatch.setattr(session, "config_record", lambda cfg: {"model": cfg_model, "train": {"steps": 9}})
    return session.open_session("cfg", "out", resume=True, overwrite=False, init_hf=None,
                                abstract_tree=lambda setup: "abstract", fresh_tree=lambda setup, hf: ("fresh", hf),
                                **kw)


def test_a_session_without_a_checkpoint_starts_fresh_from_the_hf_weights(monkeypatch):
    s = _open(monkeypatch, _Saved(None, None))
    assert (s.tree, s.start, s.saved_meta) == (("fresh", "hf-tree"), 0, None)


def test_a_resume_restores_the_latest_checkpoint_and_starts_there(monkeypatch):
    seen = []
    meta = {"config": {"model": "m", "train": {"steps": 6}}, "pos": 3}  # more steps asked: same model
    s = _open(monkeypatch, _Saved(6, meta), check_saved=seen.append)
    assert s.tree == ("restored", 6, "abstract") and s.start == 6 and s.saved_meta == meta and seen == [meta]


def test_a_resume_of_another_model_or_an_unfitting_checkpoint_is_refused_and_closes(monkeypatch):
    other = _Saved(6, {"config": {"model": "other"}})
    with pytest.raises(RunError, match="holds a model of another shape or kind"):
        _open(monkeypatch, other)
    assert other.closed
    bad = _Saved(4, {"config": {"model": "m"}}, restore_error=ValueError("shape (2,) != (3,)"))
    with pytest.raises(RunError, match=r"the checkpoint at step 4 in out does not fit the model: shape \(2,\)"):
        _open(monkeypatch, bad)
    assert bad.closed


# ------------------------------------------------------------------------------------------------
# metrics: what reaches TensorBoard, and which lines count as records


class _FakeTB:
    def __init__(self, logdir):
        self.scalars = []
        _FakeTB.last = self

    def add_scalar(self, key, value, global_step):
        self.scalars.append((key, value, global_step))

    def flush(self):
        pass

    def close(self):
        pass


def test_tensorboard_gets_every_finite_metric_at_its_step_and_never_the_step_itself(tmp_path, monkeypatch):
    import tensorboardX
    from hybridmoe.run.metrics import MetricsWriter
    monkeypatch.setattr(tensorboardX, "SummaryWriter", _FakeTB)
    with MetricsWriter(tmp_path) as w:
        w.write(0, {"loss": 2.0, "kl": float("inf")})
        w.write(1, {"loss": 1.5})
        w.write(2, {"loss": 1.0})
    assert _FakeTB.last.scalars == [("loss", 2.0, 0), ("loss", 1.5, 1), ("loss", 1.0, 2)]
    assert _records(tmp_path)[0] == {"step": 0, "loss": 2.0, "kl": None}
    # A resume from step 2 keeps steps 0 and 1 and replays them to a fresh TensorBoard folder.
    with MetricsWriter(tmp_path, resume_from_step=2):
        pass
    assert _FakeTB.last.scalars == [("loss", 2.0, 0), ("loss", 1.5, 1)]
    assert [r["step"] for r in _records(tmp_path)] == [0, 1]


def test_only_objects_with_an_integer_step_are_records(tmp_path):
    from hybridmoe.run.metrics import read_metrics
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0, "a": 1}\n{"step": "1"}\n[1]\n{"a": 2}\n\n{"step": 3, "a": 3}\n{"step": 4, "a"')
    assert read_metrics(f) == [{"step": 0, "a": 1}, {"step": 3, "a": 3}]


def test_checkpoints_keep_the_last_three_steps_each_with_its_own_state_and_metadata(tmp_path):
    import jax.numpy as jnp
    from hybridmoe.run.checkpoint import Checkpoints, finished_steps
    ckpt = Checkpoints(tmp_path / "checkpoints")
    try:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"a": jnp.arange(3.0) * step}, {"pos": step * 10})
        ckpt.wait()
        assert finished_steps(tmp_path / "checkpoints") == [2, 3, 4] and ckpt.latest_step() == 4
        assert ckpt.restore_meta(4) == {"pos": 40}
        state, meta = ckpt.restore(3, {"a": jnp.zeros(3)})
        assert state["a"].tolist() == [0.0, 3.0, 6.0] and meta == {"pos": 30}
    finally:
        ckpt.close()
