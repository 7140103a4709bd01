"""Remat policies of the layer scan: what the forward keeps for the backward.

none: no rematerialisation (everything the backward needs is stored);
full: only the block's input is kept, the whole block is recomputed;
minimal: weight-matmul outputs are kept, elementwise work and attention are recomputed;
custom: exactly the checkpoint names of `remat.save` are kept.
"""

from __future__ import annotations

import jax

from hybridmoe.config.schema import RematConfig


def remat_policy(r: RematConfig):
    if r.policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if r.policy == "minimal":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if r.policy == "custom":
        return jax.checkpoint_policies.save_only_these_names(*r.save)
    raise ValueError(f"remat policy {r.policy!r} has no checkpoint policy")
