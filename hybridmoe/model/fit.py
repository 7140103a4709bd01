"""Which weight dimensions the rules table splits over the mesh, and which of them do not split evenly.

Read from the two sources the run itself uses: the abstract weight declarations
(`model.params.declare_params`) and the logical-axis rules table. Every dimension a weight names a
logical axis for is checked against the product of the mesh axes the rules give that dimension of
that weight (`logical_to_spec`: the FSDP dimension takes the data-parallel axes the others leave), so a
new weight or a new rule is checked the moment it exists. The offending config key is found the
same way: the model fields whose change alters that dimension of that weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from hybridmoe.config.schema import ModelConfig
from hybridmoe.parallel.rules import logical_to_spec, mesh_axes_of

Problem = tuple[str, str]


def _flat_shapes(m: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    from hybridmoe.model.params import declare_params, param_table

    return {name: (shape, axes) for name, shape, _, axes in param_table(declare_params(m))}


def _perturbed_shapes(m: ModelConfig) -> dict[str, dict]:
    """Per integer model field, the weight shapes with that field doubled (1 where it is 0)."""
    out = {}
    for field, value in m.model_dump().items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        try:
            out[field] = _flat_shapes(m.model_copy(update={field: 2 * value or 1}))
        except Exception:  # noqa: BLE001 -- a perturbation the declarations cannot take says nothing
            continue
    return out


def _fields_behind(perturbed: dict[str, dict], name: str, dim: int, size: int) -> list[str]:
    """The integer model fields whose change alters dimension `dim` of weight `name`."""
    return [field for field, shapes in perturbed.items() if name in shapes and shapes[name][0][dim] != size]


def sharding_problems(m: ModelConfig, rules: Mapping, mesh_sizes: Mapping[str, int]) -> list[Problem]:
    """(key, message) for every weight dimension that does not split over the mesh axes its logical
    axis is mapped to; one problem per (model field, mesh axes), naming the weights affected.

    `mesh_sizes` may omit axes whose size is not known yet (they are not checked)."""
    found: dict[tuple[str, tuple[str, ...]], dict] = {}
    perturbed = None
    for name, (shape, axes) in _flat_shapes(m).items():
        spec = logical_to_spec(axes, rules)
        for dim, (size, logical, entry) in enumerate(zip(shape, axes, spec)):
            if logical is None:
                continue
            mesh_axes = tuple(a for a in mesh_axes_of(entry) if a in mesh_sizes)
            shards = math.prod(mesh_sizes[a] for a in mesh_axes)
            if shards <= 1 or size % shards == 0:
                continue
            perturbed = _perturbed_shapes(m) if perturbed is None else perturbed
            fields = _fields_behind(perturbed, name, dim, size) or ["layer_pattern"]
            entry = found.setdefault((fields[0], mesh_axes), {"size": size, "shards": shards, "logical": logical,
                                                              "weights": [], "also": fields[1:]})
            entry["weights"].append(name)
    out = []
    for (field, mesh_axes), e in found.items():
        axes_text = " x ".join(f"mesh.{a}={mesh_sizes[a]}" for a in mesh_axes)
        weights = ", ".join(e["weights"][:3]) + (f" and {len(e['weights']) - 3} more" if len(e["weights"]) > 3 else "")
        also = f" (with model.{', model.'.join(e['also'])})" if e["also"] else ""
        out.append((f"model.{field}", f"a dimension of {e['size']}{also} does not split over the {e['shards']} "
                    f"shards of {axes_text}, which the rules give logical axis {e['logical']!r} ({weights}); "
                    f"make it a multiple of {e['shards']} or change the mesh"))
    return out

