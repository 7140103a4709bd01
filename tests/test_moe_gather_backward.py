"""moe.gather_backward (docs/levers.md): the backward of the MoE dispatch's two row moves as gathers
by the inverse permutation. Validator, exactness against the lever off (the same sums), the
program (no scatter left in the MoE's backward), and the broken variants the proofs must catch.

With top-2 routing a token's input gradient is the sum of two rows: autodiff's scatter-add into
zeros and the gather's float32 sum both round that exact sum once, and the outputs' move back is a
permutation (no sum at all), so lever on and off must agree bit for bit, float32 and bfloat16.
At top-4 the scatter-add rounds after each add: on and off then agree to float32 rounding.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from broken_variants import mutated
from helpers import TWO_LAYERS, tiny_config, tiny_params
from hybridmoe.config import ConfigError
from hybridmoe.model import moe as moe_mod
from hybridmoe.run.setup import build

ON = ("moe.gather_backward=true",)
RAGGED = ("kernels.gmm.xla_impl=ragged_dot",)  # the default program TPUs and GPUs run (sparse_experts)
RING = ("mesh.expert=2", "moe.capacity_factor=0.5")  # the kernel family's path; half the rows fit


def _problems(*overrides):
    with pytest.raises(ConfigError) as e:
        tiny_config(*overrides, platform="cpu")
    return {p[0]: p[1] for p in e.value.problems}


def test_refused_where_it_would_change_nothing():
    assert "moe.impl=sparse" in _problems(*ON, "moe.impl=dense")["moe.gather_backward"]
    msg = _problems(*ON)["moe.gather_backward"]  # CPU's default program: row tiles
    assert "row tiles" in msg and "kernels.gmm.xla_impl=ragged_dot" in msg, msg
    tiny_config(*ON, *RAGGED, platform="cpu")
    tiny_config(*ON, *RING, platform="cpu")  # the grouped path runs it on any platform
    tiny_config(*ON, platform="tpu")  # auto is ragged_dot there


@functools.cache
def _run(*overrides, dtype="float32"):
    """((loss, y), (param grads, x grad)) of the production MoE layer on the 8-device mesh."""
    cfg = tiny_config(*TWO_LAYERS, f"model.compute_dtype={dtype}", *overrides)
    p = jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.model.d_model)).astype(dtype)

    def f(p, x):
        y = moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.size).reshape(y.shape) % 7), y

    with build(cfg).context():
        out = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, x)
    return jax.tree.map(lambda a: np.asarray(a, np.float32), out)


def _max_rel(a, b):  # max over leaves of max |a - b| / max |b|
    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _dispatch_grads(path: str, dtype: str, gather_backward: bool, k: int = 2):
    """(y, grads of x, routing weights, wi, wo) of one dispatch function alone: sparse_experts (the
    default program) or _grouped_rows with a buffer that drops rows (the kernel family's path)."""
    cfg = tiny_config(*RAGGED, f"model.num_experts_per_tok={k}", "moe.capacity_factor=0.5" if path == "grouped" else
                      "moe.capacity_factor=0", f"moe.gather_backward={str(gather_backward).lower()}", platform="cpu")
    m, T, E = cfg.model, 64, cfg.model.num_experts
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (T, m.d_model)).astype(dtype)
    # Skewed routing: expert 0 takes most rows. A buffer of half the even share (grouped) keeps
    # E x ceil(M / 2E) rows of M: the rest are dropped (a buffer of 1x always spans M rows).
    idx = jax.random.categorical(keys[1], jnp.log(jnp.array([8.0] + [1.0] * (E - 1))), shape=(T, k)).astype(jnp.int32)
    w = jax.random.uniform(keys[2], (T, k), jnp.float32, 0.1, 1.0)
    wi = (jax.random.normal(keys[3], (E, m.d_model, 2 * m.moe_intermediate_size)) * 0.2).astype(dtype)
    wo = (jax.random.normal(keys[4], (E, m.moe_intermediate_size, m.d_model)) * 0.2).astype(dtype)
    if path == "default":
        fn = lambda x, w, wi, wo: moe_mod.sparse_experts(x, w, idx, wi, wo, jax.lax.ragged_dot, gather_backward)  # noqa: E731
    else:
        plan = moe_mod.GroupedPlan.of(m, cfg.moe, cfg.kernels, platform="cpu")
        fn = lambda x, w, wi, wo: moe_mod._grouped_rows(x, w, idx, wi, wo, plan, 0)[0]  # noqa: E731
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))  # noqa: E731
    out = jax.jit(lambda *a: (fn(*a), jax.grad(loss, (0, 1, 2, 3))(*a)))(x, w, wi, wo)
    return jax.tree.map(lambda a: np.asarray(a, np.float32), out)


