"""Sequence-sharded context parallelism of the chunked core (docs/gdn.md section 3). Runs inside shard_map.

A rank's shard is an affine map of the state it receives: S_out = M_r S_in + S_ext_r, with M_r the
product of its chunk transitions M_c = decay I - K_bwd^T W (later chunks on the left) and S_ext_r
its end state from a zero start. Forward: pass 1 (S_ext_r, M_r); the exclusive prefix over ranks
gives S_in_r; pass 2 is the local chunked pass from S_in_r. Backward, mirrored: the local state
cotangent from a zero end (dS_loc_r); the reverse exclusive prefix with the transposed forward
M_r gives the cotangent at the shard's end; then the single-device backward from there.

Packed documents need nothing extra: a chunk holding a document start has M_c = 0 (its decay and
every K_bwd^T W term across the start are masked), so the chain is cut inside a shard, and the
first token of a shard is flagged as a start when its document differs from the previous rank's
last token's (`cross_rank_starts`).

Remat: the forward names M_r ("gdn_cp_transition") and S_in_r ("gdn_cp_state_in"); a policy that
saves both replays only pass 2 in the backward (no pass 1, no cross-rank collective).

Dimension letters as in xla.py; P ranks along the context axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from hybridmoe.kernels.gdn import pallas, pallas_cp_scans, pallas_tpu, pallas_tpu_cp, tpu_chunk
from hybridmoe.kernels.gdn.limits import RESIDUALS_NAME
from hybridmoe.kernels.gdn.reference import document_starts
from hybridmoe.kernels.platform import trace_platform
from hybridmoe.kernels.gdn.xla import (
    ChunkInputs,
    ChunkTerms,
    chunk_end_cotangents,
    chunk_outputs,
    chunk_start_states,
    chunk_state_step,
    chunk_terms,
    finish_backward,
    from_chunks,
    matmul_highest,
    prepare_chunks,
    replay_chunks,
)

PREFIXES = ("all_gather", "ppermute")
TRANSITION_NAME, STATE_IN_NAME = "gdn_cp_transition", "gdn_cp_state_in"


# ---------------------------------------------------------------------------------------------
# The shard's transition product M_r (forward) and its local state cotangent (backward), each as a
# balanced tree over the materialised [N, ..., K, K] stack (default) or a sequential scan.


def chunk_transitions(t: ChunkTerms):
    """M_c = decay I - K_bwd^T W for every chunk: [B, N, H, K, K] float32."""
    eye_KK = jnp.eye(t.w.shape[-1], dtype=t.w.dtype)
    return t.decay[..., None, None] * eye_KK - matmul_highest("bnhck,bnhcj->bnhkj", t.k_to_end, t.w)


def _fold_pairs(items_N, combine, identity):
    """Left-to-right fold of a [N, ...] stack in log depth: combine(earlier, later) on pairs."""
    while items_N[0].shape[0] > 1:
        if items_N[0].shape[0] % 2:
            items_N = tuple(jnp.concatenate([a, i[None]]) for a, i in zip(items_N, identity))
        items_N = combine(tuple(a[0::2] for a in items_N), tuple(a[1::2] for a in items_N))
    return tuple(a[0] for a in items_N)


def cp_m_tree_product(t: ChunkTerms):
    """M_r = M_{N-1} ... M_0 [B, H, K, K] by pairwise products (m[1::2] @ m[0::2])."""
    m_NBHKK = jnp.moveaxis(chunk_transitions(t), 1, 0)
    eye = jnp.broadcast_to(jnp.eye(m_NBHKK.shape[-1], dtype=m_NBHKK.dtype), m_NBHKK.shape[1:])
    (m_BHKK,) = _fold_pairs((m_NBHKK,), lambda early, late: (matmul_highest("...ij,...jk->...ik", late[0], early[0]),),
                            (eye,))
    return m_BHKK


def _pallas_scans(pallas) -> bool:
    """Whether the scans run as Mosaic kernels: given, or where the program is traced for a TPU."""
    return trace_platform() == "tpu" if pallas is None else pallas


def cp_m_scan_product(t: ChunkTerms, *, pallas: bool | None = None, interpret: bool = False):
    """M_r by one pass over chunks carrying one [K, K] product per head: M <- decay M - K_bwd^T (W M).

    On a TPU (or with pallas=True; interpret=True runs it on CPU) a Mosaic kernel keeps the products
    in VMEM (pallas_cp_scans.py). Elsewhere the state step with U = 0 applied to the identity, in a
    fori_loop that reads chunk n in place (a lax.scan would first copy its inputs to chunk-major
    order). Either way no [N, H, K, K] stack is formed.
    """
    if _pallas_scans(pallas):
        return pallas_cp_scans.m_scan_product(t, interpret=interpret)
    batch, num_chunks, heads, _, key_dim = t.w.shape
    eye_BHKK = jnp.broadcast_to(jnp.eye(key_dim, dtype=t.w.dtype), (batch, heads, key_dim, key_dim))
    zeros_BHCK = jnp.zeros_like(t.w[:, 0])

    def step(n, m_BHKK):
        chunk = (lax.dynamic_index_in_dim(a, n, 1, keepdims=False) for a in (t.w, t.k_to_end, t.decay))
        w_BHCK, k_to_end_BHCK, decay_BH = chunk
        return chunk_state_step(m_BHKK, w_BHCK, zeros_BHCK, k_to_end_BHCK, decay_BH)

    return lax.fori_loop(0, num_chunks, step, eye_BHKK)


def cp_dh_tree_cotangent(t: ChunkTerms, do_BNHCV):
    """dS_loc: the cotangent at the shard's start from its outputs alone (zero cotangent at its end).

    Each chunk is the adjoint map x -> M_c^T x + e_c, e_c = Q_dec^T dO - W^T A_qk^T dO; the maps
    are composed pairwise over the materialised [N, H, K, K] stack of M_c^T.
    """
    mt_NBHKK = jnp.moveaxis(jnp.swapaxes(chunk_transitions(t), -1, -2), 1, 0)
    e_BNHKV = matmul_highest("bnhck,bnhcv->bnhkv", t.q_decayed, do_BNHCV) - matmul_highest(
        "bnhck,bnhdc,bnhdv->bnhkv", t.w, t.attn, do_BNHCV)
    e_NBHKV = jnp.moveaxis(e_BNHKV, 1, 0)

    def combine(early, late):  # x -> early(late(x)): the later chunk's map is applied first
        mt_early, e_early = early
        mt_late, e_late = late
        return (matmul_highest("...ij,...jk->...ik", mt_early, mt_late),
                matmul_highest("...ij,...jv->...iv", mt_early, e_late) + e_early)

    eye = jnp.broadcast_to(jnp.eye(mt_NBHKK.shape[-1], dtype=mt_NBHKK.dtype), mt_NBHKK.shape[1:])
    _, d_start_BHKV = _fold_pairs((mt_NBHKK, e_NBHKV), combine, (eye, jnp.zeros_like(e_NBHKV[0])))
    return d_start_BHKV


def cp_dh_scan_cotangent(t: ChunkTerms, do_BNHCV, *, pallas: bool | None = None, interpret: bool = False):
    """dS_loc by the reverse recurrence of docs/gdn.md section 2 as one scan (no [N, H, K, K] stack):
    a Mosaic kernel on a TPU (as cp_m_scan_product), a lax.scan elsewhere."""
    if _pallas_scans(pallas):
        return pallas_cp_scans.dh_scan_cotangent(t, do_BNHCV, interpret=interpret)
    return chunk_end_cotangents(t, do_BNHCV, _zero_state(t))[1]


def _zero_state(t: ChunkTerms):
    batch, _, heads, _, key_dim = t.w.shape
    return jnp.zeros((batch, heads, key_dim, t.u.shape[-1]), t.w.dtype)


# ---------------------------------------------------------------------------------------------
# The exclusive prefix over ranks of the affine maps x -> A_r x + b_r (A_r^T with `transpose`):
# forward, S_in_r = map_{r-1} o ... o map_0 (0); reverse (the backward), over the ranks after r
# from the last one down.


def _apply(a_BHKK, x_BHKV, transpose):
    return matmul_highest("bhjk,bhjv->bhkv" if transpose else "bhkj,bhjv->bhkv", a_BHKK, x_BHKV)


def exclusive_prefix_all_gather(a_BHKK, b_BHKV, axis_name, *, reverse=False):
    """All-gather every rank's (A, b), then each rank folds the ranks before it (P small matmuls).

    The default prefix. One collective of P * (K*K + K*V) floats per head, then P matrix-state
    products ([K, K] x [K, V]) on every rank; it never multiplies two [K, K] maps, where the
    permute scan below composes log2(P) - 1 of them and waits on log2(P) + 1 dependent permutes.
    Measured against the permute scan (benchmarks/records/gdn_cp.json, the `small` GDN layer on 2, 4, 8
    simulated CPU devices): the scan moves fewer collective bytes (4.1 vs 7.2 MB at 8 ranks) and
    has slightly smaller temporaries (11.4 vs 13.6 MB at 8), and the times split (the scan faster
    at 2 and 8 ranks, slower at 4) inside that run's noise. Simulated devices model neither
    interconnect latency nor bandwidth, and on a real one the prefix's payload is small against
    the layer, so the one-collective form stays the default; the scan is kept (cp_prefix) for
    context sizes where the gathered stack of P maps would matter.
    """
    ranks = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    a_PBHKK = lax.all_gather(a_BHKK, axis_name)
    b_PBHKV = lax.all_gather(b_BHKV, axis_name)
    x_BHKV = jnp.zeros_like(b_BHKV)
    for p in reversed(range(ranks)) if reverse else range(ranks):
        before = p > me if reverse else p < me
        x_BHKV = jnp.where(before, _apply(a_PBHKK[p], x_BHKV, reverse) + b_PBHKV[p], x_BHKV)
    return x_BHKV


def exclusive_prefix_ppermute(a_BHKK, b_BHKV, axis_name, *, reverse=False):
    """Hillis-Steele scan over collective-permutes: log2(P) steps composing maps, then a shift by one."""
    ranks = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    if reverse:
        a_BHKK = jnp.swapaxes(a_BHKK, -1, -2)

    def from_rank_before(x, distance):
        if reverse:  # "before" is the higher rank
            return lax.ppermute(x, axis_name, [(i + distance, i) for i in range(ranks - distance)])
        return lax.ppermute(x, axis_name, [(i, i + distance) for i in range(ranks - distance)])

    distance = 1
    while distance < ranks:
        a_prev, b_prev = from_rank_before(a_BHKK, distance), from_rank_before(b_BHKV, distance)
        has_prev = me + distance < ranks if reverse else me >= distance
        b_BHKV = jnp.where(has_prev, _apply(a_BHKK, b_prev, False) + b_BHKV, b_BHKV)
        if 2 * distance < ranks:
            a_BHKK = jnp.where(has_prev, matmul_highest("...ij,...jk->...ik", a_BHKK, a_prev), a_BHKK)
        distance *= 2
    return from_rank_before(b_BHKV, 1)  # the first rank in order receives zeros


def exclusive_prefix(a_BHKK, b_BHKV, axis_name, *, prefix, reverse=False):
    fn = {"all_gather": exclusive_prefix_all_gather, "ppermute": exclusive_prefix_ppermute}[prefix]
    return fn(a_BHKK, b_BHKV, axis_name, reverse=reverse)


def cross_rank_starts(starts_BT, segment_ids_BT, axis_name):
    """Flag the shard's first token as a document start when the previous rank's last token is in
    another document (the first rank: never; the row's first document starts from zero anyway)."""
    ranks = lax.axis_size(axis_name)
    # A whole cycle (the first rank's value, the last rank's, is masked below): a partial permutation
    # would serve shard_map alike, but vmap over ranks (tools/chip_cases.py's gdn_cp) takes only whole ones.
    prev_last_B = lax.ppermute(segment_ids_BT[:, -1], axis_name, [(i, (i + 1) % ranks) for i in range(ranks)])
    first_B = (segment_ids_BT[:, 0] != prev_last_B) & (lax.axis_index(axis_name) > 0)
    return starts_BT.at[:, 0].set(first_B | starts_BT[:, 0])


# ---------------------------------------------------------------------------------------------
# The core on one rank's shard, with its custom backward.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def context_parallel_core(x: ChunkInputs, starts_BNC, axis_name, cp_m_scan, cp_dh_scan, prefix, backend="xla",
                          interpret=False, precision="float32"):
    """o [B, N, H, C, V] of this rank's chunks, the state entering the shard from the ranks before.

    A Pallas backend runs pass 2 and the backward's final pass as its kernels; pass 1, M_r
    and the local state cotangent stay in XLA (they need the chunk terms, not the kernels' outputs).
    """
    return _cp_fwd(x, starts_BNC, axis_name, cp_m_scan, cp_dh_scan, prefix, backend, interpret, precision)[0]


