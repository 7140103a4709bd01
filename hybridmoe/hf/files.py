"""Checkpoint folders: config.json and the *.safetensors shards (with their index), read and written.

Every error is a CheckpointError naming the file and the fix.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so bf16 safetensors shards load
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hybridmoe.hf.config_fields import hf_config_from_model_fields, model_fields_from_hf_config
from hybridmoe.hf.weights import ExpertLayout, hf_to_native, is_text_tensor, native_to_hf, text_prefix

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A Hugging Face checkpoint folder that cannot be read; the message names the file and the fix."""


def checkpoint_shards(path: str) -> list[str]:
    """The *.safetensors files of a checkpoint: those model.safetensors.index.json names when it is
    present (every one must exist), else every *.safetensors file in the folder."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index (no valid weight_map: {e}); "
                                  "re-download it or delete it to read every *.safetensors file") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise CheckpointError(f"{index_path}: names shard(s) missing from the folder: {', '.join(missing[:4])}; "
                                  "download every shard the index lists")
        return [os.path.join(path, n) for n in names]
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise CheckpointError(f"{path}: no *.safetensors files; a checkpoint folder holds config.json and its weights")
    return shards


def read_hf_config(path: str) -> dict:
    """config.json of a checkpoint folder as a dict; CheckpointError naming the file otherwise."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not os.path.exists(config_path):
        raise CheckpointError(f"{config_path}: missing; a Hugging Face checkpoint folder holds config.json "
                              "beside its *.safetensors files")
    try:
        with open(config_path) as fh:
            config = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object")
    return config


def _shard_names(shard: str) -> list[str]:
    try:
        with safe_open(shard, framework="numpy") as fh:
            return list(fh.keys())
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError (and OSError)
        raise CheckpointError(f"{shard}: truncated or corrupt safetensors file ({e}); "
                              "download it again (its size must match the published one)") from None


def load_hf_checkpoint(path: str) -> tuple[dict, dict]:
    """config.json + the checkpoint's *.safetensors shards in `path` -> (model fields, native tree of numpy arrays).

    Raises CheckpointError (a ValueError) naming the file for a missing/invalid config.json, an
    unsupported architecture, a missing shard and a truncated or corrupt safetensors file.
    """
    try:
        fields = model_fields_from_hf_config(read_hf_config(path))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: {str(e).removeprefix('config.json: ')}") from None
    state: dict[str, np.ndarray] = {}
    files: dict[str, str] = {}
    shards = checkpoint_shards(path)
    prefix = text_prefix(name for shard in shards for name in _shard_names(shard))
    for shard in shards:
        try:
            with safe_open(shard, framework="numpy") as fh:
                for name in fh.keys():
                    if not is_text_tensor(name, prefix):  # a vision tower, MTP layers, ...: never read
                        continue
                    if name in state:
                        raise CheckpointError(f"{shard}: tensor {name} is also in {files[name]}")
                    state[name] = fh.get_tensor(name)
                    files[name] = shard
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError (and OSError)
            raise CheckpointError(f"{shard}: truncated or corrupt safetensors file ({e}); "
                                  "download it again (its size must match the published one)") from None
    return fields, hf_to_native(state, fields, files=files, where=path)


def save_hf_checkpoint(path: str, fields, tree, *, expert_layout: ExpertLayout = "per_expert") -> None:
    """Write config.json + model.safetensors into `path` atomically.

    Both files are written into a temporary folder beside `path` first and then moved into place,
    so an interrupted save never leaves a half-written file under `path`.
    """
    state = native_to_hf(tree, fields, expert_layout=expert_layout)
    dtype = str(state["model.embed_tokens.weight"].dtype)
    config = hf_config_from_model_fields(fields, dtype=dtype)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as fh:
            json.dump(config, fh, indent=2)
            fh.write("\n")
        save_file(state, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a checkpoint folder is an ordinary folder
        if not os.path.exists(path):
            os.replace(tmp, path)
            return
        # Existing folder: replace our two files one by one (each rename is atomic) and drop stale
        # shards from an earlier sharded save, which load_hf_checkpoint would otherwise also read.
        stale = set(glob.glob(os.path.join(path, "*.safetensors")))
        stale |= set(glob.glob(os.path.join(path, "model.safetensors.index.json")))
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            os.replace(os.path.join(tmp, name), os.path.join(path, name))
            stale.discard(os.path.join(path, name))
        for old in stale:
            os.remove(old)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
