"""The row-tiled grouped matmul (the xla backend on CPU): against the per-group reference loop,
on every MoE path through the model, and in the program (no loop, no scatter-add, no collective
inside a loop on one device or on the expert mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_rel_l2, packed_batch, tiny_config, tiny_params
from hybridmoe.tools.program import analyze, count, primitive_counts
from hybridmoe.config import ConfigError
from hybridmoe.kernels import gmm as K
from hybridmoe.kernels.gmm import reference as R
from hybridmoe.kernels.gmm import row_tiles as rt
from hybridmoe.model.moe import moe_layer
from hybridmoe.run.step import nll_sum

# (sizes, offset, local groups, transpose, rows per tile): empty groups, padding rows, one group
# holding every row, expert-sharded groups, groups straddling tiles, one-row tiles.
CASES = [([5, 0, 11, 3], 0, 4, False, 4), ([0, 0, 19, 0], 0, 4, True, 8), ([1, 1, 1, 1], 0, 4, False, 16),
         ([7, 6, 0, 2], 0, 4, True, 1), ([3, 7, 0, 6], 1, 2, False, 4), ([4, 6, 5, 3], 3, 1, True, 2)]


def _errors(sizes, offset, num_local, transpose, tile):
    """Max |ours - reference| of the output and of both gradients (padding rows hold NaN)."""
    rng = np.random.default_rng(sum(sizes) + tile)
    m, k, n = 24, 6, 5
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(num_local, n, k) if transpose else (num_local, k, n)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)
    ours = lambda a, b: K.gmm(a, b, gs, transpose_rhs=transpose, group_offset=offset,  # noqa: E731
                              xla_impl="row_tiles", xla_tile_rows=tile)
    ref = lambda a, b: R.gmm(a, b, gs, transpose_rhs=transpose, group_offset=offset)  # noqa: E731
    garbage = lhs.at[sum(sizes):].set(jnp.nan)
    out = ours(garbage, rhs)
    errs = {"out": float(np.max(np.abs(out - ref(lhs, rhs))))}
    g = [jax.grad(lambda a, b: jnp.sum(f(a, b) * cot), (0, 1))(lhs, rhs) for f in (ours, ref)]
    errs["dlhs"] = float(np.max(np.abs(g[0][0] - g[1][0])))
    errs["drhs"] = float(np.max(np.abs(g[0][1] - g[1][1])))
    return errs, out, g[0]


@pytest.mark.parametrize("sizes, offset, num_local, transpose, tile", CASES)
def test_matches_the_per_group_loop_forward_and_gradients(sizes, offset, num_local, transpose, tile):
    errs, out, (dlhs, drhs) = _errors(sizes, offset, num_local, transpose, tile)
    assert max(errs.values()) < 1e-5, errs
    keep = np.asarray(R.group_row_masks(jnp.asarray(sizes, jnp.int32), 24, offset, num_local).any(0))
    assert not np.any(np.asarray(out)[~keep]), "rows of no local group (padding: NaN) not zero"
    assert not np.any(np.asarray(dlhs)[~keep]), "rows of no local group got a gradient"
    empty = np.asarray(sizes)[offset:offset + num_local] == 0
    assert not np.any(np.asarray(drhs)[empty]), "an empty group got a weight gradient"


# Deliberate sabotages of the layout and of the weight gradient's segment sum; each must be caught.
_ORIGINAL_GROUP_OF = rt._group_of
_ORIGINAL_TGMM = rt.tgmm_f32


def _tiles_without_mask(x_MK, lay):
    return x_MK[lay.src_P].reshape(lay.num_tiles, lay.rows_per_tile, x_MK.shape[1])


BROKEN_LAYOUTS = {
    "group_of_off_by_one": ("_group_of", lambda ends, pos: jnp.maximum(_ORIGINAL_GROUP_OF(ends, pos) - 1, 0)),
    "padding_not_masked": ("to_tiles", _tiles_without_mask),
    "tiles_summed_into_the_next_group": ("tgmm_f32", lambda lhs, g, lay, num_local: _ORIGINAL_TGMM(
        lhs, g, lay._replace(group_T=jnp.minimum(lay.group_T + 1, num_local - 1)), num_local=num_local)),
}


@pytest.mark.parametrize("variant", list(BROKEN_LAYOUTS))
def test_broken_layout_caught(variant, monkeypatch):
    name, fn = BROKEN_LAYOUTS[variant]
    monkeypatch.setattr(rt, name, fn)
    worst = max(max(_errors(*case)[0].values()) for case in CASES[:2])
    assert not worst < 1e-5, f"{variant} not caught: max error {worst:.2e}"


def test_backward_is_gathers_and_matmuls():
    """No scatter-add and no loop in the grouped matmul's forward + backward (fused pair too)."""
    gs = jnp.asarray([5, 0, 11, 3], jnp.int32)
    x, wi, wo = jnp.ones((24, 8)), jnp.ones((4, 8, 12)), jnp.ones((4, 6, 8))
    kw = dict(xla_impl="row_tiles", xla_tile_rows=4)

    def pair(x, wi, wo):
        h, pre = K.wi_fused_swiglu(x, wi, gs, return_preact=True, **kw)
        return jnp.sum(K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=None, **kw))

    def plain(x, wi, wo):
        return jnp.sum(K.gmm(K.swiglu(K.gmm(x, wi, gs, **kw)), wo, gs, **kw))

    for fn in (pair, plain):
        prims = primitive_counts(jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(x, wi, wo).jaxpr)
        assert prims["gather"] > 0 and prims["dot_general"] >= 6, prims
        assert not {"scatter-add", "scatter_add", "while", "scan"} & set(prims), prims


