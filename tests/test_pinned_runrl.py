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
