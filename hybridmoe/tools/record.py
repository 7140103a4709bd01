"""What every benchmark record carries: machine, date, commit, versions; written atomically."""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import subprocess
from pathlib import Path


@functools.cache
def source_commit() -> str:
    """The checkout's commit, "+modified" when the package's files differ from it; "" outside git.

    Read once, on the first call, and kept: a command or benchmark that writes a record calls it
    when it starts (`hybridmoe bench/eval/inspect/gates --out`, `benchmarks/harness.py`), so a long
    run records the code it started from, not a commit landed while it ran; nothing else runs git.
    """
    here = Path(__file__).parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                                 cwd=here).stdout.strip()
    except OSError:
        return ""
    return head + ("+modified" if head and changed else "")


def machine_record() -> dict:
    import jax
    commit = source_commit()
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()},
            "versions": {"python": platform.python_version(), "jax": jax.__version__},
            "backend": jax.default_backend()}


def write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
