"""The step-time model's hardware (analysis/hardware.py): the makers' rows, a chip's measurements
over them, how an estimate charges them, and which row a device or target takes."""

import json

import pytest

from hybridmoe.analysis import hardware as hwmod
from hybridmoe.analysis import step_estimate as se
from hybridmoe.analysis.hlo_cost import OpCost

from helpers import HandMadeEstimator

ROW = {"bf16_flops_chip": 160e12, "hbm_bytes_per_s_chip": 800e9, "grid_step_s": 1e-6, "op_overhead_s": 2e-6,
       "kernel_factors": {"gdn_chunk_forward": 3.0},
       "measured": {"device": "TPU v5 lite", "commit": "0123456789abcdef", "date": "2026-12-05"}}


class _Ops(HandMadeEstimator):
    """An Estimator that yields the hand-made ops below instead of walking a program."""

    def __init__(self, text, apply_trip_counts=True):
        self.unknown_trips = []

    def ops(self):
        return [(OpCost("dense matmuls", flops=1.6e9, useful_flops=1.6e9, bytes=4e6), 10.0),
                (OpCost("GDN", flops=0.8e9, useful_flops=0.8e9, bytes=8e6, grid_steps=20, kernel="gdn_chunk_forward"), 1.0),
                (OpCost("collectives", collective="all-gather", wire_bytes=1e6), 1.0)]


def test_an_estimate_charges_the_measured_rates_fixed_costs_and_kernel_factor(monkeypatch):
    monkeypatch.setattr(se, "Estimator", _Ops)
    hw = hwmod.calibrated(hwmod.MAKERS["v5e"], ROW)
    e = se.estimate("", hw, tokens_per_step=1000, chips=1, devices=1)
    # the dot: max(1.6e9 / 160e12 = 10 us, 4e6 / 800e9 = 5 us) + 2 us per launch, 10 times = 120 us
    assert e["categories"]["dense matmuls"]["s"] == pytest.approx(120e-6)
    # the kernel: (max(5 us, 10 us) + 20 grid steps x 1 us) x its measured/modelled 3 + 2 us = 92 us
    assert e["categories"]["GDN"]["s"] == pytest.approx(92e-6)
    # the gather: 1e6 wire bytes over v5e's links (the maker's 100 GB/s one way; not measured) = 10 us
    assert e["categories"]["collectives"]["s"] == pytest.approx(10e-6)
    assert e["serial"]["step_s"] == pytest.approx(222e-6) and e["overlapped"]["step_s"] == pytest.approx(212e-6)
    assert "measured on TPU v5 lite at 0123456789" in se.format_estimate(e)
    # the maker's row charges neither fixed cost per op nor a kernel factor: 10 x 10 us + (10 + 20 x 0.35) us
    maker = se.estimate("", hwmod.MAKERS["v5e"], tokens_per_step=1000, chips=1, devices=1)
    assert maker["categories"]["GDN"]["s"] == pytest.approx(max(0.8e9 / 197e12, 8e6 / 819e9) + 20 * 0.35e-6)
    assert maker["categories"]["dense matmuls"]["s"] == pytest.approx(10 * max(1.6e9 / 197e12, 4e6 / 819e9))


class _UntimedKernels(_Ops):
    """The same GDN op as the CP pass-1 kernel (a proxy's), and one kernel with neither factor nor proxy."""

    def ops(self):
        return [(OpCost("GDN", flops=0.8e9, useful_flops=0.8e9, bytes=8e6, grid_steps=20, kernel="gdn_cp_transition"), 1.0),
                (OpCost("GDN", flops=0.8e9, useful_flops=0.8e9, bytes=8e6, grid_steps=20, kernel="unknown_kernel"), 1.0)]


