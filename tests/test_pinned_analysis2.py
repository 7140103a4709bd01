"""Single checks and small formulas of the program analysis, by hand: a while loop's trip count in
each compare direction, the devices of a collective's group in each spelling and its ring wire
bytes (analysis/hlo_cost.py), and a program's executed collective bytes (analysis/program.py)."""

from __future__ import annotations

import pytest

from hybridmoe.analysis import hlo_cost as hc
from hybridmoe.analysis import program

from helpers import counted_loop_hlo


@pytest.mark.parametrize("start, limit, operands, direction, trips", [
    (1, 4, "%i, %limit", "LT", 3),    # i < 4 from 1: 1, 2, 3
    (1, 4, "%i, %limit", "NE", 3),    # i != 4 from 1: 1, 2, 3
    (1, 4, "%i, %limit", "LE", 4),    # i <= 4 from 1: 1, 2, 3, 4
    (10, 4, "%i, %limit", "GT", 6),   # i > 4 from 10: 10 .. 5 (a count from the start down)
    (10, 4, "%i, %limit", "GE", 7),   # i >= 4 from 10: 10 .. 4
    (1, 4, "%limit, %i", "GT", 3),    # 4 > i: i < 4
    (1, 4, "%limit, %i", "GE", 4),    # 4 >= i: i <= 4
    (10, 4, "%limit, %i", "LT", 6),   # 4 < i: i > 4
    (10, 4, "%limit, %i", "LE", 7),   # 4 <= i: i >= 4
    (5, 4, "%i, %limit", "LT", 0),    # already past: none, never negative
    (2, 4, "%i, %limit", "EQ", None),  # not a counted loop
])
def test_a_loops_trip_count_from_its_condition_in_each_direction(start, limit, operands, direction, trips):
    text = counted_loop_hlo(start, limit, operands, direction)
    assert hc.while_trip_counts(text) == {"loop": trips}
    if trips is not None:
        assert hc.hlo_flops(text) == trips * 2 * 8 * 8 * 8  # each trip's dot: 2 x 64 results x 8


def test_the_known_trip_count_wins_over_the_condition():
    text = counted_loop_hlo(1, 4, "%i, %limit", "LT").replace(
        "condition=%cond, body=%body", 'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"9"}}')
    assert hc.while_trip_counts(text) == {"loop": 9}


@pytest.mark.parametrize("attrs, n", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
    ("replica_groups={{0,1}}", 2),
    ("replica_groups=[2,4]<=[8]", 4),
    ("replica_groups=[8,1]<=[8]", 1),
    ("replica_groups=mesh['data'=2,'model'=4]{'model'}", 4),
    ("replica_groups=mesh['data'=2,'model'=4]{'data'}", 2),
    ("replica_groups=mesh['data'=2,'model'=4]{'data','model'}", 8),
    ("source_target_pairs={{0,1},{1,0}}", 2),
    ("replica_groups={}", 1),
    ("", 1),
])
def test_the_devices_of_a_collectives_group_in_each_spelling(attrs, n):
    assert hc._group_size(attrs) == n


def test_ring_wire_bytes_of_each_collective_kind_by_hand():
    # 4 devices a group, a 1000-byte result.
    assert hc.wire_bytes("all-gather", 1000, 4) == 750.0        # the 3 shards of the others
    assert hc.wire_bytes("all-to-all", 1000, 4) == 750.0        # all but its own quarter
    assert hc.wire_bytes("ragged-all-to-all", 1000, 4) == 750.0
    assert hc.wire_bytes("reduce-scatter", 1000, 4) == 3000.0   # the result is one shard: 3 shards sent
    assert hc.wire_bytes("all-reduce", 1000, 4) == 1500.0       # reduce-scatter + all-gather: 2 x 3/4
    assert hc.wire_bytes("collective-permute", 1000, 2) == 1000.0  # its whole buffer to one peer
    # A group of one sends nothing, except a permute (its pairs, not its groups, say where it goes).
    for kind in ("all-gather", "all-to-all", "reduce-scatter", "all-reduce"):
        assert hc.wire_bytes(kind, 1000, 1) == 0.0
    assert hc.wire_bytes("collective-permute", 1000, 1) == 1000.0
    assert hc.wire_bytes("all-gather", 1000, 2) == 500.0