def test_platform_choice():
    assert K.xla_impl_for("auto", "cpu") == "row_tiles"
    assert K.xla_impl_for("auto", "gpu") == K.xla_impl_for("auto", "tpu") == "ragged_dot"
    assert K.xla_impl_for("ragged_dot", "cpu") == "ragged_dot"
    with pytest.raises(ValueError, match="unknown xla grouped matmul"):
        K.xla_impl_for("scan")


# ---------------------------------------------------------------------------------------------
# Through the model, every MoE path, on the 8-device mesh.

# The lever and buffer paths run the same kernels (their tests compare them with references on
# the CPU default, row tiles); the default program and the ring are checked here.
PATHS = {
    "default": (),
    "expert2": ("mesh.expert=2",),
    "fused": ("moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true", "moe.router_grad_from_wo_input=true"),
    "capacity": ("moe.capacity_factor=1.5",),
}


@pytest.mark.parametrize("path", [p if p in ("default", "expert2") else pytest.param(p, marks=pytest.mark.slow)
                                  for p in PATHS])
def test_model_loss_and_gradients_equal_ragged_dot_on_the_mesh(path):
    from hybridmoe.run.setup import build
    tiled = tiny_config(*PATHS[path])  # auto: row tiles on CPU
    ragged = tiny_config("kernels.gmm.xla_impl=ragged_dot", *PATHS[path])
    params = tiny_params(tiled)
    batch = packed_batch(0, 8, 64, tiled.model.vocab_size)
    setup = build(tiled)
    out, prims = [], []
    for cfg in (ragged, tiled):
        with setup.context():
            p = jax.device_put(params, setup.param_shardings)
            fn = jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0])
            out.append(jax.jit(fn)(p))
            prims.append(primitive_counts(jax.make_jaxpr(fn)(p).jaxpr))
    assert prims[0]["ragged_dot_general"] > 0 and prims[1]["ragged_dot_general"] == 0, "arms not distinct"
    assert_rel_l2(out[0], out[1], 1e-5)


# ---------------------------------------------------------------------------------------------
# Program facts of the MoE layer's forward + backward.


@pytest.mark.parametrize("mesh", ["one_device", "expert2"])
def test_no_loop_and_no_collective_inside_a_loop(mesh):
    from hybridmoe.run.setup import build
    cfg = tiny_config(*(("mesh.expert=2",) if mesh == "expert2" else ("mesh.data=1",)))
    setup = build(cfg, jax.devices()[:1] if mesh == "one_device" else None)
    lp = jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, cfg.model.d_model)), jnp.float32)

    def loss(p, x):
        return jnp.sum(moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels) ** 2)

    with setup.context():
        fn = jax.grad(loss, (0, 1))
        prims = primitive_counts(jax.make_jaxpr(fn)(lp, x).jaxpr)
        prog = analyze(fn, lp, x)
    assert prims["ragged_dot_general"] == 0 and prims["while"] == prims["scan"] == 0, prims
    assert count(prog.compiled_collectives, in_loop=True) == 0
    assert "while" not in prog.compiled_text
    if mesh == "expert2":
        assert count(prog.compiled_collectives, kind="all-gather") > 0, "the ring's gathers are missing"


@pytest.mark.parametrize("overrides", [("moe.impl=dense",), ("kernels.gmm.backend=pallas_tpu", "kernels.interpret=true")])
def test_explicit_choice_refused_where_it_would_not_run(overrides):
    with pytest.raises(ConfigError) as e:
        tiny_config("kernels.gmm.xla_impl=row_tiles", *overrides)
    assert any(k == "kernels.gmm.xla_impl" for k, _ in e.value.problems), e.value.problems