def test_a_kernel_no_case_timed_takes_its_proxys_factor_and_the_estimate_says_so(monkeypatch):
    """gdn_cp_transition shares gdn_chunk_forward's body: at its factor 3 (92 us as above); a kernel
    with no factor and no proxy stays at the bare model (10 + 20 = 30 us, + 2 us per launch); the
    printed estimate names both."""
    monkeypatch.setattr(se, "Estimator", _UntimedKernels)
    hw = hwmod.calibrated(hwmod.MAKERS["v5e"], ROW)
    assert hw.kernel_factor("gdn_cp_transition") == 3.0 and hw.factor_source("gdn_cp_transition") == "gdn_chunk_forward"
    assert hw.kernel_factor("gdn_chunk_forward") == 3.0 and hw.factor_source("gdn_chunk_forward") == "gdn_chunk_forward"
    assert hw.kernel_factor("unknown_kernel") == 1.0 and hw.factor_source("unknown_kernel") is None
    e = se.estimate("", hw, tokens_per_step=1000, chips=1, devices=1)
    assert e["kernels"]["gdn_cp_transition"]["s"] == pytest.approx(92e-6)
    assert e["kernels"]["unknown_kernel"]["s"] == pytest.approx(32e-6)
    text = se.format_estimate(e)
    assert "gdn_cp_transition at gdn_chunk_forward's" in text and "(the bare model): unknown_kernel" in text


def test_the_calibration_table_is_written_whole_and_keeps_other_generations(tmp_path):
    path = tmp_path / "chip_calibration.json"
    hwmod.write_calibration("v6e", {**ROW, "bf16_flops_chip": 800e12}, path)
    hwmod.write_calibration("v5e", ROW, path)
    table = json.loads(path.read_text())
    assert set(table) == {"v5e", "v6e"} and table["v6e"]["bf16_flops_chip"] == 800e12
    assert [p.name for p in tmp_path.iterdir()] == ["chip_calibration.json"]  # no temporary left behind
    with pytest.raises(ValueError, match="op_overhead_s"):
        hwmod.write_calibration("v5e", {k: v for k, v in ROW.items() if k != "op_overhead_s"}, path)
    with pytest.raises(ValueError, match="no maker's row"):
        hwmod.write_calibration("v9", ROW, path)
    assert json.loads(path.read_text()) == table  # a refused row leaves the table as it was
    hw = hwmod.hardware_for("v5e:2x2", table=table)
    assert (hw.bf16_flops_chip, hw.hbm_bytes_per_s_chip, hw.op_overhead_s) == (160e12, 800e9, 2e-6)
    assert hw.kernel_factor("gdn_chunk_forward") == 3.0 and hw.kernel_factor("gmm") == 1.0
    assert hw.hbm_bytes_chip == hwmod.MAKERS["v5e"].hbm_bytes_chip  # what was not measured stays the maker's
    assert hwmod.hardware_for("v5e:2x2", table=table, use_calibration=False) == hwmod.MAKERS["v5e"]
    assert hwmod.hardware_for("tpu7x:2x2x1", table=table) == hwmod.MAKERS["tpu7x"]


def test_a_device_and_a_target_take_their_generations_row():
    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    assert [hwmod.generation_of_device(Device(k)) for k in ("TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU7x", "cpu")] \
        == ["v5e", "v5p", "v6e", "tpu7x", None]
    from hybridmoe.tools.train_program import Target

    on_a_v5e_host = Target("tpu:1", "tpu", (Device("TPU v5 lite"),), None)
    assert se.default_hardware(on_a_v5e_host) == "v5e"
    assert se.default_hardware(Target("v6e:2x2", "tpu", (Device("TPU v6 lite"),) * 4, None)) == "v6e"
    assert se.default_hardware(Target("cpu:8", "cpu", (Device("cpu"),) * 8, None)) is None
    for gen in ("v5e", "v5p", "v6e"):  # every TPU row states a full set of figures
        row = hwmod.MAKERS[gen]
        assert row.bf16_flops_chip > 0 and row.hbm_bytes_per_s_chip > 0 and row.link_bytes_per_s_chip > 0


