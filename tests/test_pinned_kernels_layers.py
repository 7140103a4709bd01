"""The layers' small formulas pinned to hand-worked numbers: the RMSNorms, the rotary tables and
the partial rotation (model/norms.py), the GDN gates and the causal conv across document edges
and a decode tail (model/gdn.py). A handful of scalars each; nothing compiles a model."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest
import numpy as np

from hybridmoe.config.schema import ModelConfig
from hybridmoe.model import gdn
from hybridmoe.model.norms import apply_partial_rope, gated_rms_norm, rms_norm, rope_tables


def _silu(x):
    return x / (1 + math.exp(-x))


def test_rms_norm_scales_by_one_plus_the_weight():
    # (3, 4): rms = sqrt(12.5); weights (0, 1) -> scales 1 and 2
    r = math.sqrt(12.5)
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([0.0, 1.0]), 0.0)),
                               [[3 / r, 2 * 4 / r]], rtol=1e-6)
    # eps joins the mean square: (0, 0) stays 0; (1, 1) with eps 1 -> 1 / sqrt(2)
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.array([[1.0, 1.0]]), jnp.zeros(2), 1.0)),
                               [[1 / math.sqrt(2)] * 2], rtol=1e-6)


def test_gated_rms_norm_multiplies_the_weight_and_silu_of_the_gate():
    r = math.sqrt(12.5)
    out = gated_rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([[1.0, 2.0]]), jnp.array([2.0, 1.0]), 0.0)
    np.testing.assert_allclose(np.asarray(out), [[2 * 3 / r * _silu(1.0), 4 / r * _silu(2.0)]], rtol=1e-6)


def test_rope_tables_and_partial_rotation():
    # rotary dim 4, theta 100: inverse frequencies 1 and 100 ** (-2 / 4) = 0.1; position 2: angles 2, 0.2
    cos, sin = rope_tables(jnp.array([[0, 2]]), 4, 100.0)
    np.testing.assert_allclose(np.asarray(cos[0, 1]), [math.cos(2), math.cos(0.2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sin[0, 1]), [math.sin(2), math.sin(0.2)] * 2, rtol=1e-6)
    assert np.asarray(cos[0, 0]).tolist() == [1.0] * 4
    # head dim 6, the first 4 rotated: pairs (0, 2) by angle 2 and (1, 3) by 0.2; dims 4, 5 pass
    x = jnp.array([[[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]]])  # [B 1, T 1, N 1, A 6]
    out = np.asarray(apply_partial_rope(x, cos[:, 1:], sin[:, 1:]))[0, 0, 0]
    c1, s1, c2, s2 = math.cos(2), math.sin(2), math.cos(0.2), math.sin(0.2)
    np.testing.assert_allclose(out, [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2, 5, 6],
                               rtol=1e-6, atol=1e-6)


def test_rotary_dim_is_the_rotated_fraction_of_the_head():
    assert ModelConfig(head_dim=16, partial_rotary_factor=0.25).rotary_dim == 4
    assert ModelConfig(head_dim=10, partial_rotary_factor=0.25).rotary_dim == 2  # 2.5 rounded down


def test_gdn_gates():
    # A = exp(ln 2) = 2, dt_bias 1, a = -1: softplus(0) = ln 2 -> g = -2 ln 2; b = 0 -> beta 1/2
    p = {"A_log": jnp.array([math.log(2.0)]), "dt_bias": jnp.array([1.0])}
    g, beta = gdn.gates_from_projections(p, jnp.array([[[0.0]]]), jnp.array([[[-1.0]]]))
    np.testing.assert_allclose(float(g[0, 0, 0]), -2 * math.log(2.0), rtol=1e-6)
    assert float(beta[0, 0, 0]) == 0.5
    g, beta = gdn.gates_from_projections(p, jnp.array([[[2.0]]]), jnp.array([[[1.0]]]))
    np.testing.assert_allclose(float(g[0, 0, 0]), -2 * math.log1p(math.e ** 2), rtol=1e-6)
    np.testing.assert_allclose(float(beta[0, 0, 0]), 1 / (1 + math.exp(-2)), rtol=1e-6)


# Width 3, taps (0.01, 0.1, 1) with tap 2 on the current token; x = 1, 2, 3, 4 (one channel).
TAPS = jnp.array([0.01, 0.1, 1.0]).reshape(3, 1, 1)
X = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 4, 1, 1)


def _conv(seg, x=X, tail=None, tail_seg=None):
    y, new_tail = gdn.causal_conv(x, TAPS, jnp.array([seg]), tail, tail_seg)
    return np.asarray(y).reshape(-1), np.asarray(new_tail).reshape(-1)


def test_causal_conv_reads_back_within_the_document():
    # one document: 1; 2 + 0.1; 3 + 0.2 + 0.01; 4 + 0.3 + 0.02
    y, tail = _conv([0, 0, 0, 0])
    np.testing.assert_allclose(y, [_silu(1.0), _silu(2.1), _silu(3.21), _silu(4.32)], rtol=1e-5)
    assert tail.tolist() == [3.0, 4.0]  # the last W - 1 pre-conv tokens
    # a document starting at token 2: its tokens read nothing before it
    y, _ = _conv([0, 0, 1, 1])
    np.testing.assert_allclose(y, [_silu(1.0), _silu(2.1), _silu(3.0), _silu(4.3)], rtol=1e-5)


def test_causal_conv_reads_a_decode_tail_as_the_first_tokens_document():
    # tail (5, 6), one new token 7: 7 + 0.1 * 6 + 0.01 * 5
    y, tail = _conv([3], x=jnp.array([7.0]).reshape(1, 1, 1, 1), tail=jnp.array([5.0, 6.0]).reshape(1, 2, 1, 1))
    np.testing.assert_allclose(y, [_silu(7.65)], rtol=1e-5)
    assert tail.tolist() == [6.0, 7.0]
    # a halo with its own ids: only the matching one is read (6 of document 3, not 5 of document 2)
    y, _ = _conv([3], x=jnp.array([7.0]).reshape(1, 1, 1, 1), tail=jnp.array([5.0, 6.0]).reshape(1, 2, 1, 1),
                 tail_seg=jnp.array([[2, 3]]))
    np.testing.assert_allclose(y, [_silu(7.6)], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# model/decode.py: the cache; model/forward.py: batch defaults and the routing layout

DECODE_MODEL = dict(num_layers=4, layer_pattern=("gdn", "attention"), num_kv_heads=2, head_dim=8, gdn_num_key_heads=2,
                    gdn_num_value_heads=4, gdn_key_dim=3, gdn_value_dim=5, gdn_conv_kernel=4)


def _decode_cfg(**over):
    from types import SimpleNamespace

    return SimpleNamespace(model=ModelConfig(**{**DECODE_MODEL, **over}))


def test_init_cache_shapes_per_layer_kind():
    from hybridmoe.model import decode

    cache = decode.init_cache(_decode_cfg(compute_dtype="bfloat16"), 3, 5)
    gdn_cache, attn_cache = cache["layers"]
    # 2 blocks; attention k, v [L, B, slots, G, A]; GDN tails [L, B, W - 1, heads, dim], state [L, B, U, k, v]
    assert attn_cache["k"].shape == attn_cache["v"].shape == (2, 3, 5, 2, 8)
    assert attn_cache["k"].dtype == jnp.bfloat16
    assert gdn_cache["conv_q"].shape == gdn_cache["conv_k"].shape == (2, 3, 3, 2, 3)
    assert gdn_cache["conv_v"].shape == (2, 3, 3, 4, 5)
    assert gdn_cache["ssm"].shape == (2, 3, 4, 3, 5) and gdn_cache["ssm"].dtype == jnp.float32
    assert np.asarray(cache["kv_seg"]).tolist() == [[-1] * 5] * 3  # unwritten: no document
    assert np.asarray(cache["kv_pos"]).tolist() == [[0] * 5] * 3 and int(cache["slot"]) == 0


def test_grow_cache_pads_slots_as_unwritten_and_cache_rows_picks_rows():
    from hybridmoe.model import decode

    cache = decode.init_cache(_decode_cfg(), 3, 2)
    cache = {**cache, "kv_pos": jnp.array([[0, 1], [0, 1], [5, 6]]), "kv_seg": jnp.array([[1, 1], [2, 2], [3, 3]]),
             "slot": jnp.int32(2)}
    grown = decode.grow_cache(cache, 4)
    assert np.asarray(grown["kv_seg"]).tolist() == [[1, 1, -1, -1], [2, 2, -1, -1], [3, 3, -1, -1]]
    assert np.asarray(grown["kv_pos"]).tolist() == [[0, 1, 0, 0], [0, 1, 0, 0], [5, 6, 0, 0]]
    assert grown["layers"][1]["k"].shape == (2, 3, 4, 2, 8) and grown["layers"][0]["ssm"].shape == (2, 3, 4, 3, 5)
    assert int(grown["slot"]) == 2
    with pytest.raises(ValueError, match="cannot shrink a cache of 2 slots to 1"):
        decode.grow_cache(cache, 1)
    picked = decode.cache_rows(cache, jnp.array([2, 0]))
    assert np.asarray(picked["kv_pos"]).tolist() == [[5, 6], [0, 1]]
    assert np.asarray(picked["kv_seg"]).tolist() == [[3, 3], [1, 1]]
    assert picked["layers"][1]["v"].shape == (2, 2, 2, 2, 8)  # rows are axis 1 under the stacked blocks


def test_batch_defaults_are_one_document_counting_from_zero():
    from hybridmoe.model import forward

    seg, pos = forward.default_batch_fields(jnp.zeros((2, 3), jnp.int32))
    assert np.asarray(seg).tolist() == [[1, 1, 1]] * 2 and np.asarray(pos).tolist() == [[0, 1, 2]] * 2
    seg, pos, packed = forward._batch_fields(jnp.zeros((1, 3), jnp.int32), jnp.array([[4, 4, 5]]), None)
    assert packed and np.asarray(seg).tolist() == [[4, 4, 5]] and np.asarray(pos).tolist() == [[0, 1, 2]]
    seg, pos, packed = forward._batch_fields(jnp.zeros((1, 3), jnp.int32), None, jnp.array([[7, 8, 9]]))
    assert not packed and np.asarray(seg).tolist() == [[1, 1, 1]] and np.asarray(pos).tolist() == [[7, 8, 9]]


def test_routing_layers_are_block_major():
    from hybridmoe.model import forward

    # 4 layers = 2 blocks x pattern 2: layer l = block * 2 + position; B 1, T 1, k 1
    routing = jnp.arange(4).reshape(1, 1, 4, 1)
    blocks = forward.routing_to_blocks(routing, _decode_cfg())
    assert blocks.shape == (2, 2, 1, 1, 1)
    assert np.asarray(blocks)[:, :, 0, 0, 0].tolist() == [[0, 1], [2, 3]]
    assert np.asarray(forward.routing_from_blocks(blocks)).tolist() == np.asarray(routing).tolist()
