"""Multi-host for real: `hybridmoe launch --processes 2` runs 2 processes x 4 simulated CPU devices
(jax.distributed on a local coordinator, gloo collectives) and gives the same losses and rewards
as 1 process x 8 devices, step for step; both processes write and restore the checkpoints, and a
run killed in one of its processes is stopped whole and resumes to the bits of an uninterrupted run.

On file data each host reads its own share of the file (records h, h + 2, ...) from its own
cursor: the default case resumes a 2-process run from a checkpoint whose two cursors differ and
compares it with an uninterrupted run of the same global batches in one process."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import hybridmoe.train.loop as train_loop
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


# The default suite's 2-process run is the file-data one below (its train loop, collectives and
# checkpoints are these); these repeat the guarantee on rows built from the step.
@pytest.mark.parametrize("command", [pytest.param("train", marks=pytest.mark.slow),
                                     pytest.param("rl", marks=pytest.mark.slow)])
def test_two_processes_equal_one_step_for_step(command, tmp_path, cache):
    _one_process(command, tmp_path / "one")
    done = subprocess.run(_launch_argv(command, tmp_path / "two"), env=_env(cache), cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_steps(tmp_path / "two", tmp_path / "one", command)
    assert finished_steps(tmp_path / "two" / "checkpoints") == finished_steps(tmp_path / "one" / "checkpoints")
    # metrics from process 0 only: one record per step (two writers would duplicate them)
    assert_tensorboard_matches_jsonl(tmp_path / "two")


class TwoHostsOfFiles:
    """For a 1-process run, the global batch two hosts of a file-data run feed a step: host h's
    share of the file (TextSource, host h of 2) packed from its own cursor, process 0's rows first
    (its devices hold the first half of the batch). The position is both cursors, as the 2-process
    run's checkpoint records them."""

    host_local = False

    def __init__(self, cfg):
        from hybridmoe.data.sources import config_tokenizer
        from hybridmoe.data.text import TextSource
        self.hosts = [TextSource(cfg, config_tokenizer(cfg), h, 2) for h in range(2)]
        self.cursors = [0, 0]

    def batch(self, step: int, position):
        rows = []
        for h, host in enumerate(self.hosts):
            host_rows, self.cursors[h] = host.batch(self.cursors[h])
            rows.append(host_rows)
        return {k: np.concatenate([r[k] for r in rows], axis=1) for k in rows[0]}, list(self.cursors)


def _file_data(folder: Path) -> tuple[Path, list[int]]:
    """40 documents for the character tokenizer: the even lines (host 0's share) 3-5 characters, the
    odd ones (host 1's) 10-14, so host 0 packs about ten a step and host 1 four: their cursors part
    at once, and host 0 finishes an epoch about every two steps. (the file, each host's document count)"""
    rng = np.random.default_rng(46)
    texts = ["".join(map(str, rng.integers(0, 10, size=rng.integers(3, 6) if i % 2 == 0 else rng.integers(10, 15))))
             for i in range(40)]
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path, [20, 20]


def _data_position(run: Path, step: int) -> list[int]:
    from hybridmoe.run.checkpoint import Checkpoints
    ckpt = Checkpoints(run / "checkpoints")
    try:
        return ckpt.restore_meta(step)["data_position"]
    finally:
        ckpt.close()


RESUME_AT = 2  # the checkpoint the 2-process run resumes from (COMMANDS["train"]: 6 steps, one every 2)


def test_two_processes_on_file_data_resume_each_host_at_its_own_cursor(tmp_path, cache, monkeypatch, capsys):
    """The uninterrupted run: 1 process x 8 devices fed both hosts' rows (TwoHostsOfFiles), to step
    6. Its checkpoint after step 2, whose cursors differ, resumes as `launch --processes 2`: each
    host must continue at its own cursor, through its share's epoch boundaries, to the uninterrupted
    run's losses, and write the same cursors into its checkpoints. A 1-process resume of those
    cursors is refused, naming them."""
    data, docs_per_host = _file_data(tmp_path)
    files = ["train.data=files", f"data.path={data}"]
    with monkeypatch.context() as patch:
        patch.setattr(train_loop, "training_source", TwoHostsOfFiles)
        patch.setattr(train_loop, "position_record", list)
        assert main([*COMMANDS["train"], *files, "mesh.cpu_devices=8", "--out", str(tmp_path / "one")]) == 0
    at_resume, at_end = _data_position(tmp_path / "one", RESUME_AT), _data_position(tmp_path / "one", 6)
    # The fixture holds what it claims: the hosts resume at different cursors, and after the resume
    # each host's stream crosses an epoch boundary of its share.
    assert at_resume[0] != at_resume[1], at_resume
    assert all(a // n < b // n for a, b, n in zip(at_resume, at_end, docs_per_host)), (at_resume, at_end)

    two = tmp_path / "two"
    shutil.copytree(tmp_path / "one", two)
    for step in finished_steps(two / "checkpoints"):
        if step > RESUME_AT:
            shutil.rmtree(two / "checkpoints" / str(step))
    done = subprocess.run(_launch_argv("train", two, *files, "--resume"), env=_env(cache), cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_steps(two, tmp_path / "one", "train")
    assert finished_steps(two / "checkpoints") == finished_steps(tmp_path / "one" / "checkpoints")
    for step in (4, 6):  # each host's own cursor, gathered from both processes
        assert _data_position(two, step) == _data_position(tmp_path / "one", step), step
    assert_tensorboard_matches_jsonl(two)  # metrics from process 0 only: one record per step

    # One process cannot continue two hosts' cursors: refused before anything is restored or written.
    before = (two / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main([*COMMANDS["train"], *files, "mesh.cpu_devices=8", "--out", str(two), "--resume"]) == 2
    err = capsys.readouterr().err
    cursors = _data_position(two, 6)
    assert f"data_position {cursors}" in err and "this run has 1 process(es)" in err and "Traceback" not in err, err
    assert (two / "metrics.jsonl").read_text() == before


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
