"""Hugging Face Qwen3.5-MoE / Qwen3-Next checkpoints <-> the native weight tree.

The native tree (what `params.declare_params` describes) stacks the layers of one pattern position:
`blocks[p]` holds layers p, p + P, p + 2P, ... (P = len(layer_pattern)) on a leading axis of size
nb = num_layers / P. Hugging Face stores one tensor per layer, `nn.Linear` weights as [out, in].

Hugging Face names (prefix `model.`; multimodal checkpoints use `model.language_model.` and also
hold `model.visual.*`, and some hold multi-token-prediction `mtp.*` weights, both ignored here):
  embed_tokens.weight [V, D]         norm.weight [D]          lm_head.weight [V, D] (no prefix)
  layers.i.input_layernorm.weight [D]  layers.i.post_attention_layernorm.weight [D]
  attention   layers.i.self_attn.{q_proj [N*2A, D] (per head [q | gate]), k_proj, v_proj [G*A, D],
              o_proj [D, N*A]}.weight, {q_norm, k_norm}.weight [A]
  GDN         layers.i.linear_attn.in_proj_qkv.weight [2*K*k + U*v, D] rows [q | k | v],
              in_proj_z [U*v, D], in_proj_b [U, D], in_proj_a [U, D], conv1d.weight [2*K*k + U*v, 1, W]
              (channels as in_proj_qkv), A_log [U], dt_bias [U], norm.weight [v], out_proj [D, U*v]
              Qwen3-Next instead: in_proj_qkvz [2*K*k + 2*U*v, D] grouped per key head,
              [q_g | k_g | v of g's U/K value heads | z of the same], and in_proj_ba [2U, D] grouped
              per key head, [b of g's U/K value heads | a of the same].
  MoE         layers.i.mlp.gate.weight [E, D], shared_expert.{gate,up}_proj.weight [S, D],
              shared_expert.down_proj.weight [D, S], shared_expert_gate.weight [1, D], and either
              experts.{e}.{gate,up}_proj.weight [F, D] + experts.{e}.down_proj.weight [D, F]
              (what `save_pretrained` writes) or the fused experts.gate_up_proj [E, 2F, D]
              (rows [gate | up]) + experts.down_proj [E, D, F] (the in-memory module layout).

Shape legend: D model width, V vocab, E routed experts, F expert hidden, S shared-expert hidden,
N attention query heads, G attention key/value heads, A attention head dim, K GDN key heads,
U GDN value heads, k GDN key dim, v GDN value dim, W conv width, L layers, nb stacked blocks.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Literal

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so bf16 safetensors shards load
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

FIELD_NAMES = (
    "vocab_size", "d_model", "num_layers", "layer_pattern", "num_heads", "num_kv_heads", "head_dim",
    "rope_theta", "partial_rotary_factor", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_dim",
    "gdn_value_dim", "gdn_conv_kernel", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "rms_norm_eps",
)
SUPPORTED_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
HF_LAYER_KIND = {"linear_attention": "gdn", "full_attention": "attention"}
NATIVE_LAYER_KIND = {v: k for k, v in HF_LAYER_KIND.items()}
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
MULTIMODAL_PREFIX = "model.language_model."
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"

ExpertLayout = Literal["per_expert", "fused"]
GDNProjections = Literal["split", "interleaved"]


# ----------------------------------------------------------------------------------------- config


def _fields(fields) -> dict[str, Any]:
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

    # A multimodal config keeps tie_word_embeddings on the outer object; either place counts.
    for where in (config_json, text):
        if where.get("tie_word_embeddings", False):
            reject("tie_word_embeddings", True, "the native model has an untied lm_head")
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
    }


def hf_config_from_model_fields(fields, dtype: str = "float32") -> dict:
    """A Qwen3_5MoeForCausalLM (text-only) config.json for the given model fields."""
    f = _fields(fields)
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
        "tie_word_embeddings": False,
    }


# ------------------------------------------------------------------------------ tensor bookkeeping


class _Source:
    """Hands out HF tensors by name with shape checks; errors name the file and the tensor."""

    def __init__(self, state: Mapping[str, np.ndarray], files: Mapping[str, str] | None, where: str):
        self.state = {}
        for name, value in state.items():
            if name.startswith(IGNORED_PREFIXES):
                continue
            # Multimodal checkpoints nest the text model one level deeper.
            if name.startswith(MULTIMODAL_PREFIX):
                name = "model." + name[len(MULTIMODAL_PREFIX):]
            self.state[name] = value
        self.files = {}
        for name, file in (files or {}).items():
            if name.startswith(MULTIMODAL_PREFIX):
                name = "model." + name[len(MULTIMODAL_PREFIX):]
            self.files[name] = file
        self.where = where
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.state:
            raise ValueError(f"{self.where}: missing tensor {name} (expected shape {shape})")
        value = np.asarray(self.state[name])
        if tuple(value.shape) != tuple(shape):
            file = self.files.get(name, self.where)
            raise ValueError(f"{file}: {name}: expected {tuple(shape)}, got {tuple(value.shape)}")
        self.used.add(name)
        return value

    def check_all_used(self) -> None:
        unused = sorted(set(self.state) - self.used)
        if unused:
            shown = ", ".join(unused[:8]) + (f", ... ({len(unused)} in all)" if len(unused) > 8 else "")
            raise ValueError(f"{self.where}: tensors the model does not use (wrong config or layout?): {shown}")


def _dims(f: dict) -> dict[str, int]:
    return {
        "D": f["d_model"], "V": f["vocab_size"], "E": f["num_experts"], "F": f["moe_intermediate_size"],
        "S": f["shared_expert_intermediate_size"], "N": f["num_heads"], "G": f["num_kv_heads"],
        "A": f["head_dim"], "K": f["gdn_num_key_heads"], "U": f["gdn_num_value_heads"],
        "k": f["gdn_key_dim"], "v": f["gdn_value_dim"], "W": f["gdn_conv_kernel"],
    }


# ------------------------------------------------------------------------------------- HF -> native


def _attention_to_native(src: _Source, pre: str, d: dict) -> dict:
    D, N, G, A = d["D"], d["N"], d["G"], d["A"]
    return {
        # Rows are per head [q_h | gate_h]; [N*2A, D] -> [D, N, 2A] keeps that split on the last axis.
        "wq": src.take(pre + "q_proj.weight", (N * 2 * A, D)).T.reshape(D, N, 2 * A),
        "wk": src.take(pre + "k_proj.weight", (G * A, D)).T.reshape(D, G, A),
        "wv": src.take(pre + "v_proj.weight", (G * A, D)).T.reshape(D, G, A),
        "q_norm": src.take(pre + "q_norm.weight", (A,)),
        "k_norm": src.take(pre + "k_norm.weight", (A,)),
        "wo": src.take(pre + "o_proj.weight", (D, N * A)).T.reshape(N, A, D),
    }


def deinterleave_qkvz(qkvz: np.ndarray, ba: np.ndarray, d: dict) -> tuple[np.ndarray, ...]:
    """Qwen3-Next's grouped in_proj_qkvz [2Kk + 2Uv, D] and in_proj_ba [2U, D] -> the Qwen3.5 split
    projections (in_proj_qkv [2Kk + Uv, D], in_proj_z [Uv, D], in_proj_b [U, D], in_proj_a [U, D]).

    Key head g owns value heads g*r .. g*r + r - 1 (r = U / K), the same grouping as the
    repeat_interleave of key heads onto value heads, so the value-head order is unchanged.
    """
    D, K, U, k, v = d["D"], d["K"], d["U"], d["k"], d["v"]
    r = U // K
    grouped = qkvz.reshape(K, 2 * k + 2 * r * v, D)
    q, kk = grouped[:, :k], grouped[:, k:2 * k]
    vv, z = grouped[:, 2 * k:2 * k + r * v], grouped[:, 2 * k + r * v:]
    qkv = np.concatenate([q.reshape(K * k, D), kk.reshape(K * k, D), vv.reshape(U * v, D)], axis=0)
    ba_grouped = ba.reshape(K, 2 * r, D)
    b, a = ba_grouped[:, :r].reshape(U, D), ba_grouped[:, r:].reshape(U, D)
    return qkv, z.reshape(U * v, D), b, a


def interleave_qkvz(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray,
                    d: dict) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `deinterleave_qkvz`: split projections -> Qwen3-Next's (in_proj_qkvz, in_proj_ba)."""
    D, K, U, k, v = d["D"], d["K"], d["U"], d["k"], d["v"]
    r = U // K
    q, kk, vv = qkv[:K * k], qkv[K * k:2 * K * k], qkv[2 * K * k:]
    grouped = np.concatenate(
        [q.reshape(K, k, D), kk.reshape(K, k, D), vv.reshape(K, r * v, D), z.reshape(K, r * v, D)], axis=1
    )
    ba = np.concatenate([b.reshape(K, r, D), a.reshape(K, r, D)], axis=1)
    return grouped.reshape(K * (2 * k + 2 * r * v), D), ba.reshape(2 * U, D)


