"""The run directory: what counts as a run in it, and how a fresh start, a resume and an overwrite
treat it, decided before anything in it is created or changed.

A checkpoint step is finished once orbax has renamed its temporary folder (N.orbax-checkpoint-tmp*)
to N; a kill mid-save leaves only the temporary folder, which is never chosen and is removed when
the checkpoint manager opens. A resume with no finished checkpoint starts at step 0 in the same
folder (and says so); a fresh start in a folder that already holds a run (metrics, TensorBoard
events or a finished checkpoint) is refused unless asked to overwrite it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from hybridmoe.parallel.host import is_lead_host, sync_hosts
from hybridmoe.run.checkpoint import CHECKPOINT_DIR_NAME, Checkpoints, finished_steps
from hybridmoe.run.metrics import JSONL_NAME, PNG_NAME, TB_DIR_NAME


class RunError(RuntimeError):
    """A run that cannot start as asked; nothing on disk was changed."""


RUN_FILES = (JSONL_NAME, PNG_NAME, TB_DIR_NAME, CHECKPOINT_DIR_NAME)


def run_contents(out: Path) -> list[str]:
    """What in `out` belongs to an earlier run (an unfinished checkpoint alone does not count)."""
    found = [name for name in (JSONL_NAME, TB_DIR_NAME) if (out / name).exists()]
    if finished_steps(out / CHECKPOINT_DIR_NAME):
        found.append(CHECKPOINT_DIR_NAME)
    return found


def check_paths(out: Path | None, *, resume: bool = False, overwrite: bool = False, export_hf: Path | None = None,
                init_hf: Path | None = None) -> None:
    """Refuse paths a run cannot use, before anything is built, trained or written."""
    if resume and out is None:
        raise RunError("--resume continues the run in --out: pass --out DIR")
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other: choose one")
    for flag, path in (("--out", out), ("--export-hf", export_hf)):
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise RunError(f"{flag} {path} is a file; it must name a folder (choose another path)")
    if init_hf is not None and not Path(init_hf).is_dir():
        raise RunError(f"--init-hf {init_hf} is not a folder holding config.json and *.safetensors")


def open_checkpoints(out: Path | None, *, resume: bool, overwrite: bool = False) -> Checkpoints | None:
    """The run's checkpoints, its folder checked for the way the run starts (see the module doc)."""
    check_paths(out, resume=resume, overwrite=overwrite)
    if out is None:
        return None
    out = Path(out)
    earlier = run_contents(out) if out.is_dir() else []
    if earlier and not resume:
        if not overwrite:
            raise RunError(f"{out} already holds a run ({', '.join(earlier)}); pass --resume to continue it, "
                           "--overwrite to replace it, or choose another --out")
        if is_lead_host():
            for name in RUN_FILES:
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        sync_hosts("overwrite")
    sync_hosts("run folder checked")  # no host may see another's first writes as an earlier run
    ckpt = Checkpoints(out / CHECKPOINT_DIR_NAME)
    if resume and ckpt.latest_step() is None and is_lead_host():
        print(f"--resume: no finished checkpoint in {out}; starting at step 0 in the same folder", file=sys.stderr)
    return ckpt


def config_record(cfg) -> dict:
    """The resolved config as plain JSON values (checkpoint metadata, records)."""
    return json.loads(cfg.model_dump_json())
