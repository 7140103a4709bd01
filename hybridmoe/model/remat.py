"""Remat policies of the layer scan: what the forward keeps for the backward.

none: no rematerialisation (everything the backward needs is stored);
full: only the block's input is kept, the whole block is recomputed;
minimal: weight-matmul outputs are kept, elementwise work and attention are recomputed;
custom: exactly the checkpoint names of `remat.save` are kept, and the names the levers add.
"""

from __future__ import annotations

import jax

from hybridmoe.config.schema import Config
from hybridmoe.model.attention import LB_IDS_NAME


def save_names(cfg: Config) -> tuple[str, ...]:
    """The custom policy's save list: remat.save, then the names the levers save."""
    lever = (LB_IDS_NAME,) if cfg.attention.cp_load_balance_hoist_ids and LB_IDS_NAME not in cfg.remat.save else ()
    return tuple(cfg.remat.save) + lever


def remat_policy(cfg: Config):
    r = cfg.remat
    if r.policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if r.policy == "minimal":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if r.policy == "custom":
        return jax.checkpoint_policies.save_only_these_names(*save_names(cfg))
    raise ValueError(f"remat policy {r.policy!r} has no checkpoint policy")