def _gdn_to_native(src: _Source, pre: str, d: dict) -> dict:
    D, K, U, k, v, W = d["D"], d["K"], d["U"], d["k"], d["v"], d["W"]
    C = 2 * K * k + U * v  # conv channels, ordered [q | k | v]
    if pre + "in_proj_qkv.weight" in src or pre + "in_proj_qkvz.weight" not in src:
        qkv = src.take(pre + "in_proj_qkv.weight", (C, D))
        z = src.take(pre + "in_proj_z.weight", (U * v, D))
        b = src.take(pre + "in_proj_b.weight", (U, D))
        a = src.take(pre + "in_proj_a.weight", (U, D))
    else:  # Qwen3-Next
        qkvz = src.take(pre + "in_proj_qkvz.weight", (2 * K * k + 2 * U * v, D))
        ba = src.take(pre + "in_proj_ba.weight", (2 * U, D))
        qkv, z, b, a = deinterleave_qkvz(qkvz, ba, d)
    # Depthwise conv [C, 1, W]; tap W-1 multiplies the current token (left padding W-1, causal).
    conv = src.take(pre + "conv1d.weight", (C, 1, W))[:, 0, :].T  # [W, C]
    return {
        "wq": qkv[:K * k].T.reshape(D, K, k),
        "wk": qkv[K * k:2 * K * k].T.reshape(D, K, k),
        "wv": qkv[2 * K * k:].T.reshape(D, U, v),
        "wz": z.T.reshape(D, U, v),
        "wb": b.T,
        "wa": a.T,
        "conv_q": conv[:, :K * k].reshape(W, K, k),
        "conv_k": conv[:, K * k:2 * K * k].reshape(W, K, k),
        "conv_v": conv[:, 2 * K * k:].reshape(W, U, v),
        "A_log": src.take(pre + "A_log", (U,)),
        "dt_bias": src.take(pre + "dt_bias", (U,)),
        "norm": src.take(pre + "norm.weight", (v,)),
        "wo": src.take(pre + "out_proj.weight", (D, U * v)).T.reshape(U, v, D),
    }


