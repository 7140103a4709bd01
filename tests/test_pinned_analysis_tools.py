"""Figures and checks of the tools around the analysis pinned by hand: the numerics gates' table and
verdicts (tools/gates.py), memory and step time against depth (tools/depth.py), pass@k
(tools/evaluate.py), the record's writer (tools/record.py), the count search against the device's
memory (run/memory_fit.py) and what the GRPO plan offers it (rl/memory_plan.py). Small fakes stand
in for compiled programs and set-ups; nothing compiles."""

from __future__ import annotations

import json
import math
import types

import jax
import numpy as np
import pytest

from hybridmoe.run import memory_fit as mf
from hybridmoe.run.run_dir import RunError
from hybridmoe.tools import depth, gates
from hybridmoe.tools.evaluate import pass_at_k

GIB = 2**30

# ---------------------------------------------------------------------------------------------
# tools/gates.py


def test_the_gates_table_names_each_metric_measure_and_tolerance():
    assert [(g.name, g.metric, g.measure, g.tolerance) for g in gates.GATES] == [
        ("V1", "kept_frac", "equal", 0.0), ("V2", "loss", "rel", 1e-5), ("N1", "logp_mean", "abs", 5e-5),
        ("N1-last", "logp_mean_last", "abs", 5e-5), ("N2", "entropy", "rel", 1e-4), ("N3", "grad_norm", "rel", 2e-3)]


def test_a_difference_is_absolute_or_relative_to_the_reference():
    rel, ab, eq = (next(g for g in gates.GATES if g.measure == m) for m in ("rel", "abs", "equal"))
    assert gates._difference(rel, 3.0, 2.0) == 0.5 and gates._difference(rel, 1.0, 2.0) == 0.5  # |a - b| / |b|
    assert gates._difference(rel, 1.0, -4.0) == 1.25
    assert gates._difference(ab, 1.0, 4.0) == 3.0
    assert gates._difference(eq, 1.0, 1.0) == 0.0 and gates._difference(eq, 1.0, 0.5) == 1.0
    assert gates._difference(rel, 1e-40, 0.0) == pytest.approx(1e-10)  # a zero reference: over 1e-30


def _run(**m):
    base = {"kept_frac": 1.0, "loss": 2.0, "logp_mean": -3.0, "logp_mean_last": -3.0, "entropy": 4.0,
            "grad_norm": 1.0}
    return [{**base, **m}, {**base, "loss": 99.0}]  # step 1 is never gated


def test_the_gates_pass_at_their_tolerance_and_fail_past_it():
    ref = _run()
    # Each value sits at its tolerance: loss 2 x (1 + 1e-5), log-prob 5e-5 off, entropy 4 x (1 + 1e-4).
    at = _run(loss=2.0 * (1 + 0.9e-5), logp_mean=-3.0 + 4.9e-5, logp_mean_last=-3.0 - 4.9e-5,
              entropy=4.0 * (1 + 0.9e-4), grad_norm=1.0019)
    rows = gates.evaluate(ref, _run(loss=2.0 * (1 + 1e-6)), at)
    assert [r["gate"] for r in rows] == ["V1", "V2", "N1", "N1-last", "N2", "N3"]
    assert all(r["passed"] for r in rows), rows
    v2 = rows[1]
    assert v2["reference"] == 2.0 and v2["candidate"] == 2.0 * (1 + 0.9e-5)
    assert v2["value"] == pytest.approx(0.9e-5) and v2["reference_pair"] == pytest.approx(1e-6)
    assert v2["tolerance"] == 1e-5
    past = {"V1": _run(kept_frac=0.99), "V2": _run(loss=2.0 * (1 + 1.1e-5)), "N1": _run(logp_mean=-3.0 + 5.1e-5),
            "N1-last": _run(logp_mean_last=-3.0 + 5.1e-5), "N2": _run(entropy=4.0 * (1 + 1.1e-4)),
            "N3": _run(grad_norm=1.0021)}
    for name, cand in past.items():
        failed = [r["gate"] for r in gates.evaluate(ref, ref, cand) if not r["passed"]]
        assert failed == [name], (name, failed)


