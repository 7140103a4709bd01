"""Figures of the analysis modules pinned against numbers worked out by hand: the itemised peak
(analysis/peak_memory.py), the device's refusal (device_refusal.py), the hardware rows and their
calibration (hardware.py), the step estimate's accumulation and table (step_estimate.py) and what
analysis/program.py reads from a compiled program's text and buffer assignment. Everything runs on
hand-written inputs and small fakes; nothing compiles."""

from __future__ import annotations

import os
import types

import pytest

from hybridmoe.analysis import device_refusal as dr
from hybridmoe.analysis import hardware as hwmod
from hybridmoe.analysis import peak_memory as pm
from hybridmoe.analysis import program
from hybridmoe.analysis import step_estimate as se
from hybridmoe.analysis.hlo_cost import OpCost
from hybridmoe.analysis.program import LiveBuffer

GIB, MIB = 2**30, 2**20

# ---------------------------------------------------------------------------------------------
# analysis/peak_memory.py

# D 16, F 4 (2F 8), 3 experts; the parameter shapes below; 5 blocks.
SHAPES = pm.ModelShapes(16, 4, 3, frozenset({(3, 16, 8), (16, 16), (7, 16), (2, 7, 9)}), num_blocks=5)


def _buf(shape, op_name="", nbytes=100, storage="temp"):
    return LiveBuffer("v", nbytes, shape, op_name, "c", None, storage)


def test_dims_drop_ones_and_a_tuple_has_none():
    assert pm.dims_of("bf16[15,1,16384,4096]") == (15, 16384, 4096)
    assert pm.dims_of("f32[]") == ()
    assert pm.dims_of("tuple") is None and pm.dims_of("(f32[2], f32[3])") is None


def test_expert_weights_are_rank_three_ending_in_d_and_f_or_twice_f_either_way():
    for dims in [(3, 16, 4), (3, 16, 8), (3, 4, 16), (3, 8, 16), (2, 3, 16, 8)]:
        assert SHAPES.expert_weight_like(dims), dims
    for dims in [(16, 4), (16, 8), (3, 16, 12), (3, 12, 16), (3, 16, 16), (3, 4, 4)]:
        assert not SHAPES.expert_weight_like(dims), dims
    # A parameter's shape of rank >= 3 counts only with `shards`; rank 2 never.
    shard_like = pm.ModelShapes(16, 4, 3, frozenset({(3, 5, 7), (5, 7)}))
    assert shard_like.expert_weight_like((3, 5, 7), shards=True)
    assert not shard_like.expert_weight_like((3, 5, 7))
    assert not shard_like.expert_weight_like((5, 7), shards=True)


def test_the_innermost_named_scope_of_an_op_wins():
    assert pm.innermost_scope("jit(step)/micro_batches/layers/moe/dot_general") == "moe"
    assert pm.innermost_scope("jit(step)/transpose(jvp(layers))/attention/mul") == "attention"
    assert pm.innermost_scope("jit(step)/add") is None
    # An argument's name is no op's: nothing counts there.
    assert pm.innermost_scope("state['params']['blocks'][0]['moe']['wi']") is None


@pytest.mark.parametrize("shape, op_name, expected", [
    ("f32[3,16,8]", "jit(s)/layers/moe/dot", pm.EXPERT_WEIGHTS),
    ("f32[7,16]", "jit(s)/layers/moe/dot", pm.MOE_ROWS),          # a row buffer of the MoE block
    ("f32[3,16,8]", "jit(s)/layers/layer_weights/convert", pm.EXPERT_WEIGHTS),
    ("f32[7,16]", "jit(s)/layers/layer_weights/convert", pm.OTHER),  # a dense weight at use
    ("f32[2,7,9]", "jit(s)/layers/moe/reduce_scatter", pm.EXPERT_WEIGHTS),  # a parameter shard's gradient
    ("f32[2,7,9]", "jit(s)/layers/layer_weights/convert", pm.OTHER),  # not expert-shaped: shape alone tells
    ("f32[7,16]", "jit(s)/layers/attention/dot", pm.ATTENTION),
    ("f32[7,16]", "jit(s)/layers/gdn/dot", pm.GDN),
    ("f32[7,16]", "jit(s)/lm_head/dot", pm.LM_HEAD),
    ("f32[7,9]", "jit(s)/optimizer/mul", pm.GRADIENTS),
    ("f32[16,16]", "jit(s)/transpose(jvp(layers))/add", pm.GRADIENTS),  # the backward's gradient stack
    ("f32[16,16]", "jit(s)/layers/add", pm.RESIDUALS),                  # the forward's saved stack
    ("f32[7,9]", "jit(s)/transpose(jvp(layers))/add", pm.RESIDUALS),    # not parameter-shaped
    ("f32[5,7,9]", "jit(s)/while", pm.RESIDUALS),   # leading dim = the 5 blocks, outside every scope
    ("f32[4,7,9]", "jit(s)/while", pm.OTHER),       # a leading dim other than the blocks: no stack
    ("f32[16,16]", "jit(s)/add", pm.GRADIENTS),     # a parameter's shape outside the model's parts
    ("f32[7,9]", "jit(s)/add", pm.OTHER),
    ("f32[5]", "jit(s)/add", pm.OTHER),             # rank 1 of length num_blocks is no stack
])
def test_each_buffer_counts_to_the_category_of_its_scope_and_shape(shape, op_name, expected):
    assert pm.category(_buf(shape, op_name), SHAPES) == expected


