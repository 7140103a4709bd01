"""Public entry points of the grouped matmuls and the Gated DeltaNet core at their smallest
accepted sizes, with results worked out by hand on one-element heads and weights (the XLA
backend, eager: nothing compiles a kernel)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels.gdn import ops as gdn_ops
from hybridmoe.kernels.gmm import ops as gmm_ops


def _gdn(q, k, v, g, beta, tokens, chunk_size, **kw):
    shape = (1, tokens, 1, 1)
    full = lambda x, s: jnp.full(s, x, jnp.float32)  # noqa: E731
    # jit: one small compile is faster than the chunked core's many eager ops
    run = jax.jit(functools.partial(gdn_ops.gated_delta_rule, chunk_size=chunk_size, normalize_qk=False, **kw))
    return run(full(q, shape), full(k, shape), full(v, shape), full(g, shape[:3]), full(beta, shape[:3]))


def test_gdn_accepts_a_chunk_of_one_token_and_runs_the_delta_rule():
    # dk = dv = 1, no normalisation (q scaled by 1^-1/2 = 1), q 2, k 3, v 5, beta 0.5:
    # token 1: S = 0 + 0.5 * 3 * (5 - 0) = 7.5, o = 2 * 7.5 = 15
    # token 2 (gate 0.5): S' = 3.75; S = 3.75 + 0.5 * 3 * (5 - 3 * 3.75) = -5.625; o = 2 * S = -11.25
    o, final = _gdn(2.0, 3.0, 5.0, float(np.log(0.5)), 0.5, 2, 1)
    np.testing.assert_allclose(np.asarray(o).ravel(), [15.0, -11.25], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(final).ravel(), [-5.625], rtol=1e-6)


def test_gdn_chunk_longer_than_the_sequence_pads_without_changing_the_result():
    # the same two tokens in one chunk of 4 (two padding tokens that leave the state alone)
    o, final = _gdn(2.0, 3.0, 5.0, float(np.log(0.5)), 0.5, 2, 4)
    np.testing.assert_allclose(np.asarray(o).ravel(), [15.0, -11.25], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(final).ravel(), [-5.625], rtol=1e-5)
    with pytest.raises(ValueError, match="chunk_size must be positive; got 0"):
        _gdn(2.0, 3.0, 5.0, 0.0, 0.5, 2, 0)


# ---------------------------------------------------------------------------------------------
# wo_fused_dswiglu: the routing weight's gradient is the row dot unless turned off


def _row_scale_grad(**kw):
    # two rows of one group; F = D = 1; wo 3; preact [gate 20 | up 0.5]: silu(20) = 20 in float32
    # (sigmoid(20) rounds to 1), so h = 20 * 0.5 = 10; y_r = s_r * h_r * wo; loss sum(y * g), g = 1, 2
    h, wo = jnp.full((2, 1), 10.0), jnp.full((1, 1, 1), 3.0)
    pre, g = jnp.array([[20.0, 0.5], [20.0, 0.5]]), jnp.array([[1.0], [2.0]])
    sizes = jnp.array([2], jnp.int32)

    def loss(s):
        y = gmm_ops.wo_fused_dswiglu(h, wo, sizes, preact=pre, preact_tile_n_per_half=None, row_scale=s, **kw)
        return jnp.sum(y * g)

    return np.asarray(jax.grad(loss)(jnp.ones((2,))))


def test_row_scale_gradient_is_the_row_dot_by_default():
    # d loss / d s_r = <g_r wo^T, silu(gate_r) up_r> = g_r * 3 * 10: 30, 60
    np.testing.assert_allclose(_row_scale_grad(), [30.0, 60.0], rtol=1e-6)


def test_row_scale_is_a_constant_when_the_row_dot_is_turned_off():
    np.testing.assert_array_equal(_row_scale_grad(with_row_dot=False), [0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# The xla weight gradient in chunks of groups (TPU's ragged_dot cap), adding into a carried one


SIZES = [9, 0, 17, 8, 0, 0, 21, 5, 13, 0, 16]  # 105 rows of 11 groups; 7 rows of padding past them


@pytest.mark.parametrize("offset, num_local", [(2, 7), (0, 11)])
def test_chunked_weight_gradient_adds_each_chunks_share_of_the_carried_gradient(monkeypatch, offset, num_local):
    from hybridmoe.kernels.gmm import xla

    # traced for TPU with the cap lowered to 4 groups: 7 local groups run as chunks of 3, 3, 1 (sharded:
    # each chunk with its zero group); 11 as 3, 3, 3, 2
    monkeypatch.setattr(xla, "trace_platform", lambda: "tpu")
    monkeypatch.setattr(xla, "TPU_RAGGED_DOT_MAX_GROUPS", 4)
    # lhs and grad all ones [112, 1]: group g's gradient is its row count; the carried one is 100 g
    ones = jnp.ones((112, 1), jnp.float32)
    acc = (100.0 * jnp.arange(num_local, dtype=jnp.float32))[:, None, None]
    out = gmm_ops.tgmm(ones, ones, jnp.asarray(SIZES, jnp.int32), num_local=num_local, group_offset=offset,
                       acc=acc)
    expected = [size + 100.0 * g for g, size in enumerate(SIZES[offset:offset + num_local])]
    np.testing.assert_array_equal(np.asarray(out)[:, 0, 0], expected)


# ---------------------------------------------------------------------------------------------
# The unfused SwiGLU pieces the fused epilogues are proven against


def test_unfused_swiglu_splits_the_row_in_halves():
    from hybridmoe.kernels.gmm import epilogue

    gate, up = epilogue.split_halves(jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]))
    assert np.asarray(gate).tolist() == [[1, 2, 3]] and np.asarray(up).tolist() == [[4, 5, 6]]
    # [gate 20, 0 | up 0.5, 7]: silu(20) = 20 in float32 (sigmoid rounds to 1), silu(0) = 0
    np.testing.assert_array_equal(np.asarray(epilogue.swiglu(jnp.array([[20.0, 0.0, 0.5, 7.0]]))), [[10.0, 0.0]])


def test_scale_rows_multiplies_in_float32_and_rounds_once_to_h_dtype():
    from hybridmoe.kernels.gmm import epilogue

    # bfloat16 h [100, 3] times the float32 scale 1.012: 101.2 and 3.036 in float32, rounded once to bfloat16
    # (spacing 0.5 at 64..128, 1/64 at 2..4): 101.0 and 194 / 64 = 3.03125. (Rounding the scale to
    # bfloat16 first, 1.015625, would give 101.5 and 3.046875.)
    out = epilogue.scale_rows(jnp.array([[100.0, 3.0]], jnp.bfloat16), jnp.array([1.012], jnp.float32))
    assert out.dtype == jnp.bfloat16
    assert np.asarray(out, np.float32).tolist() == [[101.0, 194 / 64]]