def test_the_gate_table_prints_pass_and_fail_and_each_steps_pair():
    ref, cand = _run(), _run(grad_norm=1.5)
    rows = gates.evaluate(ref, ref, cand)
    text = gates.format_gates(rows, ref, cand, gaps={
        "logp_gap": {"mean": 0.25, "max": 0.5}, "logp_gap_reference_pair": {"mean": 0.0, "max": 0.0},
        "sampler_gap": {"reference": {"sampler_gap_mean": 0.125, "sampler_gap_max": 1.0},
                        "candidate": {"sampler_gap_mean": 0.375, "sampler_gap_max": 2.0}}})
    lines = text.splitlines()
    n3 = next(ln for ln in lines if ln.startswith("N3"))
    assert n3.split()[-5:] == ["1.5", "0.5", "0", "0.002", "FAIL"]
    assert next(ln for ln in lines if ln.startswith("V2")).endswith("PASS")
    assert "mean 0.25  max 0.5   (reference pair: mean 0  max 0)" in text
    assert "reference 0.125 / 1  |  candidate 0.375 / 2" in text
    assert "  0  2 | 2  1 | 1.5  4 | 4  -3 | -3" in text and "  1  99 | 99" in text


def test_the_logp_gap_is_the_mean_and_max_absolute_difference():
    a = {"logp_tokens": np.array([[-1.0, -2.0], [-3.0, -4.0]])}
    b = {"logp_tokens": np.array([[-1.5, -2.0], [-2.0, -4.25]])}
    assert gates.logp_gap(a, b) == {"mean": (0.5 + 0 + 1 + 0.25) / 4, "max": 1.0}
    other = gates.logp_gap(a, {"logp_tokens": np.zeros((2, 3))})
    assert math.isnan(other["mean"]) and math.isnan(other["max"])


def _rl_cfg(**rl):
    r = dict(rollouts_per_step=6, sequence_len=10, max_new_tokens=4, mini_batches=1)
    r.update(rl)
    return types.SimpleNamespace(rl=types.SimpleNamespace(**r), train=types.SimpleNamespace(seed=3),
                                 model=types.SimpleNamespace(vocab_size=50))


def test_the_gate_batches_are_rollout_rows_of_the_sequence_with_completions_of_max_new_tokens():
    cfg = _rl_cfg()
    assert gates.batch_tokens(cfg) == 6 * 4  # completion tokens only
    rollout, adv = gates.random_rollout(cfg, 0)
    assert rollout["tokens"].shape == (6, 10) and rollout["tokens"].min() >= 1 and rollout["tokens"].max() < 50
    assert (rollout["segment_ids"] == 1).all() and (rollout["positions"][2] == np.arange(10)).all()
    assert (rollout["lengths"] == 4).all() and adv.shape == (6,) and adv.dtype == np.float32
    again, adv2 = gates.random_rollout(cfg, 0)
    other, _ = gates.random_rollout(cfg, 1)
    assert (again["tokens"] == rollout["tokens"]).all() and (adv2 == adv).all()
    assert (other["tokens"] != rollout["tokens"]).any()


def test_run_gates_runs_the_reference_twice_and_compares_the_candidate_with_the_first(monkeypatch):
    calls = []

    def run_arm(cfg, steps, with_sampler_gap=True):
        calls.append((cfg, steps, with_sampler_gap))
        offset = {"ref": 0.0, "cand": 1.0}[cfg] + 0.25 * (len(calls) == 2)
        return {"steps": _run(loss=2.0 + offset), "logp_tokens": np.full((2, 2), offset),
                "sampler_gap": None if not with_sampler_gap else {"sampler_gap_mean": offset, "sampler_gap_max": 0.0}}

    monkeypatch.setattr(gates, "run_arm", run_arm)
    out = gates.run_gates("ref", "cand", steps=2)
    assert calls == [("ref", 2, True), ("ref", 2, False), ("cand", 2, True)]
    v2 = next(r for r in out["gates"] if r["gate"] == "V2")
    assert v2["value"] == 0.5 and v2["reference_pair"] == 0.125 and not out["passed"]
    assert out["gaps"]["logp_gap"] == {"mean": 1.0, "max": 1.0}
    assert out["gaps"]["logp_gap_reference_pair"] == {"mean": 0.25, "max": 0.25}
    assert out["gaps"]["sampler_gap"]["candidate"]["sampler_gap_mean"] == 1.0
    with pytest.raises(ValueError, match="at least one step"):
        gates.run_gates("ref", "cand", steps=0)


# ---------------------------------------------------------------------------------------------
# tools/depth.py


def test_extrapolation_over_two_blocks_apart_divides_by_their_distance():
    """Blocks of 2 layers, compiled at 4 and 8 layers (2 and 4 blocks), extrapolated to 20 (10 blocks):
    argument 100 -> 160 is 30 a block, 100 + 30 x 8 = 340; temp 50 -> 57 is 3.5 a block (rounded to 4
    as a figure), 50 + 3.5 x 8 = 78."""
    mem = {8: {"argument": 160, "temp": 57, "total": 217, "default_space": 200},
           4: {"argument": 100, "temp": 50, "total": 150, "default_space": None}}
    d = depth.extrapolate(mem, 2, 20, hbm=400)
    assert d["per_block"] == {"argument": 30, "temp": 4, "total": 34, "default_space": None}
    assert d["extrapolated"] == {"layers": 20, "blocks": 10, "argument": 340, "temp": 78, "total": 418,
                                 "default_space": None}
    assert d["compiled"][0] == {"layers": 4, "blocks": 2, "argument": 100, "temp": 50, "total": 150,
                                "default_space": None}
    assert d["fits"] is False and depth.extrapolate(mem, 2, 20, hbm=418)["fits"] is True
    assert depth.extrapolate(mem, 2, 20, hbm=None)["fits"] is None