def test_a_per_block_stack_shaped_like_a_parameter_is_a_gradient():
    shapes = pm.ModelShapes(16, 4, 3, frozenset({(5, 7, 9)}), num_blocks=5)
    assert pm.category(_buf("f32[5,7,9]", "jit(s)/while"), shapes) == pm.GRADIENTS
    one_block = pm.ModelShapes(16, 4, 3, frozenset(), num_blocks=1)
    assert pm.category(_buf("f32[1,7,9]", "jit(s)/while"), one_block) == pm.OTHER


def test_itemise_sums_temporaries_by_category_largest_shapes_first():
    bufs = [_buf("f32[3,16,8]", "jit(s)/layers/moe/dot", 300),
            _buf("f32[3,16,8]", "jit(s)/layers/moe/dot", 300),
            _buf("f32[3,16,4]", "jit(s)/layers/moe/dot", 200),
            _buf("f32[3,4,16]", "jit(s)/layers/moe/dot", 500),
            _buf("f32[3,8,16]", "jit(s)/layers/moe/dot", 50),
            _buf("f32[7,16]", "jit(s)/layers/attention/dot", 40),
            _buf("f32[7,16]", "jit(s)/layers/attention/dot", 1000, storage="argument"),  # not a temporary
            _buf("f32[7,16]", "jit(s)/layers/attention/dot", 1000, storage="on-chip")]
    out = pm.itemise(bufs, SHAPES, temp_bytes=2000)
    # Attention listed after expert weights (CATEGORIES order), whatever the bytes.
    assert [r["category"] for r in out["categories"]] == [pm.EXPERT_WEIGHTS, pm.ATTENTION]
    experts = out["categories"][0]
    assert experts["bytes"] == 300 + 300 + 200 + 500 + 50 and experts["buffers"] == 5
    # Top three shapes by bytes summed: [3,16,8] 600 (2 buffers), [3,4,16] 500, [3,16,4] 200.
    assert experts["largest"] == [{"shape": "f32[3,16,8]", "bytes": 600, "count": 2},
                                  {"shape": "f32[3,4,16]", "bytes": 500, "count": 1},
                                  {"shape": "f32[3,16,4]", "bytes": 200, "count": 1}]
    assert out["categories"][1]["bytes"] == 40 and out["categories"][1]["buffers"] == 1
    assert out["itemised"] == 1390 and out["temp"] == 2000
    assert out["heap_gaps"] == 2000 - 1390
    assert out["share"] == 0.695  # 1390 / 2000
    unknown = pm.itemise(bufs, SHAPES, temp_bytes=None)
    assert unknown["share"] is None and unknown["heap_gaps"] is None and unknown["itemised"] == 1390


def test_heap_share_rounds_to_four_places_and_needs_a_positive_heap():
    assert pm.heap_share({"itemised": 1}, {"default_space": 7, "argument": 1}) == 0.1667  # 1 / 6
    assert pm.heap_share({"itemised": 3}, {"default_space": 10}) == 0.3  # no arguments: all heap
    assert pm.heap_share({"itemised": 3}, {"default_space": 4, "argument": 4}) is None
    assert pm.heap_share({"itemised": 3}, {"argument": 4}) is None
    assert pm.heap_share(None, {"default_space": 10}) is None


def test_the_itemised_listing_prints_each_category_in_the_unit_with_its_share():
    peak = {"categories": [{"category": pm.MOE_ROWS, "bytes": 3 * MIB, "buffers": 2,
                            "largest": [{"shape": "f32[4]", "bytes": 3 * MIB, "count": 2}]},
                           {"category": pm.OTHER, "bytes": 1 * MIB, "buffers": 7, "largest": []}],
            "itemised": 4 * MIB, "temp": 5 * MIB, "heap_gaps": 1 * MIB, "share": 0.8, "heap_share": 0.9}
    lines = pm.format_itemised("train", peak, MIB, "MiB")
    assert lines[0] == ("train: the temporaries live at the peak by what made them (per device; 4.00 MiB itemised, "
                        "80.0% of the temporaries' figure, 90.0% of the default memory space's heap)")
    assert lines[1].split() == ["MoE", "rows", "3.00", "MiB", "75.0%", "2", "buffers", "largest:", "2x", "f32[4]"]
    assert lines[2].split()[:5] == ["other", "1.00", "MiB", "25.0%", "7"]
    assert lines[3].split()[:8] == ["(not", "itemised:", "figure", "-", "sum)", "1.00", "MiB", "heap"]
    assert pm.format_itemised("train", {"categories": []}, MIB, "MiB") == []


# ---------------------------------------------------------------------------------------------
# analysis/device_refusal.py


@pytest.mark.parametrize("text, needed, available", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (2.5G) "
     "exceeds available HBM (512M).", int(2.5 * GIB), 512 * MIB),
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 3T of 1.5K hbm.", 3 * 2**40, 1536),
    ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 100B. That was not possible. "
     "There are 7 free.", 100, 7),
    ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.5GiB. That was not possible. "
     "There are 0.25GiB free.", int(1.5 * GIB), GIB // 4),
])
def test_refusal_sizes_in_each_unit(text, needed, available):
    got = dr.device_refusal(text)
    assert (got["needed_bytes"], got["available_bytes"]) == (needed, available)


def test_a_refusal_keeps_its_first_refusing_line_cut_at_400_characters():
    text = "Traceback (most recent call last)\n  XlaRuntimeError: RESOURCE_EXHAUSTED: " + "x" * 500 + "\nmore"
    got = dr.device_refusal(text, "run")
    assert got["message"].startswith("XlaRuntimeError: RESOURCE_EXHAUSTED")
    assert len(got["message"]) == 400
    assert got["when"] == "run" and got["what"] is None and got["needed_bytes"] is None