def _cp_fwd(x, starts_BNC, axis_name, cp_m_scan, cp_dh_scan, prefix, backend, interpret, precision):
    t = chunk_terms(x, starts_BNC)
    _, s_ext_BHKV = chunk_start_states(t, _zero_state(t))  # pass 1
    scans = dict(pallas=True if backend == "pallas_tpu" else None, interpret=interpret)
    m_BHKK = cp_m_scan_product(t, **scans) if cp_m_scan else cp_m_tree_product(t)
    m_BHKK = checkpoint_name(m_BHKK, TRANSITION_NAME)
    s_in_BHKV = checkpoint_name(exclusive_prefix(m_BHKK, s_ext_BHKV, axis_name, prefix=prefix), STATE_IN_NAME)
    if backend == "xla":  # pass 2
        states_BNHKV, _ = chunk_start_states(t, s_in_BHKV)
        o_BNHCV, _ = chunk_outputs(t, states_BNHKV)
        kernel_residuals = states_BNHKV
    else:
        (o_BNHCV, _), kernel_residuals = pallas.core_forward(x, starts_BNC, s_in_BHKV, backend=backend,
                                                             interpret=interpret, precision=precision)
    return o_BNHCV, (x, starts_BNC, kernel_residuals, m_BHKK)


def _cp_bwd(axis_name, cp_m_scan, cp_dh_scan, prefix, backend, interpret, precision, residuals, do_BNHCV):
    x, starts_BNC, kernel_residuals, m_BHKK = residuals  # the XLA pass's: the states at every chunk start
    if backend == "xla":
        local_vjp, t = replay_chunks((x, starts_BNC, kernel_residuals))
    else:
        t = chunk_terms(x, starts_BNC)
    if cp_dh_scan:
        scans = dict(pallas=True if backend == "pallas_tpu" else None, interpret=interpret)
        d_local_BHKV = cp_dh_scan_cotangent(t, do_BNHCV, **scans)
    else:
        d_local_BHKV = cp_dh_tree_cotangent(t, do_BNHCV)
    # dS_in_r = M_r^T dS_out_r + dS_loc_r, folded from the last rank down: the cotangent at this
    # shard's end is what the ranks after it send back.
    d_end_BHKV = exclusive_prefix(m_BHKK, d_local_BHKV, axis_name, prefix=prefix, reverse=True)
    if backend == "xla":
        dx, _ = finish_backward(local_vjp, t, do_BNHCV, d_end_BHKV)
    else:
        dx, _ = pallas.core_backward(kernel_residuals, do_BNHCV, d_end_BHKV, backend=backend, interpret=interpret,
                                     precision=precision)
    return dx, None


