"""The row-tiled grouped matmul (the xla backend on CPU): against the per-group reference loop,
on every MoE path through the model, and in the program (no loop, no scatter-add, no collective
inside a loop on one device or on the expert mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ATTENTION_LAYERS, TWO_LAYERS, assert_rel_l2, packed_batch, tiny_config, tiny_params
from hybridmoe.analysis.program import analyze, count, primitive_counts
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
    # Attention layers only (the MoE layer is every layer's; a GDN layer would only add to each compile).
    tiled = tiny_config(*ATTENTION_LAYERS, *PATHS[path])  # auto: row tiles on CPU
    ragged = tiny_config(*ATTENTION_LAYERS, "kernels.gmm.xla_impl=ragged_dot", *PATHS[path])
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
@pytest.mark.default_cpu_codegen
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


# ---------------------------------------------------------------------------------------------
# The whole routed MLP in the tile layout (the default MoE program on CPU, row_tiles.routed_swiglu_mlp).

# 37 tokens x 2 slots = 74 rows over 5 experts, 4-row tiles: groups straddle tiles, expert 4 is
# never routed to (an empty group), the rows do not fill the last tile; inputs span many binades.
_RT, _RD, _RE, _RF, _RK, _RTILE = 37, 8, 5, 4, 2, 4


def _routed_case():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(_RT, _RD)) * np.exp(2 * rng.normal(size=(_RT, 1))), jnp.float32)
    idx = jnp.asarray(np.stack([rng.permutation(_RE - 1)[:_RK] for _ in range(_RT)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.05, 1.0, size=(_RT, _RK)), jnp.float32)
    wi = jnp.asarray(rng.normal(size=(_RE, _RD, 2 * _RF)) * 0.3, jnp.float32)
    wo = jnp.asarray(rng.normal(size=(_RE, _RF, _RD)) * 0.3, jnp.float32)
    cot = jnp.asarray(rng.normal(size=(_RT, _RD)), jnp.float32)
    return x, w, idx, wi, wo, cot


def _routed_numpy(x, w, idx, wi, wo):
    """The routed MLP token by token, slot by slot, in float64."""
    x, w, idx, wi, wo = (np.asarray(a, np.float64) if a.dtype != jnp.int32 else np.asarray(a)
                         for a in (x, w, idx, wi, wo))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            h = x[t] @ wi[idx[t, j]]
            gate, up = h[:_RF], h[_RF:]
            out[t] += w[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wo[idx[t, j]])
    return out


def _routed_errors():
    """Relative L2 of the tile-layout MLP against the sorted gmm path (same sums) and against
    independent references: numpy float64 (forward) and the dense every-expert path (gradients)."""
    from hybridmoe.model.moe import dense_experts, sparse_experts
    x, w, idx, wi, wo, cot = _routed_case()
    ours = lambda x, w, wi, wo: rt.routed_swiglu_mlp(x, w, idx, wi, wo, rows_per_tile=_RTILE)  # noqa: E731
    sorted_path = lambda x, w, wi, wo: sparse_experts(  # noqa: E731
        x, w, idx, wi, wo, lambda a, b, s: rt.row_tiled_dot(a, b, s, tile_rows=_RTILE))
    dense = lambda x, w, wi, wo: dense_experts(x, w, idx, wi, wo)  # noqa: E731
    grads = {n: jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), (0, 1, 2, 3)))(x, w, wi, wo)
             for n, f in (("ours", ours), ("sorted", sorted_path), ("dense", dense))}
    y = jax.jit(ours)(x, w, wi, wo)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))  # noqa: E731
    errs = {"fwd_vs_numpy": rel(y, _routed_numpy(x, w, idx, wi, wo)),
            "fwd_vs_sorted": rel(y, np.asarray(jax.jit(sorted_path)(x, w, wi, wo), np.float64))}
    for name, a, b, c in zip(("dx", "dw", "dwi", "dwo"), grads["ours"], grads["sorted"], grads["dense"]):
        errs[f"{name}_vs_sorted"] = rel(a, np.asarray(b, np.float64))
        errs[f"{name}_vs_dense"] = rel(a, np.asarray(c, np.float64))
    return errs, grads["ours"]


def test_routed_mlp_equals_the_sorted_path_and_the_references():
    errs, (dx, dw, dwi, dwo) = _routed_errors()
    assert max(errs.values()) < 1e-5, errs
    assert not np.any(np.asarray(dwi)[_RE - 1]) and not np.any(np.asarray(dwo)[_RE - 1]), \
        "the empty expert got a weight gradient"


# Sabotages of the layout's position map and of the hand-written backward; each must be caught.
_ORIGINAL_ROUTED_TILES = rt.routed_tiles
_ORIGINAL_ROW_COTANGENTS = rt.row_cotangents

BROKEN_ROUTED = {
    # The combine reads each (token, slot) row's neighbour in the padded layout.
    "position_off_by_one": ("routed_tiles", lambda idx, e, r: (lambda t: t._replace(
        pos_Tk=jnp.minimum(t.pos_Tk + 1, t.token_P.shape[0] - 1)))(_ORIGINAL_ROUTED_TILES(idx, e, r))),
    # The backward forgets the routing weight on the rows' output cotangents.
    "row_cotangent_unweighted": ("row_cotangents", lambda d, w, r, dt: _ORIGINAL_ROW_COTANGENTS(
        d, jnp.ones_like(w), r, dt)),
    # SiLU's derivative without its second term.
    "silu_grad_first_term_only": ("silu_grad", lambda x: jax.nn.sigmoid(x)),
}


@pytest.mark.parametrize("variant", list(BROKEN_ROUTED))
def test_routed_mlp_broken_variants_caught(variant, monkeypatch):
    name, fn = BROKEN_ROUTED[variant]
    monkeypatch.setattr(rt, name, fn)
    errs, _ = _routed_errors()
    worst = max(v for k, v in errs.items() if "sorted" not in k)
    assert worst > 1e-4, f"{variant} not caught (10x the clean bound 1e-5): {errs}"
