"""Flash attention, the math of one (query block, key block) pair: shared by every backend.

The XLA backend (xla.py), the Mosaic TPU driver (pallas_tpu.py) and the Triton GPU driver
(pallas_gpu.py) all run these functions; each driver only decides how blocks are walked and how
refs are read. Every function here is a plain jnp function of 2D operands [rows, cols] (the
Pallas kernels) or the same with leading batch dims (the XLA backend: [G, rows, cols]); a
per-row quantity is a column [rows, 1], a per-key one a row [1, cols]. Each piece a kernel can get
wrong is its own function (the tests patch broken variants in here):
  visible               the element mask: key visible to query iff kv_pos <= q_pos, same segment;
  block_may_be_visible  the skip predicate on per-block (min, max) ranges of positions and segments;
  block_fully_visible   the no-mask predicate (every key visible to every query of the pair);
  scores                q k^T * scale, float32;
  rescale_factor        the online softmax's correction exp(m_old - m_new) of what was summed so far;
  query_heads_of        which query heads read kv head g (g * R + r: GQA's grouping).

Shape letters: B batch, T query tokens, S key tokens, N query heads, G kv heads, R = N / G query
heads per kv head, A head dim; I query blocks, J key blocks. Inside a kernel, "rows" are the
query rows of a block (the R heads of one kv head times block_q tokens, folded: row r * block_q +
t), "cols" the keys of a key block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32
NEG_INF = float("-inf")

# Block classes of a (query block, key block) pair.
SKIP, PARTIAL, FULL = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Masks and block classes


def visible(q_pos, q_seg, kv_pos, kv_seg):
    """Element mask: a key is visible to a query iff it is at or before it (by position value) in
    the same segment. Broadcasts: (column, row) gives [rows, cols], (row, column) the transpose."""
    return (kv_pos <= q_pos) & (kv_seg == q_seg)


class Ranges(NamedTuple):
    """Per block: the least and greatest position and segment id of its tokens ([B, blocks] each)."""
    pos_lo: jnp.ndarray
    pos_hi: jnp.ndarray
    seg_lo: jnp.ndarray
    seg_hi: jnp.ndarray


def block_ranges(pos_BT, seg_BT, block: int) -> Ranges:
    B, T = pos_BT.shape
    pos, seg = pos_BT.reshape(B, T // block, block), seg_BT.reshape(B, T // block, block)
    return Ranges(pos.min(-1), pos.max(-1), seg.min(-1), seg.max(-1))


def block_may_be_visible(q: Ranges, kv: Ranges):
    """False only when no key of the key block can be visible to any query of the query block:
    every key after the latest query, or the two blocks' segment ranges disjoint."""
    return (kv.pos_lo <= q.pos_hi) & (kv.seg_lo <= q.seg_hi) & (q.seg_lo <= kv.seg_hi)


def block_fully_visible(q: Ranges, kv: Ranges):
    """True only when every key is visible to every query: both blocks in one and the same segment
    and every key at or before the earliest query."""
    return ((kv.pos_hi <= q.pos_lo) & (q.seg_lo == q.seg_hi) & (kv.seg_lo == kv.seg_hi)
            & (q.seg_lo == kv.seg_lo))


def block_classes(q: Ranges, kv: Ranges):
    """[B, I, J] int32: SKIP, PARTIAL (masked) or FULL (no mask) per (query block, key block)."""
    qx = Ranges(*(a[:, :, None] for a in q))
    kx = Ranges(*(a[:, None, :] for a in kv))
    return jnp.where(block_may_be_visible(qx, kx), jnp.where(block_fully_visible(qx, kx), FULL, PARTIAL),
                     SKIP).astype(jnp.int32)


class Schedule(NamedTuple):
    """For each (batch, outer block): the inner blocks to visit, visible ones first in ascending
    order, then the last visible one repeated (a Pallas TPU pipeline does not fetch a block again
    when its index repeats; block 0 when none is visible); how many are visible; their classes."""
    order: jnp.ndarray  # [B, O, I] int32
    count: jnp.ndarray  # [B, O] int32
    cls: jnp.ndarray  # [B, O, I] int32 (class of order[..., i])


