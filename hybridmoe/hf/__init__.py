"""Hugging Face checkpoints, a leaf (imports only the standard library, numpy and safetensors):
config.json fields (config_fields.py), tensor names and layouts (weights.py), folders of
safetensors shards (files.py), the form of a source folder an export keeps (source.py)."""

from hybridmoe.hf.config_fields import (FIELD_NAMES, SUPPORTED_MODEL_TYPES, config_changes, hf_config_from_model_fields,
                                        model_fields_from_hf_config)
from hybridmoe.hf.files import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError, checkpoint_shards,
                                load_hf_checkpoint, read_hf_config, save_hf_checkpoint)
from hybridmoe.hf.source import SourceForm, copy_tensors, read_source_form, shard_header
from hybridmoe.hf.weights import (EXPERT_LEAVES, HEAD, IGNORED_PREFIXES, MULTIMODAL_PREFIX, ExpertLayout,
                                  deinterleave_qkvz, hf_to_native, interleave_qkvz, is_text_tensor, layer_shapes,
                                  layer_to_hf, native_to_hf, outer_to_hf, text_prefix)

__all__ = ["CONFIG_FILE", "EXPERT_LEAVES", "FIELD_NAMES", "HEAD", "IGNORED_PREFIXES", "INDEX_FILE", "MULTIMODAL_PREFIX",
           "SUPPORTED_MODEL_TYPES", "WEIGHTS_FILE", "CheckpointError", "ExpertLayout", "SourceForm", "checkpoint_shards",
           "config_changes", "copy_tensors", "deinterleave_qkvz", "hf_config_from_model_fields", "hf_to_native",
           "interleave_qkvz", "is_text_tensor", "layer_shapes", "layer_to_hf", "load_hf_checkpoint",
           "model_fields_from_hf_config", "native_to_hf", "outer_to_hf", "read_hf_config", "read_source_form",
           "save_hf_checkpoint", "shard_header", "text_prefix"]
