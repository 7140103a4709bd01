"""Multi-host for real: `hybridmoe launch --processes 2` runs 2 processes x 4 simulated CPU devices
(jax.distributed on a local coordinator, gloo collectives) and gives the same losses and rewards
as 1 process x 8 devices, step for step; both processes write and restore the checkpoints, and a
run killed in one of its processes is stopped whole and resumes to the bits of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridmoe.cli import main
from hybridmoe.run.checkpoint import finished_steps
from hybridmoe.run.metrics import read_metrics
from kill_harness import COMMANDS, ROOT, _env
from run_checks import assert_tensorboard_matches_jsonl, comparable

COMPARED = {"train": ("loss", "grad_norm", "tokens"), "rl": ("warmup_loss", "reward_mean", "loss", "kl", "grad_norm")}
# gloo sums the cross-process partial sums in another order than one process does: float32
# rounding, measured 9e-8 relative on the train loss; the tolerance is 100x that.
REL_TOL = 1e-5


def _one_process(command, out):
    """1 process x 8 devices: the CLI's main() in this process (the session's 8 CPU devices, JAX
    settings and compile cache, as the launched processes inherit them)."""
    assert main([*COMMANDS[command], "mesh.cpu_devices=8", "--out", str(out)]) == 0


def _launch_argv(command, out, *extra):
    return [sys.executable, "-m", "hybridmoe", "launch", "--processes", "2", "--", *COMMANDS[command],
            "mesh.cpu_devices=4", "--out", str(out), *extra]


def _same_steps(two, one, command):
    got, want = read_metrics(two / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    worst = 0.0
    for a, b in zip(got, want):
        for key in COMPARED[command]:
            if key in b and b[key] is not None:
                err = abs(a[key] - b[key]) / max(abs(b[key]), 1e-12)
                worst = max(worst, err)
                assert err <= REL_TOL, (a["step"], key, a[key], b[key], err)
    print(f"2 processes vs 1, {command}: worst relative difference {worst:.2e} (tolerance {REL_TOL:.0e})")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path_factory.mktemp("xla-cache"))


@pytest.mark.parametrize("command", ["train", pytest.param("rl", marks=pytest.mark.slow)])
def test_two_processes_equal_one_step_for_step(command, tmp_path, cache):
    _one_process(command, tmp_path / "one")
    done = subprocess.run(_launch_argv(command, tmp_path / "two"), env=_env(cache), cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_steps(tmp_path / "two", tmp_path / "one", command)
    assert finished_steps(tmp_path / "two" / "checkpoints") == finished_steps(tmp_path / "one" / "checkpoints")
    # metrics from process 0 only: one record per step (two writers would duplicate them)
    assert_tensorboard_matches_jsonl(tmp_path / "two")


def _child_with(launcher_pid: int, text: str) -> int | None:
    """The launcher's child process whose command line holds `text` (read from /proc/*/stat's ppid)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher_pid and text in cmdline:
            return int(stat.parent.name)
    return None


@pytest.mark.slow
def test_killing_one_process_stops_the_run_and_both_resume_from_the_checkpoint(tmp_path, cache):
    """SIGKILL to process 1 after the first checkpoint: the launcher stops process 0 and exits non-zero
    naming the dead process; --resume continues and ends bit-identical to an uninterrupted 2-process run."""
    straight = subprocess.run(_launch_argv("train", tmp_path / "straight"), env=_env(cache), cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "two"
    launcher = subprocess.Popen(_launch_argv("train", out), env=_env(cache), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900
    while not finished_steps(out / "checkpoints") and launcher.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    victim, survivor = (_child_with(launcher.pid, f"mesh.process_id={i}") for i in (1, 0))
    assert victim is not None and launcher.poll() is None, "the run ended before a checkpoint could be killed into"
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode != 0 and "process 1 exited" in err and "stopping the others" in err, err[-2000:]
    assert survivor is None or not Path(f"/proc/{survivor}").exists(), "process 0 outlived the launcher"
    assert finished_steps(out / "checkpoints")
    done = subprocess.run(_launch_argv("train", out, "--resume"), env=_env(cache), cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = read_metrics(out / "metrics.jsonl"), read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert comparable(got) == comparable(want)
    assert finished_steps(out / "checkpoints") == finished_steps(tmp_path / "straight" / "checkpoints")
    assert_tensorboard_matches_jsonl(out)
