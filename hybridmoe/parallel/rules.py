"""Logical axis names -> mesh axes. Model code names logical axes only; this table places them.

Legend of logical axes:
  batch     sequences of a batch          seq      tokens of a sequence
  embed     the model width D             vocab    vocabulary rows/columns
  heads     attention / GDN heads          kv_heads attention key/value heads
  mlp       expert and shared-expert hidden width
  exp       routed experts                layers   the stacked-block axis of the layer scan
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

# The logical axis of a weight's FSDP dimension. Its rule lists every mesh axis that is
# data-parallel for weights; each weight is split there over those of them that its other
# dimensions leave free, and gathers them where it is used (`at_use_spec`). So a dense weight is
# split over fsdp x context x expert (the ranks that split a sequence or hold other experts are
# data-parallel for it) and a routed expert weight over fsdp x context beside its experts' axis.
# mesh.data is the replica axis: weights are whole on each of its ranks.
FSDP_AXIS = "embed"

# A rules table may name, under this key, a logical axis that takes a weight's FSDP split in place of
# its FSDP_AXIS dimension when the weight has both (the split then follows that axis's own mesh axes,
# minor to them). mesh.expert_fsdp_dim="exp" names "exp": the routed expert weights wi [E, D, 2F] and
# wo [E, F, D] split their experts over fsdp x context beside the expert axis, and keep D whole. For
# wo that keeps a shard's minor dimension whole: split over 128 ranks, D = 4096 leaves 32 columns,
# which a TPU lays out padded to 128 lanes (4x the bytes of every wo shard, its gradients and its
# optimizer state).
FSDP_TO = "fsdp_to"

DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": "context",
    FSDP_AXIS: ("fsdp", "context", "expert"),
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "exp": "expert",
    "layers": None,
}

# Experts sharded over context x expert: the context ranks that split a sequence also split experts.
CP_AS_EP_RULES: dict[str, MeshAxes] = {**DEFAULT_RULES, "exp": ("context", "expert"),
                                       "batch": ("data", "fsdp")}

RULES_TABLES = {"default": DEFAULT_RULES, "cp_as_ep": CP_AS_EP_RULES}


def rules_table(name: str, expert_fsdp_dim: str = FSDP_AXIS) -> dict[str, MeshAxes]:
    """The rules table of mesh.rules=`name` with the routed experts' FSDP dimension of
    mesh.expert_fsdp_dim (FSDP_AXIS: as the table has it; "exp": see FSDP_TO)."""
    table = RULES_TABLES[name]
    return table if expert_fsdp_dim == FSDP_AXIS else {**table, FSDP_TO: expert_fsdp_dim}

_active_rules: contextvars.ContextVar[Mapping[str, MeshAxes]] = contextvars.ContextVar(
    "active_rules", default=DEFAULT_RULES)


class AxisRuleError(ValueError):
    pass


def mesh_axes_of(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry or rules-table value (None, a name, or a tuple)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(mesh_axes: tuple[str, ...]) -> MeshAxes:
    return None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def logical_to_spec(axes: Sequence[str | None], rules: Mapping[str, MeshAxes] | None = None) -> PartitionSpec:
    """Map logical axes to a PartitionSpec; a mesh axis used twice raises (a rules collision).

    The FSDP dimension (FSDP_AXIS) takes the mesh axes of its rule that no other dimension of the
    same array uses, so it never collides; where the table's FSDP_TO names another dimension of the
    array, that dimension takes them after its own."""
    rules = _active_rules.get() if rules is None else rules
    used: dict[str, str] = {}
    out: list[MeshAxes] = [None] * len(axes)
    for i, name in enumerate(axes):
        if name is None or name == FSDP_AXIS:
            continue
        if name not in rules:
            raise AxisRuleError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        for m in mesh_axes_of(rules[name]):
            if m in used:
                raise AxisRuleError(f"mesh axis {m!r} is used by both logical axes {used[m]!r} and {name!r} "
                                    f"in {tuple(axes)}")
            used[m] = name
        out[i] = rules[name]
    fsdp_dims = [i for i, name in enumerate(axes) if name == FSDP_AXIS]
    if len(fsdp_dims) > 1:
        raise AxisRuleError(f"logical axis {FSDP_AXIS!r} names two dimensions of {tuple(axes)}")
    if fsdp_dims:
        free = tuple(m for m in mesh_axes_of(rules.get(FSDP_AXIS)) if m not in used)
        host = rules.get(FSDP_TO)
        dim = list(axes).index(host) if host is not None and host in axes else fsdp_dims[0]
        out[dim] = _entry(mesh_axes_of(out[dim]) + free)
    return PartitionSpec(*out)


def splits_evenly(spec: PartitionSpec, shape: Sequence[int]) -> bool:
    """Whether every dimension of `shape` divides over the current mesh's axes that `spec` gives it."""
    sizes = jax.sharding.get_abstract_mesh().shape
    return all(n % math.prod(sizes[a] for a in mesh_axes_of(e)) == 0 for e, n in zip(spec, shape))


def named_sharding(mesh: jax.sharding.Mesh, axes: Sequence[str | None],
                   rules: Mapping[str, MeshAxes] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


@contextlib.contextmanager
def use_rules(rules: Mapping[str, MeshAxes]):
    token = _active_rules.set(rules)
    try:
        yield
    finally:
        _active_rules.reset(token)


def active_rules() -> Mapping[str, MeshAxes]:
    return _active_rules.get()


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """Sharding constraint by logical axes under the current mesh; a no-op outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes))


def at_use_spec(axes, rules: Mapping[str, MeshAxes] | None = None) -> PartitionSpec:
    """A weight's stored sharding with its FSDP split gathered (its layout where it is used)."""
    return logical_to_spec(tuple(None if a == FSDP_AXIS else a for a in axes), rules)


def gathered_at_use(axes, rules: Mapping[str, MeshAxes] | None = None) -> tuple[tuple[str, ...], ...]:
    """Per dimension, the mesh axes a weight gathers where it is used (stored minus at-use)."""
    return tuple(tuple(m for m in mesh_axes_of(s) if m not in mesh_axes_of(u))
                 for s, u in zip(logical_to_spec(axes, rules), at_use_spec(axes, rules)))


def constrain_at_use(w: jax.Array, axes) -> jax.Array:
    """A weight where it is used: its stored sharding with the FSDP dimension gathered.

    Naming the gather makes FSDP explicit (left to itself the partitioner may instead shard the
    contraction and reshuffle activations); the transpose of this constraint reduce-scatters the
    weight's gradient back to its stored sharding. A no-op outside a mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return w
    return jax.lax.with_sharding_constraint(w, at_use_spec(axes))
