"""--export-hf: the sharded weights written as a Hugging Face checkpoint by every host, in pieces.

The model is cut into units, each a set of whole HF tensors: the embedding; the final norm with
the LM head; per layer, its dense tensors; per layer, its routed experts in chunks. Every host
computes the same plan (units -> hosts round robin -> files of at most `max_file_bytes`, named
model-0000k-of-0000n.safetensors). For one unit at a time, a jitted slice of the sharded leaves
keeps each device's part of the unit on that device (no device ever holds more than its own
shards; `ExportReport` records it), the host copies the unit's shards into memory (on several
hosts every host receives the piece and only its writer keeps it), converts it to HF tensors and
appends them to its current file. No host holds more than one unit of the model at a time.

A run that started from a checkpoint folder exports in that folder's form (hf/source.py): the
units' tensors take the source's names (model.language_model.* in a multimodal checkpoint),
layouts (per-expert or fused experts, split or interleaved GDN projections) and dtypes; every
tensor the trainer does not own (a vision tower, MTP layers, anything outside the text model) is
copied byte for byte, one output file per source shard that holds any, streamed; config.json and
the folder's other files (generation_config.json, tokenizer, chat template, processor configs) are
copied unchanged. The export must hold exactly the source's tensor names, or nothing is moved into
place. A run that started from a recipe writes a text-only Qwen3_5MoeForCausalLM checkpoint, its
config.json from the model section and the tokenizer's side files.

Files go to a temporary folder beside the target, are made 0644, and the folder is renamed into
place when every host is done (a shared filesystem on several hosts), with
model.safetensors.index.json. An interrupted export leaves no half-written checkpoint under the
target name.
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
    source: str | None = None      # the checkpoint whose form the export keeps (None: text-only)
    trained_tensors: int = 0       # written by this host from the run's weights
    kept_tensors: int = 0          # copied unchanged from the source by this host
    kept_bytes: int = 0
    dtype_changes: dict[str, int] = dataclasses.field(default_factory=dict)  # "float32 -> bfloat16": tensors
    side_files: list[str] = dataclasses.field(default_factory=list)

    def summary(self, out) -> str:
        """What the export kept and what it wrote, for the run's log."""
        if self.source is None:
            return (f"--export-hf {out}: a text-only Qwen3_5MoeForCausalLM checkpoint ({self.trained_tensors} tensors, "
                    f"config.json from the model section" + (f"; copied {', '.join(self.side_files)}" if self.side_files
                                                               else "") + ")")
        cast = "".join(f"; {n} trained tensor(s) written {k} as the source stores them"
                       for k, n in sorted(self.dtype_changes.items()))
        return (f"--export-hf {out}: the form of {self.source}: {self.trained_tensors} trained tensors under the "
                f"source's names{cast}; {self.kept_tensors} tensors the trainer does not own copied byte for byte "
                f"({self.kept_bytes / 2**20:.1f} MiB); unchanged copies of {', '.join(self.side_files)} (training "
                "changes no config.json field)")


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


def in_source_form(tensors: dict, form: hf.SourceForm | None, report: ExportReport | None = None) -> dict:
    """Text-only HF tensors -> the source's names and dtypes (unchanged without a source form)."""
    if form is None:
        return tensors
    out = {}
    for name, value in tensors.items():
        src = form.source_name(name)
        if src not in form.trained:
            raise ValueError(f"--export-hf: the run writes {src}, which the source checkpoint {form.path} does not hold")
        value = np.asarray(value)
        want = np.dtype(form.numpy_dtype(src))
        if report is not None and value.dtype != want:
            key = f"{value.dtype.name} -> {want.name}"
            report.dtype_changes[key] = report.dtype_changes.get(key, 0) + 1
        out[src] = np.ascontiguousarray(value.astype(want, copy=False))
    return out