def test_the_extrapolated_step_fits_by_its_default_space_where_both_depths_report_one():
    """Default space 200 -> 230 over one block (blocks of 4: 8 and 12 layers) is 290 at 20 layers (5
    blocks): it fits 300 though the summed total, 250 -> 300, extrapolates to 400."""
    mem = {8: {"argument": 50, "temp": 200, "total": 250, "default_space": 200},
           12: {"argument": 60, "temp": 240, "total": 300, "default_space": 230}}
    d = depth.extrapolate(mem, 4, 20, hbm=300)
    assert d["extrapolated"]["default_space"] == 290 and d["extrapolated"]["total"] == 400
    assert d["fits"] is True and depth.extrapolate(mem, 4, 20, hbm=289)["fits"] is False


def test_the_two_depths_may_reach_the_models_own():
    """The deeper compile may be the model itself (8 + 4 = its 12 layers), not past it; the other
    refusals are test_inspect_memory's."""
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(layer_pattern=("gdn", "gdn", "gdn", "attention"),
                                                            num_layers=12))
    assert depth.depths(cfg, 8) == (8, 12)
    with pytest.raises(ValueError, match="the model has 12 layers"):
        depth.depths(cfg, 12)


def test_the_depth_table_prints_gib_rows_and_the_verdict():
    d = {"block_layers": 4, "hbm": 16 * GIB, "fits": False,
         "compiled": [{"layers": 8, "blocks": 2, "argument": GIB, "temp": 2 * GIB, "total": 3 * GIB,
                       "default_space": None},
                      {"layers": 12, "blocks": 3, "argument": 1.5 * GIB, "temp": 2 * GIB, "total": 3.5 * GIB,
                       "default_space": None}],
         "per_block": {"argument": GIB // 2, "temp": 0, "total": GIB // 2, "default_space": None},
         "extrapolated": {"layers": 60, "blocks": 15, "argument": 7.5 * GIB, "temp": 2 * GIB, "total": 9.5 * GIB,
                          "default_space": None}}
    lines = depth.format_depth(d).splitlines()
    assert lines[0].startswith("memory against depth (per device, GiB): compiled at 8 and 12 layers (blocks of 4)")
    assert lines[2].split() == ["compiled", "2", "8", "1.00", "2.00", "3.00", "-"]
    assert lines[4].split() == ["per", "block", "(difference)", "1", "4", "0.50", "0.00", "0.50", "-"]
    assert lines[5].split() == ["EXTRAPOLATED", "15", "60", "7.50", "2.00", "9.50", "-"]
    assert lines[6] == "  HBM per device 16.00 GiB: the extrapolated step does NOT fit"
    small = {**d, "hbm": None, "extrapolated": {**d["extrapolated"], "total": GIB - 1},
             "compiled": [{**r, "total": 2**20} for r in d["compiled"]]}
    assert "(per device, MiB)" in depth.format_depth(small)


def test_an_estimate_is_carried_along_the_line_through_two_depths():
    """At 8 and 12 layers (blocks of 4) to 20: t = (5 - 2) / (3 - 2) = 3. Compute 1 -> 1.5 s is 1 + 3 x 0.5
    = 2.5 s; collectives 0.2 -> 0.3 s: 0.5 s; a kernel only the deeper one has: 0 -> 4 calls is 12."""
    def est(compute_s, coll_s, calls, designed):
        cats = {"dense matmuls": {"s": compute_s, "flops": 10.0}, "collectives": {"s": coll_s, "flops": 0.0}}
        return {"categories": cats, "collectives": {"all-gather": {"s": coll_s, "wire_bytes": 100.0}},
                "kernels": {"k": {"calls": calls}} if calls else {}, "tokens_per_step": 1000, "chips": 2,
                "hardware": {"bf16_flops_chip": 4e12, "devices_per_chip": 2}, "designed_flops_per_device": designed,
                "name": "deeper" if calls else "shallower"}
    out = depth.extrapolate_estimate({12: est(1.5, 0.3, 4, 20.0), 8: est(1.0, 0.2, 0, 10.0)}, 4, 20, 6e12)
    assert out["categories"]["dense matmuls"]["s"] == pytest.approx(2.5)
    assert out["categories"]["dense matmuls"]["flops"] == pytest.approx(10.0)
    assert out["collectives"]["all-gather"]["s"] == pytest.approx(0.5)
    assert out["kernels"]["k"]["calls"] == pytest.approx(12)
    assert out["serial"]["step_s"] == pytest.approx(3.0) and out["overlapped"]["step_s"] == pytest.approx(2.5)
    assert out["serial"]["tokens_per_s_per_chip"] == pytest.approx(1000 / 3.0 / 2)
    # MFU against the per-device peak: 4e12 a chip over 2 devices.
    assert out["overlapped"]["mfu"] == pytest.approx(6e12 / (2.5 * 2e12))
    assert out["designed_flops_per_device"] == pytest.approx(40.0)
    assert out["extrapolated_from_layers"] == [8, 12] and out["layers"] == 20 and out["name"] == "deeper"


# ---------------------------------------------------------------------------------------------
# tools/evaluate.py and tools/record.py


def test_pass_at_k_is_one_less_the_chance_that_k_draws_all_fail():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - (3 * 2) / (5 * 4))  # 1 - C(3, 2) / C(5, 2) = 0.7
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - (3 * 2 * 1) / (5 * 4 * 3))  # 0.9
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(3, 3, 3) == 1.0 and pass_at_k(3, 0, 3) == 0.0


