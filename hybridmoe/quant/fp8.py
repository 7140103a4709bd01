"""fp8 quantization as pure array functions: scales, codes, dequantization, fake quantization.

A tensor is quantized along one reduced ("contracting") axis: every slice across the other axes
(an output channel of an expert weight, a token row of an activation) gets one scale from its
absolute maximum. Codes are float8_e4m3fn (weights, activations; largest finite 448) or
float8_e5m2 (gradients; largest finite 57344).

The scale is rounded UP TO A POWER OF TWO: the smallest 2**k with absmax / 2**k <= the format's
largest finite value (the E8M0 scale of the OCP microscaling formats). Why:
- dequantization is exact: a code has at most 4 significant bits, so code * 2**k is exactly
  representable in bfloat16 and float32 alike, and dividing by 2**k before rounding loses
  nothing. The fake-quantized weight is therefore the same number whether it is computed on an
  FSDP shard or after the gather, in bfloat16 or in float32, and a real fp8 matmul on fp8
  hardware sees exactly the values that fake quantization trained;
- quantization is idempotent (re-quantizing a quantized tensor gives it back);
- the cost is nothing in relative precision (a float format has the same significant bits in
  every binade): the largest value of a slice lands in (max/2, max] instead of on max, which
  moves at most one binade of the smallest magnitudes into the subnormal range.
An all-zero slice gets scale 1 (its codes are zero); a scale is never below 2**-126 (normal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FP8_MAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0}
MIN_SCALE_EXP = -126


def fp8_max(dtype) -> float:
    try:
        return FP8_MAX[jnp.dtype(dtype)]
    except KeyError:
        raise ValueError(f"not an fp8 code dtype: {dtype}; use float8_e4m3fn or float8_e5m2") from None


def absmax(x, axis: int):
    """float32 max |x| over `axis` (kept as size 1); no gradient flows through it."""
    return jnp.max(jnp.abs(jax.lax.stop_gradient(x)).astype(jnp.float32), axis=axis, keepdims=True)


def scale_from_absmax(amax, dtype=E4M3):
    """The smallest power of two s >= 2**-126 with amax / s <= the format's largest finite value.

    With amax = m * 2**e (m in [0.5, 1)) and the largest finite value M = mM * 2**eM, the answer
    is 2**(e - eM) when m <= mM, else 2**(e - eM + 1): exponent arithmetic, no division.
    """
    amax = jnp.asarray(amax, jnp.float32)
    m_max, e_max = jnp.frexp(jnp.float32(fp8_max(dtype)))
    m, e = jnp.frexp(amax)
    k = jnp.where(m <= m_max, e - e_max, e - e_max + 1)
    # At least the smallest normal float32: CPU and accelerators flush subnormals to zero, and a
    # zero scale would turn every code into a saturated one.
    s = jnp.ldexp(jnp.ones_like(amax), jnp.maximum(k, MIN_SCALE_EXP))
    return jnp.where(amax > 0, s, jnp.ones_like(amax))


def quantize(x, scale, dtype=E4M3):
    """fp8 codes of x / scale: round to nearest even, saturating at the largest finite value
    (a plain cast of an out-of-range value to float8_e4m3fn gives NaN)."""
    lim = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -lim, lim).astype(dtype)


def positive_zero(codes):
    """Codes with every -0.0 stored as +0.0 (the fake-quant expression w_q + (w - w) turns a
    -0.0 of w_q into +0.0; codes that keep it would dequantize to other bits)."""
    return jnp.where(codes == 0, jnp.zeros((), codes.dtype), codes)


def dequantize(codes, scale, dtype):
    """codes * scale in `dtype` (exact: see the module docstring)."""
    return (codes.astype(jnp.float32) * scale).astype(dtype)


def straight_through(x, x_q):
    """x_q in the forward, the identity's gradient to x in the backward."""
    return x_q + (x - jax.lax.stop_gradient(x))


def fake_quant(w, axis: int, amax=None, dtype=E4M3):
    """w rounded to its fp8 grid (one scale per slice across `axis`), in w's dtype, with the
    straight-through gradient. `amax`: the slices' absmax when already known (hoisted)."""
    amax = absmax(w, axis) if amax is None else jax.lax.stop_gradient(amax)
    scale = scale_from_absmax(amax, dtype)
    w_q = jax.lax.stop_gradient(dequantize(quantize(w, scale, dtype), scale, w.dtype))
    return straight_through(w, w_q)


def quantize_rows(x, axis: int = -1, dtype=E4M3):
    """(codes, float32 scale) of x with one scale per slice across `axis` (kept as size 1)."""
    scale = scale_from_absmax(absmax(x, axis), dtype)
    return quantize(x, scale, dtype), scale
