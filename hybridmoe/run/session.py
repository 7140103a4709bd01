"""A run's life, the same for the supervised loop (train/loop.py) and the RL loop (rl/loop.py).

1. `start_config`: the paths checked and, with --init-hf, the model section taken from the
   checkpoint's config.json, before anything is read, built or written.
2. The loop prepares what only it needs (the data, the task and its rewards), then
   `open_session`: the Hugging Face weights read (a corrupt file fails here, leaving no trace), the
   sharded set-up built, the run folder opened, and the state: the latest finished checkpoint of a
   resume (refused when it holds another model) or a fresh one.
3. `Session.run(step_fn, ...)`: the bookkeeping around the loop's own step: the history, the metrics
   file, the progress bar, the non-finite guard, a checkpoint every `checkpoint_every` steps and
   after the last; when the loop stops on an error (a non-finite stop included), the last completed
   step is checkpointed before the error propagates, so nothing already done is lost.
4. `Session.export`: the final weights in the Hugging Face layout.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hybridmoe.config.schema import Config
from hybridmoe.parallel.host import is_lead_host
from hybridmoe.run.checkpoint import Checkpoints
from hybridmoe.run.guard import NonFiniteGuard
from hybridmoe.run.hf_io import config_with_hf_model, export_hf_checkpoint, read_hf_weights
from hybridmoe.run.metrics import MetricsWriter
from hybridmoe.run.run_dir import RunError, check_paths, config_record, open_checkpoints
from hybridmoe.run.setup import RunSetup, build

log = logging.getLogger(__name__)


def start_config(cfg: Config, out: Path | None, *, resume: bool, overwrite: bool, init_hf: Path | None,
                 export_hf: Path | None) -> Config:
    """The run's config: the paths checked, and with init_hf the checkpoint's model section."""
    check_paths(out, resume=resume, overwrite=overwrite, export_hf=export_hf, init_hf=init_hf)
    return config_with_hf_model(cfg, init_hf) if init_hf is not None else cfg


@dataclasses.dataclass
class Session:
    """An opened run: its set-up, the checkpointed tree (`tree`, replaced by each step), where it
    starts, and the restored checkpoint's metadata on a resume (None on a fresh start)."""

    cfg: Config
    out: Path | None
    init_hf: Path | None
    setup: RunSetup
    tree: Any
    start: int
    saved_meta: dict | None
    ckpt: Checkpoints | None

    @property
    def meta(self) -> dict:
        """What every checkpoint of the run records besides the loop's own fields."""
        return {"config": config_record(self.cfg), "init_hf": str(self.init_hf) if self.init_hf else None}

    def run(self, step_fn: Callable[[Any, int], tuple[Any, dict, dict]], total: int, *, checkpoint_every: int,
            step_meta: Callable[[int], dict], progress: bool, desc: str, log_every: int = 1,
            on_write: Callable[[MetricsWriter, int], None] | None = None,
            on_close: Callable[[MetricsWriter], None] | None = None) -> list[dict]:
        """Steps start .. total - 1; the records of this invocation.

        step_fn(tree, step) -> (tree, record, progress-bar fields); the record holds update_skipped.
        step_meta(steps_done): the loop's own checkpoint fields (data position, RNG key, ...).
        A record is written every log_every steps (step 0 included) and on a stop; on_write / on_close
        follow the metrics writer (the RL loop's plot)."""
        writer = MetricsWriter(self.out, resume_from_step=self.start) if self.out is not None and is_lead_host() else None
        guard = NonFiniteGuard(self.cfg.train)
        history, done, last_saved = [], self.start, self.start

        def save(steps_done: int) -> None:
            self.ckpt.save(steps_done, self.tree, {**self.meta, **step_meta(steps_done)})

        bar = tqdm(range(self.start, total), initial=self.start, total=total,
                   disable=not progress or not is_lead_host(), desc=desc)
        try:
            with self.setup.context():
                for step in bar:
                    self.tree, rec, shown = step_fn(self.tree, step)
                    done = step + 1
                    history.append({"step": step, **rec})
                    stop = guard.observe(step, bool(rec["update_skipped"]))
                    if writer is not None and (step % log_every == 0 or stop is not None):
                        writer.write(step, rec)
                        if on_write is not None:
                            on_write(writer, done)
                    bar.set_postfix(shown)
                    if stop is not None:
                        raise stop  # the handler below checkpoints the last good state
                    if self.ckpt is not None and checkpoint_every and done % checkpoint_every == 0:
                        save(done)
                        last_saved = done
                if self.ckpt is not None and done > last_saved:
                    save(done)
                    last_saved = done
        except (Exception, KeyboardInterrupt):
            # Keep what is done: the last completed step's state is intact (the failure came between
            # steps, or inside one whose donated input is then gone: that save fails and is logged).
            if self.ckpt is not None and done > last_saved:
                try:
                    save(done)
                    log.warning("run stopped by an error in step %d; checkpointed the state after step %d "
                                "(checkpoint %d) in %s", done, done - 1, done, self.out)
                except Exception as e:  # noqa: BLE001 -- the original error is the one to report
                    log.warning("could not checkpoint step %d after the error: %s", done, e)
            raise
        finally:
            bar.close()
            self.close()
            if writer is not None:
                writer.close()
                if on_close is not None:
                    on_close(writer)
        return history

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

    def export(self, export_hf: Path | None, params) -> None:
        if export_hf is not None:
            export_hf_checkpoint(export_hf, self.cfg, params, source_dir=self.init_hf)


def open_session(cfg: Config, out: Path | None, *, resume: bool, overwrite: bool, init_hf: Path | None,
                 abstract_tree: Callable[[RunSetup], Any], fresh_tree: Callable[[RunSetup, Any], Any],
                 check_saved: Callable[[dict], None] | None = None) -> Session:
    """The set-up and the state the run starts from.

    abstract_tree(setup): the checkpoint tree's shapes and shardings (what a resume restores);
    fresh_tree(setup, hf_weights): a fresh start's tree (hf_weights: the --init-hf weights, or None);
    check_saved(meta): the loop's own refusals of a checkpoint (raise RunError)."""
    hf_tree = read_hf_weights(init_hf, out, resume)  # before anything is built or written
    setup = build(cfg)
    ckpt = open_checkpoints(out, resume=resume, overwrite=overwrite)
    session = Session(cfg, Path(out) if out is not None else None, init_hf, setup, None, 0, None, ckpt)
    latest = ckpt.latest_step() if ckpt else None
    try:
        if latest is None:
            session.tree = fresh_tree(setup, hf_tree)
            return session
        # A resume (a fresh start refuses a folder with a finished checkpoint).
        saved = ckpt.restore_meta(latest)
        if saved.get("config", {}).get("model") != session.meta["config"]["model"]:
            raise RunError(f"--resume: the checkpoint in {out} holds a model of another shape or kind than the "
                           "config asks for; resume with the same recipe, model.* overrides and --init-hf")
        if check_saved is not None:
            check_saved(saved)
        try:
            session.tree, _ = ckpt.restore(latest, abstract_tree(setup))
        except (ValueError, KeyError, TypeError) as e:
            raise RunError(f"--resume: the checkpoint at step {latest} in {out} does not fit the model: {e}") from None
        session.start, session.saved_meta = latest, saved
        return session
    except BaseException:
        session.close()
        raise
