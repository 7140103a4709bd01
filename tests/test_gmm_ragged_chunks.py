"""The xla grouped matmul in chunks of groups where the traced platform caps a ragged_dot's groups.

TPU's compiler (the pinned libtpu) refuses jax.lax.ragged_dot over more than 256 groups; traced for
TPU the xla backend runs more groups as consecutive chunks (kernels/gmm/xla.py). Here, on CPU, the
platform is made to read as TPU and the cap lowered to 4 groups, so 11 groups (expert-sharded: 7
local of 11, offset 2; and unsharded) run in 3-4 chunks whose boundaries fall inside runs of rows,
on empty groups and on the last group; against the one ragged_dot: the same values and gradients
(each row is non-zero in exactly one chunk, so the sums add zeros). A chunk offset off by one is
caught. The TPU compile of 512 groups is in test_gmm_tpu_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels import gmm as K
from hybridmoe.kernels.gmm import xla

E, M, D, N = 11, 96, 16, 24
SIZES = np.array([9, 0, 17, 8, 0, 0, 21, 5, 13, 0, 16], np.int32)  # empty groups at chunk edges; sum 89 < M


@pytest.fixture
def capped(monkeypatch):
    monkeypatch.setattr(xla, "trace_platform", lambda: "tpu")
    monkeypatch.setattr(xla, "TPU_RAGGED_DOT_MAX_GROUPS", 4)


def _operands(num_local):
    k1, k2 = jax.random.split(jax.random.key(0))
    # Rows spanning binades, so a row multiplied by the wrong group's weight cannot hide.
    scale = 2.0 ** jnp.arange(-6, 6, 12 / M)[:M, None]
    return (jax.random.normal(k1, (M, D)) * scale, jax.random.normal(k2, (num_local, D, N)),
            jnp.asarray(SIZES))


def _err(a, b) -> float:
    """Max |a - b| over max |b|: float32 products summed in another order differ by ~1e-7."""
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


TOL = 1e-5  # the clean error is ~1e-7 of the max; the broken variant's is O(1)


def _value_and_grads(offset, num_local):
    lhs, rhs, sizes = _operands(num_local)
    g = jax.random.normal(jax.random.key(3), (M, N))

    def loss(lhs, rhs):
        out = K.gmm(lhs, rhs, sizes, group_offset=offset)
        return jnp.sum(out * g), out

    (_, out), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(lhs, rhs)
    return out, grads


@pytest.mark.parametrize("offset, num_local", [(2, 7), (0, E)])
def test_chunked_gmm_equals_one_ragged_dot(capped, monkeypatch, offset, num_local):
    out_c, grads_c = _value_and_grads(offset, num_local)
    assert len(xla.ragged_group_chunks(num_local, num_local < E)) >= 3
    monkeypatch.setattr(xla, "TPU_RAGGED_DOT_MAX_GROUPS", 256)
    out, grads = _value_and_grads(offset, num_local)
    errs = [_err(out_c, out)] + [_err(a, b) for a, b in zip(grads_c, grads)]
    assert max(errs) < TOL, errs


def test_chunked_default_ragged_dot_equals_lax(capped):
    lhs, rhs, sizes = _operands(E)
    f = lambda fn: jax.value_and_grad(lambda l, r: jnp.sum(jnp.sin(fn(l, r, sizes))), (0, 1))(lhs, rhs)  # noqa: E731
    (v_c, g_c), (v, g) = f(K.ragged_dot), f(jax.lax.ragged_dot)
    errs = [_err(v_c, v)] + [_err(a, b) for a, b in zip(g_c, g)]
    assert max(errs) < TOL, errs


def test_broken_variant_chunks_without_their_offset_is_caught(capped, monkeypatch):
    """Each chunk reads its own groups' rows (group_offset + its first group); a chunk handed the
    shard's offset instead multiplies the first groups' rows by every chunk's weights."""
    from broken_variants import mutated

    out, _ = _value_and_grads(2, 7)
    monkeypatch.setattr(xla, "gmm_f32", mutated(xla, "gmm_f32", "group_offset + a, True", "group_offset, True"))
    broken, _ = _value_and_grads(2, 7)
    assert _err(broken, out) > 100 * TOL, _err(broken, out)
