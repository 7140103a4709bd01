"""The Gated DeltaNet layer of Qwen3.5 around the delta-rule core (docs/gdn.md section 4).

Shape legend: B batch, T tokens, D model, K key heads, U value heads, k key dim, v value dim,
W conv width. Packed documents: the conv never reads across a document boundary and the core
resets its state at each document start.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hybridmoe.config.schema import ModelConfig
from hybridmoe.kernels.gdn import gated_delta_rule
from hybridmoe.kernels.gdn.context_parallel import gated_delta_rule_context_parallel
from hybridmoe.kernels.gdn import limits as gdn_limits
from hybridmoe.kernels.platform import trace_platform
from hybridmoe.model.norms import gated_rms_norm
from hybridmoe.parallel.rules import constrain, logical_to_spec


def causal_conv(x_BTHC, taps_WHC, segment_ids_BT, tail_BSHC=None, tail_segment_ids_BS=None):
    """Depthwise causal conv (tap W-1 on the current token) then SiLU; returns (y, new tail).

    A tap reads token t - s only when it lies in t's document. `tail` holds the previous W-1
    pre-conv tokens of a continuing sequence: with `tail_segment_ids` (the previous context rank's
    halo) they are read where their ids match; without (decode), they are taken to be in the
    first token's document.
    """
    W = taps_WHC.shape[0]
    B, T = x_BTHC.shape[:2]
    if tail_BSHC is None:
        tail_BSHC = jnp.zeros((B, W - 1) + x_BTHC.shape[2:], x_BTHC.dtype)
        tail_seg = jnp.full((B, W - 1), -1, segment_ids_BT.dtype)  # matches no document
    elif tail_segment_ids_BS is not None:
        tail_seg = tail_segment_ids_BS
    else:
        tail_seg = jnp.broadcast_to(segment_ids_BT[:, :1], (B, W - 1))
    xp = jnp.concatenate([tail_BSHC.astype(x_BTHC.dtype), x_BTHC], axis=1)
    segp = jnp.concatenate([tail_seg, segment_ids_BT], axis=1)
    # keep[j]: tap j (reading token t - (W-1-j)) lies in t's document.
    keep_WBT = jnp.stack([segp[:, j:j + T] == segment_ids_BT for j in range(W)]).astype(jnp.float32)
    y = _depthwise_conv_silu(xp, taps_WHC, keep_WBT)
    return y, xp[:, -(W - 1):] if W > 1 else xp[:, :0]


def _conv_sum(xp_BPHC, taps_WHC, keep_WBT):
    """float32 sum over taps of keep * x(t - (W-1-j)) * tap_j: [B, T, ...]."""
    T = keep_WBT.shape[-1]
    expand = lambda m_BT: m_BT.reshape(m_BT.shape + (1,) * (xp_BPHC.ndim - 2))
    return sum(expand(keep_WBT[j]) * xp_BPHC[:, j:j + T].astype(jnp.float32) * taps_WHC[j].astype(jnp.float32)
               for j in range(taps_WHC.shape[0]))


@jax.custom_vjp
def _depthwise_conv_silu(xp_BPHC, taps_WHC, keep_WBT):
    """silu(causal depthwise conv) of the left-padded input xp [B, W-1+T, ...], in xp's dtype.

    Its own backward: the input cotangent is one pass summing the W shifted, masked, tap-scaled
    copies of the pre-SiLU cotangent, and the taps' cotangents W reductions of the same pass;
    autodiff of the masked tap loop gives each tap's select, pad and add as separate passes over
    the activations.
    """
    return jax.nn.silu(_conv_sum(xp_BPHC, taps_WHC, keep_WBT)).astype(xp_BPHC.dtype)


def _depthwise_conv_silu_fwd(xp_BPHC, taps_WHC, keep_WBT):
    return _depthwise_conv_silu(xp_BPHC, taps_WHC, keep_WBT), (xp_BPHC, taps_WHC, keep_WBT)


def _depthwise_conv_silu_bwd(residuals, dy_BTHC):
    xp_BPHC, taps_WHC, keep_WBT = residuals
    W, T = taps_WHC.shape[0], keep_WBT.shape[-1]
    acc = _conv_sum(xp_BPHC, taps_WHC, keep_WBT)
    sig = jax.nn.sigmoid(acc)
    d_acc = dy_BTHC.astype(jnp.float32) * sig * (1.0 + acc * (1.0 - sig))
    expand = lambda m_BT: m_BT.reshape(m_BT.shape + (1,) * (xp_BPHC.ndim - 2))
    no_pad = [(0, 0)] * (xp_BPHC.ndim - 2)
    d_xp = sum(jnp.pad(expand(keep_WBT[j]) * d_acc * taps_WHC[j].astype(jnp.float32), [(0, 0), (j, W - 1 - j)] + no_pad)
               for j in range(W))
    d_taps = jnp.stack([jnp.sum(expand(keep_WBT[j]) * xp_BPHC[:, j:j + T].astype(jnp.float32) * d_acc, axis=(0, 1))
                        for j in range(W)])
    return d_xp.astype(xp_BPHC.dtype), d_taps.astype(taps_WHC.dtype), None


_depthwise_conv_silu.defvjp(_depthwise_conv_silu_fwd, _depthwise_conv_silu_bwd)


def gates_from_projections(p, b_BTU, a_BTU):
    """beta = sigmoid(b) and the log gate g = -exp(A_log) softplus(a + dt_bias), float32."""
    beta = jax.nn.sigmoid(b_BTU.astype(jnp.float32))
    # float32: softplus of large a and exp(A_log) give gates near -1e3 that bf16 cannot resolve.
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a_BTU.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    return g, beta


IN_PROJECTIONS = ("wq", "wk", "wv", "wz", "wb", "wa")
CONV_TAPS = ("conv_q", "conv_k", "conv_v")


def in_projections(p, x_BTD):
    """q, k, v, z [B, T, heads * dim] (flat) and b, a [B, T, U] from ONE matmul over the weights side by side.

    The parameters stay split (the Hugging Face layout maps onto them name by name); joining the
    [D, n] weights costs a copy of the weights, far less than five more passes over the activations
    in the forward and ten in the backward (each with its own transposed copy of x or of its
    cotangent on CPU). The pieces stay flat so that q, k, v rejoin for the conv without a copy.
    """
    dt = x_BTD.dtype
    weights = [p[name].astype(dt) for name in IN_PROJECTIONS]
    widths = [w[0].size for w in weights]
    joined_DN = jnp.concatenate([w.reshape(w.shape[0], -1) for w in weights], axis=1)
    joined_BTN = jnp.einsum("btd,dn->btn", x_BTD, joined_DN)
    return jnp.split(joined_BTN, list(itertools.accumulate(widths[:-1])), axis=-1)


def _heads(a_BTN, param):
    """[B, T, heads * dim] -> [B, T, heads, dim] as the conv taps or projection `param` lays them out."""
    return a_BTN.reshape(*a_BTN.shape[:2], *param.shape[1:])


def conv_all_channels(p, q_BTN, k_BTN, v_BTN, segment_ids_BT, tails=None):
    """The three causal convs as one over the [q | k | v] channels (one pass instead of three).

    q, k, v flat [B, T, heads * dim] (the projection's adjacent columns, so joining them again is
    free); tails [B, W-1, heads, dim] or None. Returns (q, k, v) [B, T, heads, dim] after conv + SiLU
    and their new tails.
    """
    parts = (q_BTN, k_BTN, v_BTN)
    x_BT1N = jnp.concatenate(parts, axis=-1)[:, :, None, :]
    taps_W1N = jnp.concatenate([p[name].reshape(p[name].shape[0], 1, -1) for name in CONV_TAPS], axis=-1)
    tail = None if tails is None else jnp.concatenate([t.reshape(*t.shape[:2], 1, -1) for t in tails], axis=-1)
    y_BT1N, tail_BS1N = causal_conv(x_BT1N, taps_W1N, segment_ids_BT, tail)
    bounds = list(itertools.accumulate(a.shape[-1] for a in parts[:-1]))
    ys = jnp.split(y_BT1N[:, :, 0], bounds, axis=-1)
    new_tails = jnp.split(tail_BS1N[:, :, 0], bounds, axis=-1)
    return ([_heads(y, p[name]) for y, name in zip(ys, CONV_TAPS)],
            [_heads(t, p[name]) for t, name in zip(new_tails, CONV_TAPS)])


def context_ranks() -> int:
    """Size of the mesh's context axis in force (1 outside a mesh): > 1 shards the sequence."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("context", 1)