def plan_units(cfg: Config, params, max_file_bytes: int, form: hf.SourceForm | None = None) -> list[Unit]:
    """The units of the export. With a source form, the experts and GDN projections take the
    source's layouts (fused experts are written a whole layer at a time)."""
    m = cfg.model
    fields = m.model_dump()
    units = []
    itemsize = np.dtype(params["embed"].dtype).itemsize
    layouts = {} if form is None else {"expert_layout": form.expert_layout, "gdn_projections": form.gdn_projections}

    def whole(name, keys, to_hf):
        leaves = {k: params[k] for k in keys}
        out_sh = {k: v.sharding for k, v in leaves.items()}
        units.append(Unit(name, leaves, jax.jit(lambda x: x, out_shardings=out_sh), to_hf,
                          sum(v.size for v in leaves.values()) * itemsize))

    # A tied source that also stores the head gets it back: the embedding under both names.
    head_too = m.tie_word_embeddings and form is not None and form.source_name(hf.HEAD) in form.trained
    whole("embed", ["embed"], lambda t: {"model.embed_tokens.weight": np.ascontiguousarray(t["embed"]),
                                         **({hf.HEAD: np.ascontiguousarray(t["embed"])} if head_too else {})})
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
    if form is not None and form.expert_layout == "fused":
        chunk = E  # one tensor holds every expert of a layer
    for b in range(m.num_blocks):
        for p, kind in enumerate(m.layer_pattern):
            index = p + b * P
            flat = _flat(params["blocks"][p])
            dense = {k: v for k, v in flat.items() if k not in hf.EXPERT_LEAVES}
            units.append(Unit(
                f"layer {index}", dense,
                _slice_fn((b,), {k: NamedSharding(v.sharding.mesh, PartitionSpec(*_spec_without(v.sharding, 1)[:v.ndim - 1]))
                                 for k, v in dense.items()}),
                lambda t, kind=kind, index=index: hf.layer_to_hf(kind, index, _nest(t), fields, parts=("dense",),
                                                                 **layouts),
                sum(v.size // v.shape[0] for v in dense.values()) * itemsize))
            experts = {k: flat[k] for k in hf.EXPERT_LEAVES}
            for e0 in range(0, E, chunk):
                out_sh = {k: NamedSharding(v.sharding.mesh, PartitionSpec(
                    *_spec_without(v.sharding, 1, keep_axis=0, size=chunk)[:v.ndim - 1])) for k, v in experts.items()}

                def to_hf(t, kind=kind, index=index, e0=e0):
                    if chunk == E:
                        return hf.layer_to_hf(kind, index, _nest(t), fields, parts=("experts",), **layouts)
                    return hf.layer_to_hf(kind, index, _nest(t), fields, parts=("experts",), experts=(e0, e0 + chunk),
                                          **layouts)
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
                      source: hf.SourceForm | None = None,
                      max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ExportReport:
    """Write `params` (the run's sharded weights) as a Hugging Face checkpoint folder `out`.

    source: the form of the checkpoint the run started from (--init-hf). The export is then that
    checkpoint with the trained tensors replaced: under its names, layouts and dtypes, every tensor
    the trainer does not own copied byte for byte (one output file per source shard that holds
    any, streamed), config.json and every other file of the folder copied unchanged. Without it:
    a text-only Qwen3_5MoeForCausalLM checkpoint with config.json written from the model section
    and the side files of `side_files_from`.
    """
    out = Path(out).absolute()
    hosts, me = jax.process_count(), jax.process_index()
    if source is not None:
        changed = hf.config_changes(source.config, cfg.model)
        if changed:
            raise ValueError(f"--export-hf: the run's model differs from the source checkpoint {source.path} on "
                             f"{', '.join(changed)}; its export cannot keep the source's config.json")
    units = plan_units(cfg, params, max_file_bytes, source)
    placement, trained_files = _file_plan(units, hosts, max_file_bytes)
    kept = sorted(source.kept.items()) if source is not None else []
    total_files = trained_files + len(kept)
    names = [f"model-{k + 1:05d}-of-{total_files:05d}.safetensors" for k in range(total_files)]
    tmp = out.parent / f".{out.name}.export-tmp"
    if is_lead_host():
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier("hybridmoe_export_start")
    report, weight_map = ExportReport(source=source.path if source is not None else None), {}
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
        tensors = in_source_form(unit.to_hf(local), source, report)
        report.max_host_unit_bytes = max(report.max_host_unit_bytes, sum(a.nbytes for a in tensors.values()))
        report.trained_tensors += len(tensors)
        if file_number != current_file:
            flush()
            current_file = file_number
        current.update(tensors)
        weight_map.update({name: names[file_number] for name in tensors})
    flush()
    # The tensors the trainer does not own: each source shard's, copied as they are, by host k % hosts.
    for k, (shard, tensor_names) in enumerate(kept):
        if k % hosts != me:
            continue
        name = names[trained_files + k]
        report.kept_bytes += hf.copy_tensors(shard, tensor_names, str(tmp / name))
        (tmp / name).chmod(0o644)
        report.files.append(name)
        report.kept_tensors += len(tensor_names)
        weight_map.update({t: name for t in tensor_names})
    (tmp / f".weight-map-{me}.json").write_text(json.dumps(weight_map))
    _barrier("hybridmoe_export_written")
    full = {}
    for part in sorted(tmp.glob(".weight-map-*.json")):
        full.update(json.loads(part.read_text()))
    if source is not None:
        kept_names = {t for _, ts in kept for t in ts}
        _check_names(set(full), set(source.names), source.path)
        report.trained_tensors, report.kept_tensors = len(full) - len(kept_names), len(kept_names)
        report.kept_bytes = source.kept_bytes
    _barrier("hybridmoe_export_checked")
    if is_lead_host():
        for part in tmp.glob(".weight-map-*.json"):
            part.unlink()
        total_size = sum(os.path.getsize(tmp / n) for n in set(full.values()))
        _write(tmp / hf.INDEX_FILE, json.dumps({"metadata": {"total_size": total_size},
                                                "weight_map": dict(sorted(full.items()))}, indent=2) + "\n")
        if source is not None:
            for name in source.side_files():  # config.json, generation_config.json, tokenizer, processor, ...
                shutil.copyfile(Path(source.path) / name, tmp / name)
                (tmp / name).chmod(0o644)
            report.side_files = source.side_files()
        else:
            dtype = cfg.model.param_dtype
            _write(tmp / hf.CONFIG_FILE,
                   json.dumps(hf.hf_config_from_model_fields(cfg.model, dtype=dtype), indent=2) + "\n")
        if source is None and side_files_from is not None:
            src = Path(side_files_from)
            src = src.parent if src.is_file() else src
            for name in SIDE_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
                    (tmp / name).chmod(0o644)
                    report.side_files.append(name)
        tmp.chmod(0o755)
        _move_into_place(tmp, out)
    _barrier("hybridmoe_export_done")
    return report


def _check_names(written: set[str], want: set[str], source: str) -> None:
    """The export holds exactly the source's tensors (checked before anything is moved into place)."""
    missing, extra = sorted(want - written), sorted(written - want)
    if missing or extra:
        raise ValueError(f"--export-hf: the export would not hold the tensors of {source}: missing "
                         f"{missing[:5] or 'none'}, not in the source {extra[:5] or 'none'}; nothing was written")


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