def test_a_refusal_in_a_known_form_keeps_400_characters_of_its_line():
    text = ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 3.00G of 2.00G hbm. " + "y" * 600)
    got = dr.device_refusal(text)
    assert got["what"] == "the program's HBM" and got["message"] == text[:400]


def test_describe_names_where_and_the_figures_in_gib():
    compile_no = dr.device_refusal("RESOURCE_EXHAUSTED: ... the total memory required for HLO temporaries (19.76G) "
                                   "exceeds available HBM (15.75G).")
    assert dr.describe(compile_no) == ("the compiler refused it: HLO temporaries 19.76 GiB against 15.75 GiB "
                                       "available (the device's figures)")
    run_no = dr.device_refusal("RESOURCE_EXHAUSTED: Attempting to allocate 4.39G. That was not possible. "
                               "There are 2.30G free.")
    assert dr.describe(run_no) == ("the runtime refused an allocation: one allocation 4.39 GiB against 2.30 GiB "
                                   "available (the device's figures)")
    vague = dr.device_refusal("VmemOom: kernel x", None)
    assert dr.describe(vague) == "the device refused it: VmemOom: kernel x"
    assert dr.describe({**vague, "when": "compile"}) == "the compiler refused it: VmemOom: kernel x"


# ---------------------------------------------------------------------------------------------
# analysis/hardware.py

ROW = {"bf16_flops_chip": 150e12, "hbm_bytes_per_s_chip": 700e9, "grid_step_s": 0.5e-6, "op_overhead_s": 3e-6,
       "kernel_factors": {"b": 2.0, "a": 0.5}, "measured": {"device": "TPU v5 lite", "commit": "c" * 12}}


def test_the_makers_rows_hold_the_published_figures():
    """Per chip, as the makers publish them (module comments): bf16 and fp8 FLOP/s, HBM bandwidth and
    size, VMEM, one-way links, devices per chip, grid-step cost."""
    rows = {n: (h.devices_per_chip, h.bf16_flops_chip, h.fp8_flops_chip, h.hbm_bytes_per_s_chip, h.hbm_bytes_chip,
                h.vmem_bytes_device, h.link_bytes_per_s_chip, h.grid_step_s) for n, h in hwmod.MAKERS.items()}
    assert rows == {
        "v5e": (1, 197e12, 197e12, 819e9, 16 * GIB, 128 * MIB, 100e9, 0.35e-6),
        "v5p": (1, 459e12, 459e12, 2765e9, 95 * GIB, 64 * MIB, 300e9, 0.35e-6),
        "v6e": (1, 918e12, 918e12, 1640e9, 32 * GIB, 128 * MIB, 224e9, 0.35e-6),
        "tpu7x": (2, 2307e12, 4614e12, 7380e9, 192 * GIB, 64 * MIB, 600e9, 0.35e-6),
        "h100": (1, 989e12, 1979e12, 3350e9, 80e9, 228 * 1024, 450e9, 0.0),
        "h200": (1, 989e12, 1979e12, 4800e9, 141e9, 228 * 1024, 450e9, 0.0)}
    t = hwmod.MAKERS["tpu7x"]  # two devices a chip: every rate halves per device
    assert (t.bf16_flops, t.fp8_flops, t.hbm_bytes_per_s, t.link_bytes_per_s) == (1153.5e12, 2307e12, 3690e9, 300e9)
    assert t.op_overhead_s == 0.0 and t.kernel_factor("any") == 1.0


def test_a_calibration_replaces_the_measured_fields_only():
    hw = hwmod.calibrated(hwmod.MAKERS["v5e"], ROW)
    assert (hw.bf16_flops_chip, hw.hbm_bytes_per_s_chip, hw.grid_step_s, hw.op_overhead_s) == (150e12, 700e9, 0.5e-6,
                                                                                               3e-6)
    # Not measured: the fp8 rate, the links, HBM size keep the maker's.
    assert (hw.fp8_flops_chip, hw.link_bytes_per_s_chip, hw.hbm_bytes_chip) == (197e12, 100e9, 16 * GIB)
    assert hw.kernel_factors == (("a", 0.5), ("b", 2.0)) and hw.kernel_factor("b") == 2.0
    assert hw.kernel_factor("c") == 1.0 and hw.measured == ROW["measured"]


def test_a_carried_calibration_scales_the_makers_rates_by_the_sources_fractions():
    """v5e reached 150 / 197 of its bf16 peak and 700 / 819 of its HBM rate: tpu7x at the same fractions."""
    hw = hwmod.hardware_for("tpu7x:2x2x1", table={"v5e": ROW}, calibration_from="v5e")
    assert hw.bf16_flops_chip == pytest.approx(2307e12 * 150 / 197, rel=1e-12)
    assert hw.fp8_flops_chip == pytest.approx(4614e12 * 150 / 197, rel=1e-12)
    assert hw.hbm_bytes_per_s_chip == pytest.approx(7380e9 * 700 / 819, rel=1e-12)
    assert (hw.grid_step_s, hw.op_overhead_s, hw.link_bytes_per_s_chip) == (0.5e-6, 3e-6, 600e9)
    assert hw.measured == {**ROW["measured"], "carried_from": "v5e"} and hw.devices_per_chip == 2
    assert hw.kernel_factors == (("a", 0.5), ("b", 2.0))  # the source's, as they are