def _halo_from_previous_rank(x_BS, axis_name: str):
    """The previous context rank's last tokens (the first rank receives zeros)."""
    ranks = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x_BS, axis_name, [(i, i + 1) for i in range(ranks - 1)])


# The scope names the GDN core's ops in the compiled program (analysis/hlo_cost.py).
CORE_SCOPE = "gdn_core"


@jax.named_scope(CORE_SCOPE)
def _conv_and_core_sequence_sharded(p, q, k, v, g, beta, segment_ids_BT, *, chunk_size: int,
                                     cp_m_scan: bool, cp_dh_scan: bool, prefix: str, backend: str, interpret: bool,
                                     precision: str | None = None, cp_terms_in_kernel: bool = False,
                                     token_major: bool = False):
    """Causal convs and the core with the sequence split over the mesh's context axis (docs/gdn.md section 3).

    Each rank holds a [B, T / P] slice: the convs read the previous rank's last W-1 pre-conv tokens
    (the halo, masked by document like any tap); the core chains the shards' states across ranks.
    """
    token = logical_to_spec(("batch", "seq", "heads", None))
    gate = logical_to_spec(("batch", "seq", "heads"))
    ids = logical_to_spec(("batch", "seq"))
    taps = logical_to_spec((None, "heads", None))
    axis = "context"

    def local(conv_q, conv_k, conv_v, q, k, v, g, beta, seg):
        W = conv_q.shape[0]
        tail_seg = _halo_from_previous_rank(seg[:, seg.shape[1] - (W - 1):], axis) if W > 1 else None
        convolved = []
        for x, taps_WHC in ((q, conv_q), (k, conv_k), (v, conv_v)):
            tail = _halo_from_previous_rank(x[:, x.shape[1] - (W - 1):], axis) if W > 1 else None
            convolved.append(causal_conv(x, taps_WHC, seg, tail, tail_seg)[0])
        return gated_delta_rule_context_parallel(
            *convolved, g, beta, segment_ids=seg, axis_name=axis, chunk_size=chunk_size, normalize_qk=True,
            cp_m_scan=cp_m_scan, cp_dh_scan=cp_dh_scan, prefix=prefix, backend=backend, interpret=interpret,
            precision=precision, terms_in_kernel=cp_terms_in_kernel, token_major=token_major)

    # check_vma off: the core's custom backward places its own collectives.
    return jax.shard_map(local, in_specs=(taps, taps, taps, token, token, token, gate, gate, ids),
                         out_specs=token, check_vma=False)(
        p["conv_q"], p["conv_k"], p["conv_v"], q, k, v, g, beta, segment_ids_BT)