context_parallel_core.defvjp(_cp_fwd, _cp_bwd)


# ---------------------------------------------------------------------------------------------
# The core on one rank's shard on the Mosaic kernels' own layout (gdn.cp_terms_in_kernel): pass 1
# and the local state cotangent are kernels that form the chunk terms in VMEM (pallas_tpu_cp.py).


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def grouped_core(q, k, v, g_BGNHC, beta_BGNHC, axis_name, prefix, settings):
    """o of this rank's shard in pallas_tpu's layouts (kernel_layout; v's), the state entering it
    from the ranks before."""
    return _grouped_fwd(q, k, v, g_BGNHC, beta_BGNHC, axis_name, prefix, settings)[0]


def _grouped_fwd(q, k, v, g_BGNHC, beta_BGNHC, axis_name, prefix, settings):
    s_ext, m = pallas_tpu_cp.transition(k, v, g_BGNHC, beta_BGNHC, settings)  # pass 1
    m_BHKK = checkpoint_name(pallas_tpu.merge_value_heads(m, 1), TRANSITION_NAME)
    s_in_BHKV = checkpoint_name(exclusive_prefix(m_BHKK, pallas_tpu.merge_value_heads(s_ext, 1), axis_name,
                                                 prefix=prefix), STATE_IN_NAME)
    key_heads = g_BGNHC.shape[1]
    o, _, starts, inverses = pallas_tpu.forward(q, k, v, g_BGNHC, beta_BGNHC,
                                                pallas_tpu.split_value_heads(s_in_BHKV, 1, key_heads), settings,
                                                save=True)
    starts, inverses = (checkpoint_name(r, RESIDUALS_NAME) for r in (starts, inverses))
    return o, (q, k, v, g_BGNHC, beta_BGNHC, starts, inverses, m_BHKK)


