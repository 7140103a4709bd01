"""config.json of a Qwen3.5-MoE / Qwen3-Next checkpoint <-> the native model fields.

A multimodal checkpoint (model_type qwen3_5_moe) nests the text model's fields under text_config.
"""

from __future__ import annotations

from typing import Any

FIELD_NAMES = (
    "vocab_size", "d_model", "num_layers", "layer_pattern", "num_heads", "num_kv_heads", "head_dim",
    "rope_theta", "partial_rotary_factor", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_dim",
    "gdn_value_dim", "gdn_conv_kernel", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings",
)
SUPPORTED_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
HF_LAYER_KIND = {"linear_attention": "gdn", "full_attention": "attention"}
NATIVE_LAYER_KIND = {v: k for k, v in HF_LAYER_KIND.items()}


def field_dict(fields) -> dict[str, Any]:
    """Accept a plain dict of model fields or the project's ModelConfig section."""
    if hasattr(fields, "model_dump"):
        fields = fields.model_dump()
    missing = [k for k in FIELD_NAMES if k not in fields]
    if missing:
        raise ValueError(f"model fields: missing {', '.join(missing)}")
    return {k: fields[k] for k in FIELD_NAMES}


def _smallest_period(kinds: list[str]) -> tuple[str, ...]:
    n = len(kinds)
    for p in range(1, n + 1):
        if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
            return tuple(kinds[:p])
    raise AssertionError("unreachable: the whole list is always a period")


