"""benchmarks/step_anatomy.py's figures from hand-chosen times: which rounds count, per-step totals,
GFLOP/s, MFU, the step's ratios to the reference and the README's table. The script configures JAX
on import (one CPU device): that is stubbed, so the test process keeps its devices."""

import sys
from pathlib import Path

import pytest

from helpers import benchmark_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def anatomy():
    sys.path.insert(0, str(ROOT))
    import benchmarks.harness as harness

    configure = harness.configure
    harness.configure = lambda *a, **k: None
    try:
        return benchmark_script("step_anatomy")
    finally:
        harness.configure = configure


# (wall, cpu) seconds per round; round 0 warms up (100 s).
OURS = {"moe": [(100.0, 100.0), (2.0, 1.0), (4.0, 3.0), (3.0, 2.0)],
        "moe[ragged_dot]": [(100.0, 100.0), (6.0, 6.0)],
        "rmsnorm": [(0.5, 0.25)],
        "step": [(100.0, 100.0), (1.0, 0.5), (3.0, 1.5), (2.0, 1.0)]}
REF_STEP = [(50.0, 50.0), (4.0, 5.0), (4.0, 5.0), (8.0, 5.0)]
FLOPS = {"moe": 6e9, "gdn": 1e9, "attention": 1e9, "embed_head": 1e9}


def test_anatomy_component_figures_skip_round_zero_and_count_every_instance(anatomy):
    """moe: rounds 1.. 2, 4, 3 s -> median 3 s (CPU 2 s); 4 instances a step: 12 s (CPU 8 s); 6 GFLOP
    in 3 s = 2 GFLOP/s, MFU 2e9 / 4e9 = 0.5. moe[ragged_dot] is a moe: 4 instances, one timed round:
    6 s -> 24 s. rmsnorm: one round only (it is kept), no FLOPs: no rate. step: median 2 s of the
    step's 8 GFLOP: 4 GFLOP/s, MFU 1."""
    got = anatomy.summary(OURS, FLOPS, 8e9, 4e9)
    moe = got["moe"]
    assert (moe["instances"], moe["median_s"], moe["median_cpu_s"]) == (4, 3.0, 2.0)
    assert (moe["all_instances_s"], moe["all_instances_cpu_s"]) == (12.0, 8.0)
    assert moe["flops"] == 6e9
    assert moe["useful_gflops"] == pytest.approx(2.0) and moe["mfu"] == pytest.approx(0.5)
    assert moe["spread_s"]["n"] == 3 and moe["spread_s"]["max"] == 4.0 and moe["spread_cpu_s"]["min"] == 1.0
    assert moe["times_s"] == [100.0, 2.0, 4.0, 3.0] and moe["cpu_times_s"] == [100.0, 1.0, 3.0, 2.0]
    ragged = got["moe[ragged_dot]"]
    assert (ragged["instances"], ragged["median_s"], ragged["all_instances_s"]) == (4, 6.0, 24.0)
    assert ragged["useful_gflops"] == pytest.approx(1.0)
    norm = got["rmsnorm"]
    assert (norm["instances"], norm["median_s"], norm["all_instances_s"]) == (9, 0.5, 4.5)
    assert norm["all_instances_cpu_s"] == 9 * 0.25
    assert norm["flops"] == 0.0 and norm["useful_gflops"] is None and norm["mfu"] is None
    step = got["step"]
    assert (step["median_s"], step["all_instances_s"], step["flops"]) == (2.0, 2.0, 8e9)
    assert step["useful_gflops"] == pytest.approx(4.0) and step["mfu"] == pytest.approx(1.0)


def test_anatomy_instances_per_step_are_smalls_layer_counts(anatomy):
    """`small`: 4 layers, 3 GDN and 1 attention, a MoE in each; two norms per layer and a final one."""
    module = anatomy
    counts = {n: c for n, (c, _) in module.COMPONENTS.items()}
    assert counts == {"gdn": 3, "attention": 1, "moe": 4, "rmsnorm": 9, "embed_head_loss": 1, "optimizer": 1,
                      "step": 1}
    assert module.COMPONENTS["embed_head_loss"][1] == "embed_head" and module.COMPONENTS["rmsnorm"][1] is None


def test_anatomy_step_ratios_are_ours_over_the_reference(anatomy):
    """Medians of rounds 1..: ours 2 s (CPU 1 s), the reference 4 s (CPU 5 s): 0.5 and 0.2. Per round
    1/4, 3/4, 2/8 -> median 0.25 (round 0 left out)."""
    ours = {"step": OURS["step"]}
    ref = {"step": REF_STEP}
    got = anatomy.step_ratios(anatomy.summary(ours, FLOPS, 8e9, 4e9), anatomy.summary(ref, FLOPS, 8e9, 4e9), ours, ref)
    assert got["step_time_ratio"] == pytest.approx(0.5)
    assert got["step_cpu_time_ratio"] == pytest.approx(0.2)
    per_round = got["step_time_ratio_per_round"]
    assert per_round["n"] == 3 and per_round["median"] == pytest.approx(0.25) and per_round["max"] == pytest.approx(0.75)