def _grouped_bwd(axis_name, prefix, settings, residuals, do):
    *kernel_residuals, m_BHKK = residuals
    q, k, _, g_BGNHC, beta_BGNHC, _, inverses = kernel_residuals
    d_local = pallas_tpu_cp.local_state_cotangent(q, k, g_BGNHC, beta_BGNHC, inverses, do, settings)
    # As _cp_bwd: the cotangent at the shard's end is what the ranks after it send back.
    d_end_BHKV = exclusive_prefix(m_BHKK, pallas_tpu.merge_value_heads(d_local, 1), axis_name, prefix=prefix,
                                  reverse=True)
    grads = pallas_tpu.backward(tuple(kernel_residuals), do,
                                pallas_tpu.split_value_heads(d_end_BHKV, 1, g_BGNHC.shape[1]), settings)
    return pallas_tpu.input_cotangents(q, k, grads, settings)[:5]


grouped_core.defvjp(_grouped_fwd, _grouped_bwd)


def _grouped_context_parallel(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, *, axis_name, chunk_size,
                              normalize_qk, prefix, interpret, precision, token_major):
    batch, tokens, heads, value_dim = v_BTHV.shape
    zeros_BHKV = jnp.zeros((batch, heads, q_BTGK.shape[3], value_dim), jnp.float32)  # no initial state on a shard
    settings, inputs = pallas_tpu.prepared(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, zeros_BHKV,
                                           chunk_size=chunk_size, normalize_qk=normalize_qk, interpret=interpret,
                                           precision=precision, token_major=token_major)
    return pallas_tpu.output_BTHV(grouped_core(*inputs[:5], axis_name, prefix, settings), tokens, value_dim)


