"""Gated DeltaNet, the chunks of one key-head group: the math of the Mosaic TPU kernels (pallas_tpu.py).

docs/gdn.md section 2 as plain 2D jnp functions on arrays (what Mosaic lowers: 2D iotas, masked
lane / sublane reductions, 2D matmuls), for consecutive chunks of C tokens of one key head and the
value heads that read it (lists, unrolled). `forward_step` returns each chunk's and value head's
output, WY inverse T and start state, and the end states; `backward_step` takes the cotangents of
the outputs and of the end states and returns those of the inputs and of the start states (the
adjoint written by hand, line by line, as `xla.local_chunks_backward`). The key head's q k^T and
k k^T are formed once per chunk for its value heads. Each line runs over every (chunk, value
head) of the step before the next line: independent products back to back, which the MXU
pipelines (docs/gdn.md section 2, "The Pallas TPU kernels").

Document starts are not an input: the caller sets the log gate of a start token to START_LOG_GATE
(-1e30), whose exp is exactly 0: every decay across the start vanishes, so no state crosses it,
and the reference's "wipe the state before the token" is the recurrence with exp(g) = 0 there. All
exponents are masked before exp (never exp(b_i) exp(-b_j)), and every decay is a sum of g over
its own range taken directly (no difference of two running sums: docs/gdn.md section 2).

Precision. Every matmul runs on the MXU as bfloat16 passes with float32 accumulation, written out
explicitly (`mxu`): a float32 operand is split into `parts` bfloat16 pieces (hi, mid, lo), and the
products of pieces whose orders add up to less than `parts` are summed: 1 part is one pass (the
operand rounded to bfloat16), 2 parts three passes (about 2^-16 relative), 3 parts six passes
(float32, what Precision.HIGHEST does). A bfloat16 or 0/1 operand is exact and is never split
(two passes of three, or three of six). So the products keep bfloat16 data unscaled wherever
they can: q and k arrive as their rows (the input's bfloat16 values) and one float32 factor per
row (the normalisation and dk^-1/2), v and dO in their dtype, and a diagonal factor (the decays,
beta, the rows' factors) goes on the side of a product that is split anyway (scaled_product,
product_with_scaled_rows, scaled_rows_tn): the same products, a third fewer passes for every one
with q, k, v or dO in it. Writing the passes out keeps the FLOPs a kernel states (chunk_macs)
equal to what it runs, on the chip and interpreted. `Precision` chooses the parts per group of
products; `PRECISIONS` gives the float32 path (everything float32), the bfloat16 default (three
passes everywhere but the triangular
inverse's doubling: the XLA path's errors but the final state's), three passes everywhere, and a
faster bfloat16 path (see each one's comment for which products take how many passes and why).

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
# keys silu(N(0.5, 1)) so that they are alike, slow gates; relative RMS): every product at three
# passes gives the XLA path's errors (o 1.7e-3, which is the output's own bfloat16 rounding; final
# state 6e-6; gradients <= 2.3e-3). Every group at one pass misses the field's tolerance on the
# output (o 5.9e-3 > 5e-3), mostly through q S and A V_new (the state and V_new rounded to
# bfloat16); "bfloat16" below: o 3.1e-3, final state 2.3e-3, gradients <= 4.2e-3 (tolerances 5e-3,
# 8e-3, dg and dbeta 2e-2). Its cost (libtpu's static profile, v5e, the 397B cell's heads): the
# forward 0.63x of "bfloat16x3"'s cycles, the backward 0.78x (docs/gdn.md section 2).
PRECISIONS = {
    # float32 inputs: every product float32 (six passes); the CPU tests hold it to 1e-5.
    "float32": Precision(keys=3, outputs=3, inverse=3, state=3),
    # bfloat16 inputs: three passes (float32 to about 2^-16) for every product, so the errors are
    # the XLA path's. The gates' segment sums, the state and T are float32.
    "bfloat16x3": Precision(keys=2, outputs=2, inverse=2, state=2),
    # bfloat16 inputs within the field's tolerance, faster. One pass where the operands are the
    # chunk's own bfloat16 data or a matrix used once and rounded once (q k^T, k k^T, the WY
    # products, as flash-linear-attention does), and for the triangular inverse: T is rounded to
    # bfloat16 for the WY products anyway (three passes there moved o by 0.2e-3). Three passes for
    # the products with the state and V_new, which carry the sequence's history into the outputs,
    # and for the chain, whose products feed every later chunk (docs/gdn.md keeps cross-chunk
    # products float32; one pass there doubles the final state's error).
    "bfloat16": Precision(keys=1, outputs=2, inverse=1, state=2),
    # bfloat16 inputs, the default: three passes everywhere but T's doubling, at one pass. T is a
    # third of the forward's MXU work and its chain of 10 dependent products half of the forward's
    # cycles (libtpu's static profile, v5e, the 397B cell's heads: 0.69x "bfloat16x3"'s forward
    # cycles; a v5e chip at the cell: 25.55 ms forward + backward against 27.64 at 459723c,
    # benchmarks/records/tpu_kernels.json gdn_cell). The errors stay "bfloat16x3"'s but for the final
    # state's (CPU, as above: o 1.7e-3, gradients <= 2.4e-3, final state 3.0e-4 where three passes
    # give 5e-6): W and U still take T at three passes, and T's rounding is to its own entries, not
    # compounded along the sequence.
    "bfloat16x3_bf16_inverse": Precision(keys=2, outputs=2, inverse=1, state=2),
}


def precision_name(dtype) -> str:
    """The default precision of inputs of `dtype`: float32 for float32 (and wider), else
    bfloat16x3_bf16_inverse."""
    return "float32" if jnp.dtype(dtype).itemsize >= 4 else "bfloat16x3_bf16_inverse"


def _exact(x) -> bool:
    return x.dtype == BF16


def _bf16_parts(x, parts: int):
    if _exact(x):
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


def scaled_product(t, scale_C1, x, parts: int):
    """t diag(scale) x: the scale on t's columns where x is exact in bfloat16 (then x is never split:
    a pass fewer), else on x's rows."""
    if _exact(x):
        return mxu(t * row_of(scale_C1), x, _NN, parts)
    return mxu(t, scale_C1 * x, _NN, parts)


