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


def spread_channels(w, seed: int, blocks: int = 2, binades: int = 12, block_gap: int = 12):
    """w [..., K, N] (K contracted, N the output channels) with every output channel scaled by its
    own power of two in 2**(-binades/2) .. 2**(binades/2), and in every channel one of `blocks` equal
    blocks of K (the FSDP shards of a sharded K) 2**-block_gap smaller than the rest, which block
    varying by channel (above 2 blocks: a random set of them, never all). Powers of two: exact in any float dtype. On such weights a per-tensor absmax, or a
    shard-local absmax not reduced over the shards, gives other scales and other codes than the
    per-channel one; within a factor of ~3 it would give the same bits (the scale is a power of
    two, so it only moves values into or out of the subnormal range)."""
    import jax.numpy as jnp

    x = np.asarray(w, np.float32)
    rng = np.random.default_rng(seed)
    *lead, k, n = x.shape
    channel = 2.0 ** (binades // 2 - rng.integers(0, binades + 1, size=(*lead, 1, n)))
    small = rng.integers(0, blocks, size=(*lead, 1, n))
    block = np.arange(blocks)[:, None]
    small_blocks = block == small  # [..., blocks, N]
    if blocks > 2:  # more blocks small, never all: a reduction over some of the shards only is seen too
        extra = rng.random((*lead, blocks, n)) < 0.5
        small_blocks = small_blocks | (extra & (block != (small + 1) % blocks))
    block_of_row = np.arange(k) * blocks // k
    factor = np.where(small_blocks[..., block_of_row, :], 2.0 ** -block_gap, 1.0)
    return jnp.asarray(x * channel * factor, jnp.asarray(w).dtype)


def spread_experts(params, seed: int = 11, blocks: int = 2):
    """The params with every routed-expert weight (wi, wo of every block) spread as above, the
    contracting axis in `blocks` blocks (as many as the FSDP shards it is split into)."""
    spread = [{**b, "moe": {**b["moe"], **{k: spread_channels(b["moe"][k], seed + 2 * i + j, blocks=blocks)
                                          for j, k in enumerate(("wi", "wo"))}}}
              for i, b in enumerate(params["blocks"])]
    return {**params, "blocks": spread}