def test_a_record_is_written_whole_as_indented_json(tmp_path, capsys):
    from hybridmoe.tools.record import COMMIT_STAMP, commit_of, write_record

    path = tmp_path / "rec.json"
    write_record(path, {"a": 1, "b": [2]})
    assert path.read_text() == json.dumps({"a": 1, "b": [2]}, indent=1) + "\n"
    assert not (tmp_path / "rec.json.tmp").exists() and f"wrote {path}" in capsys.readouterr().out
    (tmp_path / COMMIT_STAMP).write_text("abc123+modified\n")
    assert commit_of(tmp_path) == "abc123+modified"
    assert commit_of(tmp_path / "hybridmoe") == ""  # not a checkout's root, no stamp: unknown


# ---------------------------------------------------------------------------------------------
# run/memory_fit.py


def _analysis(a, t, o, alias):
    m = types.SimpleNamespace(argument_size_in_bytes=a, temp_size_in_bytes=t, output_size_in_bytes=o,
                              alias_size_in_bytes=alias)
    return types.SimpleNamespace(memory_analysis=lambda: m)


def test_a_programs_need_is_arguments_temporaries_and_outputs_less_aliased():
    assert mf.program_bytes(_analysis(10, 20, 30, 7)) == 53


def test_a_tpu_compile_takes_the_default_space_and_falls_back_to_the_programs_figure(monkeypatch):
    import hybridmoe.analysis.program as program

    compiled = _analysis(10, 20, 30, 7)
    space = iter([41, None])
    monkeypatch.setattr(program, "compile_with_buffers", lambda lowered, buffers: (compiled, [], next(space)))
    assert mf.compile_measured(object(), "tpu") == (compiled, 41)
    assert mf.compile_measured(object(), "tpu") == (compiled, 53)
    assert mf.compile_measured(types.SimpleNamespace(compile=lambda: compiled), "cpu") == (compiled, 53)


def test_the_budget_is_the_set_figure_or_the_devices_free_memory(monkeypatch):
    dev = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 1000, "bytes_in_use": 300})
    monkeypatch.setattr(mf.jax, "local_devices", lambda: [dev])
    cfg = lambda gib: types.SimpleNamespace(run=types.SimpleNamespace(memory_budget_gib=gib))  # noqa: E731
    assert mf.memory_budget_bytes(cfg(None)) == 700
    assert mf.memory_budget_bytes(cfg(0.25)) == GIB // 4
    dev.memory_stats = lambda: {"bytes_in_use": 300}  # no limit reported: unknown
    assert mf.memory_budget_bytes(cfg(None)) is None


