"""An fp8 fake quantization written with numpy and ml_dtypes, independently of hybridmoe.quant:
the reference the fp8 tests compare against, bit for bit."""

import ml_dtypes
import numpy as np


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def ref_scale(amax, top):
    amax = np.asarray(amax, np.float64)
    with np.errstate(divide="ignore"):
        s = 2.0 ** np.ceil(np.log2(amax / top))
    return np.where(amax > 0, np.maximum(s, 2.0 ** -126), 1.0).astype(np.float32)


def ref_fake_quant(w, axis, code_dtype=ml_dtypes.float8_e4m3fn, top=448.0):
    w32 = np.asarray(w, np.float32)
    s = ref_scale(np.max(np.abs(w32), axis=axis, keepdims=True), top)
    codes = np.clip(w32 / s, -top, top).astype(code_dtype)
    w_q = (codes.astype(np.float32) * s).astype(np.asarray(w).dtype)
    return np.where(w_q == 0, np.zeros((), w_q.dtype), w_q), codes, s