def test_hardware_for_reads_the_generation_of_each_spelling_of_a_target():
    table = {"v5e": ROW}
    assert hwmod.hardware_for("v5e:2x2", table=table).bf16_flops_chip == 150e12
    assert hwmod.hardware_for("v5e:2x2", table=table, use_calibration=False) is hwmod.MAKERS["v5e"]
    assert hwmod.hardware_for("v6e", table=table) is hwmod.MAKERS["v6e"]  # no row of its own
    assert hwmod.hardware_for("gpu:h200", table={}) is hwmod.MAKERS["h200"]
    assert hwmod.hardware_for("h100", table={}) is hwmod.MAKERS["h100"]
    with pytest.raises(ValueError, match="no hardware figures for target 'cpu:8'"):
        hwmod.hardware_for("cpu:8", table={})
    with pytest.raises(ValueError, match="v5e has its own calibration row"):
        hwmod.hardware_for("v5e", table=table, calibration_from="v5e")
    with pytest.raises(ValueError, match="no v6e row .* it has: v5e"):
        hwmod.hardware_for("tpu7x", table=table, calibration_from="v6e")


def test_a_calibration_row_needs_every_measured_field(tmp_path):
    path = tmp_path / "cal.json"
    for missing in ("bf16_flops_chip", "hbm_bytes_per_s_chip", "grid_step_s", "op_overhead_s", "measured"):
        with pytest.raises(ValueError, match=f"needs {missing}"):
            hwmod.write_calibration("v5e", {k: v for k, v in ROW.items() if k != missing}, path)
    with pytest.raises(ValueError, match="no maker's row for generation 'v4'"):
        hwmod.write_calibration("v4", ROW, path)
    assert not path.exists()


# ---------------------------------------------------------------------------------------------
# analysis/step_estimate.py

# One-device chip at 1e12 FLOP/s bf16, 2e12 fp8, 1e9 B/s HBM, 1e8 B/s links, 1 us a grid step, 2 us an op.
HW = hwmod.Hardware("toy", 1, 1e12, 2e12, 1e9, 16 * GIB, 64 * MIB, 1e8, 1e-6, op_overhead_s=2e-6,
                    kernel_factors=(("k1", 3.0),), measured={"device": "Toy chip", "commit": "abcdef0123456789"})


def test_op_seconds_by_hand():
    # compute 2e9 / 1e12 = 2 ms, memory 1e6 / 1e9 = 1 ms: compute bound, + 2 us per launch.
    assert se.op_seconds(OpCost("dense matmuls", flops=2e9, bytes=1e6), HW) == pytest.approx((2.002e-3, 2e-3, 1e-3, 0))
    # fp8 at 2e12: 1 ms, memory 3 ms; + 10 grid steps x 1 us; x its kernel factor 3, + 2 us.
    s = se.op_seconds(OpCost("GDN", flops=2e9, bytes=3e6, fp8=True, grid_steps=10, kernel="k1"), HW)
    assert s == pytest.approx(((3e-3 + 10e-6) * 3 + 2e-6, 1e-3, 3e-3, 10e-6))


class _FakeEstimator:
    """What hlo_cost.Estimator yields for a hand-made program: (op, times it runs)."""

    def __init__(self, text, apply_trip_counts=True):
        self.unknown_trips = ["while.9"]

    def named_ops(self):
        return [("dot.1", OpCost("dense matmuls", flops=2e9, useful_flops=1e9, bytes=1e6), 4.0),
                ("fusion.2", OpCost("GDN", flops=1e9, useful_flops=1e9, bytes=4e6, grid_steps=5, kernel="k1"), 2.0),
                ("fusion.3", OpCost("GDN", flops=1e9, useful_flops=1e9, bytes=1e6, kernel="k2", no_cost_estimate=True),
                 1.0),
                ("ag.4", OpCost("collectives", collective="all-gather", wire_bytes=1e5), 3.0),
                ("ar.5", OpCost("collectives", collective="all-reduce", wire_bytes=2e5), 1.0)]

    def ops(self):
        return [(c, k) for _, c, k in self.named_ops()]

    def op_names(self):
        gdn = "jit(step)/layers/while/body/closed_call/gdn/shard_map/k/pallas_call"
        return {"dot.1": "jit(step)/mlp/dot_general", "fusion.2": gdn, "fusion.3": gdn}

    def timeline(self, seconds, exposures=None):
        """As if the schedule hid the all-gathers under compute and left the all-reduce exposed."""
        busy = sum(seconds(c) * k for _, c, k in self.named_ops() if not c.collective)
        exposed = sum(seconds(c) * k for name, c, k in self.named_ops() if name == "ar.5")
        if exposures is not None:
            exposures["ar.5"] = exposed
        return busy, exposed