def gated_delta_rule_context_parallel(
    q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, *, segment_ids, axis_name, chunk_size: int = 64,
    normalize_qk: bool = True, cp_m_scan: bool = False, cp_dh_scan: bool = False, prefix: str = "all_gather",
    backend: str = "xla", interpret: bool = False, precision: str | None = None, terms_in_kernel: bool = False,
    token_major: bool = False,
):
    """gated_delta_rule on this rank's shard of the sequence (inside shard_map over `axis_name`).

    Same inputs as ops.gated_delta_rule, each the rank's [B, T / P, ...] slice; segment_ids is
    required (the shard's own ids). No initial or final state: the first rank starts from zero.
    precision: the Mosaic kernels' products (tpu_chunk.PRECISIONS; None: the inputs' dtype's default,
    as on one device). terms_in_kernel (pallas_tpu only; gdn.cp_terms_in_kernel): pass 1 and the
    local state cotangent as Mosaic kernels on the chunk kernels' layout (grouped_core), where
    cp_m_scan and cp_dh_scan have no part; token_major (with terms_in_kernel): the kernels' blocks
    read and write the token-major arrays (pallas_tpu.gated_delta_rule's). Returns o [B, T / P, H, V]
    in v's dtype.
    """
    num_tokens = v_BTHV.shape[1]
    if num_tokens % chunk_size:
        raise ValueError(f"gdn context parallelism: a shard of {num_tokens} tokens is not a whole number of "
                         f"chunks of {chunk_size}")
    if terms_in_kernel and backend != "pallas_tpu":
        raise ValueError(f"gdn context parallelism: terms_in_kernel runs on the pallas_tpu core; backend is {backend!r}")
    if token_major and not terms_in_kernel:
        raise ValueError("gdn context parallelism: token_major blocks are the grouped core's (terms_in_kernel)")
    starts_BT = cross_rank_starts(document_starts(segment_ids), segment_ids, axis_name)
    if terms_in_kernel:
        o_BTHV = _grouped_context_parallel(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, axis_name=axis_name,
                                           chunk_size=chunk_size, normalize_qk=normalize_qk, prefix=prefix,
                                           interpret=interpret, precision=precision, token_major=token_major)
        return o_BTHV.astype(v_BTHV.dtype)
    x, starts_BNC = prepare_chunks(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, starts_BT, chunk_size, normalize_qk)
    if precision is not None and backend != "pallas_tpu":
        raise ValueError(f"gdn context parallelism: precision {precision!r} is the pallas_tpu core's; backend "
                         f"{backend!r} takes none")
    o_BNHCV = context_parallel_core(x, starts_BNC, axis_name, cp_m_scan, cp_dh_scan, prefix, backend, interpret,
                                    precision or tpu_chunk.precision_name(v_BTHV.dtype))
    return from_chunks(o_BNHCV).astype(v_BTHV.dtype)
