"""Tiny Hugging Face checkpoints in the layouts users bring, written with the project's own writers
(safetensors + json; no torch), from the committed text fixture tests/fixtures/hf_tiny:

  text        hf_tiny itself (Qwen3_5MoeForCausalLM, one model.safetensors)
  multimodal  the published form (Qwen3_5MoeForConditionalGeneration, model_type qwen3_5_moe):
              text_config + vision_config, the text model under model.language_model.*, a small
              vision tower under model.visual.* (names and shapes from
              tests/fixtures/hf_layouts/vision_tensors.json, which scripts/make_vision_manifest.py
              takes from transformers), multi-token-prediction tensors mtp.*, three shards with an
              index, a preprocessor_config.json, some tensors stored as bfloat16
  tied        hf_tiny with tie_word_embeddings: true and no lm_head.weight

Run as a script to write all three into a folder: python tests/hf_layouts.py OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY = FIXTURES / "hf_tiny"
VISION_MANIFEST = FIXTURES / "hf_layouts" / "vision_tensors.json"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
LAYOUTS = ("text", "multimodal", "tied")
# Multi-token-prediction tensors as the published checkpoints name them (transformers does not load them).
MTP_SHAPES = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,), "mtp.pre_fc_norm_embedding.weight": (64,),
              "mtp.pre_fc_norm_hidden.weight": (64,), "mtp.layers.0.input_layernorm.weight": (64,)}


def text_config() -> dict:
    return json.loads((HF_TINY / "config.json").read_text())


def text_state() -> dict[str, np.ndarray]:
    return load_file(str(HF_TINY / "model.safetensors"))


def write_checkpoint(dst: Path, config: dict, shards: list[dict[str, np.ndarray]], side_from: Path = HF_TINY) -> Path:
    """config.json, the shards (with an index when more than one) and the tokenizer side files."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, tensors in enumerate(shards):
            name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(tensors, str(dst / name), metadata={"format": "pt"})
            weight_map.update({t: name for t in tensors})
        total = sum(a.nbytes for s in shards for a in s.values())
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    for name in SIDE_FILES:
        if (side_from / name).is_file():
            shutil.copyfile(side_from / name, dst / name)
    return dst


def _random(rng, shape, dtype=np.float32) -> np.ndarray:
    # Values over many binades, so a copy that rounds or reorders anything shows.
    return (rng.standard_normal(shape) * np.exp2(rng.integers(-12, 4, shape))).astype(dtype)


def multimodal_config() -> dict:
    manifest = json.loads(VISION_MANIFEST.read_text())
    text = {k: v for k, v in text_config().items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "qwen3_5_moe_text"
    # Multimodal rotary: three position rows (identical for text), sections over the rotary half-dims.
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    text["max_position_embeddings"] = 4096  # not transformers' default: an export must keep it
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": manifest["vision_config"],
        "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253,
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
    }


def multimodal_tensors(seed: int = 0) -> tuple[dict, dict, dict]:
    """(text tensors under the multimodal names, vision tower, MTP) with some stored as bfloat16."""
    rng = np.random.default_rng(seed)
    text = {}
    for name, value in text_state().items():
        new = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
        text[new] = value
    # A source that stores some trained tensors narrower than the run trains them: written back so.
    for name in ("model.language_model.layers.0.input_layernorm.weight", "model.language_model.norm.weight"):
        text[name] = text[name].astype(ml_dtypes.bfloat16)
    manifest = json.loads(VISION_MANIFEST.read_text())
    vision = {name: _random(rng, shape, ml_dtypes.bfloat16 if i % 3 == 0 else np.float32)
              for i, (name, shape) in enumerate(sorted(manifest["tensors"].items()))}
    mtp = {name: _random(rng, shape) for name, shape in MTP_SHAPES.items()}
    return text, vision, mtp


def build(layout: str, dst: Path) -> Path:
    if layout == "text":
        shutil.copytree(HF_TINY, dst, dirs_exist_ok=True)
        return dst
    if layout == "tied":
        state = {k: v for k, v in text_state().items() if k != "lm_head.weight"}
        return write_checkpoint(dst, text_config() | {"tie_word_embeddings": True}, [state])
    if layout == "multimodal":
        text, vision, mtp = multimodal_tensors()
        names = sorted(text)
        # Three shards that mix the kinds: the text model split in two, the vision tower and MTP beside it.
        half = len(names) // 2
        shards = [{**{n: text[n] for n in names[:half]}, **dict(list(vision.items())[::2])},
                  {n: text[n] for n in names[half:]},
                  {**dict(list(vision.items())[1::2]), **mtp}]
        out = write_checkpoint(dst, multimodal_config(), shards)
        (out / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2}, indent=2) + "\n")
        return out
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for layout in LAYOUTS:
        build(layout, root / layout)
        print(f"wrote {root / layout}")
