"""Figures of benchmark scripts no other test reads: the memory-only read against the whole compile
(benchmarks/inspect_memory_only.py) and the GPU attention benchmark's model FLOPs
(benchmarks/attention_gpu.py). Nothing compiles; the scripts' JAX set-up on import is stubbed."""

from __future__ import annotations

import types

import pytest

from helpers import benchmark_script_unconfigured

_load = benchmark_script_unconfigured
GIB = 2**30


def _program(default_space, argument, buffers, categories, collectives, step_s):
    return {"memory": {"default_space": default_space, "argument": argument}, "peak_buffers": buffers,
            "peak_by_category": {"categories": categories}, "collectives": collectives,
            "step_estimate": None if step_s is None else {"serial": {"step_s": step_s},
                                                           "overlapped": {"step_s": step_s / 2}}}


def test_memory_only_compare_pairs_each_figure_with_the_whole_compiles_own():
    mod = _load("inspect_memory_only")
    fast = _program(10 * GIB, 3 * GIB, [{"bytes": 1}], {"moe": 5}, [{"kind": "all-gather"}], 2.0)
    whole = _program(10 * GIB, 4 * GIB, [{"bytes": 1}], {"moe": 6}, [{"kind": "all-gather"}], 2.5)
    rows = mod.compare(fast, whole)
    assert list(rows) == ["default_space", "argument", "peak_buffers", "peak_categories", "collectives",
                          "step_estimate_s"]
    # Scalars and dicts carry both values; the lists (buffers, collectives) only their verdict.
    assert rows["default_space"] == {"equal": True, "memory_only": 10 * GIB, "whole": 10 * GIB}
    assert rows["argument"] == {"equal": False, "memory_only": 3 * GIB, "whole": 4 * GIB}
    assert rows["peak_buffers"] == {"equal": True}
    assert rows["peak_categories"] == {"equal": False, "memory_only": {"moe": 5}, "whole": {"moe": 6}}
    assert rows["collectives"] == {"equal": True}
    # The serial step seconds, not the overlapped ones.
    assert rows["step_estimate_s"] == {"equal": False, "memory_only": 2.0, "whole": 2.5}
    # A side without an estimate reads None.
    none = mod.compare(_program(1, 1, [], {}, [], None), whole)["step_estimate_s"]
    assert none == {"equal": False, "memory_only": None, "whole": 2.5}
    # Only the argument differs in the fixture's other fields: each figure is read from its own key.
    other = mod.compare(fast, {**fast, "memory": {"default_space": 9 * GIB, "argument": 3 * GIB}})
    assert other["default_space"]["equal"] is False and other["argument"]["equal"] is True
    assert mod.compare(fast, {**fast, "peak_buffers": []})["peak_buffers"] == {"equal": False}
    assert mod.compare(fast, {**fast, "collectives": []})["collectives"] == {"equal": False}


