"""The inspect and gates commands end to end on tiny shapes (the TPU-target inspect is in
test_gmm_tpu_compile.py with the other tpu_compile tests, which share one libtpu process)."""

from __future__ import annotations

import json

import pytest

from helpers import ATTENTION_LAYERS, TWO_LAYERS
from hybridmoe.tools import train_program as tp
from hybridmoe.cli import main
from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config

PALLAS_TPU = ["kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit", "moe.wi_fused_swiglu=true",
              "model.d_model=128", "model.moe_intermediate_size=128", "kernels.gmm.tk=128"]


def test_targets_are_parsed_or_refused_clearly():
    assert tp.parse_target("cpu:8") == ("cpu", 8)
    assert tp.parse_target("tpu7x:2x2x1") == ("tpu", None)
    for bad in ("cpu:0", "tpu9:2x2", "v5p", "gpu:8"):
        with pytest.raises(ValueError) as refused:
            tp.parse_target(bad)
        message = str(refused.value)
        assert f"target {bad!r}" in message, message
        assert ("positive device count" in message if bad.startswith("cpu") else
                "use cpu:N, or a TPU topology" in message and "v5e:2x2" in message), message


def test_validator_accepts_the_pallas_tpu_backend_for_a_tpu_target():
    cfg = ["mesh.cpu_devices=0", *PALLAS_TPU]
    with pytest.raises(ConfigError, match="cannot run on this platform"):
        load_config("tiny", cfg)
    load_config("tiny", cfg, platform="tpu")


# The inspect runs below: attention layers only (helpers.ATTENTION_LAYERS), what inspect reads of a
# compiled step does not depend on the mixers, at about half of a two-mixer model's compile per arm.


