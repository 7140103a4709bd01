"""benchmarks/tpu_moe_combine.py end to end on CPU at its tiny shape, so the chip's combine benchmark
cannot rot between chip sessions: its record's fields, and every arm's output and gradient equal to
the [T k, D] view's (float32 sums of bfloat16 rows over the same slots; the gradient a permutation)."""

from __future__ import annotations

import json

from helpers import benchmark_script


def test_tiny_combine_runs_end_to_end(tmp_path):
    out = tmp_path / "tpu_moe_combine.json"
    assert benchmark_script("tpu_moe_combine").main(["--shapes", "tiny", "--rounds", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and "commit" in record
    shape = record["shapes"]["tiny"]
    assert (shape["T"], shape["k"], shape["D"]) == (64, 10, 128)
    arms = shape["arms"]
    assert set(arms) == {"view_and_sum", "slot_sum", "slot_sum_gather_backward"}
    for name, r in arms.items():
        assert r["fwd_bwd_ms"] > 0 and ("fwd_ms" in r) == (name != "slot_sum_gather_backward"), (name, r)
        assert r["out_max_rel_diff"] < 1e-2 and r["grad_max_rel_diff"] == 0.0, (name, r)
