"""Hugging Face Qwen3.5-MoE / Qwen3-Next tensors <-> the native weight tree.

The native tree (what `params.declare_params` describes) stacks the layers of one pattern position:
`blocks[p]` holds layers p, p + P, p + 2P, ... (P = len(layer_pattern)) on a leading axis of size
nb = num_layers / P. Hugging Face stores one tensor per layer, `nn.Linear` weights as [out, in].

Hugging Face names (prefix `model.`; multimodal checkpoints use `model.language_model.` and also
hold `model.visual.*`, and some hold multi-token-prediction `mtp.*` weights, both ignored here):
  embed_tokens.weight [V, D]         norm.weight [D]          lm_head.weight [V, D] (no prefix;
                                     absent or equal to embed_tokens with tie_word_embeddings)
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

from collections.abc import Mapping
from typing import Literal

import numpy as np

from hybridmoe.hf.config_fields import field_dict

IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
MULTIMODAL_PREFIX = "model.language_model."
TEXT_PREFIX = "model."
HEAD = "lm_head.weight"


def text_prefix(names) -> str:
    """Where a checkpoint's text model lives: under model.language_model. (multimodal) or model."""
    return MULTIMODAL_PREFIX if any(n.startswith(MULTIMODAL_PREFIX) for n in names) else TEXT_PREFIX


def is_text_tensor(name: str, prefix: str) -> bool:
    """Whether the trainer owns this tensor: the text model's and the LM head. The rest (a vision
    tower, multi-token-prediction layers, anything outside the text model) is not read, and an
    export that keeps the source's form copies it unchanged."""
    return (name == HEAD or name.startswith(prefix)) and not name.startswith(IGNORED_PREFIXES)

ExpertLayout = Literal["per_expert", "fused"]
GDNProjections = Literal["split", "interleaved"]


class _Source:
    """Hands out HF tensors by name with shape checks; errors name the file and the tensor."""

    def __init__(self, state: Mapping[str, np.ndarray], files: Mapping[str, str] | None, where: str):
        self.state = {}
        prefix = text_prefix(state)
        for name, value in state.items():
            if not is_text_tensor(name, prefix):
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
    f = field_dict(fields)
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
    }
    if not f["tie_word_embeddings"]:
        tree["lm_head"] = np.ascontiguousarray(src.take("lm_head.weight", (d["V"], d["D"])).T)
    elif "lm_head.weight" in src:
        # Some tied checkpoints also store the head; it must then be the embedding itself.
        if not np.array_equal(src.take("lm_head.weight", (d["V"], d["D"])), tree["embed"]):
            raise ValueError(f"{src.files.get('lm_head.weight', where)}: lm_head.weight differs from "
                             "model.embed_tokens.weight but config.json says tie_word_embeddings=true")
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
    f = field_dict(fields)
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
    """The tensors outside the layers: embedding, final norm, LM head (none when tied: transformers
    ties lm_head.weight to the embedding on load)."""
    f = field_dict(fields)
    d = _dims(f)
    D, V = d["D"], d["V"]
    out = {"model.embed_tokens.weight": np.ascontiguousarray(_expect("embed", tree["embed"], (V, D))),
           "model.norm.weight": np.ascontiguousarray(_expect("final_norm", tree["final_norm"], (D,)))}
    if not f["tie_word_embeddings"]:
        out["lm_head.weight"] = np.ascontiguousarray(_expect("lm_head", tree["lm_head"], (D, V)).T)
    elif "lm_head" in tree:
        raise ValueError("native tree: an lm_head leaf with model.tie_word_embeddings=true (the head is the embedding)")
    return out


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
    f = field_dict(fields)
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
