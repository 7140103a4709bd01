"""`hybridmoe calibrate`'s arithmetic and measurements (the chip runs them; here the CPU, at small
sizes, shows they run and what they compute)."""

import math

import pytest

from hybridmoe.tools import calibrate


def test_a_kernels_factor_is_what_is_left_of_the_measured_time_over_its_modelled_time():
    # The model: two kernels (2 and 1 ms) and 2 ms of other ops, 5 ms in all. Measured 8 ms: the other
    # ops are taken as modelled, so the kernels took 6 ms where the model said 3: a factor of 2 for both.
    estimate = {"kernels": {"gdn_fwd": {"s": 2e-3}, "gdn_bwd": {"s": 1e-3}}, "serial": {"step_s": 5e-3}}
    assert calibrate.kernel_factor(8e-3, estimate) == pytest.approx({"gdn_fwd": 2.0, "gdn_bwd": 2.0})
    # faster than the model's other ops alone: the kernels cost nothing measurable, not a negative time
    assert calibrate.kernel_factor(1e-3, estimate) == {"gdn_fwd": 0.0, "gdn_bwd": 0.0}
    assert calibrate.kernel_factor(8e-3, {"kernels": {}, "serial": {"step_s": 5e-3}}) == {}


def test_the_measurements_run_and_give_rates_and_costs():
    flops = calibrate.matmul_flops_per_s(256, repeats=3)
    hbm = calibrate.hbm_bytes_per_s(2**22, repeats=3)
    per_op = calibrate.op_overhead_s(4000, repeats=5)
    per_step = calibrate.grid_step_s(64, hbm, interpret=True, repeats=3)
    assert all(math.isfinite(v) and v >= 0 for v in (flops, hbm, per_op, per_step))
    assert flops > 1e8 and hbm > 1e7  # any CPU multiplies 256^3 and streams 4 MiB faster than this
    # the grid step's own cost is what is left after its bytes: never negative, and a chain of 4,000 ops
    # costs more than one
    assert per_step >= 0 and per_op > 0


def test_calibrate_refuses_a_host_without_an_accelerator_row(capsys):
    from hybridmoe.cli import main

    assert main(["calibrate", "--dry-run"]) == 2
    assert "calibrate measures a TPU" in capsys.readouterr().err


def test_kernel_factors_time_each_pallas_backend_against_its_modelled_program(monkeypatch):
    """The grouped-matmul case at the tiny geometry, interpreted. On a CPU the kernels run as
    interpreted jnp, with no Mosaic call for the model to scale, so the model is stood in for by one
    that names a kernel of 1 us in a 1 us program: its factor is then the measured time over 1 us,
    taken from a Pallas backend's run (the XLA backends are not calibrated)."""
    from hybridmoe.analysis import step_estimate
    from hybridmoe.analysis.hardware import MAKERS

    texts = []

    def model(text, hw, **kw):
        texts.append(text)
        return {"kernels": {"gmm": {"s": 1e-6}}, "serial": {"step_s": 1e-6}}

    monkeypatch.setattr(step_estimate, "estimate", model)
    got = calibrate.kernel_factors(MAKERS["v5e"], "tiny", interpret=True, repeats=1, families=("gmm",))
    assert set(got) == {"gmm"} and got["gmm"]["case"] == "gmm_tiny" and got["gmm"]["backend"].startswith("pallas")
    assert got["gmm"]["factor"] == pytest.approx(got["gmm"]["measured_s"] / 1e-6)
    assert texts and all("HloModule" in t for t in texts)  # each backend's compiled program was read


def test_the_per_op_cost_is_the_chains_time_per_launch_added(monkeypatch):
    """The timer stubbed: a call of the chain costs 50 us of its own plus 3 us per op launched, so
    2000 ops take 6050 us and 500 take 1550: (6050 - 1550) / 1500 = 3 us per op. A chain whose time
    does not grow with its length is refused, not written as a free op (the chip's 0.00 us)."""
    import jax.numpy as jnp

    timed = []

    def chain_seconds(fn, x, n, repeats):
        timed.append(int(n))
        return 50e-6 + 3e-6 * int(n)

    monkeypatch.setattr(calibrate, "median_seconds", chain_seconds)
    assert calibrate.op_overhead_s(2000) == pytest.approx(3e-6, rel=1e-9)
    assert timed == [2000, 500]
    monkeypatch.setattr(calibrate, "median_seconds", lambda fn, x, n, repeats: 50e-6)
    with pytest.raises(RuntimeError, match="no per-op cost"):
        calibrate.op_overhead_s(2000)
    # the chain is a loop of launches whose trip count is an argument: one op per iteration, unfusable
    text = calibrate.op_chain().lower(jnp.ones((8, 128), jnp.float32), jnp.int32(2)).compile().as_text()
    assert "while" in text


def test_the_per_op_cost_measured_here_is_plausible():
    # A CPU runs a loop iteration of one tiny op in well under a millisecond, and not in no time. 20,000
    # against 5,000 ops: about 20 ms between the two, above a loaded machine's noise (at 400 against 100
    # the difference, about 0.5 ms, once came out negative with the whole suite on two cores).
    assert 0 < calibrate.op_overhead_s(20000, repeats=3) < 1e-3