def product_with_scaled_rows(x, y, scale_C1, parts: int):
    """x (diag(scale) y)^T = (x y^T) diag(scale), the scale where y stays exact (scaled_product's rule)."""
    if _exact(y):
        return mxu(x, y, _NT, parts) * row_of(scale_C1)
    return mxu(x, scale_C1 * y, _NT, parts)


def scaled_rows_tn(x, scale_C1, y, parts: int):
    """(diag(scale) x)^T y = x^T (diag(scale) y): the scale on the side that is not exact in bfloat16."""
    if _exact(x) and not _exact(y):
        return mxu(x, scale_C1 * y, _TN, parts)
    return mxu(scale_C1 * x, y, _TN, parts)


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


def unit_lower_inverses(lowers_CD: list, parts: int) -> list:
    """(I + L)^-1 of each strictly lower-triangular L [C, C], by recursive doubling of blocks.

    With T_s the inverse of I + (L restricted to its diagonal blocks of size s), the blocks of size
    2s are [[A, 0], [X, D]] and their inverse is [[A^-1, 0], [-D^-1 X A^-1, D^-1]]:
        T_2s = T_s - T_s L_s T_s,    L_s = the X blocks of L (rows in the second half of a 2s block,
                                           columns in its first half).
    T_1 = I, so T_2 = I - L_1 needs no product; then two products per level, 2 (log2 C - 1) in all.
    Every intermediate is a block of the inverse itself (block forward substitution, stable like
    the row-by-row one), unlike the Neumann product (I - L)(I + L^2)(I + L^4)..., whose powers of L
    grow far beyond T's entries when keys are alike (then its rounding errors swamp T).
    The levels run over all the matrices at once: the products of one level are independent, and
    written back to back the MXU pipelines them instead of waiting out each one's latency (the
    doubling is a chain of 2 (log2 C - 1) dependent products per matrix).
    """
    size = lowers_CD[0].shape[-1]
    row, col = positions(size)
    eye = jnp.where(row == col, 1.0, 0.0)
    inverses = [eye - jnp.where((row >> 1) == (col >> 1), lower, 0.0) for lower in lowers_CD]
    span = 2
    while span < size:
        shift = span.bit_length() - 1  # log2(span)
        pair_block = ((row >> (shift + 1)) == (col >> (shift + 1))) & ((row >> shift) != (col >> shift))
        if span < _ROW_TILE:
            left = [mxu(t, jnp.where(pair_block, lower, 0.0), _NN, parts) for t, lower in zip(inverses, lowers_CD)]
            inverses = [t - mxu(x, t, _NN, parts) for t, x in zip(inverses, left)]
        else:  # only the second halves' rows of T_s L_s T_s are not zero: half the rows through the MXU
            lower_rows = [jnp.where(pair_block, lower, 0.0) for lower in lowers_CD]
            left = [mxu(second_halves(t, span), x, _NN, parts) for t, x in zip(inverses, lower_rows)]
            inverses = [t - into_second_halves(mxu(x, t, _NN, parts), span) for t, x in zip(inverses, left)]
        span *= 2
    return inverses