@jax.named_scope(CORE_SCOPE)
def _core(q, k, v, g, beta, segment_ids_BT, initial_state, *, chunk_size: int, backend: str, interpret: bool,
          precision: str | None = None, token_major: bool = False):
    """The core on the whole sequence. A Pallas kernel is a custom call that GSPMD cannot split, so
    under a mesh it runs per shard in a shard_map (rows and head groups are independent)."""
    def core(q, k, v, g, beta, seg, state):
        return gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=state, chunk_size=chunk_size,
                                normalize_qk=True, backend=backend, interpret=interpret, precision=precision,
                                token_major=token_major)

    if backend == "xla" or jax.sharding.get_abstract_mesh().empty:
        return core(q, k, v, g, beta, segment_ids_BT, initial_state)
    token = logical_to_spec(("batch", "seq", "heads", None))
    gate = logical_to_spec(("batch", "seq", "heads"))
    state = logical_to_spec(("batch", "heads", None, None))
    specs = (token, token, token, gate, gate, logical_to_spec(("batch", "seq")))
    args = (q, k, v, g, beta, segment_ids_BT)
    if initial_state is None:
        run = lambda *local: core(*local, None)
    else:
        run, specs, args = core, specs + (state,), args + (initial_state,)
    # check_vma off: a Pallas call's output shapes carry no varying-axes annotation.
    return jax.shard_map(run, in_specs=specs, out_specs=(token, state), check_vma=False)(*args)