def test_an_estimates_categories_kernels_and_collectives_by_hand(monkeypatch):
    monkeypatch.setattr(se, "Estimator", _FakeEstimator)
    e = se.estimate("", HW, tokens_per_step=1000, chips=2, devices=2, model_flops_per_device=3e9)
    dense = e["categories"]["dense matmuls"]
    # 4 runs of (max(2 ms, 1 ms) + 2 us).
    assert dense["s"] == pytest.approx(4 * 2.002e-3) and dense["compute_s"] == pytest.approx(8e-3)
    assert dense["memory_s"] == pytest.approx(4e-3) and dense["grid_s"] == 0
    assert dense["flops"] == 4e9 and dense["bytes"] == 4e6  # useful FLOPs, not the MXU's
    gdn = e["categories"]["GDN"]
    # k1: 2 runs of ((max(1 ms, 4 ms) + 5 us) x 3 + 2 us); k2: max(1 ms, 1 ms) + 2 us.
    k1_s, k2_s = (4e-3 + 5e-6) * 3 + 2e-6, 1e-3 + 2e-6
    assert gdn["s"] == pytest.approx(2 * k1_s + k2_s)
    assert gdn["compute_s"] == pytest.approx(3e-3) and gdn["memory_s"] == pytest.approx(9e-3)
    assert gdn["grid_s"] == pytest.approx(10e-6) and gdn["flops"] == 3e9 and gdn["bytes"] == 9e6
    assert e["kernels"]["k1"] == pytest.approx({"calls": 2, "grid_steps": 10, "s": 2 * k1_s, "flops": 2e9})
    assert e["kernels"]["k2"] == pytest.approx({"calls": 1, "grid_steps": 0, "s": k2_s, "flops": 1e9})
    assert e["kernels_without_cost_estimate"] == ["k2"]
    # Collectives: wire bytes over the 1e8 B/s links, no per-op cost.
    assert e["collectives"]["all-gather"] == pytest.approx({"wire_bytes": 3e5, "s": 3e-3})
    assert e["collectives"]["all-reduce"] == pytest.approx({"wire_bytes": 2e5, "s": 2e-3})
    coll = e["categories"]["collectives"]
    assert coll["s"] == pytest.approx(5e-3) and coll["bytes"] == 5e5 and coll["flops"] == 0
    compute = 4 * 2.002e-3 + 2 * k1_s + k2_s
    assert e["serial"]["step_s"] == pytest.approx(compute + 5e-3)
    assert e["overlapped"]["step_s"] == pytest.approx(compute)
    assert e["serial"]["tokens_per_s_per_chip"] == pytest.approx(1000 / (compute + 5e-3) / 2)
    assert e["overlapped"]["mfu"] == pytest.approx(3e9 / (compute * 1e12))
    # The schedule's verdict: the compute, then the all-reduce's 2 ms it left exposed.
    assert e["scheduled"]["step_s"] == pytest.approx(compute + 2e-3) and e["exposed_async_s"] == pytest.approx(2e-3)
    # Where each category's seconds go, costliest first, with the op_name the compiler kept.
    assert [r["name"] for r in e["top_ops"]["GDN"]] == ["fusion.2", "fusion.3"]
    assert e["top_ops"]["dense matmuls"][0]["op_name"] == "jit(step)/mlp/dot_general"
    assert e["top_ops"]["dense matmuls"][0]["s"] == pytest.approx(4 * 2.002e-3)
    assert e["top_exposed"] == [{"name": "ar.5", "op_name": "", "exposed_s": pytest.approx(2e-3)}]
    # The same code path (the loops' and shard_map's parts dropped) summed over its instructions.
    assert e["top_op_groups"]["GDN"] == [{"path": "layers/gdn/k/pallas_call", "instructions": 2,
                                          "s": pytest.approx(2 * k1_s + k2_s), "runs": 3.0, "bytes": 9e6, "flops": 3e9}]
    assert e["hlo_flops_per_device"] == 7e9 and e["model_flops_per_device"] == 3e9
    assert e["loops_with_unknown_trip_count"] == ["while.9"] and (e["chips"], e["devices"]) == (2, 2)
    # A grid step's cost set for the estimate replaces the row's.
    e2 = se.estimate("", HW, tokens_per_step=1000, chips=2, devices=2, grid_step_s=3e-6)
    assert e2["categories"]["GDN"]["grid_s"] == pytest.approx(30e-6)
    ops = se.op_estimates("", HW)
    assert ops["dot.1"] == pytest.approx({"category": "dense matmuls", "s": 4 * 2.002e-3, "bound": "compute",
                                          "runs": 4.0})
    assert ops["fusion.2"]["bound"] == "memory" and ops["fusion.2"]["s"] == pytest.approx(2 * k1_s)
    assert "ag.4" not in ops  # collectives are not timed per op


def test_the_estimates_table_prints_its_figures_in_their_units(monkeypatch):
    monkeypatch.setattr(se, "Estimator", _FakeEstimator)
    e = se.estimate("", HW, tokens_per_step=1000, chips=2, devices=2, model_flops_per_device=3e9)
    e["designed_flops_per_device"] = 3.5e12
    e["hlo_flops_per_device"] = 7e12
    lines = se.format_estimate(e, reference={"label": "measured", "step_s": 1.5, "tokens_per_s_per_chip": 2000.0})
    text = "\n".join(lines.splitlines())
    assert lines.splitlines()[0].startswith("step time estimate on toy (2 devices, 2 chips;")
    assert "FLOPs per device: 7.0 TFLOP compiled (Pallas calls as they state), 3.5 designed (+100.0%)" in text
    gather = next(ln for ln in lines.splitlines() if "collective all-gather" in ln)
    assert gather.split()[2:] == [f"{3e5 / GIB:.3g}", "GiB", "sent", "per", "device", "0.003", "s"]
    k1 = next(ln for ln in lines.splitlines() if "Pallas k1" in ln)
    assert k1.split()[2:6] == ["2", "calls", "10", "grid"]
    ref = next(ln for ln in lines.splitlines() if ln.strip().startswith("measured"))
    assert ref.split()[1:] == ["1.50", "s/step", "2,000", "tokens/s", "per", "chip"]
    assumptions = next(ln for ln in lines.splitlines() if "assumptions" in ln)
    assert "measured on Toy chip at abcdef0123 (hybridmoe calibrate)" in assumptions
    assert ("bf16 1 TFLOP/s, HBM 1 GB/s, links 0 GB/s per device; 1.00 us per Pallas grid step, 2.00 us per op; "
            "Pallas kernels scaled") in assumptions
    assert "without a cost estimate (counted as memory only): k2" in text
    assert "loops whose trip count is unreadable (counted once): 1" in text
    assert "exposed 0.002 s at the done of ar.5" in text
    serial = next(ln for ln in lines.splitlines() if "not overlapped" in ln)
    compute = e["overlapped"]["step_s"]
    assert f"MFU {100 * 3e9 / ((compute + 5e-3) * 1e12):.1f}%" in serial


