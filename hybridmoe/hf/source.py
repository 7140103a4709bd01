"""The form of a source checkpoint folder, so that an export can keep it: the tensors the trainer
owns (the text model) under the source's names, layouts and dtypes, and every other tensor (a
vision tower, multi-token-prediction layers, anything outside the text model) to copy unchanged.

Only the shards' headers are read here (names, dtypes, shapes); no tensor data.

Names: the trainer speaks the text-only names (`model.layers.0...`, `lm_head.weight`); a multimodal
checkpoint (Qwen3_5MoeForConditionalGeneration) nests the text model under
`model.language_model.` and keeps `lm_head.weight` at the top. Layouts: routed experts per expert
(`experts.{e}.gate_proj.weight`, what save_pretrained writes) or fused (`experts.gate_up_proj`);
GDN projections split (Qwen3.5) or interleaved (Qwen3-Next's in_proj_qkvz / in_proj_ba).
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy as np

from hybridmoe.hf.weights import (HEAD, MULTIMODAL_PREFIX, TEXT_PREFIX, ExpertLayout, GDNProjections, is_text_tensor,
                                  text_prefix)

# safetensors dtype names of the tensors a trained value can be written back in.
NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
# The files of a checkpoint folder that travel with its export: configs (config.json,
# generation_config.json, processor configs), tokenizer files, chat templates, remote code, and the
# model card and licence. Never weights (another export writes those) or anything else.
SIDE_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py", ".md")
SIDE_PREFIXES = ("LICENSE", "NOTICE", "README")


@dataclasses.dataclass(frozen=True)
class SourceForm:
    path: str
    config: dict                     # config.json as read
    prefix: str                      # where the text model's tensors live: "model." or "model.language_model."
    expert_layout: ExpertLayout
    gdn_projections: GDNProjections
    trained: dict[str, str]          # source name of each tensor the trainer owns -> its safetensors dtype
    kept: dict[str, list[str]]       # shard path -> the tensors of it that are copied unchanged
    kept_bytes: int
    names: frozenset[str]            # every tensor of the source: what its export must hold

    @property
    def multimodal(self) -> bool:
        return self.prefix == MULTIMODAL_PREFIX

    def source_name(self, text_name: str) -> str:
        """The source's name of a text-only tensor name (`model.norm.weight`, `lm_head.weight`, ...)."""
        if self.prefix != TEXT_PREFIX and text_name.startswith(TEXT_PREFIX):
            return self.prefix + text_name[len(TEXT_PREFIX):]
        return text_name

    def numpy_dtype(self, source_name: str):
        return NUMPY_DTYPES[self.trained[source_name]]

    def side_files(self) -> list[str]:
        """The folder's files that travel with an export (config.json included; see SIDE_SUFFIXES)."""
        return sorted(n for n in os.listdir(self.path)
                      if os.path.isfile(os.path.join(self.path, n)) and not n.startswith(".")
                      and (n.endswith(SIDE_SUFFIXES) or n.startswith(SIDE_PREFIXES)) and not n.endswith(".index.json"))


def shard_header(path: str) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, the byte offset where its data starts)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file (no header)")
        n = int.from_bytes(head, "little")
        if n > os.path.getsize(path) - 8:
            raise ValueError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes)")
        header = json.loads(fh.read(n))
    return header, 8 + n


def read_source_form(path: str, shards: list[str]) -> SourceForm:
    """The form of the checkpoint in `path` (config.json and its `shards`, as files.checkpoint_shards lists)."""
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    headers = {}
    for shard in shards:
        header, _ = shard_header(shard)
        headers[shard] = {k: v for k, v in header.items() if k != "__metadata__"}
    names = [n for h in headers.values() for n in h]
    prefix = text_prefix(names)
    trained, kept, kept_bytes = {}, {}, 0
    for shard, header in headers.items():
        for name, entry in header.items():
            if is_text_tensor(name, prefix):
                if entry["dtype"] not in NUMPY_DTYPES:
                    raise ValueError(f"{shard}: {name} is stored as {entry['dtype']}; a trained tensor is written back "
                                     f"in its source dtype, one of {sorted(NUMPY_DTYPES)}")
                trained[name] = entry["dtype"]
            else:
                kept.setdefault(shard, []).append(name)
                a, b = entry["data_offsets"]
                kept_bytes += b - a
    text = [n for n in trained if n != HEAD]
    return SourceForm(
        path=path, config=config, prefix=prefix,
        expert_layout="fused" if any(n.endswith(".mlp.experts.gate_up_proj") for n in text) else "per_expert",
        gdn_projections="interleaved" if any(n.endswith(".linear_attn.in_proj_qkvz.weight") for n in text) else "split",
        trained=trained, kept=kept, kept_bytes=kept_bytes, names=frozenset(names))


def copy_tensors(src: str, names: list[str], dst: str, chunk_bytes: int = 64 << 20) -> int:
    """Write the tensors `names` of the safetensors file `src` into a new safetensors file `dst`,
    their bytes copied unchanged and streamed (never more than `chunk_bytes` in memory, whatever
    their dtype). Returns the bytes of tensor data copied.

    The safetensors library writes only from tensors in memory; the format is an 8-byte header
    length, a JSON header (dtype, shape, data_offsets per tensor) and the tensors' bytes, which is
    all this writes. The library reads the result back in the tests.
    """
    header, start = shard_header(src)
    order = sorted(names, key=lambda n: header[n]["data_offsets"][0])
    entries, offset = {}, 0
    for name in order:
        a, b = header[name]["data_offsets"]
        entries[name] = {"dtype": header[name]["dtype"], "shape": header[name]["shape"],
                         "data_offsets": [offset, offset + b - a]}
        offset += b - a
    blob = json.dumps({"__metadata__": header.get("__metadata__") or {"format": "pt"}, **entries},
                      separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(len(blob).to_bytes(8, "little"))
        fout.write(blob)
        for name in order:
            a, b = header[name]["data_offsets"]
            fin.seek(start + a)
            left = b - a
            while left:
                piece = fin.read(min(left, chunk_bytes))
                if not piece:
                    raise ValueError(f"{src}: truncated while copying {name}")
                fout.write(piece)
                left -= len(piece)
    return offset
