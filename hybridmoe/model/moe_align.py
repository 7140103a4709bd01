"""The MoE dispatch with each local expert's rows padded to a multiple of `align` rows (moe.group_align_rows).

Legend: T tokens, k experts per token, M = T k (token, slot) rows, E experts, G local experts,
A = M + (G + 1) (align - 1) rows of the aligned buffer, rounded up to a multiple of align (a static
bound, in whole row tiles).

The grouped matmuls visit a row tile once for each group whose rows it holds: a tile that straddles
two experts is computed twice, once per expert, each time in full. With 128 experts of about 512
rows in 128-row tiles that is 127 extra tiles, 25% more than the rows need (docs/tpu.md). Here the
dispatch writes each local expert's rows from a multiple of `align` and pads the expert to a whole
multiple with zero rows; the kernels see group sizes that are multiples of `align`, so a kernel whose
row tile divides `align` never computes a tile twice. The padding costs the rows it adds (on average
half a tile per expert) and nothing else: the same gather places the rows, the same gather brings
the outputs back.

Every real row is computed as without the lever: the same row through the same expert's weights.
A padding row is zero, with a zero routing weight: its output is zero and never read back, and it
adds nothing to a weight's gradient. Experts that are not local keep their rows in the sort's order
(the kernels skip them); the rows before the first local expert are padded to a multiple too, so
the buffer grows by at most (G + 1) (align - 1) rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

PAD = -1  # the buffer's index of a padding row


def aligned_rows(num_rows: int, num_local: int, align: int) -> int:
    """A: the aligned buffer's rows: at most `align - 1` padding rows per local expert and before the
    first, rounded up to a multiple of `align`. Whole row tiles for a kernel whose row tile divides
    `align`: a buffer of another length would be padded to whole tiles by a copy of every operand at
    every kernel call (on the v5e that copy made the aligned MoE MLP slower than the unaligned one)."""
    return -(-(num_rows + (num_local + 1) * (align - 1)) // align) * align


def aligned_layout(flat_e_M, order_M, group_sizes_E, *, align: int, group_offset, num_local: int):
    """(buffer_A, inverse_M, padded_sizes_E) of rows sorted by expert (order_M, a stable argsort of
    flat_e_M) laid out with each local expert [offset, offset + G) starting at a multiple of `align`.

    buffer_A [A] int32: the (token, slot) row at each position, PAD for a padding row.
    inverse_M [M] int32: each (token, slot) row's position in the buffer.
    padded_sizes_E [E] int32: the local experts' sizes rounded up to a multiple of `align` (their
    padding rows belong to them); the expert before the first local one also holds the padding that
    brings that one's start to a multiple of `align`; the others' as they were.
    """
    M = flat_e_M.shape[0]
    E = group_sizes_E.shape[0]
    sizes_E = group_sizes_E.astype(jnp.int32)
    experts_E = jnp.arange(E, dtype=jnp.int32)
    off = jnp.asarray(group_offset, jnp.int32)
    local_E = (experts_E >= off) & (experts_E < off + num_local)
    starts_E = jnp.cumsum(sizes_E) - sizes_E
    # The first local expert starts at the next multiple of align: the rows up to it are padding
    # the expert before it holds (a foreign one, which the kernels skip).
    gap = -(-starts_E[off] // align) * align - starts_E[off]
    padded_E = jnp.where(local_E, -(-sizes_E // align) * align, sizes_E) + jnp.where(experts_E == off - 1, gap, 0)
    padded_starts_E = jnp.cumsum(padded_E) - padded_E
    e_sorted_M = flat_e_M[order_M].astype(jnp.int32)
    # The i-th row in expert order keeps its place within its expert, from the expert's new start.
    position_M = padded_starts_E[e_sorted_M] + jnp.arange(M, dtype=jnp.int32) - starts_E[e_sorted_M]
    A = aligned_rows(M, num_local, align)
    buffer_A = jnp.full((A,), PAD, jnp.int32).at[position_M].set(order_M.astype(jnp.int32))
    inverse_M = jnp.zeros((M,), jnp.int32).at[order_M].set(position_M)
    return buffer_A, inverse_M, padded_E


def token_rows(x_TD, buffer_A, inverse_M, k: int, gather_backward: bool):
    """[A, D]: each position's token row (a copy), zero at padding positions."""
    if gather_backward:
        return _gathered_move(x_TD, buffer_A, inverse_M, k, False)
    return _token_rows(x_TD, buffer_A, k)