def test_per_device_rates_in_the_assumptions_divide_by_the_devices_of_a_chip(monkeypatch):
    monkeypatch.setattr(se, "Estimator", _FakeEstimator)
    e = se.estimate("", hwmod.MAKERS["tpu7x"], tokens_per_step=10, chips=1, devices=2)
    line = next(ln for ln in se.format_estimate(e).splitlines() if "assumptions" in ln)
    assert "(the maker's figures): bf16 1154 TFLOP/s, HBM 3690 GB/s, links 300 GB/s per device; 0.35 us" in line
    assert "MFU -" in se.format_estimate(e)


def test_tokens_per_step_and_the_hardware_a_target_takes():
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=6, seq_len=128),
                                rl=types.SimpleNamespace(rollouts_per_step=32, mini_batches=4, sequence_len=96))
    assert se.tokens_per_step(cfg, "train") == 768
    assert se.tokens_per_step(cfg, "grpo") == 8 * 96
    assert se.tokens_per_step(cfg, "sampler") is None
    assert se.default_hardware(types.SimpleNamespace(name="tpu7x:4x4x8", devices=[])) == "tpu7x"
    assert se.default_hardware(types.SimpleNamespace(name="cpu:8", devices=[])) is None


def test_estimate_step_counts_chips_from_the_devices_a_chip_holds(monkeypatch):
    seen = {}

    def fake_estimate(text, hw, **kw):
        seen.update(kw, hw=hw.name)
        return {}

    monkeypatch.setattr(se, "estimate", fake_estimate)
    monkeypatch.setattr(se, "model_flops_per_device", lambda cfg, devices, name: 100.0 / devices)
    monkeypatch.setattr(se, "designed_flops_per_device", lambda cfg, devices, platform: f"{platform}:{devices}")
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=2, seq_len=8))
    step = types.SimpleNamespace(cfg=cfg, program_name="train", program=types.SimpleNamespace(compiled_text=""),
                                 target=types.SimpleNamespace(name="tpu7x:2x2x2", devices=[], num_devices=16,
                                                              platform="tpu"))
    out = se.estimate_step(step, recipe=se.SEED_CELL["recipe"])
    assert seen == {"hw": "tpu7x", "tokens_per_step": 16, "chips": 8, "devices": 16, "model_flops_per_device": 6.25,
                    "grid_step_s": None}
    assert out["designed_flops_per_device"] == "tpu:16" and out["reference"] is se.SEED_CELL
    assert "reference" not in se.estimate_step(step)
    one = types.SimpleNamespace(**{**vars(step), "target": types.SimpleNamespace(
        name="v5e:1", devices=[], num_devices=1, platform="tpu")})
    se.estimate_step(one)
    assert seen["chips"] == 1
    assert se.estimate_step(types.SimpleNamespace(**{**vars(step), "program": None})) is None


# ---------------------------------------------------------------------------------------------
# analysis/program.py: what is read from a compiled program's texts

HLO = """HloModule m, entry_computation_layout={()->f32[8]}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%sum, metadata={op_name="jit(f)/layers/psum"}
  %ag = (bf16[4,16]{1,0}, s32[3]{0}) all-gather-start(%x), dimensions={0}
  %mul.1 = f32[8]{0} multiply(%ar, %ar), metadata={op_name="jit(f)/layers/mul"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %mul.1)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a0 = f32[8]{0} parameter(0)
  %rs = f32[2]{0} reduce-scatter(%a0), dimensions={0}, to_apply=%sum, metadata={op_name="jit(f)/rs"}
  %add.1 = f32[8]{0} add(%a0, %a0), metadata={op_name="jit(f)/moe/add"}
  %while.1 = (s32[], f32[8]{0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}, metadata={op_name="jit(f)/while"}
  ROOT %r = f32[8]{0} get-tuple-element(%while.1), index=1
}
"""


def test_collectives_of_a_compiled_module_with_their_loop_and_bytes():
    colls = program.parse_hlo(HLO)
    by_kind = {c.kind: c for c in colls}
    assert set(by_kind) == {"all-reduce", "all-gather", "reduce-scatter"}
    ar, ag, rs = by_kind["all-reduce"], by_kind["all-gather"], by_kind["reduce-scatter"]
    assert (ar.bytes, ar.loop_depth, ar.loop, ar.trip_count, ar.op_name) == (32, 1, "while.1", 5, "jit(f)/layers/psum")
    # A tuple result: 4 x 16 bf16 (128 bytes) + 3 s32 (12); dtype and shape of the first element.
    assert (ag.dtype, ag.shape, ag.bytes, ag.shapes) == ("bf16", (4, 16), 140, ((4, 16), (3,)))
    assert (rs.bytes, rs.loop_depth, rs.loop, rs.in_loop) == (8, 0, None, False)
    # One run: the loop's collectives times its 5 trips, the rest once: 5 x (32 + 140) + 8.
    assert program.executed_bytes(colls) == 5 * (32 + 140) + 8
    assert program.count(colls, in_loop=True) == 2 and program.count(colls, kind="all-reduce", dtype="f32") == 1
    assert program.count(colls, dtype="bf16", in_loop=False) == 0
    assert program.per_iteration(colls) == {"while.1": {"all-reduce": 1, "all-gather": 1}}
    assert program.table(colls)[("all-gather", "bf16", True)] == {"ops": 1, "bytes": 140}
    loops = program.loop_instructions(HLO)
    assert loops["while.1"][("multiply", "f32")] == 1 and loops["while.1"][("compare", "pred")] == 1


