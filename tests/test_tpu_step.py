"""benchmarks/tpu_step.py's rounds, record and merge, with the bench stubbed (its own figures are
tests/test_bench.py's): each round is led by the default, each arm's ratio is to the default of its
own round, the record is written after every round, a round past the budget is left out, and an
earlier record of the device keeps the arms not run now."""

from __future__ import annotations

import json

from helpers import benchmark_script


def _script():
    return benchmark_script("tpu_step")


# Seconds per step each arm measures, per round it runs in (the default's drifts between rounds).
SECONDS = {"default": [0.40, 0.44], "xla_gdn": [0.52], "pallas_gmm": [0.38], "fused_swiglu": [0.41]}


def _fake_bench(calls):
    def run_bench(recipe, common, arms, steps, *, skip_unfit, profile_steps):
        calls.append([n for n, _ in arms])
        round_index = len(calls) - 1
        out = {}
        for name, overrides in arms:
            if name == "fused_swiglu":
                out[name] = {"overrides": overrides, "refused": "the compiler refused it: ...",
                             "device_refusal": {"needed_bytes": 17 * 2**30}}
                continue
            s = SECONDS[name][min(round_index, len(SECONDS[name]) - 1)]
            out[name] = {"overrides": overrides, "seconds_per_step": s, "estimate": {"step_s": 0.4},
                         "measured_over_estimated": s / 0.4, "step_times_s": [s] * 4, "compile_s": 50.0,
                         "mfu": 0.5, "useful_mfu": 0.25, "peak_flops_per_device": 1.6e14, "peak_source": "calibration",
                         "tokens_per_step": 8192, "program": {"argument": 1, "temp": 2, "output": 1, "alias": 1}}
        return out
    return run_bench


def test_rounds_led_by_the_default_ratios_within_a_round_and_the_merge(tmp_path, monkeypatch):
    from hybridmoe.tools import bench

    module = _script()
    assert module.rounds_of(["default", "a", "b", "c"], 2) == [["default", "a", "b"], ["default", "c"]]
    assert module.rounds_of(["a"], 3) == [["default", "a"]] and module.rounds_of(["default"], 3) == [["default"]]
    calls = []
    monkeypatch.setattr(bench, "run_bench", _fake_bench(calls))
    monkeypatch.setattr(bench, "format_table", lambda results: "")
    out = tmp_path / "tpu_step.json"
    # An earlier record of this device: an arm not run now stays with its commit.
    out.write_text(json.dumps({"device": "cpu", "overrides": [], "arms": {"remat_minimal": {"measured_s": 0.5,
                                                                                           "commit": "abc"}}}))
    assert module.main(["--only", "default,xla_gdn,pallas_gmm,fused_swiglu", "--group", "2", "--out", str(out),
                        "--profile", "0"]) == 0
    assert calls == [["default", "xla_gdn", "pallas_gmm"], ["default", "fused_swiglu"]]
    record = json.loads(out.read_text())
    arms = record["arms"]
    assert arms["remat_minimal"] == {"measured_s": 0.5, "commit": "abc"}
    assert arms["xla_gdn"]["round"] == 0 and abs(arms["xla_gdn"]["over_default_in_round"] - 0.52 / 0.40) < 1e-12
    assert abs(arms["pallas_gmm"]["over_default_in_round"] - 0.38 / 0.40) < 1e-12
    assert arms["default"]["measured_s"] == 0.44 and arms["default"]["round"] == 1  # the latest round's
    assert "refused" in arms["fused_swiglu"] and "measured_s" not in arms["fused_swiglu"]
    assert abs(arms["pallas_gmm"]["tokens_per_s"] - 8192 / 0.38) < 1e-9
    assert record["fastest"] == "pallas_gmm" and abs(record["default_over_fastest"] - 0.44 / 0.38) < 1e-12


def test_a_round_past_the_budget_is_left_out_and_the_finished_ones_are_kept(tmp_path, monkeypatch):
    from hybridmoe.tools import bench

    module = _script()
    calls = []
    monkeypatch.setattr(bench, "run_bench", _fake_bench(calls))
    monkeypatch.setattr(bench, "format_table", lambda results: "")
    out = tmp_path / "tpu_step.json"
    assert module.main(["--only", "default,xla_gdn,pallas_gmm", "--group", "1", "--budget-s", "0", "--out",
                        str(out), "--profile", "0"]) == 0
    assert calls == [["default", "xla_gdn"]]  # the first round starts at 0 s; the second is past the budget
    assert set(json.loads(out.read_text())["arms"]) == {"default", "xla_gdn"}


def test_every_arm_is_a_config_the_validator_accepts_on_one_tpu():
    """An arm the validator refuses would cost a chip call to learn it: each arm's overrides over the
    recipe load for a TPU target and build no error on one device."""
    from hybridmoe.recipe import load_config
    from hybridmoe.recipe.validate import check_requirements

    module = _script()
    for name, overrides in module.ARMS.items():
        cfg = load_config(module.RECIPE, overrides, platform="tpu")
        check_requirements(cfg, platform="tpu", devices=1)
    # The arms that turn a recipe lever off do turn it off.
    default = load_config(module.RECIPE, platform="tpu")
    assert default.moe.gather_backward and default.remat.save == ("moe_gate", "moe_up", "attn_core_residuals")
    assert default.kernels.logprobs.chunk_vocab == default.model.vocab_size
    arm = lambda name: load_config(module.RECIPE, module.ARMS[name], platform="tpu")  # noqa: E731
    assert not arm("scatter_backward").moe.gather_backward
    assert arm("expert_matmuls_replayed").remat.save == ("attn_core_residuals",)
    assert arm("attention_core_replayed").remat.save == ("moe_gate", "moe_up")
    assert arm("logprobs_vocab_chunk_4096").kernels.logprobs.chunk_vocab == 4096