# Rows of a float32 tile: row blocks of this many rows are whole vregs (slices and joins move no data).
_ROW_TILE = 8


def second_halves(x, span: int):
    """The rows of x in the second half of each block of 2 span rows, in order: [C / 2, D]."""
    return jnp.concatenate([x[start + span:start + 2 * span] for start in range(0, x.shape[0], 2 * span)], axis=0)


def into_second_halves(x, span: int):
    """second_halves' inverse: x's rows back in the second halves, zero rows in the first: [2 R, D]."""
    zeros = jnp.zeros((span, x.shape[1]), x.dtype)
    return jnp.concatenate([part for start in range(0, x.shape[0], span) for part in (zeros, x[start:start + span])],
                           axis=0)


def unit_lower_inverse(lower_CD, parts: int):
    """(I + L)^-1 of one strictly lower-triangular L [C, C] (unit_lower_inverses)."""
    return unit_lower_inverses([lower_CD], parts)[0]


class ChunkIn(NamedTuple):
    """One chunk of a key head and the value heads that read it: q, k [C, K] as the input's rows
    (bfloat16 rows stay bfloat16: exact, never split) and the factor of each row, q_scale and k_scale
    as rows [1, C] float32: the normalised, scaled q is diag(q_scale) q, and k likewise
    (reference.query_key_scales); per value head (lists): v [C, V] in the input dtype, log gates g
    and beta as rows [1, C] float32."""

    q: jax.Array
    k: jax.Array
    v: list
    g: list
    beta: list
    q_scale: jax.Array
    k_scale: jax.Array


def _each(fn, *lists):
    return [fn(*items) for items in zip(*lists)]


class _Terms(NamedTuple):
    """The state-independent terms of every (chunk, value head) of a step, flat lists in chunk-major
    order (item i = chunk i // H, head i % H)."""

    decays: list
    beta: list  # [C, 1]
    q_scale: list  # [C, 1] (None without q)
    k_scale: list  # [C, 1]
    key_scale: list  # beta a k_scale [C, 1]: W = T diag(beta a) k (k normalised) = T diag(key_scale) k (rows)
    kk: list  # k k^T [C, D] of the normalised k (the item's chunk's)
    lower: list  # L [C, D]
    inverse: list  # T [C, D]
    w: list  # [C, K]
    u: list  # [C, V]: T diag(beta) v
    attn: list  # A = q k^T * Gamma [C, D]


