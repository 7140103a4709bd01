"""All-gather context parallelism: queries stay sequence-sharded, keys and values are gathered.

Shape legend: B batch, T tokens (global), N query heads, G key/value heads, A head dim; lower-case
t is one rank's share of T.

Each rank attends its t queries to all T keys. The mask compares positions and segment ids (kept
with the tokens, so any token order works: natural, or the load-balanced order of
parallel/context.py), never token indices. Keys, values, key positions and key segment ids are
all-gathered over the context axes; the gradient of a gather is a reduce-scatter, so dK and dV
come back to the rank that owns the token. The local core is the caller's (the model's
kernels.attention.backend: flash attention over t queries x T keys, or the masked XLA core).

Without segment ids (unpacked rows) the mask is causal by position alone and no segment id is
moved.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.kernels.attention.xla import attention


def context_parallel_attention(q_BTNA, k_BTGA, v_BTGA, positions_BT, segment_ids_BT, *, axes: tuple[str, ...],
                               scale: float, q_spec, kv_spec, ids_spec, core=attention, check_vma: bool = True):
    """Global, sequence-sharded arrays in and out; `axes` are the context mesh axes, the specs the
    partition specs of the queries [B, T, N, A], the keys and values [B, T, G, A] and the ids [B, T]
    (the caller maps its logical axes to them). `core`: the local attention, with xla.attention's
    signature (called per rank on t queries and T keys); check_vma=False for a Pallas core (its
    kernels declare no varying-axes type on their outputs)."""
    packed = segment_ids_BT is not None

    def local(q_BtNA, k_BtGA, v_BtGA, pos_Bt, *seg):
        gather = lambda a: jax.lax.all_gather(a, axes, axis=1, tiled=True)  # noqa: E731
        k_BTGA, v_BTGA, kv_pos_BT = gather(k_BtGA), gather(v_BtGA), gather(pos_Bt)
        if packed:
            q_seg_Bt, kv_seg_BT = seg[0], gather(seg[0])
        else:
            q_seg_Bt, kv_seg_BT = jnp.zeros_like(pos_Bt), jnp.zeros_like(kv_pos_BT)
        return core(q_BtNA, k_BTGA, v_BTGA, q_pos_BT=pos_Bt, kv_pos_BS=kv_pos_BT, q_seg_BT=q_seg_Bt,
                    kv_seg_BS=kv_seg_BT, scale=scale)

    args = (q_BTNA, k_BTGA, v_BTGA, positions_BT) + ((segment_ids_BT,) if packed else ())
    specs = (q_spec, kv_spec, kv_spec, ids_spec) + ((ids_spec,) if packed else ())
    return jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=check_vma)(*args)
