"""The profile's op names mapped to the step-time model's categories (tools/profile.py): a device's
trace read as a TPU writes it (its "XLA Ops" line, loops nesting their bodies, instruction names as
event names or `hlo_op` arguments), through the same classifier the estimate uses."""

import gzip
import json
import re

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.tools import profile
from hybridmoe.tools.profile import UNMATCHED, by_category

# A program as the TPU compiler prints it: a dot in the GDN scope, a loop whose body runs an
# attention fusion and the loop's counter, a grouped matmul, an all-reduce.
TPU_STYLE = """HloModule jit_step, entry_computation_layout={(bf16[64,64]{1,0})->bf16[64,64]{1,0}}

%fused_computation (param_0: bf16[64,64]) -> bf16[64,64] {
  %param_0 = bf16[64,64]{1,0} parameter(0)
  ROOT %convolution.1 = bf16[64,64]{1,0} dot(%param_0, %param_0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/attention/dot_general"}
}

%body (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  %fusion.12 = bf16[64,64]{1,0} fusion(%x), kind=kOutput, calls=%fused_computation, metadata={op_name="jit(step)/while/body/attention/dot_general"}
  %one = s32[] constant(1)
  %add.5 = s32[] add(%i, %one), metadata={op_name="jit(step)/while/body/add"}
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%add.5, %fusion.12)
}

%cond (q: (s32[], bf16[64,64])) -> pred[] {
  %q = (s32[], bf16[64,64]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%sum (a.1: bf16[], b.1: bf16[]) -> bf16[] {
  %a.1 = bf16[] parameter(0)
  %b.1 = bf16[] parameter(1)
  ROOT %add.9 = bf16[] add(%a.1, %b.1)
}

ENTRY %main (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %dot.1 = bf16[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/gdn/dot_general"}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,64]{1,0}) tuple(%zero, %dot.1)
  %while.3 = (s32[], bf16[64,64]{1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(step)/while"}
  %out = bf16[64,64]{1,0} get-tuple-element(%while.3), index=1
  %dot.9 = bf16[64,64]{1,0} dot(%out, %out), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/moe/grouped_matmul/dot_general"}
  ROOT %all-reduce.2 = bf16[64,64]{1,0} all-reduce(%dot.9), replica_groups={}, to_apply=%sum
}
"""


def _write_trace(folder, events, device="/device:TPU:0"):
    """A Chrome trace as the profiler writes it (plugins/profile/RUN/HOST.trace.json.gz): the device
    process with its "XLA Ops" thread, and a host process whose thunks name an hlo_op too."""
    meta = [{"ph": "M", "pid": 3, "name": "process_name", "args": {"name": device}},
            {"ph": "M", "pid": 3, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "XLA Modules"}},
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    run = folder / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)


def _op(name, ts, dur, **args):
    return {"ph": "X", "pid": 3, "tid": 2, "ts": ts, "dur": dur, "name": name, "args": args}


def test_a_tpu_trace_maps_to_the_models_categories(tmp_path):
    """Microseconds by hand, one step traced: dot.1 100 (GDN); while.3 400 with four fusion.12 of 80
    (attention 320) and four add.5 of 5 nested in it (named `add`, hlo_op add.5: the rest 20), so
    the loop's own 60 (the rest: 80 in all); dot.9 named by its long name 150 (grouped matmuls);
    all-reduce.2 50 (collectives); fusion.999, absent from the program, by its tf_op in the GDN
    scope 30 (GDN 130 in all); mystery.1 20 (apart). Left out: another module's event on the
    device line, the module's whole span on the Modules line and the host's thunks."""
    events = [_op("dot.1", 0, 100), _op("while.3", 100, 400)]
    for k in range(4):
        events += [_op("fusion.12", 110 + 100 * k, 80), _op("add", 190 + 100 * k, 5, hlo_op="add.5")]
    events += [_op("%dot.9 = bf16[64,64]{1,0} dot(%out, %out)", 500, 150), _op("all-reduce.2", 650, 50),
               _op("fusion.999", 700, 30, tf_op="jit(step)/gdn/dot_general"), _op("mystery.1", 730, 20),
               _op("dot.1", 800, 999, hlo_module="jit_other"),
               {"ph": "X", "pid": 3, "tid": 1, "ts": 0, "dur": 750, "name": "jit_step(1)", "args": {}},
               {"ph": "X", "pid": 1, "tid": 9, "ts": 0, "dur": 5000, "name": "dot.1", "args": {"hlo_op": "dot.1"}}]
    _write_trace(tmp_path, events)
    ops = profile.sum_ops(profile.op_events(profile.read_trace(str(tmp_path)), profile.module_name(TPU_STYLE)), 1)
    got = by_category(ops, TPU_STYLE)
    want = {"GDN": 130, "attention": 320, "grouped matmuls": 150, "collectives": 50, "the rest": 80,
            "dense matmuls": 0, UNMATCHED: 20}
    assert got == pytest.approx({k: v * 1e-6 for k, v in want.items()}, abs=1e-12)
    assert got[UNMATCHED] / sum(got.values()) <= 0.1


def _scoped_step(x):
    with jax.named_scope("gdn"):
        y = jnp.sin(x @ x)

    def body(i, y):
        with jax.named_scope("attention"):
            return jnp.tanh(y @ y)
    return jax.lax.fori_loop(0, 3, body, y) + 1