def _moe_to_native(src: _Source, pre: str, d: dict) -> dict:
    D, E, F, S = d["D"], d["E"], d["F"], d["S"]
    if pre + "experts.gate_up_proj" in src or pre + "experts.0.gate_proj.weight" not in src:
        wi = src.take(pre + "experts.gate_up_proj", (E, 2 * F, D)).transpose(0, 2, 1)  # rows [gate | up]
        wo = src.take(pre + "experts.down_proj", (E, D, F)).transpose(0, 2, 1)
    else:  # one tensor per expert, as save_pretrained writes them
        gate = [src.take(f"{pre}experts.{e}.gate_proj.weight", (F, D)) for e in range(E)]
        up = [src.take(f"{pre}experts.{e}.up_proj.weight", (F, D)) for e in range(E)]
        down = [src.take(f"{pre}experts.{e}.down_proj.weight", (D, F)) for e in range(E)]
        wi = np.stack([np.concatenate([g.T, u.T], axis=1) for g, u in zip(gate, up)])
        wo = np.stack([w.T for w in down])
    return {
        "router": src.take(pre + "gate.weight", (E, D)).T,
        "wi": wi,
        "wo": wo,
        "shared_wi": np.concatenate(
            [src.take(pre + "shared_expert.gate_proj.weight", (S, D)).T,
             src.take(pre + "shared_expert.up_proj.weight", (S, D)).T], axis=1),
        "shared_wo": src.take(pre + "shared_expert.down_proj.weight", (D, S)).T,
        "shared_gate": src.take(pre + "shared_expert_gate.weight", (1, D))[0],
    }


