"""The commands as a user runs them: real output files, clear errors for bad input."""

from pathlib import Path

import numpy as np

from helpers import TWO_LAYERS
from hybridmoe.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "hf_tiny"


def test_score_reproduces_the_reference_logprobs(tmp_path):
    out = tmp_path / "lp.npy"
    assert main(["score", "--hf", str(FIXTURE), "--tokens", str(FIXTURE / "tokens.npy"), "--out", str(out)]) == 0
    got, want = np.load(out), np.load(FIXTURE / "logprobs.npy")
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_score_rejects_out_of_vocab_tokens_without_writing(tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((1, 4), 10_000, np.int32))
    out = tmp_path / "lp.npy"
    assert main(["score", "--hf", str(FIXTURE), "--tokens", str(bad), "--out", str(out)]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert not out.exists()


def test_unknown_word_is_refused(capsys):
    import pytest
    with pytest.raises(SystemExit):
        main(["describe", "stray"])


def test_rl_starts_from_a_hf_checkpoint_and_exports_it_back_exactly(tmp_path):
    from safetensors.numpy import load_file
    out = tmp_path / "hf_out"
    assert main(["rl", "recipe=demo", "rl.warmup_steps=0", "rl.steps=0", "--init-hf", str(FIXTURE),
                 "--export-hf", str(out), "--out", str(tmp_path / "run")]) == 0
    got = {k: v for f in sorted(out.glob("model-*.safetensors")) for k, v in load_file(f).items()}
    want = load_file(FIXTURE / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_bench_times_every_arm_interleaved_and_records_program_facts(tmp_path, capsys):
    import json

    import pytest

    from hybridmoe.tools.bench import parse_arm
    with pytest.raises(ValueError, match="--arm"):
        parse_arm(":remat.policy=none")
    assert parse_arm("lever:moe.impl=dense,remat.policy=none") == ("lever", ["moe.impl=dense", "remat.policy=none"])
    out = tmp_path / "bench.json"
    assert main(["bench", "recipe=tiny", *TWO_LAYERS, "bench.steps=2", "train.seq_len=16", "--arm", "control",
                 "--arm", "no_remat:remat.policy=none", "--estimate-for", "v5e", "--profile", "1",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["arms"]) == {"control", "no_remat"}
    for arm in rec["arms"].values():
        # two visits of the arm, one timed step each after an untimed one
        assert len(arm["step_times_s"]) == 2 and arm["seconds_per_step"] > 0 and arm["program"]["temp"] > 0
        # MFU: the step's XLA FLOPs per second over the matmul peak measured on the same devices.
        assert arm["peak_flops_per_device"] > 0 and 0 < arm["mfu"] < 1
        # the step-time model's estimate of the same program on the named chip, beside the time
        est = arm["estimate"]
        assert est["hardware"] == "v5e" and est["step_s"] > 0 and "GDN" in est["category_s"]
        assert arm["measured_over_estimated"] == pytest.approx(arm["seconds_per_step"] / est["step_s"])
        # the device's time by the model's categories, from a profiler trace of one more step: the
        # GDN and attention layers' ops are found by their names in the compiled program
        prof = arm["profile_category_s"]
        assert prof["GDN"] > 0 and prof["attention"] > 0, prof
        assert prof["not in the model's walk"] < 0.5 * sum(prof.values()), prof
        # and its heaviest ops beside the model's seconds for the same instructions, largest first
        ops = arm["profile_ops"]
        both = [r for r in ops if r["measured_s"] and r["estimated_s"]]
        assert both and {r["category"] for r in both} <= set(prof), ops
        heaviest = [max(r["measured_s"] or 0, r["estimated_s"] or 0) for r in ops]
        assert heaviest == sorted(heaviest, reverse=True)
    assert rec["arms"]["no_remat"]["config"]["remat"]["policy"] == "none"
    text = capsys.readouterr().out
    assert "control" in text and "MFU" in text


def test_score_refuses_overrides(tmp_path, capsys):
    out = tmp_path / "lp.npy"
    assert main(["score", "model.d_model=8", "--hf", str(FIXTURE), "--tokens", str(FIXTURE / "tokens.npy"),
                 "--out", str(out)]) == 2
    assert "config.json" in capsys.readouterr().err and not out.exists()


def test_only_commands_that_write_a_record_run_git(monkeypatch, tmp_path, capsys):
    """Starting the CLI runs no git; a command writing a record (--out) reads the commit before it
    builds anything, so the record names the code the process started from."""
    import subprocess

    from hybridmoe.tools import record

    real, calls = subprocess.run, []

    def run(cmd, *a, **kw):
        calls.append(cmd[0])
        return real(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "run", run)
    # A checkout stamped for a copy to an accelerator host (scripts/tpu_records.sh stamp) reads the
    # stamp, not git: the test asks git's path whatever this checkout holds.
    monkeypatch.setattr(record, "COMMIT_STAMP", ".no-stamp-in-this-test")
    record.source_commit.cache_clear()
    assert main(["describe", "recipe=tiny"]) == 0
    assert main(["train", "recipe=tiny", "train.sted=1"]) == 2
    assert "git" not in calls
    # bench --out: the commit is read at start, before the config error stops it.
    assert main(["bench", "recipe=tiny", "train.sted=1", "--out", str(tmp_path / "r.json")]) == 2
    assert calls.count("git") == 2 and record.source_commit.cache_info().currsize == 1
    record.source_commit.cache_clear()


def test_launch_refuses_fewer_than_one_process_before_starting_any(monkeypatch, capsys):
    from hybridmoe.parallel import launch as launch_mod

    started = []
    monkeypatch.setattr(launch_mod, "launch", lambda argv, processes, port: started.append(processes) or 0)
    assert main(["launch", "--processes", "0", "--", "train", "recipe=tiny"]) == 2
    assert "--processes 0: at least 1" in capsys.readouterr().err
    assert main(["launch", "--processes", "-1", "--", "train", "recipe=tiny"]) == 2
    assert main(["launch", "--processes", "1", "--", "demo"]) == 2
    assert started == []
    assert main(["launch", "--processes", "1", "--", "train", "recipe=tiny"]) == 0 and started == [1]