def model_fields_from_hf_config(config_json: dict) -> dict:
    """The project's `model.*` values for a Qwen3.5-MoE (text or multimodal) or Qwen3-Next config.json.

    Raises ValueError naming the config field for anything the native model does not express.
    """
    model_type = config_json.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    text = config_json["text_config"] if "text_config" in config_json else config_json

    def need(key):
        if key not in text:
            raise ValueError(f"config.json: missing field {key!r}")
        return text[key]

    def reject(key, value, why):
        raise ValueError(f"config.json: {key}={value!r} is not supported: {why}")

    # A multimodal config keeps tie_word_embeddings on the outer object (the head belongs to the
    # outer model); its text_config may repeat it, and then the two must agree.
    places = [where["tie_word_embeddings"] for where in (config_json, text) if "tie_word_embeddings" in where]
    if len(set(map(bool, places))) > 1:
        reject("tie_word_embeddings", places[0], f"text_config.tie_word_embeddings={places[1]!r} disagrees")
    tied = bool(places[0]) if places else False
    if text.get("attention_bias", False):
        reject("attention_bias", True, "attention projections have no biases")
    if text.get("hidden_act", "silu") != "silu":
        reject("hidden_act", text["hidden_act"], "only silu (SwiGLU experts, SiLU conv) is implemented")
    if text.get("mlp_only_layers"):
        reject("mlp_only_layers", text["mlp_only_layers"], "every layer must hold the MoE block")
    if text.get("decoder_sparse_step", 1) != 1:
        reject("decoder_sparse_step", text["decoder_sparse_step"], "every layer must hold the MoE block")
    if not text.get("attn_output_gate", True):
        reject("attn_output_gate", False, "the attention always has its sigmoid output gate")

    # Rotary: transformers 5 nests it in rope_parameters; older config.json files keep it flat.
    rope = dict(text.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and key in text:
            rope[key] = text[key]
    if text.get("rope_scaling"):
        reject("rope_scaling", text["rope_scaling"], "only the default rotary embedding is implemented")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        reject("rope_parameters.rope_type", rope_type, "only the default rotary embedding is implemented")
    if "rope_theta" not in rope:
        raise ValueError("config.json: missing field 'rope_parameters.rope_theta'")
    # mrope_section / mrope_interleaved only matter for image/video positions: for text the three
    # position rows are identical, so multimodal rope reduces to the plain rotary embedding.

    num_layers = need("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        reject("layer_types", layer_types, f"has {len(layer_types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted(set(layer_types) - set(HF_LAYER_KIND))
    if unknown:
        reject("layer_types", unknown, f"layer kinds must be among {sorted(HF_LAYER_KIND)}")
    pattern = _smallest_period([HF_LAYER_KIND[t] for t in layer_types])

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = text.get("head_dim") or hidden // heads
    key_heads, value_heads = need("linear_num_key_heads"), need("linear_num_value_heads")
    if value_heads % key_heads:
        reject("linear_num_value_heads", value_heads, f"must be a multiple of linear_num_key_heads={key_heads}")
    num_experts = need("num_experts")
    if num_experts <= 0:
        reject("num_experts", num_experts, "the native model always has routed experts")
    shared = need("shared_expert_intermediate_size")
    if shared <= 0:
        reject("shared_expert_intermediate_size", shared, "Qwen3.5-MoE always has a shared expert")
    return {
        "vocab_size": need("vocab_size"),
        "d_model": hidden,
        "num_layers": num_layers,
        "layer_pattern": pattern,
        "num_heads": heads,
        "num_kv_heads": need("num_key_value_heads"),
        "head_dim": head_dim,
        "rope_theta": float(rope["rope_theta"]),
        "partial_rotary_factor": float(rope.get("partial_rotary_factor", 1.0)),
        "gdn_num_key_heads": key_heads,
        "gdn_num_value_heads": value_heads,
        "gdn_key_dim": need("linear_key_head_dim"),
        "gdn_value_dim": need("linear_value_head_dim"),
        "gdn_conv_kernel": need("linear_conv_kernel_dim"),
        "num_experts": num_experts,
        "num_experts_per_tok": need("num_experts_per_tok"),
        "moe_intermediate_size": need("moe_intermediate_size"),
        "shared_expert_intermediate_size": shared,
        # Qwen3.5-MoE always renormalises the top-k weights and has no field for it; Qwen3-Next does.
        "norm_topk_prob": bool(text.get("norm_topk_prob", True)),
        "rms_norm_eps": float(need("rms_norm_eps")),
        "tie_word_embeddings": tied,
    }


def hf_config_from_model_fields(fields, dtype: str = "float32") -> dict:
    """A Qwen3_5MoeForCausalLM (text-only) config.json for the given model fields."""
    f = field_dict(fields)
    if not f["norm_topk_prob"]:
        raise ValueError(
            "model.norm_topk_prob=False has no Qwen3.5-MoE form (it always renormalises the top-k weights)")
    if f["num_layers"] % len(f["layer_pattern"]):
        raise ValueError(f"model.num_layers={f['num_layers']} is not a multiple of "
                         f"len(model.layer_pattern)={len(f['layer_pattern'])}")
    pattern = f["layer_pattern"]
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "dtype": dtype,
        "vocab_size": f["vocab_size"],
        "hidden_size": f["d_model"],
        "num_hidden_layers": f["num_layers"],
        "layer_types": [NATIVE_LAYER_KIND[pattern[i % len(pattern)]] for i in range(f["num_layers"])],
        "num_attention_heads": f["num_heads"],
        "num_key_value_heads": f["num_kv_heads"],
        "head_dim": f["head_dim"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": f["rope_theta"],
            "partial_rotary_factor": f["partial_rotary_factor"],
        },
        "linear_num_key_heads": f["gdn_num_key_heads"],
        "linear_num_value_heads": f["gdn_num_value_heads"],
        "linear_key_head_dim": f["gdn_key_dim"],
        "linear_value_head_dim": f["gdn_value_dim"],
        "linear_conv_kernel_dim": f["gdn_conv_kernel"],
        "num_experts": f["num_experts"],
        "num_experts_per_tok": f["num_experts_per_tok"],
        "moe_intermediate_size": f["moe_intermediate_size"],
        "shared_expert_intermediate_size": f["shared_expert_intermediate_size"],
        "hidden_act": "silu",
        "rms_norm_eps": f["rms_norm_eps"],
        "tie_word_embeddings": bool(f["tie_word_embeddings"]),
    }


def config_changes(config_json: dict, fields) -> list[str]:
    """The model fields on which `fields` differ from what `config_json` describes ("model.key: a -> b")."""
    before, after = model_fields_from_hf_config(config_json), field_dict(fields)

    def plain(v):
        return tuple(v) if isinstance(v, (list, tuple)) else v
    return [f"model.{k}: {before[k]!r} -> {after[k]!r}" for k in FIELD_NAMES if plain(before[k]) != plain(after[k])]
