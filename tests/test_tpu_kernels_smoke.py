"""benchmarks/tpu_kernels.py end to end on CPU (interpret mode, the tiny grouped matmul), so the chip's
kernel benchmark cannot rot between chip sessions: its record's fields, the useful FLOPs and
TFLOP/s against the hand-computed count, every backend within bf16 rounding of the reference."""

from __future__ import annotations

import json

import pytest

from helpers import SteppingClock, benchmark_script


def _benchmark():
    return benchmark_script("tpu_kernels")


def test_tiny_grouped_matmul_runs_end_to_end(tmp_path):
    out = tmp_path / "tpu_kernels.json"
    assert _benchmark().main(["--tiny", "--only", "gmm_tiny", "--rounds", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and "commit" in record and record["ceiling_tflops"] > 0
    rows = record["kernels"]["gmm_tiny"]
    # tiny: 200 rows x 256 -> 256 over 5 groups: 2 M K N = 26,214,400 forward, 3x with the backward.
    fwd_flops, both_flops = 2 * 200 * 256 * 256, 3 * 2 * 200 * 256 * 256
    assert record["cases"]["gmm_tiny"]["flops_fwd"] == fwd_flops
    skipped = record["cases"]["gmm_tiny"]["skipped"]
    assert set(rows) | set(skipped) == {"ragged_dot", "pallas_tpu", "pallas_tpu_128", "pallas_tpu_table",
                                        "pallas_tpu_aligned_16", "tokamax"}
    for backend in ("ragged_dot", "pallas_tpu", "pallas_tpu_128", "pallas_tpu_table", "pallas_tpu_aligned_16"):
        r = rows[backend]
        assert "error" not in r, r
        assert r["ms"] == r["fwd_bwd_ms"] > 0 and r["fwd_ms"] > 0
        assert abs(r["tflops"] * r["ms"] * 1e9 - both_flops) < 1e-6 * both_flops
        assert abs(r["fwd_tflops"] * r["fwd_ms"] * 1e9 - fwd_flops) < 1e-6 * fwd_flops
        # bf16 outputs and gradients: within a few roundings (2^-8) of the float32 reference.
        assert 0 < r["fwd_rel_err"] < 1e-2 and 0 < r["rel_err"] < 1e-2, r


def test_the_matmul_ceiling_is_2_n_cubed_flops_over_the_median_call(monkeypatch):
    benchmark = _benchmark()
    monkeypatch.setattr(benchmark, "time", SteppingClock(0.5))  # every timed call: 0.5 s
    assert benchmark.matmul_ceiling_tflops(8, repeats=3) == 2 * 8**3 / 0.5 / 1e12


def test_interleaved_records_one_calls_time_per_round(monkeypatch):
    """With several calls per round, each round's figure is the mean call: the round's time over reps."""
    benchmark = _benchmark()
    harness = benchmark.harness
    calls = []
    # The clock moves 2 s between a round's two readings (the CPU clock 1 s), the round 3 calls.
    monkeypatch.setattr(harness, "time", SteppingClock(2.0, 1.0))
    times = harness.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2, reps=3)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3  # the order rotated in the second round
    assert times == {name: {"wall_s": [2.0 / 3, 2.0 / 3], "cpu_s": [1.0 / 3, 1.0 / 3]} for name in ("a", "b")}


def test_a_cases_milliseconds_are_its_median_wall_time(monkeypatch):
    """A stub case (one backend, a jitted doubling) with harness.interleaved stubbed: the forward's
    wall times 3, 1, 2 ms (median 2), the forward+backward's 9, 5, 6 ms (median 6), every CPU time
    0.01 ms. 6 and 30 GFLOP: 3 TFLOP/s forward, 5 forward and backward."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    benchmark = _benchmark()
    x = jnp.arange(4.0)
    double = jax.jit(lambda a: 2 * a)
    built = SimpleNamespace(fwd=(double, (x,)), fwd_bwd=(double, (x,)), restore=lambda out, backward: out)
    case = SimpleNamespace(name="stub", shape=(4,), flops=(6e9, 30e9), skipped={},
                           reference=lambda: SimpleNamespace(fwd=2 * x, fwd_bwd=2 * x), make_inputs=lambda: None,
                           backends={"stub": lambda inputs: built}, view=lambda result, backward: result)
    walls = iter(([3e-3, 1e-3, 2e-3], [9e-3, 5e-3, 6e-3]))  # the forward's round, then forward+backward's

    def interleaved(calls, rounds):
        return {name: {"wall_s": next(walls), "cpu_s": [1e-5] * 3} for name in calls}

    monkeypatch.setattr(benchmark.harness, "interleaved", interleaved)
    rows, _ = benchmark.run_case(case, 3, lambda *a: None)
    r = rows["stub"]
    assert r["fwd_ms"] == pytest.approx(2.0, rel=1e-12) and r["fwd_bwd_ms"] == r["ms"] == pytest.approx(6.0, rel=1e-12)
    assert r["fwd_tflops"] == pytest.approx(3.0, rel=1e-12) and r["tflops"] == pytest.approx(5.0, rel=1e-12)


def test_device_ops_name_the_heaviest_ops_of_a_program():
    """--profile-ops on CPU: a 512^3 matmul beside an add on 512 floats. The heaviest op is the
    matmul's instruction in the model's category for it, rows come heaviest first, `top` bounds them
    and the rest's time is kept apart (the parts add up to what was traced)."""
    import jax
    import jax.numpy as jnp

    from hybridmoe.analysis.hlo_cost import Estimator

    a = jnp.ones((512, 512), jnp.float32)
    compiled = jax.jit(lambda x, y: (x @ x, y + 1)).lower(a, a[0]).compile()
    traced = _benchmark().device_ops(compiled, (a, a[0]), calls=2, top=1)
    assert len(traced["ops"]) == 1
    heaviest = traced["ops"][0]
    categories = {name: c.category for name, c, _ in Estimator(compiled.as_text()).named_ops()}
    dots = [name for name, c, _ in Estimator(compiled.as_text()).named_ops() if c.flops >= 2 * 512**3]
    assert heaviest["op"] in dots and heaviest["category"] == categories[heaviest["op"]], (traced, dots)
    assert heaviest["ms"] > traced["other_ms"] >= 0
    assert traced["traced_ms"] == pytest.approx(heaviest["ms"] + traced["other_ms"], rel=1e-9)
