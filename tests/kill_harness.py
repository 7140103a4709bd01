"""kill -9 trials: run `python -m hybridmoe train|rl` as a subprocess, SIGKILL it at a chosen moment
(a random time, while the export is being written, or exactly as its 1st / 2nd / 3rd checkpoint is
written but not committed, by tests/kill_point.py), resume it, and compare the finished run with one
that was never interrupted.

Checked per trial: (a) the resume succeeds, so the checkpoint it chose was readable, and no
unfinished checkpoint is left; (b) metrics.jsonl (wall-clock keys aside) and the export equal the
uninterrupted run's bit for bit; (c) TensorBoard holds exactly the records of metrics.jsonl.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridmoe.run.metrics import read_metrics
from helpers import ATTENTION_LAYERS
from run_checks import assert_tensorboard_matches_jsonl, comparable

ROOT = Path(__file__).resolve().parent.parent
KILL_POINT = Path(__file__).resolve().parent / "kill_point.py"
# Two attention layers (each run in its own interpreter traces its programs again: a train run took
# 15.7 s at tiny's four layers, 10.0 s at one layer of each mixer, its compiles read from the cache);
# what a kill can lose (checkpoints, metrics, the export, the data cursor and key) does not depend on
# the mixers.
TINY = ["recipe=tiny", *ATTENTION_LAYERS, "train.batch_size=8", "train.seq_len=16", "gdn.chunk_size=8"]
COMMANDS = {
    "train": ["train", *TINY, "train.steps=6", "train.checkpoint_every=2"],
    "rl": ["rl", *TINY, "rl.warmup_steps=2", "rl.steps=3", "rl.checkpoint_every=2", "rl.prompts_per_step=2",
           "rl.group_size=4", "rl.max_prompt_len=6", "rl.max_new_tokens=3"],
}
# Kill moments per command, cycled through by the trials.
MOMENTS = {"train": ("checkpoint", "random", "random"), "rl": ("checkpoint", "export", "random")}


def _argv(command: str, run_dir: Path, *extra: str, kill_at: str = "") -> list[str]:
    """The command line; with kill_at ("checkpoint:N" or "export"), run through kill_point.py, which
    SIGKILLs the run exactly there."""
    runner = [str(KILL_POINT), kill_at] if kill_at else ["-m", "hybridmoe"]
    argv = [sys.executable, *runner, *COMMANDS[command], "--out", str(run_dir / "run"), *extra]
    if command == "rl":
        argv += ["--export-hf", str(run_dir / "export")]
    return argv


def _env(cache_dir: Path) -> dict:
    # JAX's own settings for the child: CPU only, and compiled programs shared between the runs.
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _run(argv, env, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _kill_after(argv, env, delay_s: float) -> dict:
    """Start the run and SIGKILL it after delay_s; what happened."""
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.perf_counter()
    while proc.poll() is None and time.perf_counter() - t0 < delay_s:
        time.sleep(0.01)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return {"moment": "random", "killed": killed, "hit": killed, "after_s": round(time.perf_counter() - t0, 3)}


def uninterrupted(command: str, work: Path, cache_dir: Path, in_process: bool = False) -> tuple[Path, float]:
    """The run never interrupted, and its seconds. in_process: through the CLI's main() in this
    process (the test session's 8 CPU devices, JAX settings and compile cache, as a child inherits
    them), which starts no interpreter; else as a child process, whose time random kills need."""
    run_dir = work / f"{command}-straight"
    t0 = time.perf_counter()
    if in_process:
        from hybridmoe.cli import main
        assert main(_argv(command, run_dir)[3:]) == 0  # the words after `python -m hybridmoe`
    else:
        done = _run(_argv(command, run_dir), _env(cache_dir))
        assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, time.perf_counter() - t0


def trial(command: str, index: int, work: Path, cache_dir: Path, straight: Path, straight_s: float,
          rng: random.Random) -> dict:
    """One kill and resume; raises AssertionError naming the check that failed."""
    run_dir = work / f"{command}-trial{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    moment = MOMENTS[command][index % len(MOMENTS[command])]
    env = _env(cache_dir)
    # The uninterrupted run compiled; the trials read its compile cache and finish sooner, so random
    # kills fall early in its time (the first record: kills at 0.2-1.0 of it all came too late).
    if moment == "checkpoint":
        # Killed in the middle of the 1st, 2nd, 3rd checkpoint write in turn, exactly (a watcher polling
        # for the temporary folder often came too late): the rl run killed in its first one once
        # resumed to different metrics (an earlier record), not reproduced since.
        nth = (index // len(MOMENTS[command])) % 3 + 1
        done = _run(_argv(command, run_dir, kill_at=f"checkpoint:{nth}"), env)
        killed = done.returncode == -signal.SIGKILL
        event = {"moment": f"checkpoint {nth}", "killed": killed, "hit": killed, "after_s": None}
    elif moment == "export":
        # Killed exactly in the middle of the export (weight files written, index not yet): a watcher
        # polling for the temporary folder never caught it in 20 trials.
        done = _run(_argv(command, run_dir, kill_at="export"), env)
        killed = done.returncode == -signal.SIGKILL
        event = {"moment": "export", "killed": killed, "hit": killed, "after_s": None}
    else:
        event = _kill_after(_argv(command, run_dir), env, rng.uniform(0.02, 0.3) * straight_s)
    resumed = _run(_argv(command, run_dir, "--resume"), env)
    assert resumed.returncode == 0, f"(a) resume failed after {event}: {resumed.stderr[-3000:]}"
    assert not list((run_dir / "run" / "checkpoints").glob("*tmp*")), "(a) an unfinished checkpoint was left"
    got, want = read_metrics(run_dir / "run" / "metrics.jsonl"), read_metrics(straight / "run" / "metrics.jsonl")
    assert comparable(got) == comparable(want), f"(b) metrics differ from the uninterrupted run after {event}"
    if command == "rl":
        for name in sorted(p.name for p in (straight / "export").iterdir()):
            assert (run_dir / "export" / name).read_bytes() == (straight / "export" / name).read_bytes(), \
                f"(b) export file {name} differs after {event}"
    assert_tensorboard_matches_jsonl(run_dir / "run")  # (c)
    shutil.rmtree(run_dir)
    return event


def run_trials(command: str, trials: int, work: Path, seed: int = 0, first: int = 0) -> dict:
    """`trials` kill-and-resume trials of one command, from the `first`-th of its cycle of moments on;
    a summary (raises on the first failure)."""
    # The suite's compile cache (tests/conftest.py) when there is one, so trials reuse the programs
    # every earlier run compiled.
    cache_dir = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or work / "xla-cache")
    # Random kills fall anywhere in the uninterrupted run's time as a child process, compile included
    # (later runs read the compile cache this one fills, so they reach their steps sooner); trials at
    # exact moments only need its results, from a run in this process.
    moments = [MOMENTS[command][i % len(MOMENTS[command])] for i in range(first, first + trials)]
    straight, straight_s = uninterrupted(command, work, cache_dir, in_process="random" not in moments)
    rng = random.Random(seed)
    events = [trial(command, i, work, cache_dir, straight, straight_s, rng) for i in range(first, first + trials)]
    return {"command": command, "trials": trials, "passed": len(events), "uninterrupted_s": round(straight_s, 2),
            "killed": sum(e["killed"] for e in events), "hit_moment": sum(e["hit"] for e in events),
            "events": events}
