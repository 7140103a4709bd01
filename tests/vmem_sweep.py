"""Each Mosaic kernel alone at a tile, compiled for a compile-only TPU, against the VMEM model's verdict
(shared by tests/test_vmem_tpu_compile.py and benchmarks/gmm_vmem.py).

`POINTS` lists (kernel, tiles) on both sides of a small scoped limit (LIMIT_MIB, so the boundary lies
at small tiles where a compile takes about a second). The operands are large (tens of MiB), so the
compiler keeps them in HBM: small ones it may prefetch into VMEM whole, which changes what the
kernel's own scoped allocation holds.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from hybridmoe.analysis import compiled_facts
from hybridmoe.kernels.attention import limits as attention_limits
from hybridmoe.kernels.gdn import limits as gdn_limits
from hybridmoe.kernels.gmm import tiling
from hybridmoe.kernels.vmem import MIB, tpu_bytes

LIMIT_MIB = 4.0
BF16, F32 = jnp.bfloat16, jnp.float32
# gmm family: M routed rows, D model width, F hidden half, E local groups.
M, D, F, E = 32768, 2048, 1024, 8
# flash attention: T = S tokens, N query heads over G kv heads.
T, N, G = 16384, 8, 2
# GDN: batch, chunks, value heads.
GDN_B, GDN_N, GDN_H = 1, 64, 4

# (kernel, tiles): gmm kernels (tm, tk, tn), flash (block_q, block_k, head_dim), GDN (chunk, key dim, value dim).
# tk = D (2048) is one K tile, on both sides of the limit. (gmm_t at one K tile needs less than the
# model counts: at (256, 2048, 256) the compiler takes 2.0 to 2.5 MiB, the model 4.5.)
POINTS = [
    *[("gmm", t) for t in [(256, 512, 256), (512, 512, 256), (512, 512, 512), (512, 1024, 512), (128, 2048, 256),
                           (256, 2048, 256)]],
    *[("gmm_t", t) for t in [(256, 512, 256), (512, 512, 512), (512, 1024, 512), (128, 2048, 256), (512, 2048, 256)]],
    *[("tgmm", t) for t in [(256, 512, 256), (512, 512, 512), (512, 1024, 512)]],
    *[("wi_fused", t) for t in [(128, 512, 256), (256, 512, 256), (256, 512, 512), (512, 512, 512), (128, 2048, 128),
                                (128, 2048, 256)]],
    *[("wo_fused_dlhs", t) for t in [(8, 256, 0), (64, 256, 0), (128, 256, 0), (256, 512, 0)]],
    *[(k, t) for k in attention_limits.KERNELS for t in [(128, 128, 128), (128, 256, 128), (256, 256, 128),
                                                         (128, 256, 256), (256, 512, 256)]],
    *[(k, t) for k in gdn_limits.KERNELS for t in [(64, 128, 128), (128, 128, 128), (128, 256, 256),
                                                   (256, 256, 256)]],
]


def _spec(shape, dtype, dev):
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))


def model_bytes(kernel: str, tiles) -> int:
    """The model's need of one kernel at its tiles, at this file's shapes."""
    a, b, c = tiles
    if kernel in ("gmm", "gmm_t", "tgmm"):  # each over contraction D: the kernel pallas_tpu runs at these tiles
        return tpu_bytes(tiling.plain_buffers(kernel, tm=a, tk=b, tn=c, k=D))
    if kernel in tiling.PALLAS_NAMES:
        return tpu_bytes(tiling.tpu_buffers(kernel, tm=a, tk=b, tn=c or F, f=F, row_scale=True))
    if kernel in attention_limits.KERNELS:
        return tpu_bytes(attention_limits.tpu_buffers(kernel, block_q=a, block_k=b, group=N // G, head_dim=c,
                                                      grad_itemsize=4))  # pallas_tpu.backward's float32 default
    return tpu_bytes(gdn_limits.tpu_buffers(kernel, chunk_size=a, key_dim=b, value_dim=c, group=1, chunks_per_step=1))


def _call(kernel: str, tiles, limit_mib: float, dev):
    """(function, abstract args) running `kernel` alone at `tiles` under limit_mib."""
    a, b, c = tiles
    s = lambda shape, dtype=BF16: _spec(shape, dtype, dev)  # noqa: E731
    if kernel in tiling.PALLAS_NAMES:
        from hybridmoe.kernels.gmm import pallas_tpu as P

        t = tiling.Tiling(tm=a, tk=b, tn=c or 128, vmem_limit_mib=limit_mib)
        gs = s((E,), jnp.int32)
        kw = dict(group_offset=0, sharded=False, tiling=t)
        if kernel in ("gmm", "gmm_t"):
            w = (E, F, D) if kernel == "gmm_t" else (E, D, F)
            return (lambda x, w, gs: P.gmm(x, w, gs, transpose_rhs=kernel == "gmm_t", out_dtype=BF16, **kw),
                    (s((M, D)), s(w), gs))
        if kernel == "tgmm":
            return (lambda x, g, gs: P.tgmm(x, g, gs, num_local=E, out_dtype=BF16, **kw), (s((M, D)), s((M, F)), gs))
        if kernel == "wi_fused":
            return (lambda x, w, gs: P.wi_fused_swiglu(x, w, gs, tile_n_per_half=c, mode="float32", **kw),
                    (s((M, D)), s((E, D, 2 * F)), gs))
        return (lambda g, wo, gs, pre, sc: P.wo_fused_dswiglu_dlhs(
                    g, wo, gs, pre, preact_tile_n_per_half=F, row_scale_M=sc, out_tile_n_per_half=F, mode="float32",
                    **kw), (s((M, D)), s((E, F, D)), gs, s((M, 2 * F)), s((M,), F32)))
    if kernel in attention_limits.KERNELS:
        from hybridmoe.kernels.attention import pallas_tpu as P

        ids = s((1, T), jnp.int32)
        q, kv = s((1, G, N // G, T, c)), s((1, G, T, c))
        kw = dict(scale=0.1, block_q=a, block_k=b, vmem_limit_mib=limit_mib)
        if kernel == "flash_attention_forward":
            return lambda q, k, v, p, sg: P.forward(q, k, v, p, sg, p, sg, **kw), (q, kv, kv, ids, ids)
        stats = s((1, G, N // G, T), F32)

        def backward(q, k, v, do, lse, delta, p, sg):
            dq, dk, dv = P.backward(q, k, v, do, lse, delta, p, sg, p, sg, **kw)
            return dq if kernel == "flash_attention_dq" else (dk, dv)  # the other kernel is dead code
        return backward, (q, kv, kv, q, stats, stats, ids, ids)
    from hybridmoe.kernels.gdn import pallas_tpu as P

    # GDN_H key heads of one value head each, one chunk per grid step, float32 inputs.
    settings = P.Settings(chunk_size=a, chunks_per_step=1, precision="float32", vmem_limit_mib=limit_mib)
    tokens = s((GDN_B, GDN_H, GDN_N * a, b), F32)
    v = s((GDN_B, GDN_H, 1, GDN_N * a, c), F32)
    gates = s((GDN_B, GDN_H, GDN_N, 1, a), F32)
    state = s((GDN_B, GDN_H, 1, b, c), F32)
    keys = lambda x: (P.Keys(x[0], x[1]), P.Keys(x[2], x[3]))  # noqa: E731 - q, k: rows and their factors
    if kernel == "gdn_chunk_forward":
        return (lambda *x: P.forward(*keys(x), *x[4:], settings, save=True),
                (tokens, gates, tokens, gates, v, gates, gates, state))
    residuals = (tokens, gates, tokens, gates, v, gates, gates, s((GDN_B, GDN_H, GDN_N, b, c), F32),
                 s((GDN_B, GDN_H, GDN_N, a, a), F32))
    return lambda *x: P.backward((*keys(x), *x[4:9]), x[9], x[10], settings), (*residuals, v, state)


_OVERFLOW = re.compile(r"CompileTimeScopedVmemOom|Ran out of memory in memory space vmem", re.I)


def compile_verdict(kernel: str, tiles, limit_mib: float, dev) -> tuple[bool, str]:
    """(compiles, the first line of the VMEM error or ''); another error is raised."""
    fn, args = _call(kernel, tiles, limit_mib, dev)
    try:
        # a new function: no trace cache across limits; the verdict is read from the compile cache on a rerun
        compiled_facts.compile(jax.jit(lambda *x: fn(*x)).lower(*args))
        return True, ""
    except Exception as err:  # noqa: BLE001 - the compiler's verdict is the measurement
        if not _OVERFLOW.search(str(err)):
            raise
        return False, str(err).strip().splitlines()[0][:200]


def model_verdict(kernel: str, tiles, limit_mib: float) -> bool:
    return model_bytes(kernel, tiles) <= limit_mib * MIB
