"""MetricsWriter: one fsynced JSON line per step, resume without duplicate steps, TensorBoard mirror,
and the PNG plot."""

import json
import math

import numpy as np
import pytest

from hybridmoe.run.metrics import MetricsWriter, plot_metrics, read_metrics


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_jsonl_records_and_tensorboard_events(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(0, {"loss": 1.5, "reward_mean": np.float32(0.25), "kl": float("nan")})
        writer.write(1, {"loss": 1.25, "reward_mean": 0.5})
        # each line is on disk as soon as write returns (flushed + fsynced), before close
        assert _steps(tmp_path / "metrics.jsonl") == [0, 1]
        with pytest.raises(ValueError, match="'step'"):
            writer.write(2, {"step": 3.0})
        with pytest.raises(TypeError, match="scalar"):
            writer.write(2, {"loss": [1.0, 2.0]})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 0, "loss": 1.5, "reward_mean": 0.25, "kl": None}  # NaN -> null
    assert json.loads(lines[1]) == {"step": 1, "loss": 1.25, "reward_mean": 0.5}
    assert len(lines) == 2  # the rejected writes left nothing behind
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100  # scalar summaries, not just the file header


def test_resume_truncates_steps_at_and_after_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(6):
            writer.write(step, {"loss": float(step)})
    # A kill mid-write leaves a torn last line.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')

    with MetricsWriter(tmp_path, resume_from_step=4) as writer:
        assert _steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3]
        assert not list(tmp_path.glob(".*.tmp"))  # the rewrite went through os.replace
        for step in range(4, 7):
            writer.write(step, {"loss": 10.0 + step})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(7))  # no duplicate steps, none lost
    assert [r["loss"] for r in records] == [0.0, 1.0, 2.0, 3.0, 14.0, 15.0, 16.0]


def test_torn_line_without_resume_does_not_glue_to_the_next_record(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    with MetricsWriter(tmp_path) as writer:
        writer.write(2, {"loss": 3.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 2]


def test_plot_metrics_writes_a_png_with_the_present_keys(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(5):
            writer.write(step, {"reward_mean": step / 4, "loss": math.exp(-step), "entropy": 2.0,
                                "kl": float("inf") if step == 2 else 0.01 * step})
    png = tmp_path / "metrics.png"
    plotted = plot_metrics(tmp_path / "metrics.jsonl", png)
    assert plotted == ["reward_mean", "loss", "kl", "entropy"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))
    only = plot_metrics(tmp_path / "metrics.jsonl", png, keys=("loss", "grad_norm"))
    assert only == ["loss"]  # absent keys get no empty subplot
    # A tuple is one panel of several lines (a step's time split): its present keys, in order.
    grouped = plot_metrics(tmp_path / "metrics.jsonl", png, keys=(("loss", "grad_norm", "entropy"), "kl"))
    assert grouped == ["loss", "entropy", "kl"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_metrics(empty, tmp_path / "empty.png") == []
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_a_key_some_records_lack_is_still_plotted(tmp_path):
    """An RL run: two warm-up records (warmup_loss only), then two GRPO records (reward_mean, loss).
    Each key appears in some record, so each gets its panel; a key in none gets none."""
    with MetricsWriter(tmp_path) as writer:
        writer.write(0, {"warmup_loss": 2.0})
        writer.write(1, {"warmup_loss": 1.5})
        writer.write(2, {"reward_mean": 0.25, "loss": 0.5})
        writer.write(3, {"reward_mean": 0.5, "loss": 0.25})
    plotted = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png",
                           keys=("reward_mean", "loss", "kl", "warmup_loss"))
    assert plotted == ["reward_mean", "loss", "warmup_loss"]
