"""Model figures pinned to hand-worked numbers at tiny, odd shapes: parameter shapes and counts
(model/params.py), routing weights and the capacity buffer's drops (model/moe.py), the remat auto
rule's estimate and threshold (model/remat.py), chip generations (kernels/platform.py) and fp8
scales (quant/fp8.py). Eager arrays of a few elements; nothing compiles a model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.config.schema import ModelConfig
from hybridmoe.kernels import platform
from hybridmoe.model import moe as moe_mod
from hybridmoe.model import params as P
from hybridmoe.model import remat
from hybridmoe.quant import fp8

# D 8, V 10, one block of (gdn, attention); attention N 4, G 2, A 8; GDN K 2, U 4, k 3, v 5, W 4;
# E 6 routed experts (top 2) of F 7, a shared expert of S 9. Every size distinct where a swap matters.
DIMS = dict(vocab_size=10, d_model=8, num_layers=2, layer_pattern=("gdn", "attention"), num_heads=4, num_kv_heads=2,
            head_dim=8, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_dim=3, gdn_value_dim=5, gdn_conv_kernel=4,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=7, shared_expert_intermediate_size=9)
# attention: wq 8*4*16 + wk, wv 8*2*8 each + q_norm, k_norm 8 each + wo 4*8*8
ATTN = 512 + 2 * 128 + 2 * 8 + 256
# GDN: wq, wk 8*2*3; wv, wz 8*4*5; wb, wa 8*4; conv_q, conv_k 4*2*3; conv_v 4*4*5; A_log, dt_bias 4; norm 5; wo 4*5*8
GDN = 2 * 48 + 2 * 160 + 2 * 32 + 2 * 24 + 80 + 2 * 4 + 5 + 160
# MoE: router 8*6; wi 6*8*14; wo 6*7*8; shared_wi 8*18; shared_wo 9*8; shared_gate 8
MOE = 48 + 672 + 336 + 144 + 72 + 8
NORMS = 2 * 8  # input_norm, post_norm
OUTER = 80 + 8 + 80  # embed 10*8, final_norm, lm_head 8*10


def test_param_count_is_every_weight_of_every_layer():
    m = ModelConfig(**DIMS)
    assert P.count_params(P.declare_params(m)) == (GDN + NORMS + MOE) + (ATTN + NORMS + MOE) + OUTER  # 4581
    # two blocks: the layers twice, embeddings once
    m4 = ModelConfig(**{**DIMS, "num_layers": 4})
    assert P.count_params(P.declare_params(m4)) == 2 * (GDN + ATTN + 2 * NORMS + 2 * MOE) + OUTER
    # no shared expert: 144 + 72 + 8 fewer per layer
    m0 = ModelConfig(**{**DIMS, "shared_expert_intermediate_size": 0})
    assert P.count_params(P.declare_params(m0)) == 4581 - 2 * (144 + 72 + 8)
    # tied: no lm_head
    assert P.count_params(P.declare_params(ModelConfig(**{**DIMS, "tie_word_embeddings": True}))) == 4581 - 80


def test_active_params_leave_out_the_experts_a_token_is_not_sent_to():
    # per expert 3 * D * F = 168; 6 - 2 idle experts in each of 2 layers
    assert P.count_active_params(ModelConfig(**DIMS)) == 4581 - 4 * 168 * 2
    m4 = ModelConfig(**{**DIMS, "num_layers": 4, "num_experts_per_tok": 3})
    assert P.count_active_params(m4) == P.count_params(P.declare_params(m4)) - 3 * 168 * 4


def test_declared_shapes_and_axes_are_stacked_per_block():
    m = ModelConfig(**{**DIMS, "num_layers": 4})
    tree = P.declare_params(m)
    gdn, attn = tree["blocks"]
    assert gdn["mixer"]["wv"].shape == (2, 8, 4, 5) and gdn["mixer"]["wv"].axes == ("layers", "embed", "heads", None)
    assert gdn["mixer"]["conv_q"].shape == (2, 4, 2, 3)
    assert gdn["mixer"]["wo"].shape == (2, 4, 5, 8) and gdn["mixer"]["wo"].axes == ("layers", "heads", None, "embed")
    assert attn["mixer"]["wq"].shape == (2, 8, 4, 16) and attn["mixer"]["wk"].axes == ("layers", "embed", "kv_heads", None)
    assert attn["moe"]["wi"].shape == (2, 6, 8, 14) and attn["moe"]["wi"].axes == ("layers", "exp", "embed", "mlp")
    assert attn["moe"]["wo"].shape == (2, 6, 7, 8) and attn["moe"]["wo"].axes == ("layers", "exp", "mlp", "embed")
    assert attn["moe"]["shared_wi"].shape == (2, 8, 18)
    assert tree["embed"].axes == ("vocab", "embed") and tree["lm_head"].shape == (8, 10)
    assert P.layer_axes(m)[0]["mixer"]["wb"] == ("embed", "heads")
    with pytest.raises(ValueError, match="differ in rank"):
        P.ParamSpec((2, 3), ("embed",), P.constant(0.0))


def test_initialisers_hit_their_ranges():
    key = jax.random.key(0)
    assert np.all(np.asarray(P.constant(1.5)(key, (3,), jnp.float32)) == 1.5)
    a = np.exp(np.asarray(P.a_log_init(key, (4096,), jnp.float32)))
    assert a.min() >= 1.0 and a.max() <= 16.0 and a.max() > 15.0 and a.min() < 1.1
    dt = np.log1p(np.exp(np.asarray(P.dt_bias_init(key, (4096,), jnp.float32))))  # softplus
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001 and dt.min() < 1.2e-3 and dt.max() > 0.09
    x = np.asarray(P.normal(0.5)(key, (20000,), jnp.float32))
    assert abs(x.std() - 0.5) < 0.01
    # the declared initialisers: conv taps at 1 / sqrt(W) = 1 / 2 (W 4), projections at init_std
    gdn = P.declare_params(ModelConfig(**{**DIMS, "init_std": 0.03}))["blocks"][0]["mixer"]
    taps = np.asarray(gdn["conv_q"].init(key, (20000,), jnp.float32))
    assert abs(taps.std() - 0.5) < 0.01
    assert abs(np.asarray(gdn["wq"].init(key, (20000,), jnp.float32)).std() - 0.03) < 0.001
    assert np.all(np.asarray(gdn["norm"].init(key, (3,), jnp.float32)) == 1.0)  # GDN's norm multiplies directly


# ---------------------------------------------------------------------------------------------
# model/moe.py


def _route(x, norm=True, replay=None):
    # router [D 2, E 3] = [[1, 0, 0], [0, 1, 0]]: logits (x0, x1, 0)
    router = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    m = SimpleNamespace(num_experts_per_tok=2, norm_topk_prob=norm)
    return moe_mod.route(router, jnp.asarray(x, jnp.float32), m, replay)


def test_route_weights_are_top_k_probabilities_renormalised():
    # x (ln 4, ln 2): probabilities (4, 2, 1) / 7
    w, idx, probs = _route([[math.log(4.0), math.log(2.0)]])
    np.testing.assert_allclose(np.asarray(probs), [[4 / 7, 2 / 7, 1 / 7]], rtol=1e-6)
    assert np.asarray(idx).tolist() == [[0, 1]]
    np.testing.assert_allclose(np.asarray(w), [[2 / 3, 1 / 3]], rtol=1e-6)
    w, _, _ = _route([[math.log(4.0), math.log(2.0)]], norm=False)
    np.testing.assert_allclose(np.asarray(w), [[4 / 7, 2 / 7]], rtol=1e-6)


def test_replayed_route_weights_the_given_experts_by_current_probabilities():
    w, idx, _ = _route([[math.log(4.0), math.log(2.0)]], replay=jnp.array([[2, 0]]))
    assert np.asarray(idx).tolist() == [[2, 0]]
    np.testing.assert_allclose(np.asarray(w), [[1 / 5, 4 / 5]], rtol=1e-6)  # (1, 4) / 7, renormalised


@pytest.mark.parametrize("rows, experts, factor, expected", [
    (8, 4, 1.0, 2), (8, 4, 1.5, 3), (8, 4, 1.25, 3), (10, 4, 1.0, 3), (8, 4, 0.1, 1), (8, 4, 2.0, 4)])
def test_capacity_rows_round_the_even_share_up(rows, experts, factor, expected):
    assert moe_mod.capacity_rows(rows, experts, factor) == expected


def _capacity_case():
    # 4 tokens, k 2, 4 experts: rows per expert 4, 2, 1, 1 (M = 8)
    idx = jnp.array([[0, 1], [0, 2], [0, 3], [1, 0]])
    w = jnp.array([[0.5, 0.5], [0.25, 0.75], [0.6, 0.4], [0.3, 0.7]])
    x = jax.random.normal(jax.random.key(1), (4, 8))
    wi = jax.random.normal(jax.random.key(2), (4, 8, 6)) * 0.5
    wo = jax.random.normal(jax.random.key(3), (4, 3, 8)) * 0.5
    return x, w, idx, wi, wo


def _numpy_experts(x, w, idx, wi, wo, kept):
    """Each kept (token, slot) row through its expert, weighted, summed per token."""
    x, w, idx, wi, wo = map(lambda a: np.asarray(a, np.float64), (x, w, idx, wi, wo))
    y = np.zeros_like(x)
    for t, j in kept:
        e = int(idx[t, j])
        h = x[t] @ wi[e]
        gate, up = h[:3], h[3:]
        y[t] += w[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wo[e])
    return y


@pytest.mark.parametrize("factor, dropped, lost", [
    (1.0, 2, {(2, 0), (3, 1)}),       # cap 2: expert 0 keeps tokens 0, 1 and drops tokens 2, 3
    (1.5, 1, {(3, 1)}),               # cap 3: expert 0 drops the last token only
    (0.1, 4, {(1, 0), (2, 0), (3, 1), (3, 0)}),  # cap 1: expert 0 keeps token 0, expert 1 token 0
    (0.0, 0, set()),                  # dropless
])
def test_capacity_drops_the_latest_tokens_of_a_full_expert(factor, dropped, lost):
    x, w, idx, wi, wo = _capacity_case()
    plan = moe_mod.GroupedPlan(num_experts=4, capacity_factor=factor)
    y, n = moe_mod.grouped_experts(x, w, idx, wi, wo, plan)
    assert int(n) == dropped
    kept = [(t, j) for t in range(4) for j in range(2) if (t, j) not in lost]
    np.testing.assert_allclose(np.asarray(y), _numpy_experts(x, w, idx, wi, wo, kept), rtol=1e-4, atol=1e-5)


def test_capacity_drops_counted_for_local_experts_only():
    x, w, idx, wi, wo = _capacity_case()
    plan = moe_mod.GroupedPlan(num_experts=4, capacity_factor=1.0)
    # experts 2, 3 held here (one row each, cap 2): nothing of theirs dropped
    _, n = moe_mod.grouped_experts(x, w, idx, wi[2:], wo[2:], plan, group_offset=2)
    assert int(n) == 0
    _, n = moe_mod.grouped_experts(x, w, idx, wi[:2], wo[:2], plan, group_offset=0)
    assert int(n) == 2


def test_grouped_plan_is_default_only_without_levers():
    assert moe_mod.GroupedPlan(num_experts=4).is_default
    assert moe_mod.GroupedPlan(num_experts=4, xla_impl="row_tiles").runs_row_tiles
    assert not moe_mod.GroupedPlan(num_experts=4, xla_impl="ragged_dot").runs_row_tiles
    for lever in (dict(capacity_factor=1.0), dict(wi_fused_swiglu=True), dict(wo_fused_dswiglu=True),
                  dict(router_grad_from_wo_input=True), dict(backend="pallas_tpu"), dict(fp8=True),
                  dict(token_chunks=2)):
        assert not moe_mod.GroupedPlan(num_experts=4, **lever).is_default, lever
        assert not moe_mod.GroupedPlan(num_experts=4, xla_impl="row_tiles", **lever).runs_row_tiles, lever


# ---------------------------------------------------------------------------------------------
# model/remat.py: the auto rule


def _remat_model(**over):
    # D 64, N 4, G 2, A 16; GDN K 2, U 4, k 8, v 16; E 8, top 2, F 32, S 32
    return ModelConfig(**{"gdn_key_dim": 8, **over})


def test_residual_elements_per_token_by_mixer():
    # attention: (3 * 4 + 2 * 2) * 16 + 2 * 4 * seq 64 = 768; GDN: 3 * (2 * 2 * 8 + 2 * 4 * 16) = 480;
    # MoE: 2 * (2 * 64 + 4 * 32) + 8 + 3 * 32 = 616; 6 * D = 384
    assert remat.residual_elements_per_token(_remat_model(), 64) == 384 + 768 + 616
    assert remat.residual_elements_per_token(_remat_model(layer_pattern=("gdn",)), 64) == 384 + 480 + 616
    # the score rows grow with the sequence: 256 + 2 * 4 * 256
    assert remat.residual_elements_per_token(_remat_model(layer_pattern=("attention",)), 256) == 384 + 2304 + 616


def _remat_cfg(policy="auto", seq_len=64, **model):
    return SimpleNamespace(remat=SimpleNamespace(policy=policy), model=_remat_model(**model),
                           train=SimpleNamespace(seq_len=seq_len))


def test_auto_remat_is_none_while_residuals_fit_a_quarter_of_the_device():
    # 4 layers x 1000 tokens x 1768 elements x 4 bytes = 28,288,000 bytes; a quarter of 113,152,000
    assert remat.resolve_policy(_remat_cfg(), 1000, 113_152_000) == "none"
    assert remat.resolve_policy(_remat_cfg(), 1000, 113_151_999) == "full"
    assert remat.resolve_policy(_remat_cfg(policy="minimal"), 1000, 1) == "minimal"
    # bfloat16 halves the bytes
    assert remat.resolve_policy(_remat_cfg(compute_dtype="bfloat16"), 1000, 113_152_000 // 2) == "none"
    assert remat.resolve_policy(_remat_cfg(compute_dtype="bfloat16"), 1000, 113_152_000 // 2 - 1) == "full"


def test_auto_remat_caps_the_sequence_at_the_models_longest():
    # train.seq_len 1024 over max_seq_len 256: 384 + 2304 + 616 = 3304 elements; 4 x 1000 x 3304 x 4 x 4
    assert remat.resolve_policy(_remat_cfg(seq_len=1024), 1000, 4 * 1000 * 3304 * 4 * 4) == "none"
    assert remat.resolve_policy(_remat_cfg(seq_len=1024), 1000, 4 * 1000 * 3304 * 4 * 4 - 1) == "full"


def test_device_memory_is_the_limit_else_host_memory_per_device(monkeypatch):
    monkeypatch.setattr(jax, "local_devices", lambda: [SimpleNamespace(memory_stats=lambda: {"bytes_limit": 12345})])
    assert remat.device_memory_bytes() == 12345
    monkeypatch.setattr(jax, "local_devices", lambda: [SimpleNamespace(memory_stats=lambda: None)])
    monkeypatch.setattr(jax, "local_device_count", lambda: 8)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}
    monkeypatch.setattr(remat.os, "sysconf", lambda name: pages[name])
    assert remat.device_memory_bytes() == 4096 * 1000 // 8


def test_save_names_add_the_hoisted_ids_once():
    from hybridmoe.model.attention import LB_IDS_NAME

    def cfg(save, hoist):
        return SimpleNamespace(remat=SimpleNamespace(save=save), attention=SimpleNamespace(cp_load_balance_hoist_ids=hoist))

    assert remat.save_names(cfg(("moe_gate",), False)) == ("moe_gate",)
    assert remat.save_names(cfg(("moe_gate",), True)) == ("moe_gate", LB_IDS_NAME)
    assert remat.save_names(cfg((LB_IDS_NAME,), True)) == (LB_IDS_NAME,)
    assert remat.remat_policy(cfg((), False), "full") is jax.checkpoint_policies.nothing_saveable
    assert remat.remat_policy(cfg((), False), "minimal") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    with pytest.raises(ValueError, match="has no checkpoint policy"):
        remat.remat_policy(cfg((), False), "none")


# ---------------------------------------------------------------------------------------------
# kernels/platform.py and quant/fp8.py


@pytest.mark.parametrize("kind, generation", [("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"),
                                              ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU7x", "tpu7x"),
                                              ("NVIDIA H200", "h200"), ("cpu", None)])
def test_generation_of_device_by_kind(kind, generation):
    assert platform.generation_of_device(SimpleNamespace(device_kind=kind)) == generation
    assert platform.generation_of_device(object()) is None


def test_pallas_platforms():
    assert platform.PALLAS_PLATFORMS == {"pallas_tpu": ("tpu",), "pallas_gpu": ("gpu", "cuda", "rocm")}


@pytest.mark.parametrize("amax, dtype, scale", [
    (448.0, fp8.E4M3, 1.0),            # exactly the largest finite e4m3
    (449.0, fp8.E4M3, 2.0),            # just over: the next power of two
    (1.0, fp8.E4M3, 2.0 ** -8),        # 1 / 2**-8 = 256 <= 448; 2**-9 would give 512
    (0.0, fp8.E4M3, 1.0),              # an all-zero slice
    (2.0 ** -120, fp8.E4M3, 2.0 ** -126),  # 2**-128 would fit: never below the smallest normal
    (57344.0, fp8.E5M2, 1.0),
    (1.0, fp8.E5M2, 2.0 ** -15),       # 57344 = 0.875 * 2**16
])
def test_fp8_scale_is_the_smallest_power_of_two_that_fits(amax, dtype, scale):
    assert float(fp8.scale_from_absmax(jnp.float32(amax), dtype)) == scale


def test_fp8_quantize_saturates_and_rounds_on_the_scaled_grid():
    codes, scale = fp8.quantize_rows(jnp.array([[1000.0, 1.0, -3.0]]), axis=-1)
    assert float(scale[0, 0]) == 4.0                  # 1000 / 2 = 500 > 448; / 4 = 250
    assert np.asarray(codes.astype(jnp.float32)).tolist() == [[256.0, 0.25, -0.75]]  # 250 rounds to 256 (e4m3: 16 apart in [128, 256))
    assert np.asarray(fp8.quantize(jnp.array([1e6, -1e6]), 1.0).astype(jnp.float32)).tolist() == [448.0, -448.0]
    assert np.asarray(fp8.dequantize(codes, scale, jnp.float32)).tolist() == [[1024.0, 1.0, -3.0]]
    with pytest.raises(ValueError, match="not an fp8 code dtype"):
        fp8.fp8_max(jnp.bfloat16)
