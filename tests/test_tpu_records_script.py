"""scripts/tpu_records.sh hands back a record a stage has written even when the call is killed at its
time limit while that stage's process is still shutting down (twice on the chip, after MaxText's
run: a returned folder without the record)."""

import contextlib
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for the host's python3: the stage's process writes its record, then takes longer to shut
# down than the call has left (as a TPU runtime's shutdown after MaxText's run did).
FAKE_PYTHON = """#!/usr/bin/env bash
mkdir -p benchmarks/records
echo '{"benchmark": "tpu_tests", "new": true}' > benchmarks/records/tpu_tests.json.part
mv benchmarks/records/tpu_tests.json.part benchmarks/records/tpu_tests.json
exec sleep 60
"""


def test_a_record_written_before_the_time_runs_out_comes_back(tmp_path):
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "tpu_records.sh", tree / "scripts")
    (tree / "benchmarks" / "records").mkdir(parents=True)
    # A record of an earlier day, unchanged by this call, stays out of the returned folder.
    (tree / "benchmarks" / "records" / "tpu_step.json").write_text('{"benchmark": "tpu_step"}\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    # SIGKILL at 4 s, as a call's hard limit ends it: no exit handler of the script runs. Its own
    # session, so that what outlives the kill is killed after.
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(["timeout", "-s", "KILL", "4", "bash", str(tree / "scripts" / "tpu_records.sh"),
                                 "--copy-to", str(out), "tests"], env=env, stdout=log, stderr=log,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0, (tmp_path / "log").read_text()  # cut by the time limit, as on the chip
    assert sorted(p.name for p in out.iterdir()) == ["tpu_tests.json"], list(out.iterdir())
    assert '"new": true' in (out / "tpu_tests.json").read_text()