def _coll(kind, nbytes, depth, trips):
    return program.Collective(kind, "f32", (nbytes // 4,), nbytes, depth, "while.1" if depth else None, trips,
                              "c", "")


def test_executed_bytes_count_a_loops_collectives_per_known_trip_and_once_when_unknown():
    colls = [_coll("all-reduce", 100, 1, 5),      # in a loop of 5: 500
             _coll("all-gather", 40, 1, None),    # in a loop of unknown trips: once, 40
             _coll("reduce-scatter", 8, 0, 7)]    # outside every loop: once, whatever the field says
    assert program.executed_bytes(colls) == 500 + 40 + 8
    assert program.count(colls, in_loop=True) == 2 and program.count(colls, in_loop=False) == 1
    assert program.per_iteration(colls) == {"while.1": {"all-reduce": 1, "all-gather": 1}}
    two = program.table([*colls, _coll("all-reduce", 60, 1, 5)])
    assert two[("all-reduce", "f32", True)] == {"ops": 2, "bytes": 160}
    assert two[("reduce-scatter", "f32", False)] == {"ops": 1, "bytes": 8}


_OPS = """HloModule ops

%light (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %l = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%heavy (h: f32[8,8]) -> f32[8,8] {
  %h = f32[8,8]{1,0} parameter(0)
  %h1 = f32[8,8]{1,0} dot(%h, %h), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %h2 = f32[8,8]{1,0} dot(%h1, %h1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[8,8], p1: bf16[8,8], p2: f32[16,8], idx: s32[2,1], upd: f32[2,8], i0: s32[], q: pred[]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  %p2 = f32[16,8]{1,0} parameter(2)
  %idx = s32[2,1]{1,0} parameter(3)
  %upd = f32[2,8]{1,0} parameter(4)
  %i0 = s32[] parameter(5)
  %q = pred[] parameter(6)
  %highest = f32[8,8]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  %high = f32[8,8]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={high,high}
  %half = bf16[8,8]{1,0} dot(%p1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  %dus = f32[16,8]{1,0} dynamic-update-slice(%p2, %upd, %i0, %i0)
  %sc = f32[16,8]{1,0} scatter(%p2, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  %sl = f32[2,8]{1,0} slice(%p2), slice={[0:2], [0:8]}
  %cond = f32[8,8]{1,0} conditional(%q, %p0, %p0), true_computation=%light, false_computation=%heavy
  ROOT %out = f32[8,8]{1,0} add(%highest, %cond)
}
"""


def test_mxu_passes_in_place_updates_slices_and_the_heavier_branch_by_hand():
    ops = {name: c for name, c, _ in hc.Estimator(_OPS).named_ops()}
    one = 2 * 8 * 8 * 8  # a [8, 8] @ [8, 8] dot: 1024 useful FLOPs
    # A float32 dot at HIGHEST precision is 6 bfloat16 MXU passes, HIGH 3; a bfloat16 dot one, whatever it says.
    assert (ops["highest"].useful_flops, ops["highest"].flops) == (one, 6 * one)
    assert (ops["high"].useful_flops, ops["high"].flops) == (one, 3 * one)
    assert (ops["half"].useful_flops, ops["half"].flops) == (one, one)
    # An in-place update moves its update (2 x 8 f32 = 64 bytes) in and out, not the 512-byte buffer.
    assert ops["dus"].bytes == 2 * 64 and ops["sc"].bytes == 2 * 64
    assert ops["sl"].bytes == 2 * 64  # a slice reads what it returns and writes it
    # The conditional costs its heavier branch: two dots, not one.
    assert sum(c.useful_flops for name, c in ops.items() if name in ("l", "h1", "h2")) == 2 * one
    assert "l" not in ops
    assert hc.hlo_flops(_OPS) == 3 * one + 2 * one


def test_a_kernels_flops_are_the_mxus_while_its_category_counts_the_useful_ones(monkeypatch):
    from hybridmoe.analysis import hardware as hwmod
    from hybridmoe.analysis import step_estimate as se
    from hybridmoe.analysis.hlo_cost import OpCost

    hw = hwmod.Hardware("toy", 1, 1e12, 1e12, 1e9, 2**30, 2**20, 1e8, 0.0)
    # A float32 kernel at HIGHEST: 6e9 MXU FLOPs for 1e9 useful, run 2 times; 6 ms compute = 6 ms memory.
    op = OpCost("GDN", flops=6e9, useful_flops=1e9, bytes=6e6, kernel="k")

    class Fake:
        def __init__(self, text, apply_trip_counts=True):
            self.unknown_trips = []

        def named_ops(self):  # the same instruction reached twice (a body called from two places)
            return [("f.1", op, 2.0), ("f.1", op, 3.0)]

        def op_names(self):
            return {}

        def timeline(self, seconds, exposures=None):
            return 5 * seconds(op), 0.0

    monkeypatch.setattr(se, "Estimator", Fake)
    e = se.estimate("", hw, tokens_per_step=100, chips=1, devices=1)
    assert e["kernels"]["k"]["flops"] == 30e9 and e["categories"]["GDN"]["flops"] == 5e9
    assert e["hlo_flops_per_device"] == 5e9
    assert e["top_ops"]["GDN"] == [{"name": "f.1", "op_name": "", "category": "GDN", "s": pytest.approx(5 * 6e-3),
                                    "runs": 5.0, "flops": 30e9, "bytes": 30e6, "bound": "compute"}]
    assert e["serial"]["mfu"] is None  # no model FLOPs given
    # Compute and memory equal: the op is said to be compute bound.
    got = se.op_estimates("", hw)["f.1"]
    assert got == {"category": "GDN", "s": pytest.approx(5 * 6e-3), "bound": "compute", "runs": 5.0}


_CALLS = """module @jit_g {
  func.func private @helper(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = "stablehlo.all_gather"(%arg0) {all_gather_dim = 0 : i64} : (tensor<8xf32>) -> tensor<16xf32>
    return %arg0 : tensor<8xf32>
  }
  func.func private @deep(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %1:2 = stablehlo.while(%iterArg = %c, %iterArg_0 = %arg0) : tensor<i32>, tensor<8xf32>
     cond {
      stablehlo.return %c : tensor<i1>
    } do {
      %2 = "stablehlo.all_to_all"(%iterArg_0) {split_dimension = 0 : i64} : (tensor<8xf32>) -> tensor<8xf32>
      stablehlo.return %iterArg, %2 : tensor<i32>, tensor<8xf32>
    }
    return %1#1 : tensor<8xf32>
  }
  func.func private @mid(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = func.call @deep(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func public @main(%arg0: tensor<8xf32>) -> (tensor<8xf32>) {
    %0 = "stablehlo.collective_permute"(%arg0) {source_target_pairs = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<f32>) -> tensor<f32>
    %1:2 = stablehlo.while(%iterArg = %c, %iterArg_0 = %arg0) : tensor<i32>, tensor<8xf32>
     cond {
      stablehlo.return %c : tensor<i1>
    } do {
      %3 = func.call @mid(%iterArg_0) : (tensor<8xf32>) -> tensor<8xf32>
      stablehlo.return %iterArg, %3 : tensor<i32>, tensor<8xf32>
    }
    return %1#1 : tensor<8xf32>
  }
}
"""


def test_lowered_collectives_start_at_main_and_add_the_loops_of_each_call():
    colls = {c.kind: c for c in program.parse_stablehlo(_CALLS)}
    # helper is written first but nothing calls it: main is the entry, so its gather is not counted.
    assert set(colls) == {"collective-permute", "all-to-all"}
    cp, a2a = colls["collective-permute"], colls["all-to-all"]
    assert (cp.shape, cp.bytes, cp.loop_depth, cp.loop) == ((), 4, 0, None)  # a scalar: one f32
    # In deep's own loop, deep called by mid, mid from main's loop: two loops deep, deep's loop innermost.
    assert (a2a.loop_depth, a2a.loop, a2a.computation) == (2, "deep/while#1", "deep")


_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[8]| at ShapeIndex {}:
 value: <1 a0 @0> (size=32,offset=0): f32[8]{0}
allocation 1: size 4096, preallocated-temp:
 value: <3 big @0> (size=2048,offset=0): f32[512]{0}
"""

_LIVE = """Peak:
Live ranges at 3 (peak):
  a0: 32 bytes
  small: 16 bytes
  big: 2048 bytes
"""

_ENTRY = """HloModule m

ENTRY %main (a0: f32[8]) -> f32[512] {
  %a0 = f32[8]{0} parameter(0)
  ROOT %big = f32[512]{0} broadcast(%a0), dimensions={}, metadata={op_name="jit(f)/big"}
}
"""


def test_peak_buffers_outside_loops_keep_their_own_op_name_and_unassigned_ones_are_temporaries():
    bufs = program.peak_buffers(_LIVE, _ASSIGNMENT, _ENTRY)
    assert [(b.value, b.bytes, b.storage, b.op_name, b.loop) for b in bufs] == [
        ("big", 2048, "temp", "jit(f)/big", None),
        ("a0", 32, "argument", "", None),     # an entry parameter: no op, not carried by any loop
        ("small", 16, "temp", "", None)]      # in no allocation listed: a temporary at its live-range size
    assert bufs[2].shape == "?" and bufs[2].computation == "?"


def test_the_dumps_main_module_is_the_largest_file_whatever_its_name_and_sizes_wait_for_every_file():
    import os

    dumps = program._Dumps(None)
    try:
        def write(name, size):
            with open(os.path.join(dumps.folder, name), "w") as f:
                f.write("x" * size)

        # The kernel's file sorts last by name but is the smaller one.
        write("module_0001.jit_step.after_optimizations.txt", 9)
        write("module_0002.kernel.after_optimizations.txt", 3)
        assert dumps.read("after_optimizations.txt") == "x" * 9
        write("module_0001.jit_step.after_optimizations-buffer-assignment.txt", 5)
        write("module_0001.jit_step.after_optimizations-live-range.txt", 4)
        write("module_0001.jit_step.after_optimizations-memory-usage-report.txt", 0)
        assert dumps.sizes() is None  # the report is there but still empty
        write("module_0001.jit_step.after_optimizations-memory-usage-report.txt", 2)
        assert dumps.sizes() == (9, 5, 4, 2)
    finally:
        dumps.remove()


def test_a_generation_with_its_own_calibration_refuses_another_ones():
    from hybridmoe.analysis import hardware as hwmod

    row = {"bf16_flops_chip": 150e12, "hbm_bytes_per_s_chip": 700e9, "grid_step_s": 0.5e-6, "op_overhead_s": 3e-6,
           "measured": {"device": "TPU v5 lite", "commit": "c" * 12}}
    table = {"v5e": row, "v6e": {**row, "measured": {"device": "TPU v6 lite", "commit": "d" * 12}}}
    with pytest.raises(ValueError, match=r"v5e has its own calibration row \(measured on TPU v5 lite\); "
                                         "drop --calibration-from v6e"):
        hwmod.hardware_for("v5e:2x2", table=table, calibration_from="v6e")
    carried = hwmod.hardware_for("v5p", table=table, calibration_from="v6e")
    assert carried.measured["carried_from"] == "v6e"


def test_only_a_training_step_of_the_seed_recipe_is_shown_beside_the_seeds_measured_step(monkeypatch):
    import types

    from hybridmoe.analysis import step_estimate as se

    monkeypatch.setattr(se, "estimate", lambda text, hw, **kw: {})
    monkeypatch.setattr(se, "model_flops_per_device", lambda cfg, devices, name: 1.0)
    monkeypatch.setattr(se, "designed_flops_per_device", lambda cfg, devices, platform: 2.0)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=2, seq_len=8),
                                rl=types.SimpleNamespace(rollouts_per_step=8, mini_batches=2, sequence_len=16))
    target = types.SimpleNamespace(name="tpu7x:2x2x1", devices=[], num_devices=8, platform="tpu")
    grpo = types.SimpleNamespace(cfg=cfg, program_name="grpo", program=types.SimpleNamespace(compiled_text=""),
                                 target=target)
    out = se.estimate_step(grpo, recipe=se.SEED_CELL["recipe"])
    assert out == {}  # no reference and no design count: both are the training step's
    train = types.SimpleNamespace(**{**vars(grpo), "program_name": "train"})
    assert se.estimate_step(train, recipe=se.SEED_CELL["recipe"]) == {"designed_flops_per_device": 2.0,
                                                                     "reference": se.SEED_CELL}


def test_loop_instructions_count_only_what_loops_run():
    loops = program.loop_instructions(counted_loop_hlo(1, 4, "%i, %limit", "LT"))
    # The body's add and dot (and the condition's compare) under the loop's name; the entry's own ops under none.
    assert set(loops) == {"loop"}
    assert loops["loop"][("dot", "f32")] == 1 and loops["loop"][("add", "s32")] == 1
    assert loops["loop"][("compare", "pred")] == 1