def test_inspect_cpu_side_by_side(tmp_path, capsys):
    out = tmp_path / "inspect.json"
    rc = main(["inspect", "recipe=tiny", *ATTENTION_LAYERS, "train.batch_size=8", "--target", "cpu:8",
               "--compare", "moe.capacity_factor=0.5", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "temporaries MiB" in text and "collectives" in text and "all-gather f32" in text
    rec = json.loads(out.read_text())
    base, other = rec["programs"]["base"], rec["programs"]["compare"]
    assert rec["target"] == "cpu:8" and base["devices"] == 8
    assert base["memory"]["argument"] > 0 and base["memory"]["temp"] > 0 and base["flops"] > 0
    assert base["memory"]["fits"] is None  # no HBM figure for a CPU host
    # XLA's memory-usage report: on CPU its default memory space is memory_analysis' figures
    # (arguments, outputs not donated, temporaries) within 1%; a wrong space or table row is not.
    m = base["memory"]
    assert abs(m["default_space"] - m["total"]) <= 0.01 * m["total"], m
    assert "default space (XLA report)" in text
    assert any(r["kind"] == "all-gather" for r in base["collectives"])
    # The capacity buffer halves the routed rows the grouped matmuls run: fewer FLOPs.
    assert other["flops"] < base["flops"]


def test_saved_residuals_with_the_fp8_hoist_on_an_expert_mesh():
    """The residual listing takes the layer scan's xs as the step does: with the hoisted fp8 absmax
    they are (params, absmax), which a params-only listing failed to unpack (the 397B levers arm)."""
    import jax

    from hybridmoe.run.setup import build

    cfg = load_config("tiny", ["train.batch_size=8", "mesh.expert=2", "quant.fp8_moe_fake_quant=true",
                               "quant.fp8_fake_quant_hoist=gather8"])
    setup = build(cfg, jax.devices())
    with setup.context():  # as compile_step calls it
        residuals = tp.block_residuals(cfg, setup)
    assert tp.residual_bytes(residuals) > 0 and any(r.name == "gdn_core_out" for r in residuals)


REFUSAL = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(132.47G) exceeds available HBM (94.75G).")


def test_inspect_reports_a_step_the_compiler_refuses_for_memory(tmp_path, capsys, monkeypatch):
    """A TPU compile refused for HBM (libtpu's error, as the 397B default step gets it) is a result:
    the compiler's temporaries, the arguments from their shardings (equal to what the compiled
    program of the same step reports), fits NO; no traceback, the record written."""
    import jax

    from hybridmoe.analysis import compiled_facts

    # Both arms compile (the CLI's facts cache kept out; a refusal it keeps: tests/test_compile_cache.py).
    monkeypatch.setattr(compiled_facts, "_folder", None)
    monkeypatch.setattr(compiled_facts, "use_folder", lambda folder: None)
    real_compile, calls = jax.stages.Lowered.compile, []

    def compile_then_refuse(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            return real_compile(self, *a, **k)
        raise jax.errors.JaxRuntimeError(REFUSAL)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_then_refuse)
    out = tmp_path / "inspect.json"
    rc = main(["inspect", "recipe=tiny", *ATTENTION_LAYERS, "train.batch_size=8", "--target", "cpu:8",
               "--compare", "train.seed=1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "compare: the compiler refused the step for memory" in text and "132.47G" in text
    progs = json.loads(out.read_text())["programs"]
    compiled, refused = progs["base"]["memory"], progs["compare"]["memory"]
    assert refused["temp"] == round(132.47 * 2**30) and refused["fits"] is False
    assert refused["argument"] == compiled["argument"] > 0
    assert refused["total"] == refused["argument"] + refused["temp"]


def test_a_refused_sampler_counts_its_prng_key_among_the_arguments(tmp_path, capsys, monkeypatch):
    """The sampler's inputs hold a PRNG key (a key<fry> array, which numpy cannot size): refused for
    memory, as the 397B cell's sampler is, inspect still records the compiler's figure, the
    arguments with the key's two uint32 words, and fits NO (it raised a TypeError there before)."""
    import jax

    def refuse(self, *a, **k):
        raise jax.errors.JaxRuntimeError(REFUSAL)

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    key = jax.ShapeDtypeStruct((3,), jax.eval_shape(lambda: jax.random.key(0)).dtype)
    assert tp.shard_bytes([key]) == 3 * 2 * 4
    out = tmp_path / "inspect.json"
    rc = main(["inspect", "recipe=tiny", *TWO_LAYERS, "train.batch_size=8", "--target", "cpu:8",
               "--program", "sample", "--out", str(out)])
    assert rc == 0 and "132.47G" in capsys.readouterr().out
    refused = json.loads(out.read_text())["programs"]["base"]["memory"]
    assert refused["fits"] is False and refused["temp"] == round(132.47 * 2**30) and refused["argument"] > 0


def test_other_compile_errors_are_not_taken_for_a_memory_refusal(monkeypatch):
    import jax

    from hybridmoe.analysis import compiled_facts

    def fail(self, *a, **k):
        raise jax.errors.JaxRuntimeError("INTERNAL: Mosaic failed to compile the kernel")

    # The compile runs (the CLI's facts cache kept out: test_inspect_cpu_side_by_side's base is this step).
    monkeypatch.setattr(compiled_facts, "_folder", None)
    monkeypatch.setattr(jax.stages.Lowered, "compile", fail)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Mosaic"):
        tp.compile_step(load_config("tiny", [*ATTENTION_LAYERS, "train.batch_size=8"]), tp.host_target(),
                        with_residuals=False)


def test_a_kernel_over_vmem_is_a_clear_error_naming_the_tiles(monkeypatch):
    import jax

    def fail(self, *a, **k):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem while "
            "allocating on stack for %wi_fused_swiglu_fwd.8 = (bf16[327680,1024]{1,0}) custom-call(%bitcast.1)")

    from hybridmoe.analysis import compiled_facts

    monkeypatch.setattr(compiled_facts, "_folder", None)  # the compile runs, whatever another test kept
    monkeypatch.setattr(jax.stages.Lowered, "compile", fail)
    cfg = load_config("tiny", [*ATTENTION_LAYERS, "train.batch_size=8", "moe.wi_fused_swiglu=true"])
    with pytest.raises(ValueError, match=r"wi_fused_swiglu_fwd does not fit the TPU core's VMEM .*wi_fwd .* at "
                                         r"kernels.gmm.wi_fwd_tm=\d+ kernels.gmm.wi_fwd_tk=\d+ kernels.gmm.wi_fwd_tn=\d+; "
                                         r"lower those tiles"):
        tp.compile_step(cfg, tp.host_target(), with_residuals=False)


GATE_SHAPES = [*ATTENTION_LAYERS, "rl.prompts_per_step=2", "rl.group_size=4", "rl.max_prompt_len=8", "rl.max_new_tokens=4"]


def test_gates_fail_a_perturbed_candidate(tmp_path, capsys):
    """A slightly different model (RMSNorm epsilon 1e-6 -> 1e-3) fails the log-prob and
    gradient-norm gates and the command exits 1; the reference pair lands identically on CPU
    (spread 0 on every gate), so the same code as candidate passes every gate."""
    out = tmp_path / "gates.json"
    assert main(["gates", "recipe=tiny", *GATE_SHAPES, "--steps", "1", "--candidate", "model.rms_norm_eps=1e-3",
                 "--out", str(out)]) == 1
    text = capsys.readouterr().out
    failed = {line.split()[0] for line in text.splitlines() if line.endswith("FAIL")}
    assert {"N1", "N3"} <= failed and "a gate FAILED" in text, text
    rec = json.loads(out.read_text())
    assert [g["gate"] for g in rec["gates"]] == ["V1", "V2", "N1", "N1-last", "N2", "N3"]
    assert all(g["reference_pair"] == 0 <= g["tolerance"] for g in rec["gates"]), rec["gates"]
    assert rec["passed"] is False
    # The gaps beside the gates: the candidate's per-token log-probs moved (at least as far as the
    # mean the N1 gate sees), the reference pair's did not; at T = 1 without truncation each arm's
    # sampler draws from the trainer's own distribution, so its gap is float rounding.
    gaps, n1 = rec["gaps"], next(g for g in rec["gates"] if g["gate"] == "N1")
    assert gaps["logp_gap_reference_pair"] == {"mean": 0.0, "max": 0.0}, gaps
    assert gaps["logp_gap"]["max"] >= gaps["logp_gap"]["mean"] >= 0.9 * n1["value"] > 0, (gaps, n1)
    for arm in ("reference", "candidate"):
        assert 0 <= gaps["sampler_gap"][arm]["sampler_gap_mean"] <= gaps["sampler_gap"][arm]["sampler_gap_max"] < 1e-4
    assert "gaps (reported, not gated)" in text and "sampler gap (sampler_gap_mean / max)" in text