def test_a_count_is_passed_over_when_its_scaled_need_is_over_the_budget():
    """First count 2 needs 10 GiB of which 4 are fixed: at count 4 the rest shrinks to 6 x 2 / 4 = 3 GiB,
    7 GiB in all; at 3, 4 + 6 x 2 / 3 = 8 GiB."""
    first = mf.Fit(2, object(), 10 * GIB)
    assert mf.cannot_fit(first, 4, 7 * GIB - 1, fixed_bytes=4 * GIB)
    assert not mf.cannot_fit(first, 4, 7 * GIB, fixed_bytes=4 * GIB)
    assert mf.cannot_fit(first, 3, 8 * GIB - 1, fixed_bytes=4 * GIB)
    assert not mf.cannot_fit(first, 3, 8 * GIB, fixed_bytes=4 * GIB)
    assert not mf.cannot_fit(first, 4, None, fixed_bytes=4 * GIB)
    # A refusal: its figure (temporaries) is the shrinking part's floor, the fixed part added to it.
    refused = mf.Fit(1, None, None, least_need=6 * GIB)
    assert refused.need_floor == 6 * GIB and mf.Fit(1, None, 5).need_floor == 5
    assert mf.cannot_fit(refused, 2, 7 * GIB - 1, fixed_bytes=4 * GIB)  # 4 + 6 / 2 = 7 GiB
    assert not mf.cannot_fit(refused, 2, 7 * GIB, fixed_bytes=4 * GIB)
    assert not mf.cannot_fit(mf.Fit(1, None, None), 2, 1, fixed_bytes=0)  # no figure: nothing ruled out


def test_a_compile_refused_for_memory_is_a_fit_without_a_program_and_anything_else_raises():
    def refused(count):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. "
                                         "Used 3.00G of 2.00G hbm.")

    fit = mf.compile_or_refusal(refused, 4)
    assert (fit.count, fit.compiled, fit.need, fit.least_need) == (4, None, None, 3 * GIB)
    assert mf._need_words(fit, "the step") == ("the device's compiler refused the step for memory "
                                               "(3.00 GiB of temporaries)")
    with pytest.raises(jax.errors.JaxRuntimeError):
        mf.compile_or_refusal(lambda c: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INTERNAL: x")), 1)
    prog = _analysis(1, 2, 3, 0)
    assert mf.compile_or_refusal(lambda c: prog, 2) == mf.Fit(2, prog, 6)
    assert mf.compile_or_refusal(lambda c: (prog, 99), 2) == mf.Fit(2, prog, 99)
    assert mf._need_words(mf.Fit(2, prog, int(1.5 * GIB)), "the step") == "the step needs 1.50 GiB per device"


def test_a_set_count_over_the_budget_is_refused_naming_the_smallest_that_fits():
    needs = {1: 9 * GIB, 2: 6 * GIB, 4: 4 * GIB, 8: 3 * GIB}
    compiled = []

    def compile_at(count):
        compiled.append(count)
        return object(), needs[count]

    with pytest.raises(RunError) as err:
        mf.choose_count("rl.micro_batches", 1, [1, 2, 4, 8], compile_at, 5 * GIB, "the update")
    assert str(err.value).startswith("rl.micro_batches=1: the update needs 9.00 GiB per device, over the budget "
                                     "of 5.00 GiB per device")
    assert "the smallest count that fits is rl.micro_batches=4 (or rl.micro_batches=auto)" in str(err.value)
    # 1's figure does not rule 2 out (9 x 1 / 2 = 4.5 GiB is within 5): 2 is compiled, then 4 fits; 8 is not tried.
    assert compiled == [1, 2, 4]
    compiled.clear()
    assert mf.choose_count("k.n", "auto", [1, 2, 4, 8], compile_at, 6 * GIB, "x").count == 2
    assert mf.choose_count("k.n", 2, [1, 2, 4, 8], compile_at, 6 * GIB, "x").need == 6 * GIB
    assert mf.choose_count("k.n", 1, [1, 2, 4, 8], compile_at, None, "x").count == 1  # unchecked
    with pytest.raises(RunError, match=r"k.n=auto: x fits the budget of 2.00 GiB .* none of the counts \[1, 2, 4, 8\]"):
        mf.choose_count("k.n", "auto", [1, 2, 4, 8], compile_at, 2 * GIB, "x")
    with pytest.raises(RunError, match="no count up to 8 fits"):
        mf.choose_count("k.n", 4, [1, 2, 4, 8], compile_at, 2 * GIB, "x")


def test_counts_shards_and_a_resolved_setting():
    assert mf.divisor_counts(12, 2) == [1, 2, 3, 6]  # 12 / m rows a micro-batch, even
    assert mf.divisor_counts(6) == [1, 2, 3, 6]  # one row a micro-batch too
    assert mf.fits(10, 10) and not mf.fits(11, 10) and mf.fits(10**12, None)
    from hybridmoe.config.schema import Config

    base = Config()
    cfg = mf.with_count(base, "rl.micro_batches", 4)
    assert cfg.rl.micro_batches == 4 and cfg.rl.rollouts_per_step == base.rl.rollouts_per_step
    assert cfg.train == base.train and base.rl.micro_batches != 4
    mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 3, "tensor": 5})
    def spec(s):
        return types.SimpleNamespace(batch_sharding=lambda i: types.SimpleNamespace(spec=(s,)), mesh=mesh)

    assert mf.batch_shards(spec(("data", "fsdp"))) == 6
    assert mf.batch_shards(spec("fsdp")) == 3 and mf.batch_shards(spec(None)) == 1