def schedule(classes_BOI) -> Schedule:
    n = classes_BOI.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    shown = classes_BOI != SKIP
    count = jnp.sum(shown, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(shown, idx, n + idx), axis=-1).astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    order = jnp.where(idx < count[..., None], order, jnp.where(count[..., None] > 0, last, 0))
    return Schedule(order, count, jnp.take_along_axis(classes_BOI, order, axis=-1))


def flat_schedule(s: Schedule):
    """(order, count, cls) flattened to 1-D int32: how the Pallas drivers take a schedule (TPU:
    scalar prefetch; GPU: plain inputs indexed in the kernel)."""
    return s.order.reshape(-1), s.count.reshape(-1), s.cls.reshape(-1)


def schedules(q_pos_BT, q_seg_BT, kv_pos_BS, kv_seg_BS, block_q: int, block_k: int):
    """(by query block: the key blocks to visit, by key block: the query blocks to visit)."""
    cls_BIJ = block_classes(block_ranges(q_pos_BT, q_seg_BT, block_q), block_ranges(kv_pos_BS, kv_seg_BS, block_k))
    return schedule(cls_BIJ), schedule(jnp.swapaxes(cls_BIJ, 1, 2))


# ---------------------------------------------------------------------------------------------
# Layouts: grouped query heads, ids and per-row statistics in blocks


def query_heads_of(num_kv_heads: int, group: int) -> np.ndarray:
    """[G, R]: the query heads that read kv head g (GQA: g * R + r)."""
    return np.arange(num_kv_heads * group).reshape(num_kv_heads, group)


