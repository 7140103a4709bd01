"""`python tests/kill_point.py N hybridmoe-args...`: run the hybridmoe command, and SIGKILL it at the
exact moment its N-th checkpoint is written but not yet committed (orbax's rename of
N.orbax-checkpoint-tmp to N), the kill a random moment only sometimes hits. Used by kill_harness."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from orbax.checkpoint._src.path import async_path  # noqa: E402 -- the rename orbax commits a step with

from hybridmoe.cli import main  # noqa: E402

_rename = async_path.rename
_commits = 0


async def _rename_or_die(src, dst):
    global _commits
    if "orbax-checkpoint-tmp" in str(src) and dst.name.isdigit():
        _commits += 1
        if _commits == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)
    return await _rename(src, dst)


if __name__ == "__main__":
    async_path.rename = _rename_or_die
    sys.exit(main(sys.argv[2:]))