def test_per_device_bytes_counts_each_leafs_shard():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    s = NamedSharding(mesh, PartitionSpec())
    tree = {"a": jax.ShapeDtypeStruct((4, 8), np.float32, sharding=s),
            "b": jax.ShapeDtypeStruct((3,), jax.numpy.bfloat16, sharding=s)}
    assert mf.per_device_bytes(tree) == 4 * 8 * 4 + 3 * 2

    class Half:  # a sharding that splits the first dim in two
        def shard_shape(self, shape):
            return (shape[0] // 2, *shape[1:])

    halves = [types.SimpleNamespace(shape=(4, 8), dtype=np.dtype(np.float32), sharding=Half())]
    assert mf.per_device_bytes(halves) == 2 * 8 * 4


# ---------------------------------------------------------------------------------------------
# rl/memory_plan.py


def _plan_setup(monkeypatch, **rl):
    import hybridmoe.rl.memory_plan as mp

    offered = {}

    def choose_count(key, setting, counts, compile_at, budget, what, fixed_bytes=0):
        offered[what] = {"key": key, "setting": setting, "counts": list(counts), "budget": budget,
                         "fixed": fixed_bytes}
        return mf.Fit(counts[-1], None, 0)  # the most micro-batches offered

    monkeypatch.setattr(mp, "choose_count", choose_count)
    monkeypatch.setattr(mp, "batch_shards", lambda setup: 2)
    monkeypatch.setattr(mp, "per_device_bytes", lambda tree: tree if isinstance(tree, int) else sum(tree.values()))
    r = dict(prompts_per_step=6, group_size=2, rollouts_per_step=12, mini_batches=2, updates_per_rollout=2,
             micro_batches=3, rollout_batches="auto")
    r.update(rl)
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(**r))
    setup = types.SimpleNamespace(cfg=cfg, abstract_state=lambda: {"opt_state": 300, "params": 100})
    return mp, setup, offered


def test_the_update_plan_offers_its_rows_counts_and_holds_the_state_and_reference(monkeypatch):
    """12 rollouts in 2 mini-batches: 6 rows an update, split over 2 shards: 1 or 3 micro-batches. The
    update holds the state (400) and, with a reference policy, its params again (100). The pi_old pass
    runs over all 12 rows: 1, 2, 3, 6 micro-batches; it holds the params (100)."""
    mp, setup, offered = _plan_setup(monkeypatch)
    assert mp.update_rows_per_step(setup.cfg) == 6
    assert mp.update_held_bytes(setup, True) == 500 and mp.update_held_bytes(setup, False) == 400
    plan = mp.plan_updates(setup, True, 1000)
    assert offered["the GRPO update"] == {"key": "rl.micro_batches", "setting": 3, "counts": [1, 3], "budget": 1000,
                                          "fixed": 500}
    assert offered["the pi_old pass"] == {"key": "rl.micro_batches", "setting": 3, "counts": [1, 2, 3, 6],
                                          "budget": 1000, "fixed": 100}
    assert plan.micro_batches == 3 and plan.old_logprobs_micro_batches == 6
    mp2, setup2, offered2 = _plan_setup(monkeypatch, updates_per_rollout=1, micro_batches="auto")
    plan2 = mp2.plan_updates(setup2, False, None)
    assert "the pi_old pass" not in offered2 and plan2.old_logprobs is None
    assert offered2["the GRPO update"]["setting"] == "auto" and offered2["the GRPO update"]["fixed"] == 400
    assert plan2.old_logprobs_micro_batches == plan2.micro_batches


def test_the_sampler_plan_leaves_room_for_what_stays_beside_it(monkeypatch):
    """6 prompts of 2 rows: passes of 6, 3, 2 or 1 prompts (12, 6, 4, 2 rows, each even over 2 shards); its
    budget less the optimizer state (300) and, with a reference policy, the params (100); fixed: the params."""
    mp, setup, offered = _plan_setup(monkeypatch, group_size=1)
    mp.plan_rollout(setup, None, True, 1000)
    # group 1: 6, 3, 2, 1 prompts a pass are 6, 3, 2, 1 rows; 3 and 1 do not split over 2 shards.
    assert offered["the sampler"] == {"key": "rl.rollout_batches", "setting": "auto", "counts": [1, 3],
                                      "budget": 1000 - 300 - 100, "fixed": 100}
    mp.plan_rollout(setup, None, False, 1000, setting=2)
    assert offered["the sampler"]["budget"] == 700 and offered["the sampler"]["setting"] == 2
    mp.plan_rollout(setup, None, False, None)
    assert offered["the sampler"]["budget"] is None
    # Groups of 2: every pass (12, 6, 4, 2 rows) splits over the 2 shards.
    mp, setup, offered = _plan_setup(monkeypatch, group_size=2)
    assert mp.plan_rollout(setup, None, False, 1000).count == 6
    assert offered["the sampler"]["counts"] == [1, 2, 3, 6]


