"""The layers' small formulas pinned to hand-worked numbers: the RMSNorms, the rotary tables and
the partial rotation (model/norms.py), the GDN gates and the causal conv across document edges
and a decode tail (model/gdn.py). A handful of scalars each; nothing compiles a model."""

from __future__ import annotations

import math

import jax.numpy as jnp
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
