"""Flash attention: the public functions and the dispatch on backend.

Shape legend: B batch, T query tokens, S key tokens, N query heads, G kv heads (N a multiple of
G; query head n reads kv head n // (N / G)), A head dim.

Semantics are xla.attention's: a key is visible to a query iff kv_pos <= q_pos and both carry the
same segment id. Positions and segment ids are compared as VALUES, never as token indices, so any
token order works (natural, or the load-balanced order of parallel/context.py) and a query block
may attend to the key block of another context rank (ring context parallelism: T != S). A query
with no visible key gives zeros (and zero gradients), never NaN. Segment id 0 is the packing's
padding (data/packing.py); padding tokens see the padding at or before their position exactly as
in xla.attention (nothing reads their outputs).

Backends (a plain string; the config key and its `auto` resolution live in the config layer,
platform_default names each platform's best):
  xla         blocked online softmax in plain XLA ops (xla.flash_forward / flash_backward): the CPU
              path and the oracle the Pallas drivers are tested against;
  pallas_tpu  Mosaic TPU kernels (pallas_tpu.py);
  pallas_gpu  Triton kernels (pallas_gpu.py).
The Pallas backends run on CPU with interpret=True (tests). All three run the same per-block math
(flash_block.py) over the same block schedule: per (query block, key block) pair the (min, max)
of positions and segment ids decide SKIP (no key can be visible: every key after the latest query,
or disjoint segment ranges; never visited, not even fetched on TPU), FULL (one shared segment and
every key at or before the earliest query: no mask) or PARTIAL (masked). Memory is one block pair's
scores, never an [T, S] array.

The backward is two passes (dq; then dk and dv), not the fused single pass: dq accumulates over key
blocks and dk/dv over query blocks, so each pass keeps its output block resident and writes it
once, with no atomics (TPU has none; Triton's would make sums order-dependent) and no [key blocks,
T, A] partial-dq buffer. The cost is the scores recomputed once more (q k^T and do v^T in both
passes). The R query heads of a kv head are folded into the rows of one block (the XLA and TPU
paths), so dk and dv of a group are summed into their own kv head inside the matmul; the GPU driver
loops over the group's heads in the dk/dv program.

Why our own kernels and not jax's (jax 0.10.2, jax/experimental/pallas/ops): each misses a
requirement. tpu/flash_attention.py masks causally by token index (row/col iota), has no GQA (k
and v per query head) and skips only the blocks above the index diagonal. tpu/splash_attention
takes the mask as a static numpy object (causality by token index, or a q_sequence fixed at trace
time), so positions that are values (packed documents restarting at 0, the ring's key block of a
rank chosen at run time) cannot be expressed, and segment ids mask elements but never skip blocks.
gpu/attention.py masks by token index, has no GQA and no position input. None returns lse for a
caller-supplied split of the keys with a backward that takes the global o and lse (the ring's two
primitives below).

The ring's primitives: attention_fwd gives (o, lse) of one key block set; attention_bwd gives that
set's (dq, dk, dv) from the GLOBAL o and lse (delta = rowsum(do * o), p = exp(s - lse)), so summing
dq over key sets and taking dk, dv per set gives the exact gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import limits
from hybridmoe.kernels.attention.limits import RESIDUALS_NAME
from hybridmoe.kernels.attention import xla

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")


def platform_default(platform: str) -> str:
    """The best flash backend on a platform (jax platform names): limits.resolve's `auto`."""
    return limits.resolve("auto", platform)


def _driver(backend: str):
    if backend == "pallas_tpu":
        from hybridmoe.kernels.attention import pallas_tpu
        return pallas_tpu
    if backend == "pallas_gpu":
        from hybridmoe.kernels.attention import pallas_gpu
        return pallas_gpu
    return None


