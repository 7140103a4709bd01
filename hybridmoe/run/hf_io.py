"""Hugging Face checkpoints in and out of a run: --init-hf (weights into the sharded state) and
--export-hf (the trained weights, with the checkpoint's tokenizer and generation files, back out)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.config.errors import ConfigError
from hybridmoe.run.run_dir import RunError
from hybridmoe.recipe.validate import check_requirements
from hybridmoe.model.params import abstract_params
from hybridmoe.parallel.host import put_global


# Model fields that decide a weight's shape: an HF checkpoint must agree with the recipe on these.
SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "layer_pattern", "num_heads", "num_kv_heads", "head_dim",
                "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_dim", "gdn_value_dim", "gdn_conv_kernel",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "tie_word_embeddings")


def config_with_hf_model(cfg: Config, hf_dir: Path) -> Config:
    """The recipe's config with the model fields of an HF checkpoint's config.json; a RunError naming
    every shape field where the recipe disagrees (and the overrides that would match)."""
    from hybridmoe.hf import CheckpointError, model_fields_from_hf_config, read_hf_config
    try:
        fields = model_fields_from_hf_config(read_hf_config(str(hf_dir)))
    except CheckpointError as e:
        raise RunError(f"--init-hf: {e}") from None
    current = cfg.model.model_dump()
    wrong = [(k, current[k], fields[k]) for k in SHAPE_FIELDS
             if k in fields and tuple(np.atleast_1d(current[k])) != tuple(np.atleast_1d(fields[k]))]
    if wrong:
        lines = "\n".join(f"  model.{k}: recipe {a!r}, checkpoint {b!r}" for k, a, b in wrong)
        fix = " ".join(f"model.{k}={list(b) if isinstance(b, (list, tuple)) else b}".replace(" ", "").replace("'", "")
                       for k, _, b in wrong)
        raise RunError(f"--init-hf {hf_dir}: the checkpoint's shapes disagree with the recipe's model section:\n{lines}\n"
                       f"use a recipe with this model, or pass: {fix}")
    known = {k: v for k, v in fields.items() if k in current}
    try:
        new = Config.model_validate({**cfg.model_dump(), "model": {**current, **known}})
        check_requirements(new)
    except (ConfigError, ValueError) as e:
        raise RunError(f"--init-hf {hf_dir}: its model fields do not make a valid config: {e}") from None
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