def _terms(chunks: list[ChunkIn], precision: Precision, inverses=None, *, outputs: bool = True,
           values: bool = True) -> _Terms:
    """Every item's decays, L, T (the given ones, else the doubling over all of them at once), W, U
    and A, each line over all items before the next (independent products back to back). Without
    `outputs` no q k^T and no A (the chunks' q may be None); without `values` no U (v may be empty
    lists); with T given and no `values`, no k k^T nor L either (nothing left needs them)."""
    heads = len(chunks[0].g)
    row, col = positions(chunks[0].k.shape[0])
    per_item = lambda by_chunk: [x for x in by_chunk for _ in range(heads)]  # noqa: E731
    k = per_item([c.k for c in chunks])
    k_scale_by_chunk = [column(c.k_scale) for c in chunks]
    q_scale_by_chunk = None if chunks[0].q is None else [column(c.q_scale) for c in chunks]
    d = [decays(g) for c in chunks for g in c.g]
    beta = [column(b) for c in chunks for b in c.beta]
    kk = lower = qk = attn = u = None
    # The normalised q k^T and k k^T: the rows' product (one exact pass for bfloat16 rows), scaled
    # by the row factors on both sides; once per key head.
    if inverses is None or values:
        kk = per_item([mxu(c.k, c.k, _NT, precision.keys) * r * c.k_scale for c, r in zip(chunks, k_scale_by_chunk)])
        lower = _each(lambda b, x, dd: jnp.where(row > col, b * x * dd.gamma, 0.0), beta, kk, d)
    if outputs:
        qk = per_item([mxu(c.q, c.k, _NT, precision.keys) * r * c.k_scale for c, r in zip(chunks, q_scale_by_chunk)])
    if inverses is None:
        inverses = unit_lower_inverses(lower, precision.inverse)
    k_scale = per_item(k_scale_by_chunk)
    key_scale = _each(lambda b, dd, r: b * dd.from_start * r, beta, d, k_scale)
    w = _each(lambda t, s, x: scaled_product(t, s, x, precision.keys), inverses, key_scale, k)
    if values:
        u = _each(lambda t, b, x: scaled_product(t, b, x, precision.keys), inverses, beta,
                  [x for c in chunks for x in c.v])
    if outputs:
        attn = _each(lambda x, dd: x * dd.gamma, qk, d)
    q_scale = None if q_scale_by_chunk is None else per_item(q_scale_by_chunk)
    return _Terms(d, beta, q_scale, k_scale, key_scale, kk, lower, list(inverses), w, u, attn)


def _state_chain_step(t: _Terms, items, k_CK, states: list, precision: Precision, *, values: bool = True):
    """One chunk of the state chain: (V_new = U - W S per head, each head's state at the chunk's end
    c S + (diag(e) k)^T V_new). Without `values` the chain of the chunk's transition alone (U = 0):
    S -> c S - (diag(e) k)^T W S, applied to any [K, X] (a product of transitions)."""
    w_s = [mxu(t.w[i], s, _NN, precision.state) for i, s in zip(items, states)]
    v_new = [t.u[i] - x for i, x in zip(items, w_s)] if values else [-x for x in w_s]
    ends = [t.decays[i].chunk * s + scaled_rows_tn(k_CK, t.decays[i].to_end * t.k_scale[i], vn, precision.state)
            for i, s, vn in zip(items, states, v_new)]
    return v_new, ends


def forward_step(chunks: list[ChunkIn], states: list, precision: Precision):
    """Consecutive chunks of a key head and its value heads from the states at the first one's
    start (one [K, V] per value head): (o [C, V] float32 per chunk per head, T per chunk per head
    (the backward's residual), the states at each chunk's start per chunk per head, the end states).

    The state-independent work of every chunk and head first (_terms), then the chain in order;
    within a chunk the heads' products interleave."""
    p = precision
    heads = len(states)
    t = _terms(chunks, p)
    outs, inverses, starts = [], [], []
    for c, chunk in enumerate(chunks):
        items = range(c * heads, (c + 1) * heads)
        starts.append(list(states))
        v_new, ends = _state_chain_step(t, items, chunk.k, states, p)
        q_s = [mxu(chunk.q, s, _NN, p.outputs) for s in states]
        outs.append([(t.decays[i].from_start * t.q_scale[i]) * x + mxu(t.attn[i], vn, _NN, p.outputs)
                     for i, x, vn in zip(items, q_s, v_new)])
        states = ends
        inverses.append([t.inverse[i] for i in items])
    return outs, inverses, starts, states


class HeadGrad(NamedTuple):
    """One value head's cotangents in a chunk: dv [C, V] float32, dg and dbeta as rows [1, C]."""

    v: jax.Array
    g: jax.Array
    beta: jax.Array