def _check(q, k, v, q_pos, kv_pos, q_seg, kv_seg, backend, block_q, block_k):
    if backend not in BACKENDS:
        raise ValueError(f"flash attention: unknown backend {backend!r}; choices: {', '.join(BACKENDS)}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash attention: q must be [B, T, N, A] and k, v [B, S, G, A]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    B, T, N, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    if N % G:
        raise ValueError(f"flash attention: query heads {N} must be a multiple of kv heads {G}")
    for name, ids, length in (("q_pos", q_pos, T), ("kv_pos", kv_pos, S), ("q_seg", q_seg, T), ("kv_seg", kv_seg, S)):
        if ids is not None and ids.shape != (B, length):
            raise ValueError(f"flash attention: {name} must be [B, {length}] = {(B, length)}; got {ids.shape}")
    for name, block, length, what in (("block_q", block_q, T, "query"), ("block_k", block_k, S, "key")):
        if block < 1 or length % block:
            raise ValueError(f"flash attention: {name}={block} must divide the {what} length {length}")


def _ids(q, k, q_pos, kv_pos, q_seg, kv_seg):
    """int32 ids; a missing segment id puts every token in segment 0."""
    as_i32 = lambda a, like: jnp.zeros(like.shape[:2], jnp.int32) if a is None else a.astype(jnp.int32)  # noqa: E731
    return as_i32(q_pos, q), as_i32(kv_pos, k), as_i32(q_seg, q), as_i32(kv_seg, k)


def _limit(backend: str, vmem_limit_mib: float, query_runs=None) -> dict:
    """The Mosaic kernels' scoped VMEM limit (MiB, 0 = the compiler's default) and the queries'
    global runs their stated cost counts causal blocks by; Triton takes neither."""
    return dict(vmem_limit_mib=vmem_limit_mib, query_runs=query_runs) if backend == "pallas_tpu" else {}


def attention_fwd(q_BTNA, k_BSGA, v_BSGA, *, q_pos, kv_pos, q_seg=None, kv_seg=None, scale: float,
                  backend: str = "xla", block_q: int, block_k: int, interpret: bool = False,
                  vmem_limit_mib: float = 0.0, query_runs=None):
    """(o [B, T, N, A] in q's dtype, lse [B, N, T] float32): the attention of the queries to these
    keys and the log-sum-exp of their visible scaled scores (-inf for a query with none).
    query_runs: ((start, length), ...) of the queries' global positions among the keys where the
    layout fixes them (context parallelism), for the Mosaic kernels' stated cost only."""
    _check(q_BTNA, k_BSGA, v_BSGA, q_pos, kv_pos, q_seg, kv_seg, backend, block_q, block_k)
    q_pos, kv_pos, q_seg, kv_seg = _ids(q_BTNA, k_BSGA, q_pos, kv_pos, q_seg, kv_seg)
    G = k_BSGA.shape[2]
    q_BGRTA = fb.group_heads(q_BTNA, G)
    k_BGSA, v_BGSA = jnp.moveaxis(k_BSGA, 1, 2), jnp.moveaxis(v_BSGA, 1, 2)
    kw = dict(scale=scale, block_q=block_q, block_k=block_k)
    driver = _driver(backend)
    if driver is None:
        o_BGRTA, lse_BGRT = xla.flash_forward(q_BGRTA, k_BGSA, v_BGSA, q_pos, q_seg, kv_pos, kv_seg, **kw)
    else:
        o_BGRTA, lse_BGRT = driver.forward(q_BGRTA, k_BGSA, v_BGSA, q_pos, q_seg, kv_pos, kv_seg, **kw,
                                           interpret=interpret, **_limit(backend, vmem_limit_mib, query_runs))
    return fb.ungroup_heads(o_BGRTA), jnp.moveaxis(fb.ungroup_heads(lse_BGRT[..., None])[..., 0], 1, 2)


def attention_bwd(q_BTNA, k_BSGA, v_BSGA, o_BTNA, lse_BNT, do_BTNA, *, q_pos, kv_pos, q_seg=None, kv_seg=None,
                  scale: float, backend: str = "xla", block_q: int, block_k: int, interpret: bool = False,
                  grad_dtype=jnp.float32, vmem_limit_mib: float = 0.0, query_runs=None):
    """(dq [B, T, N, A], dk [B, S, G, A], dv [B, S, G, A]): this key set's gradients given the
    GLOBAL output o and log-sum-exp lse of the queries (over every key set) and do = dL/do.
    grad_dtype: of all three (float32 by default, for a caller that sums dq over key sets); None
    gives each its input's dtype. Accumulation is float32 either way."""
    _check(q_BTNA, k_BSGA, v_BSGA, q_pos, kv_pos, q_seg, kv_seg, backend, block_q, block_k)
    q_pos, kv_pos, q_seg, kv_seg = _ids(q_BTNA, k_BSGA, q_pos, kv_pos, q_seg, kv_seg)
    G = k_BSGA.shape[2]
    delta_BTN = jnp.sum(do_BTNA.astype(jnp.float32) * o_BTNA.astype(jnp.float32), axis=-1)
    group_rows = lambda x_BNT: fb.group_heads(jnp.moveaxis(x_BNT, 1, 2)[..., None], G)[..., 0]  # noqa: E731
    args = (fb.group_heads(q_BTNA, G), jnp.moveaxis(k_BSGA, 1, 2), jnp.moveaxis(v_BSGA, 1, 2),
            fb.group_heads(do_BTNA, G), group_rows(lse_BNT.astype(jnp.float32)), group_rows(delta_BTN.swapaxes(1, 2)),
            q_pos, q_seg, kv_pos, kv_seg)
    dtypes = (q_BTNA.dtype, k_BSGA.dtype, v_BSGA.dtype) if grad_dtype is None else (grad_dtype,) * 3
    kw = dict(scale=scale, block_q=block_q, block_k=block_k, grad_dtypes=dtypes)
    driver = _driver(backend)
    if driver is None:
        dq_BGRTA, dk_BGSA, dv_BGSA = xla.flash_backward(*args, **kw)
    else:
        dq_BGRTA, dk_BGSA, dv_BGSA = driver.backward(*args, **kw, interpret=interpret,
                                                     **_limit(backend, vmem_limit_mib, query_runs))
    return fb.ungroup_heads(dq_BGRTA), jnp.moveaxis(dk_BGSA, 1, 2), jnp.moveaxis(dv_BGSA, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, options):
    return attention_fwd(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg, **dict(options))[0]


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, options):
    o, lse = attention_fwd(q, k, v, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg, **dict(options))
    # Named for remat.save: with the output and its log-sum-exp kept, a remat's backward runs no
    # second flash forward (the output is also what the layer's gate and projection read).
    o, lse = (checkpoint_name(t, RESIDUALS_NAME) for t in (o, lse))
    return o, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse)


