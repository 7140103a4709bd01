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
    """The checkout's commit, "+modified" when the package's files differ from it; "" when unknown.

    The stamp file, where there is one, says: it is written just before a copy of the tree is sent to
    an accelerator host (`scripts/tpu_records.sh stamp`; `place` removes it when the files come
    back), and whatever git the copy sits in there is not this history (the chip host's copy sat
    in a repository whose HEAD was the session's first commit, plus changes; before that, inside
    another project's checkout). Without a stamp, git says where this tree is the root of its own
    checkout; anywhere else the commit is unknown, never an enclosing repository's HEAD.

    Read once, on the first call, and kept: a command or benchmark that writes a record calls it
    when it starts (`hybridmoe bench/eval/inspect/gates --out`, `benchmarks/harness.py`), so a long
    run records the code it started from, not a commit landed while it ran; nothing else runs git.
    """
    return commit_of(Path(__file__).resolve().parent.parent.parent)


def commit_of(root: Path) -> str:
    """source_commit for the project tree at `root` (its package in root/hybridmoe)."""
    root = root.resolve()
    stamp = root / COMMIT_STAMP
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        top_and_head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                                      text=True, cwd=root).stdout.split()
    except OSError:
        top_and_head = []
    if len(top_and_head) != 2 or Path(top_and_head[0]).resolve() != root:
        return ""
    changed = subprocess.run(["git", "status", "--porcelain", "--", "hybridmoe"], capture_output=True,
                             text=True, cwd=root).stdout.strip()
    return top_and_head[1] + ("+modified" if changed else "")


# The commit a copy of the checkout was made from, for a host that gets the files without the
# history (`scripts/tpu_records.sh stamp` writes it before the tree is sent; it travels untracked).
COMMIT_STAMP = ".source-commit"


def write_commit_stamp(root: Path) -> str:
    """Write the commit of the checkout at `root`, as git says it now, to root/COMMIT_STAMP; return it.

    A stamp left from an earlier send is set aside first: read back, it would name that commit again.
    A stamp names a committed tree: where git knows no commit there, or the package differs from it
    (a copy on an accelerator host, whose own git is not this history), nothing is written, the
    stamp that was there is kept, and ValueError says so.
    """
    stamp = root / COMMIT_STAMP
    earlier = stamp.read_text() if stamp.is_file() else None
    stamp.unlink(missing_ok=True)
    commit = commit_of(root)
    if not commit or commit.endswith("+modified"):
        if earlier is not None:
            stamp.write_text(earlier)
        kept = f"; the stamp there ({earlier.strip()}) is kept" if earlier is not None else ""
        raise ValueError(f"stamp: {root} is {'no commit git knows' if not commit else commit}: a stamp names a "
                         f"committed tree (commit first, and stamp the checkout the copy is sent from){kept}")
    stamp.write_text(commit + "\n")
    return commit


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
    device = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()},
            "versions": {"python": platform.python_version(), "jax": jax.__version__},
            "backend": jax.default_backend(),
            "device": f"{device.device_kind} x {jax.device_count()}" if device.platform != "cpu" else "cpu"}


def write_record(path: Path, record: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
