"""`python tests/kill_point.py WHERE hybridmoe-args...`: run the hybridmoe command and SIGKILL it at an
exact moment a random kill only sometimes hits. WHERE is `checkpoint:N` (its N-th checkpoint written
but not yet committed: orbax's rename of N.orbax-checkpoint-tmp to N) or `export` (the Hugging Face
export in the middle: its weight files written into the temporary folder, the index and config not
yet). Used by kill_harness."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from orbax.checkpoint._src.path import async_path  # noqa: E402 -- the rename orbax commits a step with

from hybridmoe.cli import main  # noqa: E402
from hybridmoe.run import hf_export  # noqa: E402

_rename = async_path.rename
_commits = 0


async def _rename_or_die(src, dst):
    global _commits
    if "orbax-checkpoint-tmp" in str(src) and dst.name.isdigit():
        _commits += 1
        if _commits == int(sys.argv[1].split(":")[1]):
            os.kill(os.getpid(), signal.SIGKILL)
    return await _rename(src, dst)


def _die_before_writing(path, text):
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    where = sys.argv[1]
    if where.startswith("checkpoint:"):
        async_path.rename = _rename_or_die
    elif where == "export":
        hf_export._write = _die_before_writing  # the index, written after every weight file
    else:
        sys.exit(f"kill_point: WHERE is checkpoint:N or export, not {where!r}")
    sys.exit(main(sys.argv[2:]))