@pytest.mark.parametrize("path", ["default", "grouped"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top2_on_equals_off_bit_for_bit(path, dtype):
    on, off = _dispatch_grads(path, dtype, True), _dispatch_grads(path, dtype, False)
    for x, y in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
        np.testing.assert_array_equal(x, y)


def test_top4_and_the_layer_on_the_mesh_equal_off_to_float32_rounding():
    # Top-4: the scatter-add's order of a token's four rows differs from the gather's sum.
    err = _max_rel(_dispatch_grads("default", "float32", True, k=4), _dispatch_grads("default", "float32", False, k=4))
    assert err < 1e-6, err
    # The production layer on the 8-device mesh (router, shared expert, the ring with drops): x's
    # gradient adds the dispatch's share to the router's and the shared expert's, in an order the
    # compiler picks per program.
    for path in (RAGGED, RING, ("mesh.expert=2", "moe.token_chunks=2")):  # and inside the chunks' own VJP
        err = _max_rel(_run(*ON, *path), _run(*path))
        assert err < 1e-5, (path, err)  # clean ~1e-7; each broken variant below > 1e-2


@pytest.mark.default_cpu_codegen
def test_no_scatter_left_in_the_moe_backward():
    """The lever's point: the compiled backward of the default program holds no scatter of
    [rows, d_model] (the lever off: two, the token rows' gradient and the outputs' move back)."""
    def scatters(*overrides):
        cfg = tiny_config(*TWO_LAYERS, *RAGGED, *overrides)
        p = jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])
        x = jnp.ones((8, 16, cfg.model.d_model), jnp.float32)
        loss = lambda p, x: jnp.sum(moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels))  # noqa: E731
        with build(cfg).context():
            text = jax.jit(jax.grad(loss, (0, 1))).lower(p, x).compile().as_text()
        return sorted(re.search(r"= f32\[(\d+),", line).group(1) for line in text.splitlines()
                      if " scatter(" in line and re.search(rf"= f32\[\d+,{cfg.model.d_model}\]", line))
    # Lever off: the combine's backward (moe_align.slot_sum's: one scatter of the outputs' [32, 64], 16
    # tokens a device x 2 slots) and the token rows' gradient ([16, 64]); on: neither (what is left
    # are the [M] routing weights' and the router's).
    assert scatters() == ["16", "32"]
    assert scatters(*ON) == []


# Slips in the lever's backward, each patched in; the proofs above must fail for every one.
BROKEN = {
    # the token rows' gradient gathered by the sort order instead of its inverse
    "order_for_inverse": ("_token_rows_bwd", "slot_sum(g_RD, inverse_M, k)", "slot_sum(g_RD, jnp.argsort(inverse_M), k)"),
    # only the first of a token's k rows summed
    "one_slot": ("_token_rows_bwd", "slot_sum(g_RD, inverse_M, k)",
                 "slot_sum(g_RD, inverse_M.reshape(-1, k)[:, 0], 1)"),
    # the dropped rows' zeros put before the kept rows
    "padding_first": ("_token_rows_bwd", "[g_RD, jnp.zeros((M - R, D), g_RD.dtype)]",
                      "[jnp.zeros((M - R, D), g_RD.dtype), g_RD]"),
    # the outputs' gradient read back by the inverse permutation, not the sort order
    "inverse_for_order": ("_combine_fwd", "slot_sum(y_MD, inverse_M, k), order_M", "slot_sum(y_MD, inverse_M, k), inverse_M"),
}


def test_a_slot_sum_backward_that_gives_rows_the_wrong_token_is_caught(monkeypatch):
    # The lever off's combine backward (moe_align.slot_sum's own): each row given the gradient of the
    # token of its slot index instead of its token; the lever on (gathers) is the control.
    from hybridmoe.model import moe_align

    monkeypatch.setattr(moe_align, "_slot_sum_bwd", mutated(moe_align, "_slot_sum_bwd", "// k  #", "% k  #"))
    err = _max_rel(_dispatch_grads("default", "float32", True), _dispatch_grads("default", "float32", False))
    assert err > 1e-2, err


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_variant_is_caught(name, monkeypatch):
    fn, old, new = BROKEN[name]
    monkeypatch.setattr(moe_mod, fn, mutated(moe_mod, fn, old, new))
    path = "grouped" if name == "padding_first" else "default"
    err = _max_rel(_dispatch_grads(path, "float32", True), _dispatch_grads(path, "float32", False))
    assert err > 1e-2, (name, err)
