"""benchmarks/peer_maxtext.py --tiny: MaxText's Qwen3.5 training step beside ours on the CPU, and the
GDN layer alone both ways, written to a record.

Needs MaxText installed (docs/tpu.md, "A peer on the chip: MaxText"): importable as it is, or in the
repository's .maxtext-site/ (`scripts/maxtext_wheels.sh fetch` then `install`). Skipped, with the reason, where it is
not there or does not import; slow (a few minutes of compiling on a CPU), so not run by CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL_SITE = ROOT / ".maxtext-site"  # where scripts/maxtext_wheels.sh install puts it
SITE = str(LOCAL_SITE) if (LOCAL_SITE / "maxtext" / "__init__.py").is_file() else None


def maxtext_present() -> bool:
    return SITE is not None or importlib.util.find_spec("maxtext") is not None


@pytest.mark.slow
@pytest.mark.skipif(not maxtext_present(),
                    reason="maxtext is not installed: scripts/maxtext_wheels.sh fetch, then install (into .maxtext-site/)")
def test_tiny_run_writes_both_arms_and_the_gdn_layer(tmp_path):
    out = tmp_path / "peer.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "peer_maxtext.py"), "--tiny", "--steps", "2",
               "--gdn-rounds", "2", "--out", str(out)]
    if SITE:
        command += ["--maxtext-site", SITE]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    record = json.loads(out.read_text()) if out.is_file() else {}
    if proc.returncode == 2 and record.get("maxtext_import_error"):
        pytest.skip(f"maxtext does not import here: {record['maxtext_import_error']}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    arms = record["arms"]
    assert set(arms) == {"ours", "maxtext_remat_full"}
    for name, arm in arms.items():
        assert arm["measured_s"] > 0 and arm["tokens_per_s"] > 0, name
        assert len(arm["step_times_s"]) == 2, name  # one timed step in each of two visits
        assert all(loss is not None and loss == loss for loss in arm["losses"]), name  # finite, not NaN
        assert arm["kernels"]["custom_calls"] is not None and arm["memory"]["compiled"]["argument"] > 0, name
    assert arms["maxtext_remat_full"]["kernels"]["configured"]["sparse_matmul"] == "True"
    assert record["maxtext_version"].startswith("0.")
    for side in ("ours", "maxtext"):
        assert record["gdn_layer"][side]["mean_s"] > 0
    assert record["gdn_layer_over_ours"] > 0
