"""Hugging Face checkpoints in and out of a run: --init-hf (weights into the sharded state) and
--export-hf (the trained weights, with the checkpoint's tokenizer and generation files, back out)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.run.run_dir import RunError
from hybridmoe.recipe.validate import CHECKPOINT_SHAPE_FIELDS, check_requirements
from hybridmoe.model.params import abstract_params
from hybridmoe.parallel.host import put_global


def config_with_hf_model(cfg: Config, hf_dir: Path) -> Config:
    """The recipe's config with the model fields of an HF checkpoint's config.json, validated against
    the checkpoint (a ConfigError names every shape field where the recipe disagrees, and the
    override that would match)."""
    from hybridmoe.hf import CheckpointError, model_fields_from_hf_config, read_hf_config
    try:
        fields = model_fields_from_hf_config(read_hf_config(str(hf_dir)))
    except CheckpointError as e:
        raise RunError(f"--init-hf: {e}") from None
    current = cfg.model.model_dump()
    # The recipe keeps its shape fields, which the validator compares with the checkpoint's.
    taken = {k: v for k, v in fields.items() if k in current and k not in CHECKPOINT_SHAPE_FIELDS}
    try:
        new = Config.model_validate({**cfg.model_dump(), "model": {**current, **taken}})
    except ValueError as e:
        raise RunError(f"--init-hf {hf_dir}: its model fields do not make a valid config: {e}") from None
    check_requirements(new, checkpoint_model=fields)
    return new


def read_hf_weights(hf_dir: Path | None, out: Path | None, resume: bool):
    """The --init-hf weights as numpy (read before anything is created or compiled, so a corrupt file
    fails leaving no trace), or None when there is no --init-hf or a resume will restore a checkpoint."""
    from hybridmoe.hf import load_hf_checkpoint
    from hybridmoe.run.checkpoint import CHECKPOINT_DIR_NAME, finished_steps
    if hf_dir is None or (resume and out is not None and finished_steps(Path(out) / CHECKPOINT_DIR_NAME)):
        return None
    return load_hf_checkpoint(str(hf_dir))[1]


def params_from_hf(setup, hf_dir: Path, tree=None):
    """The weights of `hf_dir` (or its `tree` read by read_hf_weights), checked and sharded."""
    from hybridmoe.hf import load_hf_checkpoint
    if tree is None:
        _, tree = load_hf_checkpoint(str(hf_dir))
    want = abstract_params(setup.specs)
    problems = []
    try:
        jax.tree.map(lambda a, w: problems.append(f"{np.shape(a)} != {w.shape}") if np.shape(a) != w.shape else None,
                     tree, want)
    except ValueError as e:
        raise RunError(f"--init-hf {hf_dir}: its weight tree does not match the model's: {e}") from None
    if problems:
        raise RunError(f"--init-hf {hf_dir}: weight shapes differ from the model's: {problems[:5]}")
    return put_global(jax.tree.map(lambda a, w: np.asarray(a).astype(w.dtype), tree, want), setup.param_shardings)


def export_hf_checkpoint(out: Path, cfg: Config, params, source_dir: Path | None = None):
    """The policy as a sharded Hugging Face checkpoint in `out` (written by every host, see
    hf_export.py). A run that started from a checkpoint folder (`source_dir`, its --init-hf) exports
    in that folder's form (its names, layouts, dtypes, its other tensors and files); a run that
    started from a recipe writes a text-only checkpoint with data.tokenizer's side files. What was
    kept and what was written goes to the run's log (stderr of the lead host)."""
    import sys

    from hybridmoe.hf import checkpoint_shards, read_source_form
    from hybridmoe.parallel.host import is_lead_host
    from hybridmoe.run.hf_export import export_hf_sharded
    if source_dir is not None:
        source = read_source_form(str(source_dir), checkpoint_shards(str(source_dir)))
        report = export_hf_sharded(out, cfg, params, source=source)
    else:
        side = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
        report = export_hf_sharded(out, cfg, params, side_files_from=side)
    if is_lead_host():
        print(report.summary(out), file=sys.stderr)
    return report
