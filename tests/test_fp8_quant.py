"""hybridmoe.quant.fp8 alone: power-of-two scales, codes, dequantization, fake quantization.

The reference is numpy + ml_dtypes (float64 scales, ml_dtypes' own float8 casts), written
independently of the code under test. Comparisons are bit for bit (uint views), so a -0.0 where
+0.0 belongs is a difference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_reference import bits, ref_fake_quant, ref_scale
from hybridmoe.quant import fp8

FORMATS = [(fp8.E4M3, ml_dtypes.float8_e4m3fn, 448.0), (fp8.E5M2, ml_dtypes.float8_e5m2, 57344.0)]


def weights(dtype=jnp.bfloat16, shape=(3, 48, 20), seed=0):
    """Channels with absmax over seven decades, a zero channel, exact powers of two, tiny
    negatives that round to -0.0 and values on the saturation edge."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * 10.0 ** rng.uniform(-5, 2, size=(shape[0], 1, shape[2]))
    w[0, :, 0] = 0.0
    w[1, :, 1] = 2.0 ** rng.integers(-8, 8, size=shape[1])
    w[2, :4, 2] = [-1e-9, 1.0, -3e-4, 448.0]
    w[2, 4:, 2] = 0.0
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_scale_is_the_smallest_power_of_two(fmt):
    dtype, _, top = fmt
    rng = np.random.default_rng(1)
    amax = np.concatenate([10.0 ** rng.uniform(-30, 30, 2000), [top, top * 2.0 ** -20, np.nextafter(top, np.inf),
                                                               1.0, 0.0, 2.0 ** -126, 448 * 2.0 ** -126]]).astype(np.float32)
    s = np.asarray(fp8.scale_from_absmax(jnp.asarray(amax), dtype))
    np.testing.assert_array_equal(s, ref_scale(amax, top))
    nz = amax > 0
    mant, _ = np.frexp(s[nz])
    assert np.all(mant == 0.5), "not a power of two"
    big = nz & (s > 2.0 ** -126)
    assert np.all(amax[nz] / s[nz] <= top) and np.all(amax[big] / (s[big] / 2) > top)


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("wdtype", [jnp.bfloat16, jnp.float32])
def test_codes_and_dequantization_match_the_reference(fmt, wdtype):
    dtype, ml_dtype, top = fmt
    w = weights(wdtype)
    scale = fp8.scale_from_absmax(fp8.absmax(w, 1), dtype)
    codes = fp8.quantize(w, scale, dtype)
    _, ref_codes, ref_s = ref_fake_quant(w, 1, ml_dtype, top)
    np.testing.assert_array_equal(np.asarray(scale), ref_s)
    np.testing.assert_array_equal(bits(codes), bits(ref_codes))
    # Dequantization is exact in the weight's dtype: no rounding after code * scale.
    deq = fp8.dequantize(codes, scale, wdtype)
    np.testing.assert_array_equal(np.asarray(deq, np.float32),
                                  np.asarray(codes, np.float32) * np.asarray(scale))


def test_saturates_instead_of_nan():
    codes = fp8.quantize(jnp.asarray([1e6, -1e6, 449.0, 464.0]), jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(codes, np.float32), [448, -448, 448, 448])


@pytest.mark.parametrize("wdtype", [jnp.bfloat16, jnp.float32])
def test_fake_quant_forward_and_straight_through_gradient(wdtype):
    w = weights(wdtype)
    ref_wq, _, _ = ref_fake_quant(w, 1)
    np.testing.assert_array_equal(bits(fp8.fake_quant(w, 1)), bits(ref_wq))
    # The straight-through gradient: exactly the cotangent, untouched.
    ct = jax.random.normal(jax.random.key(0), w.shape).astype(wdtype)
    g = jax.grad(lambda w: jnp.sum((fp8.fake_quant(w, 1) * ct).astype(jnp.float32)))(w)
    np.testing.assert_array_equal(bits(g), bits(ct))
    # With the absmax given (the hoist): the same bits.
    np.testing.assert_array_equal(bits(fp8.fake_quant(w, 1, fp8.absmax(w, 1))), bits(ref_wq))


def test_fake_quant_is_idempotent():
    w = weights()
    once = fp8.fake_quant(w, 1)
    np.testing.assert_array_equal(bits(fp8.fake_quant(once, 1)), bits(once))


def test_codes_for_the_gather_store_positive_zero():
    w = weights()
    scale = fp8.scale_from_absmax(fp8.absmax(w, 1))
    raw = fp8.quantize(w, scale)
    assert np.any(bits(raw) == 0x80), "the fixture must produce -0.0 codes"
    codes = fp8.positive_zero(raw)
    assert not np.any(bits(codes) == 0x80)
    # Dequantized, the stored codes give the fake-quant expression's bits; -0.0 codes do not.
    np.testing.assert_array_equal(bits(fp8.dequantize(codes, scale, w.dtype)), bits(fp8.fake_quant(w, 1)))
    assert not np.array_equal(bits(fp8.dequantize(raw, scale, w.dtype)), bits(fp8.fake_quant(w, 1)))


def test_rows_quantization_relative_error():
    x = jax.random.normal(jax.random.key(3), (64, 32)) * jnp.logspace(-3, 3, 64)[:, None]
    codes, scale = fp8.quantize_rows(x, axis=-1)
    assert scale.shape == (64, 1) and codes.dtype == fp8.E4M3
    back = np.asarray(fp8.dequantize(codes, scale, jnp.float32))
    # Half an e4m3 ulp at the row's top binade: 2**-4 of the row's absmax.
    err = np.max(np.abs(back - np.asarray(x)), axis=1) / np.max(np.abs(np.asarray(x)), axis=1)
    assert np.all(err <= 2.0 ** -4), err.max()
