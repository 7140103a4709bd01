"""remat.policy=auto: no replay where the residuals fit (the small CPU runs), full remat where they
do not (the large recipes, which also pin it)."""

import jax
import jax.numpy as jnp
import pytest

from helpers import tiny_config
from hybridmoe.recipe import load_config
from hybridmoe.model.forward import logits
from hybridmoe.model.params import abstract_params, declare_params
from hybridmoe.model.remat import resolve_policy

GIB = 2**30


def test_small_runs_keep_everything_large_ones_replay():
    small = load_config("small", [])
    assert small.remat.policy == "auto"
    assert resolve_policy(small, 2048, device_bytes=24 * GIB) == "none"
    assert resolve_policy(small, 2048, device_bytes=64 * 2**20) == "full"  # a budget it does not fit
    for recipe in ("qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b"):
        cfg = load_config(recipe, [])
        assert cfg.remat.policy == "full", recipe
        auto = load_config(recipe, ["remat.policy=auto"])
        # One 4096-token sequence per device, 96 GiB of HBM (TPU v5p / H100-class): still too big.
        assert resolve_policy(auto, 4096, device_bytes=96 * GIB) == "full", recipe


@pytest.mark.parametrize("policy, replayed", [("auto", False), ("full", True)])
def test_default_program_has_no_replay(policy, replayed):
    cfg = tiny_config(f"remat.policy={policy}")
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(declare_params(cfg.model)))
    tokens = jnp.zeros((2, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(logits(p, cfg, tokens))))(params)
    assert ("checkpoint" in str(jaxpr) or "remat" in str(jaxpr)) == replayed