def gdn_layer(p, x_BTD, segment_ids_BT, m: ModelConfig, *, chunk_size: int, backend: str = "auto",
              interpret: bool = False, state=None, cp_m_scan: bool = False, cp_dh_scan: bool = False, cp_prefix: str = "all_gather",
              precision: str = "auto", cp_terms_in_kernel: bool = False, layout: str = "head_major"):
    """Returns the layer output, and the new recurrent state when `state` is given (decode/prefill).

    state: {"conv_q", "conv_k", "conv_v": [B, W-1, heads, dim] pre-conv tails, "ssm": [B, U, k, v]}.
    Under a mesh whose context axis is > 1 (and without `state`) the sequence stays sharded: the
    convs and the core run per rank (`_conv_and_core_sequence_sharded`); cp_m_scan / cp_dh_scan
    choose the scans over the trees there (gdn.cp_m_scan, gdn.cp_dh_scan), cp_terms_in_kernel the
    Mosaic core's own kernels for both (gdn.cp_terms_in_kernel); cp_prefix the cross-rank
    prefix (context_parallel.PREFIXES; the other one is kept for benchmarks/gdn_cp.py); precision
    the Mosaic core's products (kernels.gdn.precision; auto: the kernel's default for the dtype);
    layout the Mosaic core's blocks (kernels.gdn.layout).
    """
    backend = gdn_limits.resolve(backend, trace_platform(), chunk_size)
    dt = x_BTD.dtype
    x_BTD = x_BTD * (segment_ids_BT > 0)[..., None].astype(dt)
    q, k, v, z, b, a = in_projections(p, x_BTD)
    q, k, v = (checkpoint_name(t, n) for t, n in ((q, "gdn_q"), (k, "gdn_k"), (v, "gdn_v")))
    z = _heads(z, p["wz"])
    g, beta = gates_from_projections(p, b, a)
    precision = None if precision == "auto" or backend != "pallas_tpu" else precision
    token_major = layout == "token_major" and backend == "pallas_tpu"
    if state is None and context_ranks() > 1:
        q, k, v = (_heads(t, p[name]) for t, name in zip((q, k, v), CONV_TAPS))
        o_BTUv = _conv_and_core_sequence_sharded(p, q, k, v, g, beta, segment_ids_BT, chunk_size=chunk_size,
                                                 cp_m_scan=cp_m_scan, cp_dh_scan=cp_dh_scan, prefix=cp_prefix,
                                                 backend=backend, interpret=interpret, precision=precision,
                                                 cp_terms_in_kernel=cp_terms_in_kernel, token_major=token_major)
    else:
        tails = None if state is None else [state[name] for name in CONV_TAPS]
        (q, k, v), (tail_q, tail_k, tail_v) = conv_all_channels(p, q, k, v, segment_ids_BT, tails)
        o_BTUv, ssm = _core(q, k, v, g, beta, segment_ids_BT, None if state is None else state["ssm"],
                            chunk_size=chunk_size, backend=backend, interpret=interpret, precision=precision,
                            token_major=token_major)
    o_BTUv = checkpoint_name(constrain(o_BTUv, "batch", "seq", "heads", None), "gdn_core_out")
    y = gated_rms_norm(o_BTUv, z, p["norm"], m.rms_norm_eps)
    out = jnp.einsum("btuv,uvd->btd", y.astype(dt), p["wo"].astype(dt))
    if state is None:
        return out
    return out, {"conv_q": tail_q, "conv_k": tail_k, "conv_v": tail_v, "ssm": ssm}
