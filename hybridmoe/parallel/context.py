"""Context parallelism: the sequence split over the mesh axes of logical "seq", and the causal
load-balancing order of its shards.

With P context ranks each rank holds T/P consecutive tokens (natural order). Causal attention then
gives rank P-1 about 2P-1 times the unmasked score entries of rank 0. The load-balanced order cuts
the sequence into 2P half-chunks and gives rank r the half-chunks r and 2P-1-r: every rank holds
one early and one late half, so the work is even. Going there and back costs two
collective-permutes of half a shard each (one for the first halves, one for the second) and a
select on the rank's parity.

Functions named `*_local` run inside shard_map on one rank's shard; the others take global arrays
under the current mesh and rules and shard_map themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.parallel.rules import logical_to_spec, mesh_axes_of


def context_axes() -> tuple[str, ...]:
    """The mesh axes the sequence is split over here (size > 1), or () without a mesh or a split."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    entry = logical_to_spec(("seq",))[0]
    names = mesh_axes_of(entry)
    return tuple(a for a in names if mesh.shape[a] > 1)


def context_size(axes: Sequence[str]) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in axes)


def load_balance_permutations(P: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(source, destination) pairs of the first and the second halves into load-balanced order.

    Half-chunk j (natural: rank j // 2, first half if j is even) belongs to rank j if j < P, else to
    rank 2P-1-j.
    """
    def owner(j):
        return j if j < P else 2 * P - 1 - j

    return [(r, owner(2 * r)) for r in range(P)], [(r, owner(2 * r + 1)) for r in range(P)]


def rank_query_runs(t: int, S: int, load_balanced: bool) -> tuple[tuple[int, int], ...]:
    """((start, length), ...) of a context rank's t queries among the S = P t positions of the
    sequence, for a cost that counts causal blocks: load-balanced, half-chunks r and 2P-1-r (rank 0's;
    every rank holds as many visible (query, key) blocks); in natural order, the last rank's shard
    (the one that sees every key, so the slowest)."""
    P = S // t
    if load_balanced:
        half = t // 2
        return ((0, half), ((2 * P - 1) * half, half))
    return ((S - t, t),)


def _halves(x, axis):
    n = x.shape[axis]
    if n % 2:
        raise ValueError(f"load balancing needs an even shard length; got {n} tokens per rank")
    return jnp.split(x, 2, axis=axis)


def _parity_is_even(axes):
    return jax.lax.axis_index(axes) % 2 == 0


def to_load_balanced_local(x, axes: tuple[str, ...], P: int, axis: int = 1):
    """One rank's natural shard [.., T/P, ..] -> its load-balanced shard (half-chunks r, 2P-1-r).

    Rank s receives its first slot (half-chunk s) from the first-halves permute when s is even and
    from the second-halves permute when s is odd; its second slot the other way round.
    """
    first, second = _halves(x, axis)
    perm_first, perm_second = load_balance_permutations(P)
    got_first = jax.lax.ppermute(first, axes, perm_first)
    got_second = jax.lax.ppermute(second, axes, perm_second)
    even = _parity_is_even(axes)
    return jnp.where(even, jnp.concatenate([got_first, got_second], axis),
                     jnp.concatenate([got_second, got_first], axis))


def from_load_balanced_local(x, axes: tuple[str, ...], P: int, axis: int = 1):
    """The inverse of to_load_balanced_local: each slot goes back to the rank and half it came from."""
    slot0, slot1 = _halves(x, axis)
    even = _parity_is_even(axes)
    to_first = jnp.where(even, slot0, slot1)
    to_second = jnp.where(even, slot1, slot0)
    perm_first, perm_second = load_balance_permutations(P)
    invert = lambda perm: [(d, s) for s, d in perm]  # noqa: E731
    first = jax.lax.ppermute(to_first, axes, invert(perm_first))
    second = jax.lax.ppermute(to_second, axes, invert(perm_second))
    return jnp.concatenate([first, second], axis)


def load_balanced_token_index(T: int, P: int):
    """numpy [T]: the natural index of the token at each position of the load-balanced order."""
    h = T // (2 * P)
    order = []
    for r in range(P):
        for j in (r, 2 * P - 1 - r):
            order.extend(range(j * h, (j + 1) * h))
    return np.asarray(order)


def reorder(x, logical_axes: Sequence[str | None], *, inverse: bool = False):
    """A global array whose axis 1 is logical "seq" -> load-balanced order (inverse: back).

    A no-op without context parallelism.
    """
    axes = context_axes()
    if not axes:
        return x
    P = context_size(axes)
    spec = logical_to_spec(tuple(logical_axes))
    fn = from_load_balanced_local if inverse else to_load_balanced_local
    return jax.shard_map(lambda a: fn(a, axes, P), in_specs=(spec,), out_specs=spec)(x)


def sequence_unsharded(rules):
    """`rules` with the sequence on no mesh axis: how decoding runs under a context-parallel mesh.

    A decode step has one new token per row, which cannot be split; the context ranks then hold
    the same rows (the batch stays split over its own axes), and each layer runs its unsharded
    path.
    """
    return {**rules, "seq": None}


def unmasked_scores_per_rank(positions_BT, segment_ids_BT, P: int):
    """numpy [P]: per context rank, the (query, key) score entries that the causal, segment mask
    leaves for the queries the rank holds (in the order given), summed over the batch; keys are the
    whole gathered row. The measure of causal attention work that load balancing evens out."""
    pos, seg = np.asarray(positions_BT), np.asarray(segment_ids_BT)
    ok = (pos[:, None, :] <= pos[:, :, None]) & (seg[:, None, :] == seg[:, :, None])
    return ok.sum(axis=-1).sum(axis=0).reshape(P, -1).sum(axis=1)