def _state_cotangent_chain(t: _Terms, q: list, k: list, do: list, d_states: list, precision: Precision):
    """The reverse walk of the state cotangent over the step's chunks (last first), from the end
    states' cotangents (one per head): O = diag(a) q S + A V_new and S_end = c S + (diag(e) k)^T V_new
    give dV_new = A^T dO + diag(e) (k dS_end) and dS = c dS_end + (diag(a) q)^T dO - W^T dV_new.
    Returns (each item's end-state cotangent, each item's dV_new, the first chunk's start-state
    cotangents); items are chunk-major, as _terms'."""
    p = precision
    heads = len(d_states)
    d = t.decays
    attn_do = _each(lambda a, x: mxu(a, x, _TN, p.outputs), t.attn, do)
    q_do = _each(lambda dd, r, x, y: scaled_rows_tn(x, dd.from_start * r, y, p.outputs), d, t.q_scale, q, do)
    d_end = [None] * len(do)
    d_v_new = [None] * len(do)
    for c in reversed(range(len(do) // heads)):
        for h in range(heads):
            i = c * heads + h
            d_end[i] = d_states[h]
            d_v_new[i] = attn_do[i] + (d[i].to_end * t.k_scale[i]) * mxu(k[i], d_states[h], _NN, p.state)
        d_states = [d[c * heads + h].chunk * d_states[h] + q_do[c * heads + h]
                    - mxu(t.w[c * heads + h], d_v_new[c * heads + h], _TN, p.state) for h in range(heads)]
    return d_end, d_v_new, d_states


def backward_step(chunks: list[ChunkIn], starts: list, inverses: list, d_outs: list, d_states: list,
                  precision: Precision):
    """Cotangents of consecutive chunks (forward_step's), given each chunk's start states and T
    per head (the forward's residuals), the outputs' cotangents per chunk per head and the end
    states' cotangents (per head): (dq, dk [C, K] per chunk, summed over the heads; [HeadGrad] per
    chunk; the first chunk's start states' cotangents).

    Each line is the transpose of one line of the forward (docs/gdn.md section 2, "The backward").
    Three phases: everything the state cotangent's chain does not touch, over all items; the chain
    in reverse (its two products per chunk); then every input's cotangent, over all items."""
    p = precision
    heads = len(d_states)
    size = chunks[0].q.shape[0]
    row, col = positions(size)
    t = _terms(chunks, p, [x for per_chunk in inverses for x in per_chunk])
    q = [c.q for c in chunks for _ in range(heads)]
    k = [c.k for c in chunks for _ in range(heads)]
    state = [s for per_chunk in starts for s in per_chunk]
    do = [x for per_chunk in d_outs for x in per_chunk]  # in its dtype: a bfloat16 dO is never split
    d = t.decays
    v_new = _each(lambda u, w, s: u - mxu(w, s, _NN, p.state), t.u, t.w, state)
    # O = diag(a) q S + A V_new;  S_end = c S + (diag(e) k)^T V_new: the parts of dV_new and dS_start
    # without the end state's cotangent, then the chain.
    d_end, d_v_new, d_states = _state_cotangent_chain(t, q, k, do, d_states, p)
    d_attn = _each(lambda x, vn: jnp.where(row >= col, mxu(x, vn, _NT, p.outputs), 0.0), do, v_new)
    d_q_decayed = _each(lambda x, s: mxu(x, s, _NT, p.outputs), do, state)
    d_k_to_end = _each(lambda vn, de: mxu(vn, de, _NT, p.outputs), v_new, d_end)
    d_log_chunk = _each(lambda dd, s, de: dd.chunk * jnp.sum(jnp.sum(s * de, axis=1, keepdims=True), axis=0,
                                                            keepdims=True), d, state, d_end)
    # V_new = U - W S;  W = T diag(beta a) k;  U = T diag(beta) v.
    d_w = _each(lambda dv, s: -mxu(dv, s, _NT, p.state), d_v_new, state)
    d_k_scaled = _each(lambda tt, dw: mxu(tt, dw, _TN, p.keys), t.inverse, d_w)
    d_v_scaled = _each(lambda tt, dv: mxu(tt, dv, _TN, p.keys), t.inverse, d_v_new)
    v = [x for c in chunks for x in c.v]
    d_inverse = _each(lambda dw, x, ks, dv, y, b: (product_with_scaled_rows(dw, x, ks, p.keys)
                                                   + product_with_scaled_rows(dv, y, b, p.keys)),
                      d_w, k, t.key_scale, d_v_new, v, t.beta)
    t_dt = _each(lambda tt, dt: mxu(tt, dt, _TN, p.inverse), t.inverse, d_inverse)
    # T = (I + L)^-1: dL = strict_lower(-T^T dT T^T).
    d_lower = _each(lambda x, tt: jnp.where(row > col, -mxu(x, tt, _NT, p.inverse), 0.0), t_dt, t.inverse)
    # L = strict(diag(beta) kk^T * Gamma);  A = q k^T * Gamma.
    d_lower_gamma = _each(lambda dl, dd: dl * dd.gamma, d_lower, d)
    d_kk = _each(lambda b, x: b * x, t.beta, d_lower_gamma)
    d_qk = _each(lambda da, dd: da * dd.gamma, d_attn, d)
    # Cotangent of Gamma's log (the segment sums): dGamma * Gamma.
    d_segment = _each(lambda dl, lo, da, a: dl * lo + da * a, d_lower, t.lower, d_attn, t.attn)
    # The cotangents of the normalised q and k: their products with q and k take the rows and the
    # row factors (q k^T = diag(q_scale) q_rows k_rows^T diag(k_scale)).
    dq_items = _each(lambda dqk, x, r, dd, dqd: scaled_product(dqk, r, x, p.keys) + dd.from_start * dqd,
                     d_qk, k, t.k_scale, d, d_q_decayed)
    dk_items = _each(lambda dqk, x, rq, dkk, y, rk, b, dd, dks, dke: (
        scaled_rows_tn(dqk, rq, x, p.keys) + scaled_product(dkk, rk, y, p.keys) + scaled_rows_tn(dkk, rk, y, p.keys)
        + (b * dd.from_start) * dks + dd.to_end * dke),
        d_qk, q, t.q_scale, d_kk, k, t.k_scale, t.beta, d, d_k_scaled, d_k_to_end)
    # g_t is in the segment sum (j, i] for j < t <= i, in log a_i for i >= t, in log e_j for j < t
    # and in the chunk's sum: one exact matmul with the [j < t] mask, then masked sums over i
    # (sublanes) that leave dg as a row.
    prefix = _each(lambda ds: mxu(ds, _ones_where(row < col), _NN, 3), d_segment)
    grads = []
    for i in range(len(state)):
        c = i // heads
        v_f32 = v[i].astype(F32)
        k_dot_dks = t.k_scale[i] * jnp.sum(k[i] * d_k_scaled[i], axis=1, keepdims=True)
        d_beta = (jnp.sum(d_lower_gamma[i] * t.kk[i], axis=1, keepdims=True) + d[i].from_start * k_dot_dks
                  + jnp.sum(v_f32 * d_v_scaled[i], axis=1, keepdims=True))
        d_log_from_start = (t.beta[i] * k_dot_dks
                            + t.q_scale[i] * jnp.sum(q[i] * d_q_decayed[i], axis=1, keepdims=True)) * d[i].from_start
        d_log_to_end = t.k_scale[i] * jnp.sum(k[i] * d_k_to_end[i], axis=1, keepdims=True) * d[i].to_end
        dg = (jnp.sum(jnp.where(row >= col, prefix[i] + d_log_from_start, 0.0)
                      + jnp.where(row < col, d_log_to_end, 0.0), axis=0, keepdims=True) + d_log_chunk[i])
        grads.append(HeadGrad(t.beta[i] * d_v_scaled[i], dg, row_of(d_beta)))
    dq = [sum(dq_items[c * heads:(c + 1) * heads]) for c in range(len(chunks))]
    dk = [sum(dk_items[c * heads:(c + 1) * heads]) for c in range(len(chunks))]
    return dq, dk, [grads[c * heads:(c + 1) * heads] for c in range(len(chunks))], d_states


def transition_step(chunks: list[ChunkIn], states: list, products: list, precision: Precision):
    """Pass 1 of a context-parallel shard (docs/gdn.md section 3) over consecutive chunks of a key head
    and its value heads: each head's state carried from `states` (zero at the shard's start: its end
    is S_ext) and each head's product of the chunks' transitions M_c = c I - (diag(e) k)^T W carried
    from `products` (the identity at the start: its end is M_r, later chunks on the left), both
    [K, V] / [K, K] per head. No q and no output: the chunks' q may be None.

    The same terms and the same state chain as forward_step (the chain's products at `state`'s
    passes); the transition is that chain with U = 0, applied to the running product."""
    p = precision
    heads = len(states)
    t = _terms(chunks, p, outputs=False)
    for c, chunk in enumerate(chunks):
        items = range(c * heads, (c + 1) * heads)
        _, states = _state_chain_step(t, items, chunk.k, states, p)
        _, products = _state_chain_step(t, items, chunk.k, products, p, values=False)
    return states, products


def state_cotangent_step(chunks: list[ChunkIn], inverses: list, d_outs: list, d_states: list,
                         precision: Precision):
    """The local state cotangent of a context-parallel shard (docs/gdn.md section 3) over consecutive
    chunks, walked last first: the cotangents of the states at the first chunk's start (one [K, V]
    per head) from the outputs' cotangents (per chunk per head) and the end states' (`d_states`;
    zero after the shard's last chunk), with each chunk's T per head given (the forward's
    residual). backward_step's chain alone: no v, no input cotangents (the chunks' v may be empty)."""
    heads = len(d_states)
    t = _terms(chunks, precision, [x for per_chunk in inverses for x in per_chunk], values=False)
    q = [c.q for c in chunks for _ in range(heads)]
    k = [c.k for c in chunks for _ in range(heads)]
    do = [x for per_chunk in d_outs for x in per_chunk]
    return _state_cotangent_chain(t, q, k, do, d_states, precision)[2]


def _chunk_shapes(C: int, K: int, V: int, group: int, precision: str):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
    v = jax.ShapeDtypeStruct((C, V), F32 if precision == "float32" else BF16)
    rows = jax.ShapeDtypeStruct((C, K), F32 if precision == "float32" else BF16)
    return (ChunkIn(rows, rows, [v] * group, [f32(1, C)] * group, [f32(1, C)] * group, f32(1, C), f32(1, C)),
            [f32(K, V)] * group)


@functools.cache
def chunk_macs(kernel: str, C: int, K: int, V: int, group: int = 1, precision: str = "float32") -> int:
    """Multiply-adds of one chunk of one key-head group as `forward_step`, `backward_step`,
    `transition_step` or `state_cotangent_step` write them (kernel "forward", "backward", "transition"
    or "state_cotangent"), every bfloat16 pass counted: read from the traced
    functions' matmuls on one chunk (every product is per chunk), so the count cannot drift."""
    chunk, states = _chunk_shapes(C, K, V, group, precision)
    p = PRECISIONS[precision]
    if kernel == "forward":
        fn, args = (lambda ch, s: forward_step([ch], s, p)), (chunk, states)
    elif kernel == "backward":
        f32 = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
        fn = lambda ch, s, t, do, ds: backward_step([ch], [s], [t], [do], ds, p)  # noqa: E731
        args = (chunk, states, [f32(C, C)] * group, list(chunk.v), states)
    elif kernel == "transition":
        products = [jax.ShapeDtypeStruct((K, K), F32)] * group
        fn = lambda ch, s, m: transition_step([ch._replace(q=None, q_scale=None)], s, m, p)  # noqa: E731
        args = (chunk, states, products)
    elif kernel == "state_cotangent":
        f32 = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
        fn = lambda ch, t, do, ds: state_cotangent_step([ch._replace(v=[])], [t], [do], ds, p)  # noqa: E731
        args = (chunk, [f32(C, C)] * group, list(chunk.v), states)
    else:
        raise ValueError(f"unknown GDN kernel {kernel!r}; choose forward, backward, transition or state_cotangent")
    macs = 0
    for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            macs += math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lhs_contract)
    return macs
