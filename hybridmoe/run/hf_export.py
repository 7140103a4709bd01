"""--export-hf: the sharded weights written as a Hugging Face checkpoint by every host, in pieces.

The model is cut into units, each a set of whole HF tensors: the embedding; the final norm with
the LM head; per layer, its dense tensors; per layer, its routed experts in chunks. Every host
computes the same plan (units -> hosts round robin -> files of at most `max_file_bytes`, named
model-0000k-of-0000n.safetensors). For one unit at a time, a jitted slice of the sharded leaves
keeps each device's part of the unit on that device (no device ever holds more than its own
shards; `ExportReport` records it), the host copies the unit's shards into memory (on several
hosts every host receives the piece and only its writer keeps it), converts it to HF tensors and
appends them to its current file. No host holds more than one unit of the model at a time.

Files go to a temporary folder beside the target, are made 0644, and the folder is renamed into
place when every host is done (a shared filesystem on several hosts), with
model.safetensors.index.json, config.json and the side files (tokenizer*, chat template,
generation_config.json) of the source checkpoint. An interrupted export leaves no half-written
checkpoint under the target name.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from hybridmoe.config.schema import Config
from hybridmoe import hf
from hybridmoe.parallel.host import fetch_global, is_lead_host
from hybridmoe.parallel.rules import mesh_axes_of

# Files of a checkpoint folder that are not weights or config.json and travel with an export.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json")
DEFAULT_MAX_FILE_BYTES = 4 << 30


@dataclasses.dataclass
class Unit:
    name: str
    leaves: dict          # path -> global array (already the unit's slice once `slice` ran)
    slicer: Callable      # leaves -> leaves of the unit (jitted, sharded like the source)
    to_hf: Callable       # numpy leaves -> {HF name: array}
    nbytes: int


@dataclasses.dataclass
class ExportReport:
    files: list[str] = dataclasses.field(default_factory=list)
    # Per unit: the most bytes one device held of the unit's slice, and of the source leaves' shards.
    device_bytes: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    max_host_unit_bytes: int = 0


def _device_bytes(a) -> int:
    return max(s.data.nbytes for s in a.addressable_shards)


def _spec_without(sharding: NamedSharding, drop: int, keep_axis: int | None = None, size: int | None = None):
    """The leaf's PartitionSpec with its first `drop` axes removed; axis `keep_axis` (after the drop)
    unsharded unless `size` still splits over its mesh axes."""
    spec = list(sharding.spec) + [None] * 8
    spec = spec[drop:drop + 8]
    if keep_axis is not None and spec[keep_axis] is not None:
        names = mesh_axes_of(spec[keep_axis])
        if size % math.prod(sharding.mesh.shape[n] for n in names):
            spec[keep_axis] = None
    return spec


def _slice_fn(index: tuple, out_shardings):
    return jax.jit(lambda leaves: jax.tree.map(lambda a: a[index], leaves), out_shardings=out_shardings)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def plan_units(cfg: Config, params, max_file_bytes: int) -> list[Unit]:
    m = cfg.model
    fields = m.model_dump()
    units = []
    itemsize = np.dtype(params["embed"].dtype).itemsize

    def whole(name, keys, to_hf):
        leaves = {k: params[k] for k in keys}
        out_sh = {k: v.sharding for k, v in leaves.items()}
        units.append(Unit(name, leaves, jax.jit(lambda x: x, out_shardings=out_sh), to_hf,
                          sum(v.size for v in leaves.values()) * itemsize))

    whole("embed", ["embed"], lambda t: {"model.embed_tokens.weight": np.ascontiguousarray(t["embed"])})
    if m.tie_word_embeddings:  # one tensor, written once: the embedding (config.json says tied)
        whole("final_norm", ["final_norm"], lambda t: {"model.norm.weight": np.ascontiguousarray(t["final_norm"])})
    else:
        whole("final_norm+lm_head", ["final_norm", "lm_head"],
              lambda t: {"model.norm.weight": np.ascontiguousarray(t["final_norm"]),
                         "lm_head.weight": np.ascontiguousarray(np.asarray(t["lm_head"]).T)})
    P, E = len(m.layer_pattern), m.num_experts
    per_expert_bytes = 3 * m.d_model * m.moe_intermediate_size * itemsize
    # A chunk of experts: a divisor of E, at most one expert shard's worth, within the file budget.
    wi_sharding = params["blocks"][0]["moe"]["wi"].sharding
    expert_names = wi_sharding.spec[1] if len(wi_sharding.spec) > 1 else None
    expert_shards = math.prod(wi_sharding.mesh.shape[n] for n in (
        mesh_axes_of(expert_names)))
    chunk = max(c for c in range(1, E + 1) if E % c == 0 and c <= max(1, E // expert_shards)
                and (c == 1 or c * per_expert_bytes <= max_file_bytes))
    for b in range(m.num_blocks):
        for p, kind in enumerate(m.layer_pattern):
            index = p + b * P
            flat = _flat(params["blocks"][p])
            dense = {k: v for k, v in flat.items() if k not in hf.EXPERT_LEAVES}
            units.append(Unit(
                f"layer {index}", dense,
                _slice_fn((b,), {k: NamedSharding(v.sharding.mesh, PartitionSpec(*_spec_without(v.sharding, 1)[:v.ndim - 1]))
                                 for k, v in dense.items()}),
                lambda t, kind=kind, index=index: hf.layer_to_hf(kind, index, _nest(t), fields, parts=("dense",)),
                sum(v.size // v.shape[0] for v in dense.values()) * itemsize))
            experts = {k: flat[k] for k in hf.EXPERT_LEAVES}
            for e0 in range(0, E, chunk):
                out_sh = {k: NamedSharding(v.sharding.mesh, PartitionSpec(
                    *_spec_without(v.sharding, 1, keep_axis=0, size=chunk)[:v.ndim - 1])) for k, v in experts.items()}

                def to_hf(t, kind=kind, index=index, e0=e0):
                    return hf.layer_to_hf(kind, index, _nest(t), fields, parts=("experts",), experts=(e0, e0 + chunk))
                units.append(Unit(f"layer {index} experts {e0}..{e0 + chunk - 1}", experts,
                                  _slice_fn((b, slice(e0, e0 + chunk)), out_sh), to_hf, chunk * per_expert_bytes))
    return units


def _file_plan(units: list[Unit], hosts: int, max_file_bytes: int) -> list[tuple[int, int]]:
    """(host, file number) of every unit: round robin over hosts, each host's units packed into files."""
    out, files, fill = [], {h: -1 for h in range(hosts)}, {h: max_file_bytes for h in range(hosts)}
    for i, unit in enumerate(units):
        h = i % hosts
        if fill[h] + unit.nbytes > max_file_bytes and fill[h] > 0:
            files[h] += 1
            fill[h] = 0
        fill[h] += unit.nbytes
        out.append((h, files[h]))
    offsets, total = {}, 0
    for h in range(hosts):
        offsets[h] = total
        total += files[h] + 1
    return [(h, offsets[h] + f) for h, f in out], total


