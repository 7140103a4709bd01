"""The gated full-attention layer of Qwen3.5.

Shape legend: B batch, T tokens, D model, N query heads, G key/value heads, A head dim.
The query projection carries a per-head output gate ([q_h | gate_h] per head); q and k get a
per-head RMSNorm, then partial rotary embedding; the attention output is scaled by
sigmoid(gate) before the output projection.

The attention core is kernels.attention.backend (attention_core: flash attention in XLA ops or
Pallas kernels, or the masked XLA core in query blocks; `auto` resolved for the platform the program
is traced for). Context parallelism (the sequence split over the mesh axes of logical "seq"):
queries stay sequence-sharded and keys/values are all-gathered
(kernels/attention/context_parallel.py), that core running on each rank's queries; or, with
attention.cp_impl=ring, the K/V blocks go round the ranks (kernels/attention/ring.py). Without
context parallelism under a mesh a flash core runs per shard in a shard_map (self_attention). With
attention.cp_load_balance the layer first moves its input, positions and segment ids into the
load-balanced order of parallel/context.py and moves its output back, so the layers around it
see natural order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hybridmoe.config.schema import AttentionConfig, KernelsConfig, ModelConfig
from hybridmoe.kernels.attention import attention, causal_attention_blocked, flash_attention, limits
from hybridmoe.kernels.attention.context_parallel import context_parallel_attention
from hybridmoe.kernels.attention.ring import ring_attention
from hybridmoe.kernels.platform import trace_platform
from hybridmoe.model.norms import apply_partial_rope, rms_norm, rope_tables
from hybridmoe.parallel import context
from hybridmoe.parallel.rules import constrain, logical_to_spec, splits_evenly

# The checkpoint name of the load-balanced positions and segment ids (attention.cp_load_balance_hoist_ids).
LB_IDS_NAME = "attn_lb_ids"


def project_qkv(p, x_BTD, positions_BT, m: ModelConfig):
    """q (normed, rotated), the output gate, k (normed, rotated), v."""
    dt = x_BTD.dtype
    qg_BTNA2 = jnp.einsum("btd,dnh->btnh", x_BTD, p["wq"].astype(dt))
    qg_BTNA2 = checkpoint_name(qg_BTNA2, "attn_q")
    q_BTNA, gate_BTNA = jnp.split(qg_BTNA2, 2, axis=-1)
    k_BTGA = jnp.einsum("btd,dga->btga", x_BTD, p["wk"].astype(dt))
    v_BTGA = jnp.einsum("btd,dga->btga", x_BTD, p["wv"].astype(dt))
    q_BTNA = rms_norm(q_BTNA, p["q_norm"], m.rms_norm_eps)
    k_BTGA = rms_norm(k_BTGA, p["k_norm"], m.rms_norm_eps)
    cos, sin = rope_tables(positions_BT, m.rotary_dim, m.rope_theta)
    q_BTNA = apply_partial_rope(q_BTNA, cos, sin)
    k_BTGA = apply_partial_rope(k_BTGA, cos, sin)
    return (constrain(q_BTNA, "batch", "seq", "heads", None), gate_BTNA,
            constrain(k_BTGA, "batch", "seq", "kv_heads", None), constrain(v_BTGA, "batch", "seq", "kv_heads", None))


def gated_output(p, o_BTNA, gate_BTNA):
    o_BTNA = o_BTNA * jax.nn.sigmoid(gate_BTNA.astype(jnp.float32)).astype(o_BTNA.dtype)
    y_BTD = jnp.einsum("btna,nad->btd", o_BTNA, p["wo"].astype(o_BTNA.dtype))
    return checkpoint_name(y_BTD, "attn_out")


def load_balanced_ids(positions_BT, segment_ids_BT, a: AttentionConfig):
    """Positions and segment ids (None: unpacked) in load-balanced order.

    They depend only on the batch, yet under remat each layer's backward replay would reorder them
    again; with the hoist they carry a checkpoint name that the save list holds, so the layer scan
    keeps one copy, made outside the loop, and the backward reads it.
    """
    ids = [context.reorder(positions_BT, ("batch", "seq"))]
    if segment_ids_BT is not None:
        ids.append(context.reorder(segment_ids_BT, ("batch", "seq")))
    if a.cp_load_balance_hoist_ids:
        ids = [checkpoint_name(i, LB_IDS_NAME) for i in ids]
    return ids[0], (ids[1] if len(ids) > 1 else None)


def attention_core(kc: KernelsConfig, *, self_attention: bool, load_balanced: bool | None = None):
    """The core kernels.attention names, as a function with xla.attention's signature (q [B, T, N,
    A], k and v [B, S, G, A], positions and segment ids, scale). `self_attention`: S = T over the
    same tokens (the blocked core needs it; under context parallelism it runs the masked core).
    load_balanced: under context parallelism, the queries' layout (context.rank_query_runs)."""
    backend = limits.resolve(kc.attention.backend, trace_platform())
    block_q, block_k = kc.attention.block_q, kc.attention.block_k
    if backend == "blocked":
        if not self_attention:
            return attention
        return lambda q, *args, **kw: causal_attention_blocked(  # noqa: E731
            q, *args, **kw, num_blocks=q.shape[1] // block_q if block_q else None)
    hardware = backend != "xla" and not kc.interpret

    def core(q_BTNA, k_BSGA, v_BSGA, *, q_pos_BT, kv_pos_BS, q_seg_BT, kv_seg_BS, scale):
        t, S = q_BTNA.shape[1], k_BSGA.shape[1]
        bq, bk = limits.blocks(backend, block_q, block_k, t, S, hardware)
        runs = None if load_balanced is None or S % t else context.rank_query_runs(t, S, load_balanced)
        return flash_attention(q_BTNA, k_BSGA, v_BSGA, q_pos_BT=q_pos_BT, kv_pos_BS=kv_pos_BS, q_seg_BT=q_seg_BT,
                               kv_seg_BS=kv_seg_BS, scale=scale, backend=backend, block_q=bq, block_k=bk,
                               interpret=kc.interpret, vmem_limit_mib=kc.attention.vmem_limit_mib,
                               query_runs=runs)

    return core


# The scope names the attention core's ops in the compiled program (analysis/hlo_cost.py).
CORE_SCOPE = "attention_core"


@jax.named_scope(CORE_SCOPE)
def self_attention(q_BTNA, k_BTGA, v_BTGA, positions_BT, segment_ids_BT, kernels: KernelsConfig, *, scale: float):
    """The core over the whole (unsharded) sequence. Under a mesh a flash core runs per shard in a
    shard_map (rows and head groups are independent): a Mosaic or Triton kernel is a custom call
    that GSPMD cannot partition, and the XLA flash loop is kept to each shard's rows and heads the
    same way. The blocked core is plain einsums that GSPMD splits; so is the XLA flash core where
    the rows or heads do not divide over their mesh axes (a Pallas core there is refused by
    shard_map, naming the shapes)."""
    backend = limits.resolve(kernels.attention.backend, trace_platform())
    core = attention_core(kernels, self_attention=True)

    def local(q, k, v, pos, seg):
        return core(q, k, v, q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=scale)

    args = (q_BTNA, k_BTGA, v_BTGA, positions_BT, segment_ids_BT)
    if backend == "blocked" or jax.sharding.get_abstract_mesh().empty:
        return local(*args)
    q_spec, kv_spec = logical_to_spec(("batch", "seq", "heads", None)), logical_to_spec(("batch", "seq", "kv_heads", None))
    ids = logical_to_spec(("batch", "seq"))
    specs = (q_spec, kv_spec, kv_spec, ids, ids)
    if backend == "xla" and not all(splits_evenly(sp, a.shape) for sp, a in zip(specs, args)):
        return local(*args)
    # check_vma off for Pallas: a Pallas call's outputs carry no varying-axes annotation.
    return jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=not backend.startswith("pallas"))(*args)