def test_the_makers_rows_per_device_are_the_published_figures_over_the_devices_of_a_chip():
    """Each row's per-device rates from the figures its comment cites: TPU7x 2,307 TFLOP/s bf16 and
    4,614 fp8, 7,380 GB/s, 600 GB/s of links each way, over two devices; v5e 197 TFLOP/s, 819 GB/s and
    1,600 Gbit/s bidirectional (100 GB/s each way) on one; H200 989 TFLOP/s, 4.8 TB/s, 450 GB/s."""
    per_device = lambda hw: (hw.bf16_flops, hw.fp8_flops, hw.hbm_bytes_per_s, hw.link_bytes_per_s)  # noqa: E731
    assert per_device(hwmod.MAKERS["tpu7x"]) == (1153.5e12, 2307e12, 3690e9, 300e9)
    assert per_device(hwmod.MAKERS["v5e"]) == (197e12, 197e12, 819e9, 100e9)
    assert per_device(hwmod.MAKERS["h200"]) == (989e12, 1979e12, 4800e9, 450e9)
    assert hwmod.MAKERS["tpu7x"].hbm_bytes_chip == 192 * 2**30 and hwmod.MAKERS["h200"].hbm_bytes_chip == 141e9
    # A target names its row: a TPU topology by its generation, a GPU with or without "gpu:".
    for target, gen in (("tpu7x:2x2x1", "tpu7x"), ("v5e:2x2", "v5e"), ("h200", "h200"), ("gpu:h200", "h200"),
                        ("gpu:h100", "h100")):
        assert hwmod.hardware_for(target, use_calibration=False) == hwmod.MAKERS[gen], target
    with pytest.raises(ValueError, match="no hardware figures for target 'gpu:b200'"):
        hwmod.hardware_for("gpu:b200")


class _Blocks(HandMadeEstimator):
    """An Estimator whose program is `text` layer blocks of one dense matmul and one GDN kernel call
    each, and one all-gather outside the layer loop (the trip count of the two is the block count)."""

    F = 1153.5e12  # one second of a TPU7x device's bf16 peak

    def __init__(self, text, apply_trip_counts=True):
        self.blocks, self.unknown_trips = int(text), []

    def ops(self):
        return [(OpCost("dense matmuls", flops=self.F, useful_flops=self.F, bytes=1e6), float(self.blocks)),
                (OpCost("GDN", flops=self.F / 2, useful_flops=self.F / 2, bytes=1e6, grid_steps=1e6,
                        kernel="gdn_chunk_forward"), float(self.blocks)),
                (OpCost("collectives", collective="all-gather", wire_bytes=300e9), 1.0)]


