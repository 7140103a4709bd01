"""What the chip's kernel cases are made of (tools/chip_cases.py builds the families from these): a
case's records (Built, Reference, Case), the inputs (seeded normals and uniforms, uneven group sizes
and document lengths, packed position and segment ids), and the float32 reference of a function
with its gradients.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
SAMPLE_GROUPS = 8  # groups of gmm / moe_mlp the float32 reference covers


def as_given(out, backward):
    return out


@dataclasses.dataclass(frozen=True)
class Built:
    """One backend's jitted programs and their arguments (on the device): (fn, args) each; restore(out,
    backward): a result in the case's layout (a LaidOut backend's, brought back outside the timed
    program; the result itself for the others)."""

    fwd: tuple[Callable, tuple]
    fwd_bwd: tuple[Callable, tuple] | None
    restore: Callable = as_given


@dataclasses.dataclass(frozen=True)
class Reference:
    """Host float32 results: the forward's output, and (output, gradients) of forward + backward."""

    fwd: Any
    fwd_bwd: Any


@dataclasses.dataclass(frozen=True)
class Case:
    """One family at one geometry. backends: name -> build(inputs=None) -> Built (its arrays made on
    the device when called; pass make_inputs()'s result to share one set among backends);
    skipped: backend -> why it is not offered here; view(out, backward): the part of a backend's
    output the reference covers."""

    name: str
    family: str
    geometry: str
    shape: dict
    flops: tuple[float, float | None]
    make_inputs: Callable[[], tuple[tuple, Any]]
    backends: dict[str, Callable[..., Built]]
    skipped: dict[str, str]
    reference: Callable[[], Reference]
    view: Callable[..., Any]


# ---------------------------------------------------------------------------------------------
# Inputs


def normal(seed: int, shape, dtype, scale: float = 1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape, F32)).astype(dtype)


def uniform(seed: int, shape, low: float, high: float):
    return jax.random.uniform(jax.random.key(seed), shape, F32, low, high)


def group_sizes(rows: int, groups: int) -> np.ndarray:
    """Uneven sizes summing to rows, group 1 empty (none a multiple of a tile, in general)."""
    weights = np.random.default_rng(groups).uniform(0.2, 1.8, groups)
    weights[1 % groups] = 0.0
    sizes = np.floor(weights / weights.sum() * rows).astype(np.int32)
    sizes[-1] += rows - sizes.sum()
    return sizes


def document_lengths(tokens: int, documents: int) -> list[int]:
    """Uneven document lengths summing to tokens (cuts off every chunk and block edge in general)."""
    cuts = np.sort(np.random.default_rng(tokens + documents).choice(np.arange(1, tokens), documents - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [tokens]])).tolist()


def packed_ids(tokens: int, documents: int) -> tuple[np.ndarray, np.ndarray]:
    """[1, T] positions restarting at each document and segment ids 1, 2, ..."""
    pos, seg, start = np.zeros((1, tokens), np.int32), np.zeros((1, tokens), np.int32), 0
    for d, n in enumerate(document_lengths(tokens, documents)):
        pos[0, start:start + n], seg[0, start:start + n] = np.arange(n), d + 1
        start += n
    return pos, seg


def sampled_groups(sizes: np.ndarray) -> tuple[int, int]:
    """(groups, rows) the reference covers: the first SAMPLE_GROUPS groups and their rows."""
    s = min(SAMPLE_GROUPS, len(sizes))
    return s, int(sizes[:s].sum())


def tokamax_module():
    return importlib.import_module("tokamax") if importlib.util.find_spec("tokamax") else None


def float32_copies(tree):
    return jax.tree.map(lambda a: a.astype(F32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def reference_of(fn, args, cot, argnums) -> Reference:
    """Host float32 forward and (output, gradients) of fn on float32 copies of the arguments."""
    f32_args = float32_copies(args)
    out = jax.jit(fn)(*f32_args)
    if argnums is None:
        return Reference(jax.device_get(out), None)
    both = jax.jit(with_gradients(fn, argnums))(*f32_args, float32_copies(cot))
    return Reference(jax.device_get(out), jax.device_get(both))


@dataclasses.dataclass(frozen=True)
class OwnGradients:
    """A backend that forms its gradients itself: fn(*args) the forward, fwd_bwd(*args, cot) what
    with_gradients(fn, argnums) would return (for a program whose vjp must run inside a transform of
    its own, e.g. within a vmap that binds an axis name its backward's collectives use)."""

    fn: Callable
    fwd_bwd: Callable


def with_gradients(fn, argnums):
    """(*args, cot) -> (fn(*args), the gradients of sum(fn(*args) * cot) for args[argnums])."""
    def run(*args_and_cot):
        *args, cot = args_and_cot

        def of_diff(*diff):
            full = list(args)
            for i, d in zip(argnums, diff):
                full[i] = d
            return fn(*full)

        out, vjp = jax.vjp(of_diff, *(args[i] for i in argnums))
        return out, vjp(cot)
    return run