def test_element_sizes_of_each_spelling():
    assert [program.dtype_bytes(d) for d in ("pred", "s8", "bf16", "f16", "s32", "f32", "f64", "s64", "f8e4m3fn",
                                             "f8E5M2", "token")] == [1, 1, 2, 2, 4, 4, 8, 8, 1, 1, 0]
    with pytest.raises(ValueError, match="unknown element type 'q7'"):
        program.dtype_bytes("q7")
    assert program._hlo_result("(f32[4]{0}, s32[])") == ("f32", (4,), 20)
    assert program._mlir_result("%0 = x : (tensor<4x8xbf16>) -> tensor<16x8xbf16>") == ("bf16", (16, 8), 256)


BUFFER_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[8]| at ShapeIndex {}:
 value: <1 a0 @0> (size=32,offset=0): f32[8]{0}
allocation 1: size 96, maybe-live-out:
 value: <2 add.1 @0> (size=96,offset=0): f32[8]{0}
allocation 2: size 4096, preallocated-temp:
 value: <3 mul.1 @0> (size=1024,offset=0): f32[8]{0}
 value: <4 p{1} @0> (size=512,offset=1024): f32[8]{0}
 value: <5 rs @0> (size=128,offset=2048): f32[2]{0}
allocation 3: size 16, constant:
 value: <6 c.1 @0> (size=16,offset=0): f32[4]{0}
allocation 4: size 100, thread-local:
 value: <7 t.1 @0> (size=100,offset=0): f32[25]{0}
allocation 5: size 256, color 1:
 value: <8 v.1 @0> (size=256,offset=0): f32[64]{0}
allocation 6: size 40, parameter 1, shape |f32[10]| at ShapeIndex {}:
 value: <9 a1 @0> (size=40,offset=0): f32[10]{0}
"""

LIVE_RANGE = """Peak:
Live ranges at 7 (peak):
  rs: 8 bytes
  add.1: 32 bytes
  p{1}: 32 bytes
  mul.1: 32 bytes