def _flash_bwd(options, residuals, do):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, o, lse = residuals
    dq, dk, dv = attention_bwd(q, k, v, o, lse, do, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
                               grad_dtype=None, **dict(options))
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_BTNA, k_BSGA, v_BSGA, *, q_pos_BT, kv_pos_BS, q_seg_BT=None, kv_seg_BS=None, scale: float,
                    backend: str = "xla", block_q: int, block_k: int, interpret: bool = False,
                    vmem_limit_mib: float = 0.0, query_runs=None):
    """xla.attention's result (o [B, T, N, A] in q's dtype) by flash attention, differentiable
    (custom VJP: the forward keeps o and lse, the backward runs attention_bwd). query_runs: as
    attention_fwd's."""
    _check(q_BTNA, k_BSGA, v_BSGA, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, backend, block_q, block_k)
    q_pos, kv_pos, q_seg, kv_seg = _ids(q_BTNA, k_BSGA, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS)
    options = (("scale", float(scale)), ("backend", backend), ("block_q", int(block_q)), ("block_k", int(block_k)),
               ("interpret", bool(interpret)), ("vmem_limit_mib", float(vmem_limit_mib)),
               ("query_runs", None if query_runs is None else tuple((int(a), int(n)) for a, n in query_runs)))
    return _flash(q_BTNA, k_BSGA, v_BSGA, q_pos, kv_pos, q_seg, kv_seg, options)
