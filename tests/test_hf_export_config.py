"""config.json of an export from a recipe start (no source checkpoint), field by field.

The recipe sets every model field to a value that neither the importer's fallbacks (head_dim =
hidden / heads, rope_theta 10000, partial_rotary_factor 1, untied, a full-attention layer every
fourth) nor the schema's defaults give, and that differs from its neighbours (routed and shared
expert widths, GDN key and value dims and heads, query and key/value heads), so a field dropped,
hard-coded or swapped on the way out reads back wrong. Three readers check it: the Hugging Face
keys written out here by hand from the recipe (independent of both our exporter and importer);
our importer (`recipe=hf:DIR`, which a fine-tune of the export uses); and, where torch and
transformers are installed, transformers' own config class.
"""

from __future__ import annotations

import json

import jax
import pytest

from broken_variants import mutated
from hybridmoe import hf
from hybridmoe.hf import config_fields
from hybridmoe.recipe import load_config
from hybridmoe.run.hf_io import export_hf_checkpoint
from hybridmoe.run.setup import build, init_state

RECIPE = ("model.vocab_size=272", "model.num_layers=4", "model.layer_pattern=[gdn,attention]", "model.num_heads=4",
          "model.num_kv_heads=1", "model.head_dim=32", "model.rope_theta=500000.0", "model.partial_rotary_factor=0.5",
          "model.gdn_num_key_heads=1", "model.gdn_num_value_heads=3", "model.gdn_key_dim=8", "model.gdn_value_dim=24",
          "model.gdn_conv_kernel=3", "model.num_experts=6", "model.num_experts_per_tok=3",
          "model.moe_intermediate_size=24", "model.shared_expert_intermediate_size=40", "model.rms_norm_eps=3e-5",
          "model.tie_word_embeddings=true", "mesh.data=8", "mesh.fsdp=1")

# The Hugging Face keys the recipe must become (Qwen3.5-MoE text config names), written from RECIPE.
WANT_HF = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 272, "hidden_size": 64, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 32, "linear_num_key_heads": 1, "linear_num_value_heads": 3, "linear_key_head_dim": 8,
    "linear_value_head_dim": 24, "linear_conv_kernel_dim": 3, "num_experts": 6, "num_experts_per_tok": 3,
    "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "rms_norm_eps": 3e-5,
    "tie_word_embeddings": True,
}
WANT_ROPE = {"rope_theta": 500000.0, "partial_rotary_factor": 0.5}

BROKEN = {
    "head_dim_dropped": ('"head_dim": f["head_dim"],', ""),
    "rope_theta_hard_coded": ('"rope_theta": f["rope_theta"],', '"rope_theta": 10000.0,'),
    "intermediate_sizes_swapped": (
        '"moe_intermediate_size": f["moe_intermediate_size"],\n'
        '        "shared_expert_intermediate_size": f["shared_expert_intermediate_size"],',
        '"moe_intermediate_size": f["shared_expert_intermediate_size"],\n'
        '        "shared_expert_intermediate_size": f["moe_intermediate_size"],'),
    "partial_rotary_dropped": ('"partial_rotary_factor": f["partial_rotary_factor"],', ""),
    "kv_heads_from_heads": ('"num_key_value_heads": f["num_kv_heads"],', '"num_key_value_heads": f["num_heads"],'),
    "gdn_dims_swapped": ('"linear_key_head_dim": f["gdn_key_dim"],\n        "linear_value_head_dim": f["gdn_value_dim"],',
                         '"linear_key_head_dim": f["gdn_value_dim"],\n        "linear_value_head_dim": f["gdn_key_dim"],'),
    "eps_hard_coded": ('"rms_norm_eps": f["rms_norm_eps"],', '"rms_norm_eps": 1e-6,'),
    "untied": ('"tie_word_embeddings": bool(f["tie_word_embeddings"]),', '"tie_word_embeddings": False,'),
}


@pytest.fixture(scope="module")
def recipe_state():
    cfg = load_config("tiny", list(RECIPE))
    fallbacks = {"head_dim": cfg.model.d_model // cfg.model.num_heads, "rope_theta": 10000.0,
                 "partial_rotary_factor": 1.0, "shared_expert_intermediate_size": cfg.model.moe_intermediate_size,
                 "tie_word_embeddings": False, "layer_pattern": ("gdn", "gdn", "gdn", "attention")}
    assert all(getattr(cfg.model, k) != v for k, v in fallbacks.items())  # the fixture can show each bug
    setup = build(cfg)
    return cfg, init_state(setup, jax.random.key(0))["params"]


def _export(tmp_path, recipe_state, monkeypatch, variant):
    if variant is not None:
        broken = mutated(config_fields, "hf_config_from_model_fields", *BROKEN[variant])
        monkeypatch.setattr(config_fields, "hf_config_from_model_fields", broken)
        monkeypatch.setattr(hf, "hf_config_from_model_fields", broken)
    cfg, params = recipe_state
    out = tmp_path / "export"
    export_hf_checkpoint(out, cfg, params)  # what `train --export-hf` does after a recipe start
    return cfg, out


def _mismatches(cfg, out) -> list[str]:
    written = json.loads((out / "config.json").read_text())
    bad = [f"config.json {k}: {written.get(k)!r}, want {v!r}" for k, v in WANT_HF.items() if written.get(k) != v]
    rope = written.get("rope_parameters", {})
    bad += [f"config.json rope_parameters.{k}: {rope.get(k)!r}, want {v!r}" for k, v in WANT_ROPE.items()
            if rope.get(k) != v]
    try:  # our importer, as `recipe=hf:DIR` reads the export
        back = load_config(f"hf:{out}", ["mesh.data=8", "mesh.fsdp=1"]).model
    except Exception as e:  # noqa: BLE001 - a broken export may not even load: that is a mismatch too
        return [*bad, f"recipe=hf:{out}: {e}"]
    for k in hf.FIELD_NAMES:
        got, want = getattr(back, k), getattr(cfg.model, k)
        if got != want:
            bad.append(f"imported model.{k}: {got!r}, want {want!r}")
    return bad


@pytest.mark.parametrize("variant", [None, *BROKEN])
def test_recipe_export_config_reads_back_field_by_field(variant, recipe_state, tmp_path, monkeypatch):
    cfg, out = _export(tmp_path, recipe_state, monkeypatch, variant)
    bad = _mismatches(cfg, out)
    print(f"{variant or 'clean'}: {bad}")
    assert (not bad) if variant is None else bad


def test_recipe_export_config_loads_in_transformers(recipe_state, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg, out = _export(tmp_path, recipe_state, monkeypatch, None)
    config = transformers.AutoConfig.from_pretrained(out)
    assert type(config).__name__ == "Qwen3_5MoeTextConfig"
    for k, v in WANT_HF.items():
        if k != "model_type":
            assert getattr(config, k) == v, (k, getattr(config, k), v)
    rope = getattr(config, "rope_parameters", None) or {}
    for k, v in WANT_ROPE.items():
        assert rope.get(k, getattr(config, k, None)) == v, (k, rope)