def export_hf_sharded(out: Path, cfg: Config, params, *, side_files_from: Path | None = None,
                      max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ExportReport:
    """Write `params` (the run's sharded weights) as a Hugging Face checkpoint folder `out`."""
    out = Path(out).absolute()
    hosts, me = jax.process_count(), jax.process_index()
    units = plan_units(cfg, params, max_file_bytes)
    placement, total_files = _file_plan(units, hosts, max_file_bytes)
    names = [f"model-{k + 1:05d}-of-{total_files:05d}.safetensors" for k in range(total_files)]
    tmp = out.parent / f".{out.name}.export-tmp"
    if is_lead_host():
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier("hybridmoe_export_start")
    report, weight_map = ExportReport(), {}
    current, current_file = {}, None

    def flush():
        if current_file is not None and current:
            path = tmp / names[current_file]
            save_file(current, str(path), metadata={"format": "pt"})
            path.chmod(0o644)
            report.files.append(names[current_file])
            current.clear()

    for unit, (host, file_number) in zip(units, placement):
        piece = unit.slicer(unit.leaves)
        report.device_bytes.append((unit.name, max(_device_bytes(a) for a in piece.values()),
                                    max(_device_bytes(a) for a in unit.leaves.values())))
        local = fetch_global(piece) if hosts > 1 else jax.device_get(piece)
        del piece
        if host != me:
            continue
        tensors = unit.to_hf(local)
        report.max_host_unit_bytes = max(report.max_host_unit_bytes, sum(a.nbytes for a in tensors.values()))
        if file_number != current_file:
            flush()
            current_file = file_number
        current.update(tensors)
        weight_map.update({name: names[file_number] for name in tensors})
    flush()
    (tmp / f".weight-map-{me}.json").write_text(json.dumps(weight_map))
    _barrier("hybridmoe_export_written")
    if is_lead_host():
        full = {}
        for part in sorted(tmp.glob(".weight-map-*.json")):
            full.update(json.loads(part.read_text()))
            part.unlink()
        total_size = sum(os.path.getsize(tmp / n) for n in set(full.values()))
        _write(tmp / hf.INDEX_FILE, json.dumps({"metadata": {"total_size": total_size},
                                                "weight_map": dict(sorted(full.items()))}, indent=2) + "\n")
        dtype = cfg.model.param_dtype
        _write(tmp / hf.CONFIG_FILE, json.dumps(hf.hf_config_from_model_fields(cfg.model, dtype=dtype), indent=2) + "\n")
        if side_files_from is not None:
            src = Path(side_files_from)
            src = src.parent if src.is_file() else src
            for name in SIDE_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
                    (tmp / name).chmod(0o644)
        tmp.chmod(0o755)
        _move_into_place(tmp, out)
    _barrier("hybridmoe_export_done")
    return report


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o644)


def _move_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    # An existing folder: our files replace theirs one by one; stale weight files of an earlier
    # export (which a loader would also read) go.
    stale = set(glob.glob(str(out / "*.safetensors"))) | set(glob.glob(str(out / hf.INDEX_FILE)))
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
        stale.discard(str(out / f.name))
    for f in stale:
        os.remove(f)
    tmp.rmdir()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
