"""The validator's rules for remat.save's kernel residuals (registered in recipe/rules.py, run by
recipe/validate.py): names that a kernel's own forward rule gives what it saves for its backward.
Kept with the kernel's output, a remat's backward needs no second run of the kernel's forward; where
that forward rule does not run, or its output is not kept, the name would keep nothing useful."""

from __future__ import annotations

from hybridmoe.config.errors import Problem
from hybridmoe.config.schema import Config
from hybridmoe.kernels.attention.limits import RESIDUALS_NAME as ATTENTION_RESIDUALS
from hybridmoe.kernels.gdn.limits import RESIDUALS_NAME as GDN_RESIDUALS
from hybridmoe.recipe.facts import Facts, _attention_backend, _context_size
from hybridmoe.recipe.gdn_rules import _gdn_backend
from hybridmoe.recipe.rules import rule


def _refused(name: str, unmet: list[str]) -> list[Problem]:
    return [("remat.save", f"{name} " + "; ".join(unmet))] if unmet else []


@rule("remat.save", "remat.policy", "kernels.gdn.backend", "mesh.context")
def _remat_save_gdn_core_residuals(cfg: Config, f: Facts) -> list[Problem]:
    """gdn_core_residuals: the Mosaic core's start states and inverses, named on one sequence shard;
    kept without the core's output (gdn_core_out) the backward replays the kernel all the same."""
    if GDN_RESIDUALS not in cfg.remat.save:
        return []
    unmet = []
    if "gdn" not in cfg.model.layer_pattern:
        unmet.append("names the GDN core's residuals, and model.layer_pattern has no GDN layer")
    elif (backend := _gdn_backend(cfg, f)) != "pallas_tpu":
        unmet.append(f"names the Mosaic GDN core's residuals; kernels.gdn.backend is {backend} here "
                     "(set pallas_tpu, or drop the name)")
    elif (_context_size(cfg, f) or 1) > 1:
        unmet.append("names the one-shard GDN core's residuals; sequence-sharded GDN (mesh.context > 1) keeps its "
                     "own (gdn_cp_transition, gdn_cp_state_in)")
    if "gdn_core_out" not in cfg.remat.save:
        unmet.append("without gdn_core_out the backward still runs the forward kernel for the core's output: "
                     "add gdn_core_out")
    return _refused(GDN_RESIDUALS, unmet)


@rule("remat.save", "remat.policy", "kernels.attention.backend", "attention.cp_impl")
def _remat_save_attn_core_residuals(cfg: Config, f: Facts) -> list[Problem]:
    """attn_core_residuals: the flash core's output and log-sum-exp (the output is what the layer's
    gate reads, so nothing else need be kept); the blocked core and the ring have no such rule."""
    if ATTENTION_RESIDUALS not in cfg.remat.save:
        return []
    unmet = []
    if "attention" not in cfg.model.layer_pattern:
        unmet.append("names the attention core's residuals, and model.layer_pattern has no attention layer")
    elif _attention_backend(cfg, f) == "blocked":
        unmet.append("names the flash attention core's residuals; kernels.attention.backend=blocked keeps none "
                     "(use a flash backend, or drop the name)")
    elif (_context_size(cfg, f) or 1) > 1 and cfg.attention.cp_impl == "ring":
        unmet.append("names the one-shard flash core's residuals; attention.cp_impl=ring keeps its own")
    return _refused(ATTENTION_RESIDUALS, unmet)


@rule("remat.expert_grad_lag", "remat.expert_grad_barrier", "model.layer_pattern")
def _remat_expert_grad_lag(cfg: Config, f: Facts) -> list[Problem]:
    """A lag moves the barrier of remat.expert_grad_barrier, within one repeating block."""
    lag, layers = cfg.remat.expert_grad_lag, len(cfg.model.layer_pattern)
    if lag == 0:
        return []
    if not cfg.remat.expert_grad_barrier:
        return [("remat.expert_grad_lag", f"{lag} moves the barrier of remat.expert_grad_barrier, which is off: "
                 "set remat.expert_grad_barrier=true, or the lag to 0")]
    if lag >= layers:
        return [("remat.expert_grad_lag", f"{lag} reaches past the repeating block of model.layer_pattern "
                 f"({layers} layers: a lag ties within one block): at most {layers - 1}")]
    return []
