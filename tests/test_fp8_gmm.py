"""quant.fp8_gmm (seed 003): the MoE grouped matmuls in fp8, forward and both gradients.

Tolerance table (relative L2 against float32 with HIGHEST precision, random data whose rows,
columns and groups span several binades): e4m3 keeps 3 significant bits (rounding error up to
2**-4 of a value), e5m2 2 bits (2**-3).

    forward      out = x @ w         e4m3 x e4m3   <= 0.08
    input grad   dx  = d @ w^T       e5m2 x e4m3   <= 0.12
    weight grad  dw  = x^T @ d       e4m3 x e5m2   <= 0.12

Each error must also stay above 1e-2 (the fp8 rounding is really there) and at least 10x below
the error of every broken variant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config, tiny_params
from hybridmoe.config import ConfigError
from hybridmoe.kernels.gmm import fp8 as kfp8
from hybridmoe.kernels.gmm import reference as ref
from hybridmoe.model import moe as moe_mod
from hybridmoe.run.setup import build

TOL = {"forward": 0.08, "input_grad": 0.12, "weight_grad": 0.12}
FP8_FLOOR = 1e-2
GMM = ("quant.fp8_gmm=true",)

CASES = {"every_group_local": (8, 0), "expert_shard_at_offset_2": (4, 2)}
SIZES = (5, 0, 9, 3, 7, 0, 4, 2)  # empty groups; 6 padding rows follow


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def kernel_errors(case: str) -> dict[str, float]:
    num_local, offset = CASES[case]
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(SIZES, jnp.int32)
    m, k, n = sum(SIZES) + 6, 64, 48
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((num_local, k, n)) * np.exp(rng.standard_normal((num_local, 1, n))),
                    jnp.float32)
    ct = jnp.asarray(rng.standard_normal((m, n)) * np.exp(rng.standard_normal((m, 1))), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) * ct)

    fp8_fn = lambda x, w: kfp8.gmm_fp8(x, w, sizes, group_offset=offset)  # noqa: E731
    ref_fn = lambda x, w: ref.gmm(x, w, sizes, group_offset=offset)  # noqa: E731
    both = lambda fn: jax.jit(lambda x, w: (fn(x, w), jax.grad(loss(fn), (0, 1))(x, w)))  # noqa: E731
    out, (dx, dw) = both(fp8_fn)(x, w)
    out_r, (dx_r, dw_r) = both(ref_fn)(x, w)
    # The contract: padding rows and foreign rows are zero, value and gradient.
    outside = np.asarray(out_r)[:, 0] == 0
    assert np.all(np.asarray(out)[outside] == 0) and np.all(np.asarray(dx)[outside] == 0)
    return {"forward": rel_l2(out, out_r), "input_grad": rel_l2(dx, dx_r), "weight_grad": rel_l2(dw, dw_r)}


@pytest.mark.parametrize("case", list(CASES))
def test_three_fp8_matmuls_within_the_tolerance_table(case):
    errs = kernel_errors(case)
    for what, err in errs.items():
        assert FP8_FLOOR < err <= TOL[what], f"{case} {what}: relative L2 {err:.3g} (table {TOL[what]})"


BROKEN = {
    "neighbouring_group_weight_scale": ("weight_scale_of_rows", lambda s, g: s[(g + 1) % s.shape[0], 0, :]),
    "scale_not_moved_onto_the_gradient": ("fold_scale", lambda d, s: d),
}


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variant_far_outside_the_table(variant, monkeypatch):
    clean = kernel_errors("expert_shard_at_offset_2")
    monkeypatch.setattr(kfp8, *BROKEN[variant])
    broken = kernel_errors("expert_shard_at_offset_2")
    worst = max(broken, key=lambda w: broken[w] / TOL[w])
    assert broken[worst] > TOL[worst] and broken[worst] >= 10 * clean[worst], (
        f"{variant}: clean {clean}, broken {broken}")


# ---------------------------------------------------------------------------------------------
# The MoE layer: default grouped path and expert parallelism, against float32 without fp8


def _layer_grads(cfg, p, x, setup=None):
    def f(p, x):
        y = moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels, quant=cfg.quant)
        return jnp.sum(jnp.sin(y)), y

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    if setup is None:
        return fn(p, x)
    with setup.context():
        return fn(p, x)


LAYER_TOL = {"output": 0.08, "x_grad": 0.12, "wi_grad": 0.12, "wo_grad": 0.12}


@pytest.mark.parametrize("mesh", ["default", "expert2"])
def test_moe_layer_within_the_tolerance_table(mesh):
    over = {"default": (), "expert2": ("mesh.expert=2",)}[mesh]
    base = tiny_config()
    p = jax.tree.map(lambda a: a[0], tiny_params(base)["blocks"][0]["moe"])
    x = jax.random.normal(jax.random.key(1), (8, 16, base.model.d_model))
    (_, y_r), (gp_r, gx_r) = _layer_grads(base, p, x)  # float32, no mesh
    cfg = tiny_config(*GMM, *over)
    (_, y), (gp, gx) = _layer_grads(cfg, p, x, build(cfg))
    errs = {"output": rel_l2(y, y_r), "x_grad": rel_l2(gx, gx_r), "wi_grad": rel_l2(gp["wi"], gp_r["wi"]),
            "wo_grad": rel_l2(gp["wo"], gp_r["wo"])}
    for what, err in errs.items():
        assert FP8_FLOOR / 10 < err <= LAYER_TOL[what], f"{mesh} {what}: relative L2 {err:.3g}"


def test_validator_names_every_unmet_requirement():
    with pytest.raises(ConfigError) as e:
        tiny_config(*GMM, "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true", "kernels.gmm.backend=pallas_tpu",
                    "kernels.interpret=true")
    msg = dict(e.value.problems)["quant.fp8_gmm"]
    assert "moe.wi_fused_swiglu" in msg and "float32 accumulator" in msg and "pallas_tpu" in msg
    with pytest.raises(ConfigError) as e:
        tiny_config(*GMM, "moe.impl=dense")
    assert "moe.impl=sparse" in dict(e.value.problems)["quant.fp8_gmm"]
    with pytest.raises(ConfigError) as e:
        tiny_config(*GMM, "moe.routing_replay=true")
    assert "moe.routing_replay" in dict(e.value.problems)["quant.fp8_gmm"]
    tiny_config(*GMM, "quant.fp8_moe_fake_quant=true", "moe.capacity_factor=2.0")


@pytest.mark.slow  # the 60-step comparison with bf16 is benchmarks/fp8_gmm_train.py (record + plot)
def test_tiny_recipe_trains_with_fp8_gmm():
    from hybridmoe.train.loop import train

    cfg = tiny_config(*GMM, "model.compute_dtype=bfloat16", "train.steps=4", "train.seq_len=32",
                      "train.warmup_steps=0")
    losses = [h["loss"] for h in train(cfg, None, progress=False)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
