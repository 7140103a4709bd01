"""The row-tiled grouped matmul against the per-group reference, and through the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_rel_l2, packed_batch, tiny_config, tiny_params
from hybridmoe.config import ConfigError
from hybridmoe.kernels.gmm import row_tiled_dot
from hybridmoe.train.step import nll_sum


def _per_group(lhs, rhs, sizes):
    out, start = np.zeros((lhs.shape[0], rhs.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = lhs[start:start + n] @ rhs[g]
        start += n
    return out  # rows past the total stay zero


@pytest.mark.parametrize("sizes, tile", [([5, 0, 11, 3], 4), ([0, 0, 19, 0], 8), ([1, 1, 1, 1], 16),
                                         ([7, 6, 0, 2], 1)])
def test_matches_the_per_group_loop_forward_and_gradients(sizes, tile):
    rng = np.random.default_rng(sum(sizes) + tile)
    M, K, N = 24, 6, 5  # M exceeds the groups' total: padding rows
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(len(sizes), K, N)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = row_tiled_dot(lhs, rhs, gs, tile_rows=tile)
    np.testing.assert_allclose(got, _per_group(np.asarray(lhs), np.asarray(rhs), sizes), rtol=1e-5, atol=1e-5)
    probe = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
    g_tiled = jax.grad(lambda a, b: jnp.sum(row_tiled_dot(a, b, gs, tile_rows=tile) * probe), argnums=(0, 1))(lhs, rhs)
    g_ragged = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs) * probe), argnums=(0, 1))(lhs, rhs)
    assert_rel_l2(g_ragged, g_tiled, 1e-5)
    assert np.all(np.asarray(g_tiled[0])[sum(sizes):] == 0), "padding rows got a gradient"


def test_model_loss_and_gradients_equal_ragged_dot_on_the_mesh():
    from hybridmoe.train.setup import build
    base = tiny_config()
    tiled = tiny_config("kernels.gmm.xla_impl=row_tiles", "kernels.gmm.xla_tile_rows=8")
    params = tiny_params(base)
    batch = packed_batch(0, 8, 64, base.model.vocab_size)
    setup = build(base)
    out = []
    for cfg in (base, tiled):
        with setup.context():
            p = jax.device_put(params, setup.param_shardings)
            out.append(jax.jit(jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0]))(p))
    assert_rel_l2(out[0], out[1], 1e-5)


@pytest.mark.parametrize("overrides", [("moe.impl=dense",), ("moe.wi_fused_swiglu=true",),
                                       ("moe.capacity_factor=1.5",), ("mesh.expert=2",)])
def test_refused_where_it_would_not_run(overrides):
    with pytest.raises(ConfigError) as e:
        tiny_config("kernels.gmm.xla_impl=row_tiles", *overrides)
    assert any(k == "kernels.gmm.xla_impl" for k, _ in e.value.problems), e.value.problems