def test_the_abstract_update_batch_has_each_fields_shape(monkeypatch):
    import hybridmoe.rl.memory_plan as mp

    keys = ("tokens", "segment_ids", "positions", "logp_sampler", "mask", "advantages", "keep", "normalizer",
            "logp_old", "on_policy", "routing")
    monkeypatch.setattr(mp, "update_batch_shardings", lambda setup, with_old_logprobs: {k: None for k in keys})
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(sequence_len=10),
                                model=types.SimpleNamespace(num_layers=3, num_experts_per_tok=2))
    b = mp.abstract_update_batch(cfg, None, 2, 8, True)
    shapes = {k: (v.shape, v.dtype.name) for k, v in b.items()}
    assert shapes == {"tokens": ((2, 4, 10), "int32"), "segment_ids": ((2, 4, 10), "int32"),
                      "positions": ((2, 4, 10), "int32"), "logp_sampler": ((2, 4, 9), "float32"),
                      "mask": ((2, 4, 9), "float32"), "advantages": ((2, 4), "float32"), "keep": ((2, 4), "bool"),
                      "normalizer": ((2,), "float32"), "logp_old": ((2, 4, 9), "float32"),
                      "on_policy": ((2,), "bool"), "routing": ((2, 4, 10, 3, 2), "int32")}


def test_the_gates_log_prob_figures_from_a_rows_per_position_log_probs():
    """Rows of 5 tokens after a prompt of 3: positions 2.. score the completion's tokens 3.."""
    logp = np.array([[-9.0, -9.0, -1.0, -2.0], [-9.0, -9.0, -3.0, -4.0], [-9.0, -9.0, -5.0, -6.0]])
    assert (gates.completion_logprobs(logp, 3) == logp[:, 2:]).all()
    sampler = np.array([[-1.5, -2.0], [-3.0, -3.0], [-5.0, -6.25]])
    assert gates.sampler_gap_of(logp, sampler, 3) == {"sampler_gap_mean": (0.5 + 0 + 0 + 1 + 0 + 0.25) / 6,
                                                      "sampler_gap_max": 1.0}
    # The last micro-batch: the batch's last 2 rows, masked: (-9 x 0 + -3 + -4 + -5 + -6 x 0 ...) over the mask.
    mask = np.array([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    assert gates.last_micro_batch_logp(logp, mask) == (-3.0 - 4.0 - 9.0 - 5.0) / 4
    m = gates.step_metrics(_rl_cfg(), {"kept_tokens": np.float32(12), "loss": np.float32(0.5)}, -2.5)
    assert m == {"kept_tokens": 12.0, "loss": 0.5, "kept_frac": 12 / (6 * 4), "logp_mean_last": -2.5}


def test_a_set_count_refused_rules_out_the_counts_its_figure_puts_over_the_budget():
    """Count 1 needs 9 GiB against 4: count 2 would need at least 9 / 2 = 4.5 (passed over, never compiled),
    count 4 at least 2.25 (compiled: 4 GiB, fits)."""
    needs = {1: 9 * GIB, 2: 3 * GIB, 4: 4 * GIB, 8: 3 * GIB}
    compiled = []

    def compile_at(count):
        compiled.append(count)
        return object(), needs[count]

    with pytest.raises(RunError, match="the smallest count that fits is n.m=4"):
        mf.choose_count("n.m", 1, [1, 2, 4, 8], compile_at, 4 * GIB, "x")
    assert compiled == [1, 4]
    compiled.clear()
    assert mf.choose_count("n.m", "auto", [1, 2, 4, 8], compile_at, 4 * GIB, "x").count == 4
    assert compiled == [1, 4]


def test_a_kept_measurement_compiles_for_the_set_ups_platform_once(monkeypatch):
    seen = []
    monkeypatch.setattr(mf, "compile_measured", lambda lowered, platform: seen.append((lowered, platform)) or ("c", 7))
    kept = {}

    class Setup:
        mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="tpu")]))

        def context(self):
            import contextlib
            return contextlib.nullcontext()

        def kept(self, key, make):
            if key not in kept:
                kept[key] = make()
            return kept[key]

    assert mf.kept_measured(Setup(), "k", lambda: "lowered") == ("c", 7)
    assert mf.kept_measured(Setup(), "k", lambda: "other") == ("c", 7)
    assert seen == [("lowered", "tpu")]


