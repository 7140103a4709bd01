"""benchmarks/tpu_gmm_prefetch.py end to end on CPU at its tiny shape (interpreted), so the chip's
benchmark of the kernels that copy their own blocks cannot rot between chip sessions: its record's
fields, each kernel's grid-pipelined arm and every new-kernel tiling timed, and every new kernel's
output equal to the grid-pipelined kernel's within bfloat16 rounding (tgmm's row chunks sum in
another order)."""

from __future__ import annotations

import json

from helpers import benchmark_script


def test_tiny_prefetch_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "tpu_gmm_prefetch.json"
    bench = benchmark_script("tpu_gmm_prefetch")
    assert bench.main(["--tiny", "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and "commit" in record and record["interpret"] is True
    assert set(record["kernels"]) == set(bench.KERNELS)
    for name, row in record["kernels"].items():
        arms = row["arms"]
        grid = {"tgmm": bench.TINY_TGMM_GRID, "wi_fused": bench.TINY_FUSED_GRID,
                "wo_fused_dlhs": (32, 64)}.get(row["kind"], bench.TINY_GMM_GRID)
        assert "grid" in arms and len(arms) == 1 + len(grid), (name, list(arms))
        for arm, r in arms.items():
            assert r["uneven"]["ms"] > 0 and "error" not in r, (name, arm, r)
            if arm != "grid":
                assert r["max_rel_diff"] < 1e-2 and r["row_chunk"] == r["tiles"][0], (name, arm, r)