def attention_layer(p, x_BTD, positions_BT, segment_ids_BT, m: ModelConfig, a: AttentionConfig = AttentionConfig(),
                    *, packed: bool = True, kernels: KernelsConfig = KernelsConfig()):
    """`packed`: whether segment_ids_BT came with the batch (else it is all ones and context
    parallelism neither moves nor compares it). `kernels`: its attention core (kernels.attention)."""
    axes = context.context_axes()
    if not axes:
        q, gate, k, v = project_qkv(p, x_BTD, positions_BT, m)
        o_BTNA = self_attention(q, k, v, positions_BT, segment_ids_BT, kernels, scale=m.head_dim ** -0.5)
        return gated_output(p, o_BTNA, gate)
    seg_BT = segment_ids_BT if packed else None
    if a.cp_load_balance:
        x_BTD = context.reorder(x_BTD, ("batch", "seq", None))
        positions_BT, seg_BT = load_balanced_ids(positions_BT, seg_BT, a)
    q, gate, k, v = project_qkv(p, x_BTD, positions_BT, m)
    backend = limits.resolve(kernels.attention.backend, trace_platform())
    specs = dict(q_spec=logical_to_spec(("batch", "seq", "heads", None)),
                 kv_spec=logical_to_spec(("batch", "seq", "kv_heads", None)), ids_spec=logical_to_spec(("batch", "seq")))
    if a.cp_impl == "ring":  # a flash core (the validator refuses blocked): each step is one shard's keys
        t = q.shape[1] // context.context_size(axes)
        block_q, block_k = limits.blocks(backend, kernels.attention.block_q, kernels.attention.block_k, t, t,
                                         hardware=backend != "xla" and not kernels.interpret)
        with jax.named_scope(CORE_SCOPE):
            o_BTNA = ring_attention(q, k, v, positions_BT, seg_BT, axes=axes, scale=m.head_dim ** -0.5, **specs,
                                    backend=backend, block_q=block_q, block_k=block_k, interpret=kernels.interpret,
                                    vmem_limit_mib=kernels.attention.vmem_limit_mib)
    else:
        with jax.named_scope(CORE_SCOPE):
            o_BTNA = context_parallel_attention(q, k, v, positions_BT, seg_BT, axes=axes, scale=m.head_dim ** -0.5,
                                                **specs, core=attention_core(kernels, self_attention=False,
                                                                             load_balanced=a.cp_load_balance),
                                                check_vma=not backend.startswith("pallas"))
    y_BTD = gated_output(p, o_BTNA, gate)
    if a.cp_load_balance:
        y_BTD = context.reorder(y_BTD, ("batch", "seq", None), inverse=True)
    return y_BTD