def test_the_machine_record_names_the_accelerator_and_its_count(monkeypatch):
    from hybridmoe.tools import record

    monkeypatch.setattr(record, "source_commit", lambda: "abc")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")])
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    rec = record.machine_record()
    assert rec["device"] == "TPU v5 lite x 4" and rec["backend"] == "tpu" and rec["commit"] == "abc"
    assert rec["versions"]["jax"] == jax.__version__ and rec["date"].endswith("+00:00")
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="cpu", device_kind="cpu")])
    assert record.machine_record()["device"] == "cpu"


def test_the_depth_verdict_says_fits_or_unknown():
    base = {"block_layers": 4, "hbm": 2 * GIB, "fits": True,
            "compiled": [{"layers": 8, "blocks": 2, "argument": 1, "temp": 1, "total": GIB, "default_space": 5}] * 2,
            "per_block": {"argument": 0, "temp": 0, "total": 0, "default_space": 0},
            "extrapolated": {"layers": 60, "blocks": 15, "argument": 1, "temp": 1, "total": GIB, "default_space": 5}}
    assert depth.format_depth(base).endswith("HBM per device 2.00 GiB: the extrapolated step fits")
    assert depth.format_depth({**base, "fits": None}).endswith("the extrapolated step -")
    assert "HBM per device" not in depth.format_depth({**base, "hbm": None})


def test_counts_are_ruled_out_by_the_first_counts_figure_not_a_later_ones():
    """Needs 10 GiB at 1, 12 at 2 (the compiler packed it worse), 3 at 4, against 5: 2 is compiled (10 / 2
    = 5 is not over), 4 is compiled too (10 / 4 = 2.5), though 2's 12 GiB scaled (12 x 2 / 4 = 6) would
    have passed it over."""
    needs = {1: 10 * GIB, 2: 12 * GIB, 4: 3 * GIB}
    compiled = []

    def compile_at(count):
        compiled.append(count)
        return object(), needs[count]

    assert mf.fewest_that_fit([1, 2, 4], compile_at, 5 * GIB).count == 4
    assert compiled == [1, 2, 4]


def test_the_measured_programs_lower_their_batches_rows(monkeypatch):
    """The update lowers one update's rows (12 / 2 mini-batches = 6) with pi_old's log-probs when a rollout
    takes several updates, and the params as the reference; the pi_old pass all 12 rows, without them."""
    import hybridmoe.rl.memory_plan as mp

    mp_, setup, _ = _plan_setup(monkeypatch)
    batches = []
    monkeypatch.setattr(mp, "kept_measured", lambda setup, key, lower: (key, lower()))
    monkeypatch.setattr(mp, "abstract_update_batch",
                        lambda cfg, setup, M, rows, with_old: batches.append((M, rows, with_old)) or "batch")
    lowered = types.SimpleNamespace(lower=lambda *args: args)
    monkeypatch.setattr(mp, "jit_grpo_step", lambda setup, with_reference: lowered)
    monkeypatch.setattr(mp, "jit_old_logprobs", lambda setup: lowered)
    setup.abstract_state = lambda: {"params": "P", "opt_state": "O"}
    key, args = mp.update_measured(setup, True, 3)
    assert key == ("grpo_update_program", True, 3) and args == ({"params": "P", "opt_state": "O"}, "P", "batch")
    assert batches == [(3, 6, True)]
    assert mp.update_measured(setup, False, 2)[1][1] is None
    key, args = mp.old_logprobs_measured(setup, 4)
    assert key == ("old_logprobs_program", 4) and args == ("P", "batch") and batches[-1] == (4, 12, False)
    setup.cfg.rl.updates_per_rollout = 1
    mp.update_measured(setup, False, 1)
    assert batches[-1] == (1, 6, False)


def test_a_count_the_compiler_refused_never_fits_even_unchecked():
    def compile_at(count):
        if count == 1:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. "
                                             "Used 3.00G of 2.00G hbm.")
        return object(), 1

    assert mf.fewest_that_fit([1, 2], compile_at, None).count == 2
    with pytest.raises(RunError, match="n.m=1: the device's compiler refused x for memory"):
        mf.choose_count("n.m", 1, [1], compile_at, None, "x")


def test_the_sampler_gaps_prompts_are_full_length_rows_of_real_tokens():
    cfg = _rl_cfg(max_prompt_len=7, rollouts_per_step=40)
    cfg.model.vocab_size = 3
    prompts = np.array(gates.sampler_gap_prompts(cfg))
    assert prompts.shape == (40, 7) and set(np.unique(prompts)) == {1, 2}  # never the pad id 0
    assert (np.array(gates.sampler_gap_prompts(cfg)) == prompts).all()