def group_heads(x_BTN_, num_kv_heads: int):
    """[B, T, N, ...] -> [B, G, R, T, ...]: query heads under the kv head they read."""
    B, T, N = x_BTN_.shape[:3]
    heads = query_heads_of(num_kv_heads, N // num_kv_heads)
    order = heads.reshape(-1)
    if not np.array_equal(order, np.arange(N)):
        x_BTN_ = x_BTN_[:, :, order]
    x = x_BTN_.reshape(B, T, num_kv_heads, N // num_kv_heads, *x_BTN_.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def ungroup_heads(x_BGRT_):
    """The inverse of group_heads."""
    B, G, R, T = x_BGRT_.shape[:4]
    x = jnp.moveaxis(x_BGRT_, 3, 1).reshape(B, T, G * R, *x_BGRT_.shape[4:])
    order = query_heads_of(G, R).reshape(-1)
    if not np.array_equal(order, np.arange(G * R)):
        x = x[:, :, np.argsort(order)]
    return x


def id_blocks(pos_BT, seg_BT, block: int, repeat: int = 1):
    """[B, blocks, 2, repeat * block] int32: positions (row 0) and segment ids (row 1) of each
    block's tokens, the block repeated `repeat` times (one copy per query head of a group: the
    rows of a folded block)."""
    B, T = pos_BT.shape
    ids = jnp.stack([pos_BT, seg_BT], axis=1).astype(jnp.int32).reshape(B, 2, T // block, block)
    ids = jnp.moveaxis(ids, 2, 1)  # [B, blocks, 2, block]
    return jnp.tile(ids, (1, 1, 1, repeat)) if repeat > 1 else ids


def rows_to_blocks(x_BGRT, block: int):
    """[B, G, R, T] -> [B, G, I, R * block]: per query block, its folded rows."""
    B, G, R, T = x_BGRT.shape
    x = x_BGRT.reshape(B, G, R, T // block, block)
    return jnp.moveaxis(x, 3, 2).reshape(B, G, T // block, R * block)


def blocks_to_rows(x_BGIW, group: int):
    """The inverse of rows_to_blocks: [B, G, I, R * block] -> [B, G, R, T]."""
    B, G, nq, W = x_BGIW.shape
    x = x_BGIW.reshape(B, G, nq, group, W // group)
    return jnp.moveaxis(x, 3, 2).reshape(B, G, group, nq * (W // group))


def vary_like(tree, *refs):
    """`tree`'s arrays typed as varying over every manual mesh axis the refs vary over (inside
    shard_map a loop's initial carry, made of constants, must carry its body's type; outside
    shard_map a no-op)."""
    import jax

    want = frozenset().union(*(jax.typeof(r).manual_axis_type.varying for r in refs))

    def cast(a):
        missing = want - jax.typeof(a).manual_axis_type.varying
        return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a

    return jax.tree.map(cast, tree)


# ---------------------------------------------------------------------------------------------
# Block math


def _dot(a, b, contract_a: int, contract_b: int):
    batch = tuple(range(a.ndim - 2))
    precision = lax.Precision.HIGHEST if a.dtype == F32 and b.dtype == F32 else None
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), (batch, batch)), precision=precision,
                           preferred_element_type=F32)


def dot_nt(a, b):
    """[.., m, k] x [.., n, k] -> [.., m, n] float32."""
    return _dot(a, b, a.ndim - 1, b.ndim - 1)


def dot_nn(a, b):
    """[.., m, k] x [.., k, n] -> [.., m, n] float32."""
    return _dot(a, b, a.ndim - 1, b.ndim - 2)


def scores(q, k, scale: float):
    """q k^T * scale in float32: [rows, cols] (or keys x queries when called as scores(k, q))."""
    return dot_nt(q, k) * scale


def rescale_factor(m_old, m_new):
    """What the sums over earlier key blocks are multiplied by when the running max moves."""
    return jnp.exp(m_old - m_new)


def forward_init(rows: int, head_dim: int, lead=()):
    """(running max, running sum of exp, unnormalised output) before the first key block."""
    return (jnp.full((*lead, rows, 1), NEG_INF, F32), jnp.zeros((*lead, rows, 1), F32),
            jnp.zeros((*lead, rows, head_dim), F32))


def forward_block(q, k, v, mask, carry, scale: float):
    """One key block into the online softmax. mask: [rows, cols] bool, or None (fully visible)."""
    m_old, l_old, acc_old = carry
    s = scores(q, k, scale)
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m_old, jnp.max(s, axis=-1, keepdims=True))
    m_shift = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row with nothing visible yet: exp(-inf) = 0
    alpha = rescale_factor(m_old, m_shift)
    p = jnp.exp(s - m_shift)
    l_new = alpha * l_old + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = alpha * acc_old + dot_nn(p.astype(v.dtype), v)
    return m_new, l_new, acc_new


def forward_finish(carry):
    """(o [rows, A] float32, lse [rows, 1]): zeros and -inf for a row with no visible key."""
    m, total, acc = carry
    seen = total > 0.0
    total = jnp.where(seen, total, 1.0)
    return acc / total, jnp.where(seen, m + jnp.log(total), NEG_INF)


def probabilities(s, lse, mask):
    """exp(s - lse) given the global log-sum-exp; zero where masked (a row with no visible key has
    lse = -inf and is masked everywhere)."""
    p = jnp.exp(s - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def dq_block(q, k, v, do, lse_col, delta_col, mask, scale: float):
    """This key block's share of dq [rows, A] float32 (query rows; lse and delta columns)."""
    p = probabilities(scores(q, k, scale), lse_col, mask)
    ds = p * (dot_nt(do, v) - delta_col)
    return dot_nn(ds.astype(k.dtype), k) * scale


def dkv_block(k, v, q, do, lse_row, delta_row, mask_t, scale: float):
    """This query block's share of (dk, dv) [cols, A] float32, in key-major orientation: scores as
    keys x query rows, lse and delta as rows, mask_t the transposed mask. Summing over the folded
    query rows sums the group's query heads into their kv head."""
    p_t = probabilities(scores(k, q, scale), lse_row, mask_t)
    dv = dot_nn(p_t.astype(do.dtype), do)
    ds_t = p_t * (dot_nt(v, do) - delta_row)
    return dot_nn(ds_t.astype(q.dtype), q) * scale, dv