def _token_rows(x_TD, buffer_A, k):
    real_A = buffer_A >= 0
    rows = x_TD[jnp.where(real_A, buffer_A, 0) // k]
    return jnp.where(real_A[:, None], rows, jnp.zeros((), x_TD.dtype))


def row_values(v_M, buffer_A):
    """[A]: a per-(token, slot) value (the routing weight) at each position, zero at padding."""
    real_A = buffer_A >= 0
    return jnp.where(real_A, v_M[jnp.where(real_A, buffer_A, 0)], jnp.zeros((), v_M.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def slot_sum(rows_XD, index_M, k: int):
    """[T, D]: each token's k (token, slot) rows summed in float32, slot 0 first, in the rows' dtype;
    token t's slot j is rows_XD[index_M[t k + j]]. One gather of T rows per slot: gathered at once as
    [T k, D] and viewed as [T, k, D], the rows are copied by the TPU compiler into a layout whose
    tiles pad k to 8 or 16 rows (at the 397B cell's k = 10 a 2.7 GB copy per call; docs/levers.md,
    moe.gather_backward). The backward is one scatter-add of each (token, slot) row's token gradient
    (autodiff's would be one scatter per slot, each into a zero [X, D] buffer, then their sum)."""
    index_Tk = index_M.reshape(-1, k)
    total = rows_XD[index_Tk[:, 0]].astype(jnp.float32)
    for j in range(1, k):
        total = total + rows_XD[index_Tk[:, j]].astype(jnp.float32)
    return total.astype(rows_XD.dtype)


def _slot_sum_fwd(rows_XD, index_M, k):
    return slot_sum(rows_XD, index_M, k), (index_M, rows_XD.shape[0])


def _slot_sum_bwd(k, res, g_TD):
    index_M, rows = res
    token_M = jnp.arange(index_M.shape[0], dtype=jnp.int32) // k  # a gather, not a [T, k, D] broadcast
    return jnp.zeros((rows, g_TD.shape[1]), g_TD.dtype).at[index_M].add(g_TD[token_M]), None


# Looked up when traced (tests/test_moe_gather_backward.py patches it).
slot_sum.defvjp(lambda *a: _slot_sum_fwd(*a), lambda *a: _slot_sum_bwd(*a))


def combine(y_AD, buffer_A, inverse_M, k: int, gather_backward: bool):
    """[T, D]: each token's k output rows read at their buffer positions and summed (slot_sum)."""
    if gather_backward:
        return _gathered_move(y_AD, buffer_A, inverse_M, k, True)
    return slot_sum(y_AD, inverse_M, k)


# moe.gather_backward's two moves, each the other's backward: the token rows' gradient is the
# combine of their gradients (a token's k rows read at their positions, padding never read, summed
# over the slots in float32), and the combine's gradient at a position is the gradient of the token
# whose row it is (the token rows' move; a padding position's is zero).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gathered_move(a, buffer_A, inverse_M, k: int, is_combine: bool):
    return slot_sum(a, inverse_M, k) if is_combine else _token_rows(a, buffer_A, k)


def _gathered_move_fwd(a, buffer_A, inverse_M, k, is_combine):
    return _gathered_move(a, buffer_A, inverse_M, k, is_combine), (buffer_A, inverse_M)


def _gathered_move_bwd(k, is_combine, res, g):
    buffer_A, inverse_M = res
    return (_token_rows(g, buffer_A, k) if is_combine else slot_sum(g, inverse_M, k)), None, None


_gathered_move.defvjp(_gathered_move_fwd, _gathered_move_bwd)
