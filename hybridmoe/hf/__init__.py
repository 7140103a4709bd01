"""Hugging Face checkpoints, a leaf (imports only the standard library, numpy and safetensors):
config.json fields (config_fields.py), tensor names and layouts (weights.py), folders of
safetensors shards (files.py)."""

from hybridmoe.hf.config_fields import (FIELD_NAMES, SUPPORTED_MODEL_TYPES, hf_config_from_model_fields,
                                        model_fields_from_hf_config)
from hybridmoe.hf.files import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError, checkpoint_shards,
                                load_hf_checkpoint, read_hf_config, save_hf_checkpoint)
from hybridmoe.hf.weights import (EXPERT_LEAVES, IGNORED_PREFIXES, MULTIMODAL_PREFIX, ExpertLayout, deinterleave_qkvz,
                                  hf_to_native, interleave_qkvz, layer_shapes, layer_to_hf, native_to_hf, outer_to_hf)

__all__ = ["CONFIG_FILE", "EXPERT_LEAVES", "FIELD_NAMES", "IGNORED_PREFIXES", "INDEX_FILE", "MULTIMODAL_PREFIX",
           "SUPPORTED_MODEL_TYPES", "WEIGHTS_FILE", "CheckpointError", "ExpertLayout", "checkpoint_shards",
           "deinterleave_qkvz", "hf_config_from_model_fields", "hf_to_native", "interleave_qkvz", "layer_shapes",
           "layer_to_hf", "load_hf_checkpoint", "model_fields_from_hf_config", "native_to_hf", "outer_to_hf",
           "read_hf_config", "save_hf_checkpoint"]