def test_an_estimate_extrapolated_over_depth_by_hand(monkeypatch):
    """inspect --layers: estimates at 8 and 12 layers (2 and 3 blocks of 4) on TPU7x's row, taken to 60
    layers (15 blocks). A block: the matmul 1 s (1153.5 TFLOP at 1153.5 TFLOP/s a device), the GDN
    kernel 0.5 s + 1e6 grid steps x 0.35 us = 0.85 s; the all-gather once: 300 GB over 300 GB/s a
    device = 1 s. At 15 blocks: matmuls 15 s, GDN 12.75 s (15 calls, 1.5e7 grid steps), collectives
    1 s; serial 28.75 s, overlapped 27.75 s; 4096 tokens over 4 chips: 4096 / 28.75 / 4 = 35.62 and
    4096 / 27.75 / 4 = 36.90 tokens/s per chip. The model's 13.875 s of peak work a device: MFU
    13.875 / 27.75 = 0.5 overlapped (against a device's peak, half the chip's), 13.875 / 28.75 serial."""
    from hybridmoe.tools import depth

    monkeypatch.setattr(se, "Estimator", _Blocks)
    hw = hwmod.MAKERS["tpu7x"]
    est = {layers: se.estimate(str(layers // 4), hw, tokens_per_step=4096, chips=4, devices=8)
           for layers in (8, 12)}
    model = 13.875 * _Blocks.F
    e = depth.extrapolate_estimate(est, 4, 60, model)
    assert e["categories"]["dense matmuls"]["s"] == pytest.approx(15.0)
    assert e["categories"]["GDN"]["s"] == pytest.approx(12.75)
    assert e["categories"]["collectives"]["s"] == pytest.approx(1.0)
    assert (e["kernels"]["gdn_chunk_forward"]["calls"], e["kernels"]["gdn_chunk_forward"]["grid_steps"]) == \
        pytest.approx((15, 1.5e7))
    assert e["serial"]["step_s"] == pytest.approx(28.75) and e["overlapped"]["step_s"] == pytest.approx(27.75)
    assert e["serial"]["tokens_per_s_per_chip"] == pytest.approx(4096 / 28.75 / 4)
    assert e["overlapped"]["mfu"] == pytest.approx(0.5) and e["serial"]["mfu"] == pytest.approx(13.875 / 28.75)
    assert (e["layers"], e["extrapolated_from_layers"]) == (60, [8, 12])
    # The printed assumptions are a device's: half the chip's 2,307 TFLOP/s, 7,380 GB/s and 600 GB/s.
    assert "bf16 1154 TFLOP/s, HBM 3690 GB/s, links 300 GB/s per device" in se.format_estimate(e)
    assert "MFU 50.0%" in se.format_estimate(e)


@pytest.mark.tpu_compile
def test_inspect_names_a_topology_the_compiler_refuses_in_one_line(capsys):
    from hybridmoe.cli import main

    assert main(["inspect", "recipe=tiny", "--target", "v5e:1x1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hybridmoe")]
    assert len(err) == 1 and "'v5e:1x1'" in err[0] and "v5e:2x2" in err[0], err


def test_a_generation_without_a_chip_is_calibrated_by_anothers_fractions_of_its_maker(monkeypatch):
    """--calibration-from v5e on tpu7x: tpu7x's maker rates times the fractions of v5e's maker rates
    the v5e chip reached (ROW: 160 of 197 TFLOP/s, 800 of 819 GB/s), v5e's fixed costs and kernel
    factors as measured, tpu7x's links as the maker gives them; refused where the target has its own
    row or the source has none."""
    maker, v5e = hwmod.MAKERS["tpu7x"], hwmod.MAKERS["v5e"]
    hw = hwmod.hardware_for("tpu7x:4x4x8", table={"v5e": ROW}, calibration_from="v5e")
    assert hw.bf16_flops_chip == pytest.approx(maker.bf16_flops_chip * 160e12 / v5e.bf16_flops_chip)
    assert hw.fp8_flops_chip == pytest.approx(maker.fp8_flops_chip * 160e12 / v5e.bf16_flops_chip)
    assert hw.hbm_bytes_per_s_chip == pytest.approx(maker.hbm_bytes_per_s_chip * 800e9 / v5e.hbm_bytes_per_s_chip)
    assert (hw.grid_step_s, hw.op_overhead_s, hw.kernel_factor("gdn_chunk_forward")) == (1e-6, 2e-6, 3.0)
    assert hw.link_bytes_per_s_chip == maker.link_bytes_per_s_chip and hw.devices_per_chip == maker.devices_per_chip
    assert hw.measured["carried_from"] == "v5e" and hw.measured["device"] == "TPU v5 lite"
    assert hwmod.hardware_for("tpu7x:4x4x8", table={"v5e": ROW}) == maker  # only when asked
    with pytest.raises(ValueError, match="has its own calibration row"):
        hwmod.hardware_for("v5e:2x2", table={"v5e": ROW}, calibration_from="v5e")
    with pytest.raises(ValueError, match="has no v5p row"):
        hwmod.hardware_for("tpu7x:4x4x8", table={"v5e": ROW}, calibration_from="v5p")
    monkeypatch.setattr(se, "Estimator", _Ops)
    e = se.estimate("", hw, tokens_per_step=1, chips=1, devices=1)
    assert "fractions a v5e chip reached" in se.format_estimate(e)


def test_inspect_refuses_a_calibration_source_without_a_row_before_compiling(capsys):
    from hybridmoe.cli import main

    assert main(["inspect", "recipe=tiny", "--target", "cpu:8", "--calibration-from", "v5e"]) == 2
    assert "--calibration-from calibrates the estimate for a TPU --target or an --estimate-for" in capsys.readouterr().err