def test_a_real_programs_instructions_map_through_a_tpu_style_trace_and_the_cpus_profile(tmp_path):
    """A program compiled here: its top-level instructions in the GDN and attention scopes, found
    in its text by their op_name, each given 100 us on a TPU-style device line: their seconds land
    in those categories. Then the CPU's own profile of the same program: at most 10% outside the
    model's categories."""
    compiled = jax.jit(_scoped_step).lower(jnp.ones((128, 128))).compile()
    text = compiled.as_text()
    fused = set(re.findall(r"calls=%?([\w.\-]+)", text))
    top, comp = {}, None
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            comp = head.group(1)
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*op_name=\"([^\"]+)\"", line)
        if m and comp not in fused and re.search(r"\b(fusion|dot|convolution)\(", line):
            top[m.group(1)] = m.group(2)
    gdn = [n for n, op in top.items() if "/gdn/" in op and "dot_general" in op]
    attention = [n for n, op in top.items() if "/attention/" in op and "dot_general" in op]
    assert gdn and attention
    _write_trace(tmp_path, [_op(n, 100 * k, 100) for k, n in enumerate(gdn + attention)])
    ops = profile.sum_ops(profile.op_events(profile.read_trace(str(tmp_path)), profile.module_name(text)), 1)
    got = by_category(ops, text)
    assert got["GDN"] == pytest.approx(100e-6 * len(gdn)) and got["attention"] == pytest.approx(100e-6 * len(attention))
    assert got[UNMATCHED] == 0

    x = jnp.ones((128, 128))
    jax.block_until_ready(compiled(x))
    measured = by_category(profile.trace_ops(lambda: compiled(x), 2, profile.module_name(text)), text)
    assert measured["GDN"] > 0 and measured["attention"] > 0
    assert measured[UNMATCHED] <= 0.1 * sum(measured.values())


def test_traced_ops_go_to_the_category_of_their_instruction():
    """A profile's op names are the compiled program's instruction names: each op's seconds go to the
    category the model gives that instruction; a name the model's walk does not list is kept apart."""


    text = """HloModule step

ENTRY %main (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %dot.1 = bf16[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/gdn_core/dot_general"}
  %dot.2 = bf16[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/mlp/dot_general"}
  ROOT %add.3 = bf16[64,64]{1,0} add(%dot.1, %dot.2), metadata={op_name="jit(step)/add"}
}
"""
    got = by_category({"dot.1": 2e-3, "dot.2": 1.5e-3, "add.3": 1e-3, "copy-start.9": 5e-4}, text)
    assert got["GDN"] == 2e-3 and got["dense matmuls"] == 1.5e-3 and got["the rest"] == 1e-3
    assert got[UNMATCHED] == 5e-4 and got["attention"] == 0.0




def test_op_table_sets_each_heavy_op_beside_the_models_estimate_of_it():
    """The profile's heaviest ops beside the model's seconds for the same instruction, by hand on
    TPU_STYLE with a made-up chip (two devices a chip, so every rate is halved per device): the loop's
    attention fusion runs 4 times (each 2 x 64^3 FLOPs at 1 GFLOP/s a device = 524.288 us, compute
    bound, + 1 us a launch), the dots once; an op the model names that the device does not time, and
    one the device times that the model does not name, both kept."""
    from hybridmoe.analysis.hardware import Hardware
    from hybridmoe.analysis.step_estimate import op_estimates

    hw = Hardware("made-up", devices_per_chip=2, bf16_flops_chip=2e9, fp8_flops_chip=2e9, hbm_bytes_per_s_chip=2e9,
                  hbm_bytes_chip=1e9, vmem_bytes_device=1e6, link_bytes_per_s_chip=2e9, grid_step_s=0.0,
                  op_overhead_s=1e-6)
    est = op_estimates(TPU_STYLE, hw)
    one_dot = 2 * 64 ** 3 / 1e9 + 1e-6
    assert est["fusion.12"] == {"category": "attention", "s": pytest.approx(4 * one_dot), "bound": "compute", "runs": 4}
    assert est["dot.1"]["s"] == pytest.approx(one_dot) and est["dot.1"]["category"] == "GDN"
    assert est["dot.9"]["category"] == "grouped matmuls" and "all-reduce.2" not in est
    # The device's top 3: fusion.12, copy.7, dot.1; the model's: fusion.12, dot.1, dot.9 (walk order on ties).
    rows = profile.op_table({"fusion.12": 3e-3, "dot.1": 4e-4, "copy.7": 1e-3, "add.5": 1e-5}, est, top=3)
    assert [r["op"] for r in rows] == ["fusion.12", "copy.7", "dot.1", "dot.9"]
    assert rows[0] == {"op": "fusion.12", "category": "attention", "measured_s": 3e-3,
                       "estimated_s": pytest.approx(4 * one_dot), "bound": "compute", "runs": 4}
    assert rows[1]["estimated_s"] is None and rows[1]["category"] is None  # timed, not in the model's walk
    assert rows[2]["measured_s"] == 4e-4 and rows[2]["estimated_s"] == pytest.approx(one_dot)
    assert rows[3]["measured_s"] is None and rows[3]["estimated_s"] == pytest.approx(one_dot)  # the model's, untimed


def test_one_devices_ops_are_counted(tmp_path):
    """Every device runs the same program and the estimate is per device: of two devices' lines only
    /device:TPU:0's count (dot.1 100 us, not 100 + 70)."""
    other = [{"ph": "M", "pid": 4, "name": "process_name", "args": {"name": "/device:TPU:1"}},
             {"ph": "M", "pid": 4, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
             {"ph": "X", "pid": 4, "tid": 2, "ts": 0, "dur": 70, "name": "dot.1", "args": {}}]
    _write_trace(tmp_path, [_op("dot.1", 0, 100), *other])
    ops = profile.sum_ops(profile.op_events(profile.read_trace(str(tmp_path))), 1)
    assert ops["dot.1"].seconds == pytest.approx(100e-6)
