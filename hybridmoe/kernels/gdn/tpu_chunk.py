"""Gated DeltaNet, one chunk of one key-head group: the math of the Mosaic TPU kernels (pallas_tpu.py).

docs/gdn.md section 2 as plain 2D jnp functions on arrays (what Mosaic lowers: 2D iotas, masked
lane / sublane reductions, 2D matmuls), one chunk of C tokens of one key head and the value heads
that read it (a list, one entry per value head, unrolled). `forward_chunk` returns each value
head's output, end state and WY inverse; `backward_chunk` takes the cotangents of the outputs and
of the end state and returns those of the inputs and of the start state (the adjoint written by
hand, line by line, as `xla.local_chunks_backward`). The key head's q k^T and k k^T are formed
once for its value heads.

Document starts are not an input: the caller sets the log gate of a start token to START_LOG_GATE
(-1e30), whose exp is exactly 0: every decay across the start vanishes, so no state crosses it,
and the reference's "wipe the state before the token" is the recurrence with exp(g) = 0 there. All
exponents are masked before exp (never exp(b_i) exp(-b_j)), and every decay is a sum of g over
its own range taken directly (no difference of two running sums: docs/gdn.md section 2).

Precision. Every matmul runs on the MXU as bfloat16 passes with float32 accumulation, written out
explicitly (`mxu`): a float32 operand is split into `parts` bfloat16 pieces (hi, mid, lo), and the
products of pieces whose orders add up to less than `parts` are summed: 1 part is one pass (the
operand rounded to bfloat16), 2 parts three passes (about 2^-16 relative), 3 parts six passes
(float32, what Precision.HIGHEST does). A bfloat16 or 0/1 operand is exact and is never split.
Writing the passes out keeps the FLOPs a kernel states (chunk_macs) equal to what it runs, on the
chip and interpreted. `Precision` chooses the parts per group of products; `PRECISIONS` gives the
float32 path (everything float32) and the bfloat16 path (see its comment for which products stay
float32 and why).

Dimension letters: C position in a chunk (D the second position axis), K key dim, V value dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

F32, BF16 = jnp.float32, jnp.bfloat16
# The log gate that marks a document start: exp(START_LOG_GATE) == 0 in float32, and 64 of them
# summed stay finite (no inf, so no 0 * inf in a matmul).
START_LOG_GATE = -1e30

_NN = ((1,), (0,))  # a @ b
_NT = ((1,), (1,))  # a @ b^T
_TN = ((0,), (0,))  # a^T @ b


@dataclasses.dataclass(frozen=True)
class Precision:
    """bfloat16 parts per float32 operand (1: one pass, 2: three passes, 3: six passes = float32)
    for each group of products (and, in the backward, their adjoints)."""

    keys: int  # the chunk's inputs with each other and with T: q k^T, k k^T, W = T (beta a k), U = T (beta v)
    outputs: int  # with the carried state or V_new: q S, A V_new
    inverse: int  # the triangular inverse's doubling products and its adjoint -T^T dT T^T
    state: int  # the chain from one chunk's state to the next: W S, k^T V_new; in the backward K dS, W^T dV_new


# Measured on CPU against the float32 oracle (bfloat16 inputs, 1,024 tokens, dims 128, chunk 64,
# keys silu(N(0.5, 1)) so that they are alike, slow gates; relative RMS): every group at one pass
# misses the field's tolerance on the output (o 5.9e-3 > 5e-3), mostly through q S and A V_new
# (the state and V_new rounded to bfloat16); "bfloat16" below: o 3.1e-3, final state 2.3e-3,
# gradients <= 4.2e-3 (tolerances 5e-3, 8e-3, dg and dbeta 2e-2). Three passes everywhere gives
# the XLA path's errors (o 1.7e-3, which is the output's own bfloat16 rounding; final state 6e-6).
PRECISIONS = {
    # float32 inputs: every product float32 (six passes); the CPU tests hold it to 1e-5.
    "float32": Precision(keys=3, outputs=3, inverse=3, state=3),
    # bfloat16 inputs, the default. One pass where the operands are the chunk's own bfloat16 data
    # or a matrix used once and rounded once (q k^T, k k^T, the WY products, as
    # flash-linear-attention does), and for the triangular inverse: T is rounded to bfloat16 for
    # the WY products anyway (three passes there moved o by 0.2e-3). Three passes (float32 to
    # about 2^-16) for the products with the state and V_new, which carry the sequence's history
    # into the outputs, and for the chain, whose products feed every later chunk (docs/gdn.md
    # keeps cross-chunk products float32; one pass there doubles the final state's error). The
    # gates' segment sums and the state itself are float32 (exact sums) in every precision.
    "bfloat16": Precision(keys=1, outputs=2, inverse=1, state=2),
    # bfloat16 inputs with the XLA path's errors: three passes for every product.
    "bfloat16x3": Precision(keys=2, outputs=2, inverse=2, state=2),
}


def precision_name(dtype) -> str:
    """The default precision of inputs of `dtype`: float32 for float32 (and wider), else bfloat16."""
    return "float32" if jnp.dtype(dtype).itemsize >= 4 else "bfloat16"


def _bf16_parts(x, parts: int):
    if x.dtype == BF16:
        return [x]
    out, rest = [], x.astype(F32)
    for i in range(parts):
        piece = rest.astype(BF16)
        out.append(piece)
        if i + 1 < parts:
            rest = rest - piece.astype(F32)
    return out


def mxu(a, b, contract, parts: int):
    """dot_general(a, b) contracting `contract`, as bfloat16 MXU passes with float32 accumulation.

    The products of piece i of a and piece j of b with i + j < parts, smallest first."""
    pieces_a, pieces_b = _bf16_parts(a, parts), _bf16_parts(b, parts)
    pairs = sorted(((i, j) for i in range(len(pieces_a)) for j in range(len(pieces_b)) if i + j < parts),
                   key=lambda ij: -(ij[0] + ij[1]))
    out = None
    for i, j in pairs:
        product = lax.dot_general(pieces_a[i], pieces_b[j], (contract, ((), ())), preferred_element_type=F32)
        out = product if out is None else out + product
    return out


def positions(size: int):
    """Row and column index of a [size, size] tile (2D iotas: what Mosaic lowers)."""
    return lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)


def column(x_1C):
    """[1, C] -> [C, 1] (the diagonal picked by a masked lane reduction: no transpose in the kernel)."""
    row, col = positions(x_1C.shape[-1])
    return jnp.sum(jnp.where(row == col, x_1C, 0.0), axis=1, keepdims=True)


def row_of(x_C1):
    """[C, 1] -> [1, C]."""
    row, col = positions(x_C1.shape[0])
    return jnp.sum(jnp.where(row == col, x_C1, 0.0), axis=0, keepdims=True)


def _ones_where(mask):
    return jnp.where(mask, 1.0, 0.0).astype(BF16)  # exact in bfloat16: never split


class Decays(NamedTuple):
    """The chunk's decays (docs/gdn.md section 2), masked before exp: gamma [C, D] (j <= i),
    from_start [C, 1] (a), to_end [C, 1] (e), chunk [1, 1] (c)."""

    gamma: jax.Array
    from_start: jax.Array
    to_end: jax.Array
    chunk: jax.Array


def decays(g_1C) -> Decays:
    """From the log gates as a row [1, C] (document starts at START_LOG_GATE).

    Gamma's exponent, the sum of g over (j, i], is one exact matmul of the causal 0/1 matrix with
    the gates below the diagonal (three passes of the gates' bfloat16 pieces: every product exact);
    the other decays are masked lane sums. All sums are of terms <= 0: no cancellation."""
    size = g_1C.shape[-1]
    row, col = positions(size)
    causal = row >= col
    g_C1 = column(g_1C)
    segment_CD = mxu(_ones_where(causal), jnp.where(row > col, g_C1, 0.0), _NN, 3)
    gamma_CD = jnp.exp(jnp.where(causal, segment_CD, -jnp.inf))
    from_start_C1 = jnp.exp(jnp.sum(jnp.where(causal, g_1C, 0.0), axis=1, keepdims=True))
    to_end_C1 = jnp.exp(jnp.sum(jnp.where(col > row, g_1C, 0.0), axis=1, keepdims=True))
    chunk_11 = jnp.exp(jnp.sum(g_1C, axis=1, keepdims=True))
    return Decays(gamma_CD, from_start_C1, to_end_C1, chunk_11)


def unit_lower_inverse(lower_CD, parts: int):
    """(I + L)^-1 of a strictly lower-triangular L [C, C], by recursive doubling of blocks.

    With T_s the inverse of I + (L restricted to its diagonal blocks of size s), the blocks of size
    2s are [[A, 0], [X, D]] and their inverse is [[A^-1, 0], [-D^-1 X A^-1, D^-1]]:
        T_2s = T_s - T_s L_s T_s,    L_s = the X blocks of L (rows in the second half of a 2s block,
                                           columns in its first half).
    T_1 = I, so T_2 = I - L_1 needs no product; then two products per level, 2 (log2 C - 1) in all.
    Every intermediate is a block of the inverse itself (block forward substitution, stable like
    the row-by-row one), unlike the Neumann product (I - L)(I + L^2)(I + L^4)..., whose powers of L
    grow far beyond T's entries when keys are alike (then its rounding errors swamp T).
    """
    size = lower_CD.shape[-1]
    row, col = positions(size)
    eye = jnp.where(row == col, 1.0, 0.0)
    inverse_CD = eye - jnp.where((row >> 1) == (col >> 1), lower_CD, 0.0)
    span = 2
    while span < size:
        shift = span.bit_length() - 1  # log2(span)
        pair_block = ((row >> (shift + 1)) == (col >> (shift + 1))) & ((row >> shift) != (col >> shift))
        lower_s_CD = jnp.where(pair_block, lower_CD, 0.0)
        inverse_CD = inverse_CD - mxu(mxu(inverse_CD, lower_s_CD, _NN, parts), inverse_CD, _NN, parts)
        span *= 2
    return inverse_CD


def inverse_adjoint(inverse_CD, d_inverse_CD, parts: int):
    """dL = strict_lower(-T^T dT T^T): the adjoint of T = (I + L)^-1 on L's strictly lower part."""
    row, col = positions(inverse_CD.shape[-1])
    t_dt_CD = mxu(inverse_CD, d_inverse_CD, _TN, parts)
    return jnp.where(row > col, -mxu(t_dt_CD, inverse_CD, _NT, parts), 0.0)


class HeadIn(NamedTuple):
    """One value head's part of a chunk: v [C, V] (input dtype), log gates g and beta as rows [1, C]
    float32, the state at the chunk's start [K, V] float32."""

    v: jax.Array
    g: jax.Array
    beta: jax.Array
    state: jax.Array


class HeadOut(NamedTuple):
    """o [C, V] float32, the state at the chunk's end [K, V], the WY inverse T [C, D] (saved for the backward)."""

    o: jax.Array
    end: jax.Array
    inverse: jax.Array


class _Terms(NamedTuple):
    decays: Decays
    beta_C1: jax.Array
    lower: jax.Array  # L [C, D]
    inverse: jax.Array  # T [C, D]
    k_scaled: jax.Array  # diag(beta a) k [C, K]
    v_scaled: jax.Array  # diag(beta) v [C, V]
    w: jax.Array  # [C, K]
    v_new: jax.Array  # [C, V]
    attn: jax.Array  # A = q k^T * Gamma [C, D]


def _terms(q_CK, k_CK, kk_CD, qk_CD, head: HeadIn, precision: Precision, inverse_CD=None) -> _Terms:
    row, col = positions(q_CK.shape[0])
    d = decays(head.g)
    beta_C1 = column(head.beta)
    lower_CD = jnp.where(row > col, beta_C1 * kk_CD * d.gamma, 0.0)
    if inverse_CD is None:
        inverse_CD = unit_lower_inverse(lower_CD, precision.inverse)
    k_scaled_CK = (beta_C1 * d.from_start) * k_CK
    v_scaled_CV = beta_C1 * head.v.astype(F32)
    w_CK = mxu(inverse_CD, k_scaled_CK, _NN, precision.keys)
    u_CV = mxu(inverse_CD, v_scaled_CV, _NN, precision.keys)
    v_new_CV = u_CV - mxu(w_CK, head.state, _NN, precision.state)
    return _Terms(d, beta_C1, lower_CD, inverse_CD, k_scaled_CK, v_scaled_CV, w_CK, v_new_CV, qk_CD * d.gamma)


def _key_products(q_CK, k_CK, precision: Precision):
    """k k^T and q k^T of the key head, once for its value heads."""
    return mxu(k_CK, k_CK, _NT, precision.keys), mxu(q_CK, k_CK, _NT, precision.keys)


def forward_chunk(q_CK, k_CK, heads: list[HeadIn], precision: Precision) -> list[HeadOut]:
    """One chunk of a key head (q, k [C, K] float32: normalised, scaled) and its value heads."""
    kk_CD, qk_CD = _key_products(q_CK, k_CK, precision)
    out = []
    for head in heads:
        t = _terms(q_CK, k_CK, kk_CD, qk_CD, head, precision)
        o_CV = (t.decays.from_start * mxu(q_CK, head.state, _NN, precision.outputs)
                + mxu(t.attn, t.v_new, _NN, precision.outputs))
        end_KV = t.decays.chunk * head.state + mxu(t.decays.to_end * k_CK, t.v_new, _TN, precision.state)
        out.append(HeadOut(o_CV, end_KV, t.inverse))
    return out


class HeadGrad(NamedTuple):
    """One value head's cotangents: dv [C, V], dg and dbeta as rows [1, C], the start state's [K, V]."""

    v: jax.Array
    g: jax.Array
    beta: jax.Array
    state: jax.Array


def backward_chunk(q_CK, k_CK, heads: list[HeadIn], inverses: list, d_outs: list, d_ends: list,
                   precision: Precision):
    """Cotangents of one chunk: (dq [C, K], dk [C, K] summed over the value heads, [HeadGrad]).

    heads carry the state at the chunk's start (the forward saved it) and inverses the forward's T;
    d_outs [C, V] and d_ends [K, V] are the cotangents of the outputs and of the end state.
    Each line is the transpose of one line of the forward (docs/gdn.md section 2, "The backward")."""
    size = q_CK.shape[0]
    row, col = positions(size)
    p = precision
    kk_CD, qk_CD = _key_products(q_CK, k_CK, p)
    dq_CK = jnp.zeros_like(q_CK)
    dk_CK = jnp.zeros_like(k_CK)
    grads = []
    for head, inverse_CD, do, d_end_KV in zip(heads, inverses, d_outs, d_ends):
        t = _terms(q_CK, k_CK, kk_CD, qk_CD, head, p, inverse_CD)
        d = t.decays
        state_KV = head.state
        do_CV = do.astype(F32)
        k_to_end_CK = d.to_end * k_CK
        # O = diag(a) q S + A V_new;  S_end = c S + (diag(e) k)^T V_new.
        d_v_new_CV = mxu(t.attn, do_CV, _TN, p.outputs) + mxu(k_to_end_CK, d_end_KV, _NN, p.state)
        d_start_KV = (d.chunk * d_end_KV + mxu(d.from_start * q_CK, do_CV, _TN, p.outputs)
                      - mxu(t.w, d_v_new_CV, _TN, p.state))
        d_attn_CD = jnp.where(row >= col, mxu(do_CV, t.v_new, _NT, p.outputs), 0.0)
        d_q_decayed_CK = mxu(do_CV, state_KV, _NT, p.outputs)
        d_k_to_end_CK = mxu(t.v_new, d_end_KV, _NT, p.outputs)
        d_log_chunk_11 = d.chunk * jnp.sum(jnp.sum(state_KV * d_end_KV, axis=1, keepdims=True), axis=0,
                                           keepdims=True)
        # V_new = U - W S;  W = T diag(beta a) k;  U = T diag(beta) v.
        d_w_CK = -mxu(d_v_new_CV, state_KV, _NT, p.state)
        d_k_scaled_CK = mxu(inverse_CD, d_w_CK, _TN, p.keys)
        d_v_scaled_CV = mxu(inverse_CD, d_v_new_CV, _TN, p.keys)
        d_inverse_CD = mxu(d_w_CK, t.k_scaled, _NT, p.keys) + mxu(d_v_new_CV, t.v_scaled, _NT, p.keys)
        d_lower_CD = inverse_adjoint(inverse_CD, d_inverse_CD, p.inverse)
        # L = strict(diag(beta) kk^T * Gamma);  A = q k^T * Gamma.
        d_lower_gamma_CD = d_lower_CD * d.gamma
        d_kk_CD = t.beta_C1 * d_lower_gamma_CD
        d_qk_CD = d_attn_CD * d.gamma
        # Cotangent of Gamma's log (the segment sums): dGamma * Gamma.
        d_segment_CD = d_lower_CD * t.lower + d_attn_CD * t.attn
        dq_CK = (dq_CK + mxu(d_qk_CD, k_CK, _NN, p.keys) + d.from_start * d_q_decayed_CK)
        dk_CK = (dk_CK + mxu(d_qk_CD, q_CK, _TN, p.keys) + mxu(d_kk_CD, k_CK, _NN, p.keys)
                 + mxu(d_kk_CD, k_CK, _TN, p.keys) + (t.beta_C1 * d.from_start) * d_k_scaled_CK
                 + d.to_end * d_k_to_end_CK)
        v_f32 = head.v.astype(F32)
        dv_CV = t.beta_C1 * d_v_scaled_CV
        k_dot_dks_C1 = jnp.sum(k_CK * d_k_scaled_CK, axis=1, keepdims=True)
        d_beta_C1 = (jnp.sum(d_lower_gamma_CD * kk_CD, axis=1, keepdims=True) + d.from_start * k_dot_dks_C1
                     + jnp.sum(v_f32 * d_v_scaled_CV, axis=1, keepdims=True))
        d_log_from_start_C1 = (t.beta_C1 * k_dot_dks_C1 + jnp.sum(q_CK * d_q_decayed_CK, axis=1, keepdims=True)
                               ) * d.from_start
        d_log_to_end_C1 = jnp.sum(k_CK * d_k_to_end_CK, axis=1, keepdims=True) * d.to_end
        # g_t is in the segment sum (j, i] for j < t <= i, in log a_i for i >= t, in log e_j for
        # j < t and in the chunk's sum: one exact matmul with the [j < t] mask, then masked sums
        # over i (sublanes) that leave dg as a row.
        prefix_CT = mxu(d_segment_CD, _ones_where(row < col), _NN, 3)
        dg_1C = (jnp.sum(jnp.where(row >= col, prefix_CT + d_log_from_start_C1, 0.0)
                         + jnp.where(row < col, d_log_to_end_C1, 0.0), axis=0, keepdims=True)
                 + d_log_chunk_11)
        grads.append(HeadGrad(dv_CV, dg_1C, row_of(d_beta_C1), d_start_KV))
    return dq_CK, dk_CK, grads


def _chunk_shapes(C: int, K: int, V: int, group: int, precision: str):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
    v = jax.ShapeDtypeStruct((C, V), F32 if precision == "float32" else BF16)
    heads = [HeadIn(v, f32(1, C), f32(1, C), f32(K, V)) for _ in range(group)]
    return f32(C, K), f32(C, K), heads


@functools.cache
def chunk_macs(kernel: str, C: int, K: int, V: int, group: int = 1, precision: str = "float32") -> int:
    """Multiply-adds of one chunk of one key-head group as `forward_chunk` / `backward_chunk` write
    them (kernel "forward" or "backward"), every bfloat16 pass counted: read from the traced
    function's matmuls, so the count cannot drift from the math."""
    q, k, heads = _chunk_shapes(C, K, V, group, precision)
    p = PRECISIONS[precision]
    if kernel == "forward":
        fn = lambda q, k, heads: forward_chunk(q, k, heads, p)  # noqa: E731
        args = (q, k, heads)
    elif kernel == "backward":
        f32 = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
        fn = lambda q, k, heads, t, do, ds: backward_chunk(q, k, heads, t, do, ds, p)  # noqa: E731
        args = (q, k, heads, [f32(C, C)] * group, [heads[0].v] * group, [f32(K, V)] * group)
    else:
        raise ValueError(f"unknown GDN kernel {kernel!r}; choose forward or backward")
    macs = 0
    for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            macs += math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lhs_contract)
    return macs
