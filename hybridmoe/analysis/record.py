"""What every benchmark record carries: machine, date, commit, versions; written atomically."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path


def machine_record() -> dict:
    import jax
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
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