"""


def test_each_allocations_storage_from_its_tags():
    storage = program.value_storage(BUFFER_ASSIGNMENT)
    assert storage[("a0", "{}")] == ("argument", 32)
    assert storage[("add.1", "{}")] == ("output", 96)
    assert storage[("mul.1", "{}")] == ("temp", 1024) and storage[("p", "{1}")] == ("temp", 512)
    assert storage[("c.1", "{}")] == ("constant", 16) and storage[("t.1", "{}")] == ("thread-local", 100)
    assert storage[("v.1", "{}")] == ("on-chip", 256)
    assert program._storage("size 8, color 0, parameter 0") == "argument"
    # The arguments' allocations: 64 + 40 bytes (allocation sizes, not the values').
    assert program.argument_bytes(BUFFER_ASSIGNMENT) == 104


def test_the_peaks_buffers_at_their_padded_size_largest_first():
    bufs = program.peak_buffers(LIVE_RANGE, BUFFER_ASSIGNMENT, HLO)
    assert [(b.value, b.bytes, b.shape, b.storage) for b in bufs] == [
        ("mul.1", 1024, "f32[8]", "temp"), ("p{1}", 512, "f32[8]", "temp"), ("rs", 128, "f32[2]", "temp"),
        ("add.1", 96, "f32[8]", "output")]
    mul, carried, rs, _ = bufs
    assert (mul.op_name, mul.computation, mul.loop, mul.in_loop) == ("jit(f)/layers/mul", "body", "while.1", True)
    # A loop body's parameter carries the op_name of the while around it.
    assert carried.op_name == "jit(f)/while [carried by the loop]" and carried.loop == "while.1"
    assert (rs.op_name, rs.loop, rs.in_loop) == ("jit(f)/rs", None, False)
    assert program.peak_buffers("no peak here", BUFFER_ASSIGNMENT, HLO) == []


def test_the_default_spaces_bytes_from_the_memory_usage_report():
    report = ("Memory Space: alternate (color=1)\nTotal bytes: 7\n\n"
              "Memory Space: default (color=0)\nTotal bytes: 123456\nArguments: 5\n")
    assert program.default_space_bytes(report) == 123456
    assert program.default_space_bytes("") is None


def test_the_compiled_memory_and_cost_figures_read_as_they_are_named():
    m = types.SimpleNamespace(temp_size_in_bytes=1, argument_size_in_bytes=2, output_size_in_bytes=3,
                              alias_size_in_bytes=4, generated_code_size_in_bytes=5)
    compiled = types.SimpleNamespace(memory_analysis=lambda: m,
                                     cost_analysis=lambda: [{"flops": 7, "bytes accessed": 9, "bytes accessed{0}": 1}])
    assert program.memory_figures(compiled) == {"temp": 1, "argument": 2, "output": 3, "alias": 4, "generated_code": 5}
    assert program.cost_figures(compiled) == {"flops": 7.0, "bytes accessed": 9.0}
    prog = program.Program("", "", program.memory_figures(compiled), program.cost_figures(compiled))
    assert prog.temp_bytes == 1 and prog.bytes_accessed == 9.0
    assert program.memory_figures(types.SimpleNamespace(memory_analysis=lambda: None)) == {}


STABLEHLO = """module @jit_f {
  func.func public @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = "stablehlo.all_gather"(%arg0) {all_gather_dim = 0 : i64} : (tensor<8xf32>) -> tensor<32xbf16>
    %1:2 = stablehlo.while(%iterArg = %c, %iterArg_0 = %arg0) : tensor<i32>, tensor<8xf32>
     cond {
      stablehlo.return %c : tensor<i1>
    } do {
      %2 = "stablehlo.all_reduce"(%iterArg_0) ({
      ^bb0(%a: tensor<i32>, %b: tensor<i32>):
        %s = stablehlo.add %a, %b : tensor<i32>
        stablehlo.return %s : tensor<i32>
      }) : (tensor<8x4xi32>) -> tensor<8x4xi32>
      %3 = func.call @inner(%iterArg_0) : (tensor<8xf32>) -> tensor<8xf32>
      stablehlo.return %iterArg, %3 : tensor<i32>, tensor<8xf32>
    }
    return %1#1 : tensor<8xf32>
  }
  func.func private @inner(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = "stablehlo.reduce_scatter"(%arg0) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<8xf32>) -> tensor<2xf8E4M3FN>
    return %0 : tensor<8xf32>
  }
}
"""


def test_collectives_of_a_lowered_module_through_its_loops_and_calls():
    colls = {c.kind: c for c in program.parse_stablehlo(STABLEHLO)}
    assert set(colls) == {"all-gather", "all-reduce", "reduce-scatter"}
    ag, ar, rs = colls["all-gather"], colls["all-reduce"], colls["reduce-scatter"]
    assert (ag.dtype, ag.shape, ag.bytes, ag.loop_depth) == ("bf16", (32,), 64, 0)
    # i32 spelled s32 as in HLO; the result type after the region's `})`.
    assert (ar.dtype, ar.shape, ar.bytes, ar.loop_depth) == ("s32", (8, 4), 128, 1)
    # Called from the loop body: inside the loop, one byte an element.
    assert (rs.dtype, rs.shape, rs.bytes, rs.loop_depth, rs.computation) == ("f8e4m3fn", (2,), 2, 1, "inner")
    assert rs.loop == ar.loop == "main/while#1"


@pytest.mark.parametrize("text", ["INTERNAL: Out of memory allocating 12 bytes", "resource_exhausted: no room",
                                  "Ran out of memory in memory space vmem", "CompileTimeScopedVmemOom: kernel"])
def test_each_spelling_of_a_refusal_is_one(text):
    got = dr.device_refusal(text, "compile")
    assert got is not None and got["when"] == "compile" and got["message"] == text


def test_the_largest_dump_file_is_the_main_modules():
    dumps = program._Dumps("jit_step")
    try:
        assert dumps.options == {"xla_dump_to": dumps.folder, "xla_dump_hlo_as_text": True,
                                 "xla_dump_hlo_module_re": "jit_step"}
        assert dumps.sizes() is None and dumps.read("after_optimizations.txt") == ""
        for name, size in (("module_0001.kernel.after_optimizations.txt", 3),
                           ("module_0002.jit_step.after_optimizations.txt", 9)):
            with open(os.path.join(dumps.folder, name), "w") as f:
                f.write("x" * size)
        assert dumps.read("after_optimizations.txt") == "x" * 9
        assert dumps.sizes() is None  # the buffer assignment not yet written
    finally:
        dumps.remove()
    every = program._Dumps(None)
    every.remove()
    assert "xla_dump_hlo_module_re" not in every.options


def test_a_host_target_takes_its_devices_generation():
    host = types.SimpleNamespace(name="tpu:1", devices=[types.SimpleNamespace(device_kind="TPU v5 lite")])
    assert se.default_hardware(host) == "v5e"
    v5p = types.SimpleNamespace(name="tpu:4", devices=[types.SimpleNamespace(device_kind="TPU v5")])
    assert se.default_hardware(v5p) == "v5p"
    cpu = types.SimpleNamespace(name="cpu:1", devices=[types.SimpleNamespace(device_kind="cpu")])
    assert se.default_hardware(cpu) is None


REPORT = "Memory Space: default (color=0)\nTotal bytes: 4321\n"


class _DumpingLowered:
    """A lowered program whose compile writes XLA's dumps (the texts above) where it is told, or refuses."""

    def __init__(self, refuse: bool = False):
        self.refuse = refuse
        self.folder = None

    def compile(self, compiler_options):
        self.folder = compiler_options["xla_dump_to"]
        for suffix, text in (("after_optimizations.txt", HLO),
                             ("after_optimizations-buffer-assignment.txt", BUFFER_ASSIGNMENT),
                             ("after_optimizations-live-range.txt", LIVE_RANGE),
                             ("after_optimizations-memory-usage-report.txt", REPORT)):
            with open(os.path.join(self.folder, f"module_0001.jit_f.{suffix}"), "w") as f:
                f.write(text)
        if self.refuse:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory")
        return types.SimpleNamespace(as_text=lambda: HLO)


def test_a_compile_with_its_dumps_reads_the_peak_and_the_default_space_then_removes_them():
    lowered = _DumpingLowered()
    compiled, buffers, space = program.compile_with_buffers(lowered, "jit_f")
    assert space == 4321 and compiled.as_text() == HLO
    assert [(b.value, b.bytes) for b in buffers] == [("mul.1", 1024), ("p{1}", 512), ("rs", 128), ("add.1", 96)]
    assert not os.path.exists(lowered.folder)
    lowered = _DumpingLowered()
    assert program.compile_with_buffers(lowered, buffers=False)[1:] == ([], 4321)
    read = program.read_buffer_assignment(_DumpingLowered(), "jit_f", poll_s=0.01)
    assert (read.default_space, read.argument, read.hlo_text) == (4321, 104, HLO)
    assert [b.value for b in read.buffers] == ["mul.1", "p{1}", "rs", "add.1"]


def test_a_refused_compile_says_what_filled_memory():
    lowered = _DumpingLowered(refuse=True)
    with pytest.raises(RuntimeError) as err:
        program.compile_with_buffers(lowered, "jit_f")
    assert [b.value for b in err.value.peak_buffers] == ["mul.1", "p{1}", "rs", "add.1"]
    assert not os.path.exists(lowered.folder)