def test_memory_only_record_times_the_read_and_the_whole_compile_from_the_call(tmp_path, monkeypatch, capsys):
    import json
    import threading

    import hybridmoe.analysis.step_estimate as se
    import hybridmoe.recipe as recipe_mod
    from hybridmoe.tools import train_program as tp

    mod = _load("inspect_memory_only")
    whole = _program(10 * GIB, 3 * GIB, [], {}, [], 2.0)
    whole.update(recipe="small", overrides=["a=1"])
    against = tmp_path / "whole.json"
    against.write_text(json.dumps({"programs": {"base": whole}, "target": "tpu7x:2x2x1", "commit": "abcdef123456"}))
    seen = {}
    monkeypatch.setattr(recipe_mod, "load_config", lambda r, o, platform: seen.update(cfg=(r, o, platform)) or "cfg")
    monkeypatch.setattr(tp, "tpu_target", lambda name: f"target:{name}")
    monkeypatch.setattr(tp, "compile_step", lambda cfg, target, **kw: seen.update(step=(cfg, target, kw)) or "step")
    # The read's default space: 5.5 GiB exactly (5.5 * 2**30), recorded as 5.5.
    monkeypatch.setattr(tp, "step_facts", lambda step: _program(int(5.5 * GIB), 3 * GIB, [], {}, [], None))
    monkeypatch.setattr(se, "estimate_step", lambda step: {"serial": {"step_s": 2.0}})
    # perf_counter: 100 at the call, 130 after the read, 190 once the compile's thread is done.
    clock = iter([100.0, 130.0, 190.0])
    monkeypatch.setattr(mod, "time", types.SimpleNamespace(perf_counter=lambda: next(clock),
                                                           strftime=lambda fmt: "00:00:00"))
    monkeypatch.setattr(threading, "enumerate", lambda: [])
    written = {}
    monkeypatch.setattr(mod.harness, "write", lambda out, name, **f: written.update(out=out, name=name, **f))
    assert mod.main(["--against", str(against), "--out", str(tmp_path / "rec.json")]) == 0
    assert seen["cfg"] == ("small", ["a=1"], "tpu")
    assert seen["step"] == ("cfg", "target:tpu7x:2x2x1", {"program_name": "train", "with_residuals": False,
                                                          "memory_only": True})
    assert written["name"] == "inspect_memory_only" and written["program"] == "train"
    assert (written["read_s"], written["whole_s"]) == (30.0, 90.0)
    assert written["read_before_the_end"] is False
    assert written["default_space_gib"] == 5.5
    assert written["against_commit"] == "abcdef123456" and written["target"] == "tpu7x:2x2x1"
    assert written["figures"]["step_estimate_s"] == {"equal": True, "memory_only": 2.0, "whole": 2.0}
    assert written["figures"]["default_space"]["equal"] is False
    out = capsys.readouterr().out
    assert "read at 30 s; the same compile done at 90 s" in out and "(commit abcdef1)" in out


def test_attention_gpu_model_flops_are_three_and_a_half_causal_forwards():
    mod = _load("attention_gpu")
    # Forward: 2 matmuls of B N T T A multiply-adds (2 FLOPs each), half of them under the causal mask:
    # 4 B N T^2 A / 2; with the backward's 2.5 forwards, 3.5 forwards.
    B, T, N, A = 2, 1024, 16, 256
    forward = 4 * B * N * T * T * A / 2
    assert mod.model_flops(B, T, N, A) == forward * 3.5 == 2 * 2 * 16 * 1024 * 1024 * 256 * 3.5
    assert mod.model_flops(1, 2048, 16, 256) == pytest.approx(2 * 16 * 2048**2 * 256 * 3.5, rel=0)


def test_fp8_gmm_train_final_loss_is_the_last_ten_steps_mean_and_the_gap_fp8_over_bf16(tmp_path, monkeypatch):
    import sys
    from unittest import mock

    import matplotlib.pyplot as plt

    mod = _load("fp8_gmm_train")
    monkeypatch.setattr(plt, "subplots", lambda **kw: (mock.MagicMock(), mock.MagicMock()))  # no figure drawn
    # Twelve steps: two of loss 100 then ten of 2.0 (bf16) or 2.5 (fp8): final losses 2.0 and 2.5.
    curves = {False: [100.0, 100.0] + [2.0] * 10, True: [100.0, 100.0] + [2.5] * 10}
    monkeypatch.setattr(mod, "load_config", lambda recipe, over: (recipe, tuple(over)))
    monkeypatch.setattr(mod, "train", lambda cfg, _, progress: [{"loss": x} for x in curves["quant.fp8_gmm=true" in cfg[1]]])
    written = {}
    monkeypatch.setattr(mod.harness, "write", lambda out, name, **f: written.update(name=name, **f))
    monkeypatch.setattr(sys, "argv", ["fp8_gmm_train.py", "--steps", "12", "--plot", str(tmp_path / "p.png"),
                                      "--out", str(tmp_path / "r.json")])
    mod.main()
    arms = written["arms"]
    assert arms["bf16"]["final_loss"] == 2.0 and arms["fp8_gmm"]["final_loss"] == 2.5
    assert arms["fp8_gmm"]["overrides"] == ["model.compute_dtype=bfloat16", "quant.fp8_gmm=true"]
    assert written["final_gap"] == 0.5 and written["margin"] == 0.05 and written["within_margin"] is False
    assert written["steps"] == 12 and written["recipe"] == "tiny"
    curves[True] = curves[False]
    mod.main()
    assert written["final_gap"] == 0.0 and written["within_margin"] is True
    curves[True] = [100.0, 100.0] + [1.5] * 10  # fp8 lower by 0.5: within the margin, which bounds only excess
    mod.main()
    assert written["final_gap"] == -0.5 and written["within_margin"] is True
    monkeypatch.setattr(mod, "MARGIN", 0.5)
    curves[True] = [100.0, 100.0] + [2.5] * 10  # exactly at a margin of 0.5: within
    mod.main()
    assert written["final_gap"] == 0.5 and written["within_margin"] is True


