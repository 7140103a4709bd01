"""Native checkpoints with orbax: the sharded train state plus a small JSON of run metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoints intact and no half-written step behind; the temporary
directory such a kill leaves is never chosen, and is removed when the manager opens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

CHECKPOINT_DIR_NAME = "checkpoints"


def finished_steps(directory: Path) -> list[int]:
    """Steps with a finished checkpoint under `directory` (orbax names a finished step by its number
    alone), read from the folder names without opening a manager (which would create the folder)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


class Checkpoints:
    def __init__(self, directory: Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True),
            item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                          meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def restore_meta(self, step: int) -> dict:
        """The run metadata alone: lets a caller check a checkpoint before restoring its arrays."""
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
