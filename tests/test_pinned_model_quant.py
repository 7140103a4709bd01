"""fp8 fake quantization pinned to hand-worked codes (quant/fp8.py) and the routed experts' hook
without a mesh (quant/expert_fp8.py). Power-of-two scales change a value's rounding only where it
falls into the format's subnormal range, so the cases put a small value beside a large one in one
slice: quantized along the right axis it is a subnormal code, along the wrong one a normal one.
Tiny eager arrays; nothing compiles a model."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from hybridmoe.quant import expert_fp8, fp8

# [E 1, K 2, N 2]. Along K (axis 1, the contracting axis): column 0 (448, 0.013) has scale 1, where
# 0.013 is a subnormal e4m3 code, a multiple of 2**-9: 0.013 / 2**-9 = 6.66 -> 7 x 2**-9 = 0.013671875;
# column 1 (1, 1) has scale 2**-8 (1 / 2**-8 = 256 <= 448): exact. Along N (rows) instead, row 1
# (0.013, 1) would have scale 2**-8: 0.013 x 256 = 3.33 -> 3.25 (e4m3 steps of 0.25 in [2, 4)),
# 3.25 / 256 = 0.0126953125.
W = jnp.array([[[448.0, 1.0], [0.013, 1.0]]])
W_Q = [[[448.0, 1.0], [0.013671875, 1.0]]]


def test_fake_quant_rounds_each_column_on_its_own_scale():
    np.testing.assert_array_equal(np.asarray(fp8.fake_quant(W, 1)), W_Q)
    np.testing.assert_array_equal(np.asarray(fp8.fake_quant(W, 2)), [[[448.0, 1.0], [0.0126953125, 1.0]]])


def test_fake_quant_takes_a_given_absmax_and_passes_the_gradient_straight_through():
    # absmax 448 for column 1 too: scale 1, 1.0 still exact
    amax = jnp.array([[[448.0, 448.0]]])
    np.testing.assert_array_equal(np.asarray(fp8.fake_quant(W, 1, amax)), W_Q)
    # absmax 1 for column 0 (as if hoisted from another slice): scale 2**-8, 448 saturates at 448 x 2**-8
    small = jnp.array([[[1.0, 1.0]]])
    assert float(fp8.fake_quant(W, 1, small)[0, 0, 0]) == 448.0 / 256
    # d/dw sum(c * fake_quant(w)) = c: the rounding has no gradient
    c = jnp.array([[[1.0, 2.0], [3.0, 4.0]]])
    g = jax.grad(lambda w: jnp.sum(c * fp8.fake_quant(w, 1)))(W)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
    # straight_through: the value of x_q, the gradient of x
    v, g = jax.value_and_grad(lambda x: jnp.sum(fp8.straight_through(x, jnp.full_like(x, 5.0)) * 3.0))(jnp.ones(2))
    assert float(v) == 30.0 and np.asarray(g).tolist() == [3.0, 3.0]


def test_absmax_is_of_magnitudes_over_one_axis_kept():
    x = jnp.array([[-3.0, 2.0], [1.0, -0.5]])
    assert np.asarray(fp8.absmax(x, 1)).tolist() == [[3.0], [1.0]]
    assert np.asarray(fp8.absmax(x, 0)).tolist() == [[3.0, 2.0]]


def test_e5m2_saturates_at_57344_and_negative_zero_codes_become_positive():
    codes = fp8.quantize(jnp.array([1e9, -1e9, 3.0]), 1.0, fp8.E5M2)
    assert np.asarray(codes.astype(jnp.float32)).tolist() == [57344.0, -57344.0, 3.0]
    neg = fp8.quantize(jnp.array([-0.0, -1e-12, 1.0]), 1.0)
    assert np.signbit(np.asarray(neg.astype(jnp.float32))).tolist() == [True, True, False]
    pos = fp8.positive_zero(neg).astype(jnp.float32)
    assert np.signbit(np.asarray(pos)).tolist() == [False, False, False]
    assert np.asarray(pos).tolist() == [0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------------------
# quant/expert_fp8.py without a mesh


def test_routed_weight_at_use_without_a_mesh_is_its_fake_quantization_over_axis_1():
    axes = ("exp", "embed", "mlp")
    np.testing.assert_array_equal(np.asarray(expert_fp8.weight_at_use(W, axes, "off")), W_Q)
    # a given absmax is used as it is
    np.testing.assert_array_equal(np.asarray(expert_fp8.weight_at_use(W, axes, "absmax", jnp.array([[[1.0, 1.0]]])))[0, 0],
                                  [448.0 / 256, 1.0])
    with pytest.raises(ValueError, match="gather8 needs a device mesh with an FSDP-sharded expert weight"):
        expert_fp8.weight_at_use(W, axes, "gather8")


def test_stacked_absmax_without_a_mesh_is_per_layer_expert_and_column():
    # [L 2, E 1, K 2, N 2]: layer 1 is layer 0 negated and doubled
    stack = jnp.stack([W, -2.0 * W])
    amax = expert_fp8.stacked_absmax(stack, ("exp", "embed", "mlp"), "absmax")
    assert amax.shape == (2, 1, 1, 2)
    assert np.asarray(amax).tolist() == [[[[448.0, 1.0]]], [[[896.0, 2.0]]]]


def test_gather_refuses_axes_that_are_not_the_minor_ones_of_the_dim(monkeypatch):
    seen = []
    monkeypatch.setattr(jax.lax, "all_gather", lambda x, axes, **kw: seen.append((axes, kw["axis"])) or x)
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=r"the gathered mesh axes \('fsdp',\) must be the minor ones of the weight "
                                         r"dim \('fsdp', 'context'\)"):
        expert_fp8._gather(x, PS(None, ("fsdp", "context")), [(), ("fsdp",)])
    expert_fp8._gather(x, PS(None, ("fsdp", "context")), [(), ("context",)])
    expert_fp8._gather(x, PS("expert", ("fsdp", "context")), [(), ("fsdp", "context")])
    assert seen == [(("context",), 1), (("fsdp", "context"), 1)]


def _quant_cfg(on, hoist="off"):
    return SimpleNamespace(quant=SimpleNamespace(fp8_moe_fake_quant=on, fp8_fake_quant_hoist=hoist))


def test_layer_weights_quantize_only_the_routed_experts():
    router = jnp.array([[0.013, 448.0]])
    lp = {"input_norm": jnp.array([0.013, 448.0]), "moe": {"router": router, "wi": W, "wo": 2.0 * W}}
    axes = {"input_norm": ("embed",), "moe": {"router": ("embed", None), "wi": ("exp", "embed", "mlp"),
                                              "wo": ("exp", "mlp", "embed")}}
    out = expert_fp8.layer_weights_at_use(lp, axes, _quant_cfg(True))
    np.testing.assert_array_equal(np.asarray(out["moe"]["wi"]), W_Q)
    np.testing.assert_array_equal(np.asarray(out["moe"]["wo"]), 2.0 * np.asarray(W_Q))  # x 2 is exact
    assert out["moe"]["router"] is router and out["input_norm"] is lp["input_norm"]
    off = expert_fp8.layer_weights_at_use(lp, axes, _quant_cfg(False))
    assert off["moe"]["wi"] is W
    assert expert_fp8.sampling_weights(lp, axes, _quant_cfg(False)) is lp
    np.testing.assert_array_equal(np.asarray(expert_fp8.sampling_weights(lp, axes, _quant_cfg(True))["moe"]["wi"]), W_Q)
    # a hoisted absmax is read per routed weight
    amax = {"wi": jnp.array([[[1.0, 1.0]]]), "wo": jnp.array([[[896.0, 2.0]]])}
    hoisted = expert_fp8.layer_weights_at_use(lp, axes, _quant_cfg(True, "absmax"), amax)
    assert float(hoisted["moe"]["wi"][0, 0, 0]) == 448.0 / 256
    np.testing.assert_array_equal(np.asarray(hoisted["moe"]["wo"]), 2.0 * np.asarray(W_Q))
    # the hoist's mode reaches the weight: gather8 (which needs a mesh) is refused here, not run as off
    with pytest.raises(ValueError, match="gather8 needs a device mesh"):
        expert_fp8.layer_weights_at_use(lp, axes, _quant_cfg(True, "gather8"), amax)


def test_an_all_zero_column_keeps_scale_one_and_zero_codes():
    w = jnp.array([[[0.0, 3.0], [0.0, -5.0]]])
    np.testing.assert_array_equal(np.asarray(fp8.absmax(w, 1)), [[[0.0, 5.0]]])
    codes, scale = fp8.quantize_rows(w, axis=1)
    assert np.asarray(scale).tolist() == [[[1.0, 2.0 ** -6]]]   # 5 / 2**-6 = 320 <= 448
    assert np.asarray(codes.astype(jnp.float32)).tolist() == [[[0.0, 192.0], [0.0, -320.0]]]
