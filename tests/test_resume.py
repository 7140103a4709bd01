"""Resume never strands a run: unfinished checkpoints are ignored and removed, a resume with
nothing finished starts at step 0 in place, a fresh start refuses a folder with a run (or
overwrites it when asked), and metrics.jsonl and TensorBoard keep one record per step."""

import pytest

from helpers import ATTENTION_LAYERS, tiny_config
from hybridmoe.run.checkpoint import finished_steps
from hybridmoe.run.run_dir import RunError
from hybridmoe.train.loop import train
from hybridmoe.run.metrics import read_metrics
from run_checks import assert_tensorboard_matches_jsonl, comparable

# Attention layers only (helpers.ATTENTION_LAYERS): which checkpoint a resume takes and what it writes
# do not depend on the mixers. The step program of tests/test_train.py's resume tests and of the kill
# trials (tests/kill_harness.py): one compile in a cold run.
OVER = ("train.steps=4", "train.checkpoint_every=2", "train.batch_size=8", "train.seq_len=16", *ATTENTION_LAYERS)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    train(tiny_config(*OVER), out, progress=False)
    return out


def _killed_before_its_first_checkpoint(out):
    """What a SIGKILL during the first checkpoint write leaves: metrics of steps 0-1 and orbax's
    temporary folder for step 2."""
    train(tiny_config(*OVER[1:], "train.steps=2", "train.checkpoint_every=0"), out, progress=False)
    ckpts = out / "checkpoints"
    (ckpts / "2").rename(ckpts / "2.orbax-checkpoint-tmp-1234")
    assert finished_steps(ckpts) == []


def test_resume_with_only_an_unfinished_checkpoint_starts_at_step_0_in_place(straight, tmp_path, capsys):
    out = tmp_path / "run"
    _killed_before_its_first_checkpoint(out)
    capsys.readouterr()
    with pytest.raises(RunError, match="already holds a run"):
        train(tiny_config(*OVER), out, progress=False)  # a fresh start refuses: metrics exist
    resumed = train(tiny_config(*OVER), out, resume=True, progress=False)
    assert "starting at step 0" in capsys.readouterr().err
    assert [h["step"] for h in resumed] == [0, 1, 2, 3]
    assert not list((out / "checkpoints").glob("*tmp*"))  # the unfinished step is gone
    assert finished_steps(out / "checkpoints") == [2, 4]
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(read_metrics(straight / "metrics.jsonl"))
    assert_tensorboard_matches_jsonl(out)


def test_overwrite_replaces_the_run(tmp_path):
    out = tmp_path / "run"
    _killed_before_its_first_checkpoint(out)
    train(tiny_config(*OVER[:1], "train.steps=1", *OVER[1:]), out, overwrite=True, progress=False)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0]
    assert finished_steps(out / "checkpoints") == [1]
    assert_tensorboard_matches_jsonl(out)


def test_resume_mid_run_rewrites_metrics_and_tensorboard_to_the_checkpoint(straight, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(*OVER[1:], "train.steps=3"), out, progress=False)  # checkpoint at 2, metrics 0..2
    # as if killed after step 2's metrics but before the end-of-run checkpoint at 3
    for step_dir in (out / "checkpoints").iterdir():
        if step_dir.name == "3":
            step_dir.rename(out / "checkpoints" / "3.orbax-checkpoint-tmp-99")
    resumed = train(tiny_config(*OVER), out, resume=True, progress=False)
    assert [h["step"] for h in resumed] == [2, 3]
    assert comparable(read_metrics(out / "metrics.jsonl")) == comparable(read_metrics(straight / "metrics.jsonl"))
    assert_tensorboard_matches_jsonl(out)


def test_resume_needs_out_and_a_file_is_not_a_run_folder(tmp_path):
    with pytest.raises(RunError, match="--out"):
        train(tiny_config(*OVER), None, resume=True, progress=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunError, match="is a file"):
        train(tiny_config(*OVER), tmp_path / "f", progress=False)


def test_what_counts_as_an_earlier_run_in_the_folder(tmp_path):
    """metrics.jsonl, TensorBoard events or a finished checkpoint each make the folder a run that a
    fresh start refuses (naming what it found); an unfinished checkpoint alone does not."""
    from hybridmoe.run.run_dir import open_checkpoints, run_contents

    for name in ("metrics.jsonl", "tb"):
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).mkdir() if name == "tb" else (out / name).write_text("")
        assert run_contents(out) == [name]
        with pytest.raises(RunError, match=rf"already holds a run \({name}\)"):
            open_checkpoints(out, resume=False)
    out = tmp_path / "unfinished"
    (out / "checkpoints" / "2.orbax-checkpoint-tmp-1").mkdir(parents=True)
    assert run_contents(out) == []
    (out / "checkpoints" / "2").mkdir()
    assert run_contents(out) == ["checkpoints"]