def test_robustness_fuzz_counts_every_draw_by_outcome_and_keeps_twenty_failures(monkeypatch):
    import sys

    from hypothesis import strategies as st

    mod = _load("robustness")

    def check(x):
        if x[0] % 3 == 0:
            raise RuntimeError(f"bad {x[0]}")
        return "accepted" if x[0] % 3 == 1 else "refused"

    fake = types.SimpleNamespace(check=check, override_sets=lambda: st.tuples(st.integers(0, 10**9)))
    monkeypatch.setitem(sys.modules, "config_fuzz", fake)
    out = mod.fuzz(40)
    kinds = {k: out.get(k, 0) for k in ("accepted", "refused", "other_exception")}
    # Every draw counted once, whatever its outcome: the kinds add up to the 40 draws.
    assert out["draws"] == sum(kinds.values()) == 40
    assert min(kinds.values()) > 0
    assert len(out["failures"]) == min(20, kinds["other_exception"])
    assert out["failures"][0]["error"].startswith("RuntimeError: bad ")

    def always(x):
        raise ValueError("no")

    monkeypatch.setitem(sys.modules, "config_fuzz", types.SimpleNamespace(check=always, override_sets=fake.override_sets))
    every = mod.fuzz(22)
    assert every["draws"] == every["other_exception"] == 22 and len(every["failures"]) == 20


def test_robustness_a_failed_kill_command_keeps_its_trials_and_the_message(monkeypatch, tmp_path):
    import sys

    mod = _load("robustness")

    def run_trials(command, trials, work):
        if command == "rl":
            raise AssertionError("x" * 3000)
        return {"trials": trials, "ok": trials}

    monkeypatch.setitem(sys.modules, "kill_harness", types.SimpleNamespace(run_trials=run_trials))
    out = mod.kills(4, tmp_path)
    assert out["train"] == {"trials": 4, "ok": 4}
    assert out["rl"] == {"trials": 4, "failed": "x" * 2000}


def _est(step_s):
    return {"hardware": {"name": "tpu7x", "grid_step_s": 3e-6, "measured": None},
            "serial": {"step_s": step_s, "tokens_per_s_per_chip": 1.0, "mfu": 0.5},
            "overlapped": {"step_s": step_s / 2, "tokens_per_s_per_chip": 2.0, "mfu": 1.0},
            "categories": {"gmm": {"s": step_s}}, "collectives": {}, "kernels": {},
            "kernels_without_cost_estimate": [], "loops_with_unknown_trip_count": [],
            "hlo_flops_per_device": 1.0, "model_flops_per_device": 2.0, "tokens_per_step": 8, "chips": 4,
            "devices": 8}