def test_anatomy_markdown_rows_are_milliseconds_of_all_instances_and_ours_over_reference(anatomy):
    """moe: 12 s = 12000.0 ms ours, the reference 4 x 1 s = 4000.0 ms: ratio 3.00; CPU 8 s over
    4 x 0.5 s: 4.00; GFLOP/s 2.0 and 6.0."""
    ours = anatomy.summary({"moe": OURS["moe"]}, FLOPS, 8e9, 4e9)
    ref = anatomy.summary({"moe": [(9.0, 9.0), (1.0, 0.5)]}, FLOPS, 8e9, 4e9)
    table = anatomy.format_markdown({"ours": ours, "reference": ref})
    assert table.splitlines()[2] == "| moe (4) | 12000.0 | 4000.0 | 3.00 | 4.00 | 2.0 | 6.0 |"
    alone = anatomy.format_markdown({"ours": ours})
    assert alone.splitlines()[2] == "| moe (4) | 12000.0 | - | - | - | 2.0 | - |"


def test_anatomy_main_uses_the_larger_matmul_peak_and_records_both_sides(anatomy, monkeypatch):
    """Each of ours' calls takes 2 s (1 s of CPU), each of the reference's 4 s (its worker's figures, CPU
    4 s too: CPU ratio 0.25); JAX's peak
    4 GFLOP/s, torch's 5: MFU is against 5. The step's 20 GFLOP in 2 s: 10 GFLOP/s, MFU 2; ratio 0.5.
    3 rounds: 3 loads recorded, round 0 left out of the medians."""
    from types import SimpleNamespace

    clock = {"t": 0.0, "cpu": 0.0}

    def call():
        clock["t"] += 2.0
        clock["cpu"] += 1.0

    monkeypatch.setattr(anatomy, "time", SimpleNamespace(perf_counter=lambda: clock["t"],
                                                         process_time=lambda: clock["cpu"]))
    monkeypatch.setattr(anatomy, "pin", lambda cores: None)
    monkeypatch.setattr(anatomy, "jax_components", lambda o: ({"step": call, "moe": call}, {"batch": 4, "seq_len": 512}))

    class Ref:
        info = {"side": "reference"}

        def __init__(self, python, threads):
            pass

        def round(self):
            return {"step": [4.0, 4.0], "moe": [4.0, 4.0]}

        def peak(self):
            return 5e9

        def close(self):
            pass

    monkeypatch.setattr(anatomy, "HFWorker", Ref)
    monkeypatch.setattr(anatomy, "measure_peak_flops", lambda mesh, dtype: 4e9)
    at_shape = lambda b, t: (b, t) == (4, 512)  # noqa: E731 - the FLOPs are of the timed shape
    monkeypatch.setattr(anatomy, "component_flops", lambda m, b, t: {"moe": 8e9 if at_shape(b, t) else 0.0,
                                                                      "gdn": 1.0, "attention": 1.0, "embed_head": 1.0})
    monkeypatch.setattr(anatomy, "step_flops", lambda cfg, b, t: 20e9 if at_shape(b, t) else 1.0)
    records = []
    monkeypatch.setattr(anatomy.harness, "write", lambda out, name, **rec: records.append(rec) or rec)
    monkeypatch.setattr(sys, "argv", ["step_anatomy.py", "--hf-python", "py", "--rounds", "3"])
    anatomy.main()
    (rec,) = records
    assert rec["matmul_peak_flops"] == {"jax": 4e9, "torch": 5e9} and rec["peak_used"] == 5e9
    step = rec["ours"]["step"]
    assert step["median_s"] == 2.0 and step["useful_gflops"] == pytest.approx(10.0) and step["mfu"] == pytest.approx(2.0)
    assert rec["ours"]["moe"]["all_instances_s"] == 8.0 and rec["reference"]["moe"]["all_instances_s"] == 16.0
    assert rec["step_time_ratio"] == pytest.approx(0.5) and rec["step_flops"] == 20e9
    assert step["median_cpu_s"] == 1.0 and rec["step_cpu_time_ratio"] == pytest.approx(0.25)
    assert rec["ours"]["moe"]["useful_gflops"] == pytest.approx(4.0)
    assert len(rec["load_average_per_round"]) == 3 and len(step["times_s"]) == 3
