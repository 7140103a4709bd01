"""Ring context parallelism: queries and keys stay sequence-sharded; the K/V blocks travel.

Shape legend: B batch, T tokens (global), N query heads, G key/value heads, A head dim; lower-case
t = T / P is one rank's share; P context ranks.

Forward: each rank starts with its own K/V block (keys, values, their positions and, for packed
rows, segment ids) and, for P steps, attends its queries to the block it holds (ops.attention_fwd
-> the partial (o_s, lse_s) over that key set) while that block is already on its way to the next
rank by collective-permute (r -> r + 1: at step s rank r holds the block of rank r - s; the permute
and the step's compute do not depend on each other, so the compiler may overlap them). The
partials merge by the online softmax's rule (merge_partials): lse = logaddexp(lse, lse_s), o = o
e^(lse_old - lse) + o_s e^(lse_s - lse), in float32. Memory: besides the rank's own block, the held
one and the one in flight, each one shard [b, t, G, A]; never the gathered [T] keys.

Backward (custom VJP; the residuals are the rank's own q, k, v, ids and the global o and lse): the
K/V blocks go round again, now each with its dK/dV accumulator (float32). At step s the rank adds
its queries' share of the held block's gradients (ops.attention_bwd with the global o and lse,
whose per-key-set gradients sum to the exact ones), and sums dq over the key sets. After P steps
every accumulator is back at the rank owning its keys (P - 1 moves of K/V and ids, P of dK/dV):
dK and dV need no reduce.

Positions and segment ids are compared as values (the flash kernels' semantics), so any token order
works: natural, or the load-balanced order of parallel/context.py (rank r holds half-chunks r and
2P-1-r), where every step has about the same unmasked work. Block pairs a step cannot see (keys all
after the queries, or other documents) are skipped by the kernels' block schedule.

Bytes a rank receives per layer, forward: (P - 1) K/V blocks of [b, t, G, A] (+ int32 ids), the
same as all-gather's (P - 1) / P of [b, T, G, A]; the backward moves K/V again plus the float32
dK/dV accumulators P times, where all-gather's backward reduce-scatters dK/dV once
(benchmarks/cp_ring.py measures both from the compiled program). The difference is the peak:
all-gather holds all T keys (and [t, T]-sized work for a masked core), the ring two shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import ops

F32 = jnp.float32


def ring_source(rank, step, P: int):
    """The rank whose K/V block `rank` holds at `step` (blocks move r -> r + 1 each step)."""
    return (rank - step) % P


def merge_partials(o_acc, lse_acc, o_s, lse_s):
    """The online softmax's merge of two partial attentions over disjoint key sets: o [B, T, N, A]
    float32, lse [B, N, T] (-inf: no key seen yet); a query that has seen no key keeps zeros."""
    lse = jnp.logaddexp(lse_acc, lse_s)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w_acc = jnp.moveaxis(jnp.exp(lse_acc - safe), 1, 2)[..., None]  # [B, T, N, 1]
    w_s = jnp.moveaxis(jnp.exp(lse_s - safe), 1, 2)[..., None]
    return o_acc * w_acc + o_s.astype(F32) * w_s, lse


def _next(block, axes, P: int):
    """Every array of `block` to the next rank (r -> r + 1) by collective-permute."""
    perm = [(r, (r + 1) % P) for r in range(P)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), block)


def send_home(dkv, axes, P: int):
    """The last move of the backward: each dK/dV accumulator, complete, to the rank owning its keys
    (the block a rank holds at the last step is rank r + 1's)."""
    return _next(dkv, axes, P)


def _kv_ids(block):
    """(kv_pos, kv_seg) of a held block: (k, v, pos) or, for packed rows, (k, v, pos, seg)."""
    return block[2], (block[3] if len(block) > 3 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, pos, seg, axes, options):
    return _ring_fwd(q, k, v, pos, seg, axes, options)[0]


def _ring_forward(q, k, v, pos, seg, axes, options):
    opts = dict(options)
    P = jax.lax.axis_size(axes)

    def partial(block):
        kv_pos, kv_seg = _kv_ids(block)
        return ops.attention_fwd(q, block[0], block[1], q_pos=pos, kv_pos=kv_pos, q_seg=seg, kv_seg=kv_seg, **opts)

    block = (k, v, pos) if seg is None else (k, v, pos, seg)
    o, lse = partial(block)
    o = o.astype(F32)

    def step(carry, _):
        o, lse, block = carry
        incoming = _next(block, axes, P)  # in flight while the held block computes (no dependence)
        o, lse = merge_partials(o, lse, *partial(block))
        return (o, lse, incoming), None

    if P > 1:
        # Step 0's own block is done above; the scan receives block r - s and computes the one it
        # held (P - 2 computes), the last block received is computed after it: P - 1 moves in all.
        (o, lse, block), _ = jax.lax.scan(step, (o, lse, _next(block, axes, P)), None, length=P - 2)
        o, lse = merge_partials(o, lse, *partial(block))
    return o.astype(q.dtype), lse


def _ring_fwd(q, k, v, pos, seg, axes, options):
    o, lse = _ring_forward(q, k, v, pos, seg, axes, options)
    return o, (q, k, v, pos, seg, o, lse)


def _ring_bwd(axes, options, residuals, do):
    q, k, v, pos, seg, o, lse = residuals
    opts = dict(options)
    P = jax.lax.axis_size(axes)

    def grads(block):
        kv_pos, kv_seg = _kv_ids(block)
        return ops.attention_bwd(q, block[0], block[1], o, lse, do, q_pos=pos, kv_pos=kv_pos, q_seg=seg,
                                 kv_seg=kv_seg, **opts)

    def step(carry, _):
        dq, block, dkv = carry
        incoming = _next(block, axes, P)  # K/V and ids in flight while the held block's gradients compute
        dq_s, dk_s, dv_s = grads(block)
        # The held block's accumulated dK/dV follow it to the next rank.
        dkv = _next((dkv[0] + dk_s, dkv[1] + dv_s), axes, P)
        return (dq + dq_s, incoming, dkv), None

    block = (k, v, pos) if seg is None else (k, v, pos, seg)
    carry = fb.vary_like((jnp.zeros(q.shape, F32), block, (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))),
                         q, k, v, pos, o, lse, do)
    if P > 1:
        carry, _ = jax.lax.scan(step, carry, None, length=P - 1)
    dq, block, dkv = carry
    # The last block held is rank r + 1's: its gradients complete here and go home (no K/V move).
    dq_s, dk_s, dv_s = grads(block)
    dkv = (dkv[0] + dk_s, dkv[1] + dv_s)
    dk, dv = send_home(dkv, axes, P) if P > 1 else dkv
    return (dq + dq_s).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(q_BtNA, k_BtGA, v_BtGA, pos_Bt, seg_Bt, *, axes: tuple[str, ...], scale: float,
                         backend: str = "xla", block_q: int, block_k: int, interpret: bool = False,
                         vmem_limit_mib: float = 0.0):
    """One rank's queries against every rank's keys, inside shard_map over the context `axes`
    (o [B, t, N, A] in q's dtype). seg_Bt: segment ids, None for unpacked rows (then none is moved
    or compared: the mask is causal by position alone)."""
    options = (("scale", float(scale)), ("backend", backend), ("block_q", int(block_q)), ("block_k", int(block_k)),
               ("interpret", bool(interpret)), ("vmem_limit_mib", float(vmem_limit_mib)))
    seg = None if seg_Bt is None else seg_Bt.astype(jnp.int32)
    return _ring(q_BtNA, k_BtGA, v_BtGA, pos_Bt.astype(jnp.int32), seg, tuple(axes), options)


def ring_attention(q_BTNA, k_BTGA, v_BTGA, positions_BT, segment_ids_BT, *, axes: tuple[str, ...], scale: float,
                   q_spec, kv_spec, ids_spec, backend: str = "xla", block_q: int, block_k: int,
                   interpret: bool = False, vmem_limit_mib: float = 0.0):
    """Global, sequence-sharded arrays in and out, the specs their partition specs (as
    context_parallel_attention's); segment_ids_BT None: unpacked rows (no segment id is moved or
    compared)."""
    packed = segment_ids_BT is not None
    kw = dict(axes=axes, scale=scale, backend=backend, block_q=block_q, block_k=block_k, interpret=interpret,
              vmem_limit_mib=vmem_limit_mib)

    def local(q, k, v, pos, *seg):
        return ring_attention_local(q, k, v, pos, seg[0] if packed else None, **kw)

    args = (q_BTNA, k_BTGA, v_BTGA, positions_BT) + ((segment_ids_BT,) if packed else ())
    specs = (q_spec, kv_spec, kv_spec, ids_spec) + ((ids_spec,) if packed else ())
    return jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=not backend.startswith("pallas"))(*args)