def hf_to_native(state: Mapping[str, np.ndarray], fields, *, files: Mapping[str, str] | None = None,
                 where: str = "state dict") -> dict:
    """HF tensors (any of the layouts in the module docstring) -> the native tree (numpy).

    `files` maps a tensor name to the file it came from and `where` names the checkpoint, both only
    for error messages. Every tensor must be used: leftovers mean a config/layout mismatch.
    """
    f = _fields(fields)
    d = _dims(f)
    src = _Source(state, files, where)
    pattern, L = tuple(f["layer_pattern"]), f["num_layers"]
    P = len(pattern)
    if L % P:
        raise ValueError(f"model.num_layers={L} is not a multiple of len(model.layer_pattern)={P}")
    layers = []
    for i in range(L):
        pre = f"model.layers.{i}."
        mixer = (_gdn_to_native(src, pre + "linear_attn.", d) if pattern[i % P] == "gdn"
                 else _attention_to_native(src, pre + "self_attn.", d))
        layers.append({
            "input_norm": src.take(pre + "input_layernorm.weight", (d["D"],)),
            "post_norm": src.take(pre + "post_attention_layernorm.weight", (d["D"],)),
            "mixer": mixer,
            "moe": _moe_to_native(src, pre + "mlp.", d),
        })
    blocks = [_stack_tree([layers[i] for i in range(p, L, P)]) for p in range(P)]
    tree = {
        "embed": src.take("model.embed_tokens.weight", (d["V"], d["D"])),
        "blocks": blocks,
        "final_norm": src.take("model.norm.weight", (d["D"],)),
        "lm_head": np.ascontiguousarray(src.take("lm_head.weight", (d["V"], d["D"])).T),
    }
    src.check_all_used()
    return tree


def _stack_tree(trees: list[dict]) -> dict:
    first = trees[0]
    return {key: (_stack_tree([t[key] for t in trees]) if isinstance(first[key], dict)
                  else np.stack([t[key] for t in trees])) for key in first}


# ------------------------------------------------------------------------------------- native -> HF


def _expect(name: str, value, shape: tuple[int, ...]) -> np.ndarray:
    value = np.asarray(value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"native tree: {name}: expected {tuple(shape)}, got {tuple(value.shape)}")
    return value


def native_to_hf(tree, fields, *, expert_layout: ExpertLayout = "per_expert",
                 gdn_projections: GDNProjections = "split") -> dict[str, np.ndarray]:
    """The native tree -> HF tensors named as `save_pretrained` writes them for Qwen3_5MoeForCausalLM.

    expert_layout: "per_expert" (what save_pretrained writes) or "fused" (experts.gate_up_proj).
    gdn_projections: "split" (Qwen3.5 in_proj_qkv/z/b/a) or "interleaved" (Qwen3-Next in_proj_qkvz/ba).
    """
    f = _fields(fields)
    d = _dims(f)
    D, V = d["D"], d["V"]
    pattern, L = tuple(f["layer_pattern"]), f["num_layers"]
    P = len(pattern)
    if L % P:
        raise ValueError(f"model.num_layers={L} is not a multiple of len(model.layer_pattern)={P}")
    nb = L // P
    if len(tree["blocks"]) != P:
        raise ValueError(f"native tree: blocks has {len(tree['blocks'])} entries for a layer pattern of {P}")
    out = {name: value for name, value in outer_to_hf(tree, f).items()}
    for p, kind in enumerate(pattern):
        blk = tree["blocks"][p]
        for path, shape in layer_shapes(kind, d).items():
            node = blk
            for key in path.split("/"):
                node = node[key]
            _expect(f"blocks[{p}]/{path}", node, (nb, *shape))
        for b in range(nb):
            layer = _map_arrays(lambda a, b=b: np.asarray(a)[b], blk)
            out.update(layer_to_hf(kind, p + b * P, layer, f, expert_layout=expert_layout,
                                   gdn_projections=gdn_projections))
    return out