def _step_estimate_main(monkeypatch, tmp_path, argv, estimate_of):
    """benchmarks/step_estimate.py's main with the compiles stubbed: a 20-layer model in blocks of 4
    on an 8-device TPU target; `estimate_of(layers)` is the estimate of a compile at that depth."""
    import hybridmoe.analysis.flops as flops_mod
    import hybridmoe.analysis.step_estimate as se
    import hybridmoe.cli as cli
    import hybridmoe.tools.record as record
    from hybridmoe.tools import depth
    from hybridmoe.tools import train_program as tp

    mod = _load("step_estimate")
    seen = {"compiled": [], "extrapolate": None}

    def inspect_config(words, kind, count):
        layers = next((int(w.split("=")[1]) for w in words if w.startswith("model.num_layers=")), 20)
        model = types.SimpleNamespace(layer_pattern=("gdn", "gdn", "gdn", "attention"), num_layers=layers)
        return words[0].split("=")[1], words[1:], types.SimpleNamespace(model=model, mesh=None)

    def compile_step(cfg, target, with_residuals):
        seen["compiled"].append(cfg.model.num_layers)
        return types.SimpleNamespace(layers=cfg.model.num_layers, out_of_memory={"message": "too big"})

    def extrapolate(estimates, block, num_layers, model_flops):
        seen["extrapolate"] = (sorted(estimates), block, num_layers, model_flops)
        return _est(100.0)

    monkeypatch.setattr(mod.harness, "configure", lambda: None)
    monkeypatch.setattr(cli, "_inspect_config", inspect_config)
    monkeypatch.setattr(tp, "parse_target", lambda name: ("tpu", None))
    monkeypatch.setattr(tp, "tpu_target", lambda name: types.SimpleNamespace(name=name, num_devices=8))
    monkeypatch.setattr(tp, "compile_step", compile_step)
    monkeypatch.setattr(se, "estimate_step", lambda step, hw, recipe, grid_step_s: estimate_of(step.layers))
    monkeypatch.setattr(se, "format_estimate", lambda est, ref: "")
    monkeypatch.setattr(flops_mod, "model_flops_per_device", lambda cfg, devices: cfg.model.num_layers * 1000 / devices)
    monkeypatch.setattr(depth, "extrapolate_estimate", extrapolate)
    monkeypatch.setattr(record, "source_commit", lambda: "c0ffee")
    clock = iter(float(t) for t in range(100, 1000, 7))  # from 100 s, 7 s between reads of the clock
    monkeypatch.setattr(mod, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    written = {}
    monkeypatch.setattr(mod.harness, "write", lambda out, name, **f: written.update(name=name, **f))
    assert mod.main([*argv, "--out", str(tmp_path / "r.json")]) == 0
    return written, seen


def test_step_estimate_with_layers_compiles_two_depths_and_extrapolates_to_the_models(tmp_path, monkeypatch):
    written, seen = _step_estimate_main(monkeypatch, tmp_path, ["--target", "tpu7x:2x2x2", "--arm", "a=x=1",
                                                                "--layers", "8"], lambda n: _est(float(n)))
    # --layers 8 at blocks of 4: compiles at 8 and 12 layers; the line goes to the model's 20 layers
    # with the model's FLOPs at its full depth over the target's 8 devices (20 x 1000 / 8).
    assert seen["compiled"] == [8, 12]
    assert seen["extrapolate"] == ([8, 12], 4, 20, 2500.0)
    arm = written["arms"]["a"]
    assert arm["step_s"] == 100.0 and arm["overlapped_step_s"] == 50.0
    assert {k: v["step_s"] for k, v in arm["extrapolated_from"].items()} == {"8": 8.0, "12": 12.0}
    assert arm["compile_s"] == 7.0 and arm["commit"] == "c0ffee" and arm["overrides"] == ["x=1"]
    assert arm["target"] == "tpu7x:2x2x2" and arm["recipe"] == "small"


def test_step_estimate_without_layers_records_the_whole_models_estimate(tmp_path, monkeypatch):
    written, seen = _step_estimate_main(monkeypatch, tmp_path, ["--arm", "b="], lambda n: _est(float(n)))
    assert seen["compiled"] == [20] and seen["extrapolate"] is None
    arm = written["arms"]["b"]
    assert arm["step_s"] == 20.0 and arm["mfu"] == 0.5 and arm["overlapped_mfu"] == 1.0
    assert "extrapolated_from" not in arm


def test_step_estimate_an_arm_refused_at_either_depth_records_the_refusal(tmp_path, monkeypatch):
    written, _ = _step_estimate_main(monkeypatch, tmp_path, ["--arm", "c=", "--layers", "8"],
                                     lambda n: None if n == 12 else _est(float(n)))
    assert written["arms"]["c"] == {"recipe": "small", "overrides": [], "target": "tpu7x:2x2x1", "refused": "too big"}