def _map_arrays(fn, tree):
    """fn on every array of a nested dict (the native tree's blocks are plain dicts of arrays)."""
    return {k: _map_arrays(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def outer_to_hf(tree, fields) -> dict[str, np.ndarray]:
    """The tensors outside the layers: embedding, final norm, LM head."""
    d = _dims(_fields(fields))
    D, V = d["D"], d["V"]
    return {"model.embed_tokens.weight": np.ascontiguousarray(_expect("embed", tree["embed"], (V, D))),
            "model.norm.weight": np.ascontiguousarray(_expect("final_norm", tree["final_norm"], (D,))),
            "lm_head.weight": np.ascontiguousarray(_expect("lm_head", tree["lm_head"], (D, V)).T)}


def layer_shapes(kind: str, d: dict, num_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's native leaves (the stacked axis dropped), by path in the block."""
    D, F, S = d["D"], d["F"], d["S"]
    E = d["E"] if num_experts is None else num_experts
    N, G, A, K, U, k, v, W = d["N"], d["G"], d["A"], d["K"], d["U"], d["k"], d["v"], d["W"]
    shapes = {"input_norm": (D,), "post_norm": (D,), "moe/router": (D, d["E"]), "moe/wi": (E, D, 2 * F),
              "moe/wo": (E, F, D), "moe/shared_wi": (D, 2 * S), "moe/shared_wo": (S, D), "moe/shared_gate": (D,)}
    if kind == "attention":
        mixer = {"wq": (D, N, 2 * A), "wk": (D, G, A), "wv": (D, G, A), "q_norm": (A,), "k_norm": (A,),
                 "wo": (N, A, D)}
    else:
        mixer = {"wq": (D, K, k), "wk": (D, K, k), "wv": (D, U, v), "wz": (D, U, v), "wb": (D, U), "wa": (D, U),
                 "conv_q": (W, K, k), "conv_k": (W, K, k), "conv_v": (W, U, v), "A_log": (U,), "dt_bias": (U,),
                 "norm": (v,), "wo": (U, v, D)}
    return {**shapes, **{"mixer/" + name: shape for name, shape in mixer.items()}}


EXPERT_LEAVES = ("moe/wi", "moe/wo")


def layer_to_hf(kind: str, index: int, layer: dict, fields, *, expert_layout: ExpertLayout = "per_expert",
                gdn_projections: GDNProjections = "split", experts: tuple[int, int] | None = None,
                parts: tuple[str, ...] = ("dense", "experts")) -> dict[str, np.ndarray]:
    """One layer's native leaves (no stacked axis) -> its HF tensors.

    parts: "dense" (everything but the routed experts) and/or "experts". experts=(e0, e1): the
    layer's moe/wi and moe/wo hold only experts e0 .. e1 - 1 (per_expert layout), so a sharded
    export can write a layer's experts in pieces.
    """
    f = _fields(fields)
    d = _dims(f)
    D, E, F, S = d["D"], d["E"], d["F"], d["S"]
    N, G, A, K, U, k, v, W = d["N"], d["G"], d["A"], d["K"], d["U"], d["k"], d["v"], d["W"]
    e0, e1 = experts if experts is not None else (0, E)
    if experts is not None and expert_layout != "per_expert":
        raise ValueError("a piece of a layer's experts has only the per_expert layout")
    out: dict[str, np.ndarray] = {}

    def put(name, value):
        out[name] = np.ascontiguousarray(value)

    def leaf(path):
        node = layer
        for key in path.split("/"):
            node = node[key]
        shape = layer_shapes(kind, d, e1 - e0)[path]
        return _expect(f"layer {index} {path}", node, shape)

    pre = f"model.layers.{index}."
    e = pre + "mlp."
    if "dense" in parts:
        put(pre + "input_layernorm.weight", leaf("input_norm"))
        put(pre + "post_attention_layernorm.weight", leaf("post_norm"))
        m = {name: leaf("mixer/" + name) for name in
             [p.split("/", 1)[1] for p in layer_shapes(kind, d) if p.startswith("mixer/")]}
        if kind == "attention":
            a = pre + "self_attn."
            put(a + "q_proj.weight", m["wq"].reshape(D, N * 2 * A).T)
            put(a + "k_proj.weight", m["wk"].reshape(D, G * A).T)
            put(a + "v_proj.weight", m["wv"].reshape(D, G * A).T)
            put(a + "o_proj.weight", m["wo"].reshape(N * A, D).T)
            put(a + "q_norm.weight", m["q_norm"])
            put(a + "k_norm.weight", m["k_norm"])
        else:
            g = pre + "linear_attn."
            qkv = np.concatenate(
                [m["wq"].reshape(D, K * k), m["wk"].reshape(D, K * k), m["wv"].reshape(D, U * v)], axis=1).T
            z, bb, aa = m["wz"].reshape(D, U * v).T, m["wb"].T, m["wa"].T
            if gdn_projections == "split":
                put(g + "in_proj_qkv.weight", qkv)
                put(g + "in_proj_z.weight", z)
                put(g + "in_proj_b.weight", bb)
                put(g + "in_proj_a.weight", aa)
            elif gdn_projections == "interleaved":
                qkvz, ba = interleave_qkvz(qkv, z, bb, aa, d)
                put(g + "in_proj_qkvz.weight", qkvz)
                put(g + "in_proj_ba.weight", ba)
            else:
                raise ValueError(f"gdn_projections={gdn_projections!r}: expected 'split' or 'interleaved'")
            conv = np.concatenate(
                [m["conv_q"].reshape(W, K * k), m["conv_k"].reshape(W, K * k), m["conv_v"].reshape(W, U * v)], axis=1)
            put(g + "conv1d.weight", conv.T[:, None, :])
            put(g + "A_log", m["A_log"])
            put(g + "dt_bias", m["dt_bias"])
            put(g + "norm.weight", m["norm"])
            put(g + "out_proj.weight", m["wo"].reshape(U * v, D).T)
        put(e + "gate.weight", leaf("moe/router").T)
        shared_wi = leaf("moe/shared_wi")
        put(e + "shared_expert.gate_proj.weight", shared_wi[:, :S].T)
        put(e + "shared_expert.up_proj.weight", shared_wi[:, S:].T)
        put(e + "shared_expert.down_proj.weight", leaf("moe/shared_wo").T)
        put(e + "shared_expert_gate.weight", leaf("moe/shared_gate")[None, :])
    if "experts" in parts:
        wi, wo = leaf("moe/wi"), leaf("moe/wo")  # [Ec, D, 2F] (columns [gate | up]), [Ec, F, D]
        if expert_layout == "per_expert":
            for x in range(e1 - e0):
                put(f"{e}experts.{e0 + x}.gate_proj.weight", wi[x, :, :F].T)
                put(f"{e}experts.{e0 + x}.up_proj.weight", wi[x, :, F:].T)
                put(f"{e}experts.{e0 + x}.down_proj.weight", wo[x].T)
        elif expert_layout == "fused":
            put(e + "experts.gate_up_proj", wi.transpose(0, 2, 1))
            put(e + "experts.down_proj", wo.transpose(0, 2, 1))
        else:
            raise ValueError(f"expert_layout={expert_layout!r}: expected 'per_expert' or 'fused'")
    return out


# ------------------------------------------------------------------------------------------- files


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
    for shard in checkpoint_shards(path):
        try:
            with safe_open(shard, framework="numpy") as fh:
                for name in fh.keys():
                    if name.startswith(IGNORED_PREFIXES):
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
