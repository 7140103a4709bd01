"""Hugging Face interop: the converters against the committed tiny Qwen3.5-MoE fixture.

The fixture (tests/fixtures/hf_tiny, made by scripts/make_hf_fixture.py with the Hugging Face
reference) holds a checkpoint as save_pretrained writes it, token ids and the reference's next-token
log-probs. Everything here runs on CPU without torch; the live tests at the end run the reference
itself when torch and transformers are installed.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hybridmoe import hf

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
LOGPROB_ATOL = 2e-4  # float32 end to end; observed differences are ~1e-5

FIXTURE_FIELDS = {
    "vocab_size": 256, "d_model": 64, "num_layers": 4, "layer_pattern": ("gdn", "gdn", "gdn", "attention"),
    "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "gdn_num_key_heads": 2, "gdn_num_value_heads": 4, "gdn_key_dim": 16, "gdn_value_dim": 16,
    "gdn_conv_kernel": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def fixture_config() -> dict:
    with open(os.path.join(FIXTURE, "config.json")) as fh:
        return json.load(fh)


def fixture_state() -> dict[str, np.ndarray]:
    return load_file(os.path.join(FIXTURE, "model.safetensors"))


def flat(tree, prefix=""):
    """{'blocks/0/mixer/wq': array, ...} for comparing trees leaf by leaf."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): np.asarray(tree)}


def assert_trees_equal(a, b):
    fa, fb = flat(a), flat(b)
    assert sorted(fa) == sorted(fb)
    for key in fa:
        assert fa[key].dtype == fb[key].dtype, key
        np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)


def assert_states_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _zeros_tree(f: dict) -> dict:
    """A native tree of zeros with the shapes `f` implies (only its shapes are used)."""
    D, V, E = f["d_model"], f["vocab_size"], f["num_experts"]
    F, S = f["moe_intermediate_size"], f["shared_expert_intermediate_size"]
    N, G, A = f["num_heads"], f["num_kv_heads"], f["head_dim"]
    K, U, W = f["gdn_num_key_heads"], f["gdn_num_value_heads"], f["gdn_conv_kernel"]
    k, v = f["gdn_key_dim"], f["gdn_value_dim"]
    nb = f["num_layers"] // len(f["layer_pattern"])
    z = lambda *s: np.zeros((nb, *s), np.float32)  # noqa: E731
    mixers = {
        "attention": lambda: {"wq": z(D, N, 2 * A), "wk": z(D, G, A), "wv": z(D, G, A), "q_norm": z(A),
                              "k_norm": z(A), "wo": z(N, A, D)},
        "gdn": lambda: {"wq": z(D, K, k), "wk": z(D, K, k), "wv": z(D, U, v), "wz": z(D, U, v), "wb": z(D, U),
                        "wa": z(D, U), "conv_q": z(W, K, k), "conv_k": z(W, K, k), "conv_v": z(W, U, v),
                        "A_log": z(U), "dt_bias": z(U), "norm": z(v), "wo": z(U, v, D)},
    }
    moe = lambda: {"router": z(D, E), "wi": z(E, D, 2 * F), "wo": z(E, F, D), "shared_wi": z(D, 2 * S),  # noqa: E731
                   "shared_wo": z(S, D), "shared_gate": z(D)}
    return {
        "embed": np.zeros((V, D), np.float32),
        "blocks": [{"input_norm": z(D), "post_norm": z(D), "mixer": mixers[kind](), "moe": moe()}
                   for kind in f["layer_pattern"]],
        "final_norm": np.zeros((D,), np.float32),
        "lm_head": np.zeros((D, V), np.float32),
    }


def random_hf_state(fields: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF tensors for `fields`, scaled like a trained model (activations O(1), norms near
    identity, decays in a useful range), in save_pretrained's per-expert layout."""
    rng = np.random.default_rng(seed)
    names_and_shapes = {k: v.shape for k, v in hf.native_to_hf(_zeros_tree(fields), fields).items()}
    state = {}
    for name, shape in names_and_shapes.items():
        n = rng.standard_normal(shape)
        if name.endswith("A_log"):
            value = np.log(rng.uniform(0.05, 2.0, shape))
        elif name.endswith("dt_bias"):
            value = 0.5 * n
        elif name.endswith("linear_attn.norm.weight"):
            value = 1.0 + 0.2 * n  # gated RMSNorm scales by w
        elif name.endswith("norm.weight"):
            value = 0.2 * n  # the other RMSNorms scale by (1 + w)
        elif name.endswith("conv1d.weight"):
            value = 0.5 * n
        elif name.endswith("embed_tokens.weight"):
            value = n
        elif name.endswith(("lm_head.weight", "mlp.gate.weight")):
            value = 2.0 * n / np.sqrt(shape[1])
        else:  # nn.Linear [out, in]
            value = n / np.sqrt(shape[1])
        state[name] = value.astype(np.float32)
    return state


def random_native_tree(fields: dict, seed: int = 0) -> dict:
    return hf.hf_to_native(random_hf_state(fields, seed), fields)


def to_fused_experts(state: dict) -> dict:
    """Per-expert tensors -> the fused experts.gate_up_proj [E, 2F, D] / experts.down_proj [E, D, F]."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    layers = sorted({int(k.split(".")[2]) for k in state if ".mlp.experts." in k})
    for i in layers:
        pre = f"model.layers.{i}.mlp.experts."
        E = len({k for k in state if k.startswith(pre) and k.endswith(".gate_proj.weight")})
        out[pre + "gate_up_proj"] = np.stack(
            [np.concatenate([state[f"{pre}{e}.gate_proj.weight"], state[f"{pre}{e}.up_proj.weight"]])
             for e in range(E)])
        out[pre + "down_proj"] = np.stack([state[f"{pre}{e}.down_proj.weight"] for e in range(E)])
    return out


# ------------------------------------------------------------------------------------------ config


def test_fields_from_fixture_config():
    assert hf.model_fields_from_hf_config(fixture_config()) == FIXTURE_FIELDS


def test_config_round_trip():
    config = hf.hf_config_from_model_fields(FIXTURE_FIELDS)
    assert config["layer_types"] == fixture_config()["layer_types"]
    assert hf.model_fields_from_hf_config(config) == FIXTURE_FIELDS


def test_fields_accept_model_config_section():
    schema = pytest.importorskip("hybridmoe.config.schema")
    cfg = schema.ModelConfig(**FIXTURE_FIELDS)
    assert hf.hf_config_from_model_fields(cfg) == hf.hf_config_from_model_fields(FIXTURE_FIELDS)


def test_multimodal_and_flat_rope_configs():
    text = fixture_config()
    outer = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
             "text_config": {**text, "rope_parameters": {**text["rope_parameters"], "mrope_section": [11, 11, 10],
                                                           "mrope_interleaved": True}}}
    assert hf.model_fields_from_hf_config(outer) == FIXTURE_FIELDS
    # Qwen3-Next config.json files keep rope_theta flat and have norm_topk_prob.
    flat_rope = {k: v for k, v in text.items() if k != "rope_parameters"}
    flat_rope |= {"model_type": "qwen3_next", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                  "norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 1}
    assert hf.model_fields_from_hf_config(flat_rope) == FIXTURE_FIELDS | {"norm_topk_prob": False}


def test_layer_pattern_is_the_smallest_period():
    config = fixture_config() | {"num_hidden_layers": 8, "layer_types": fixture_config()["layer_types"] * 2}
    fields = hf.model_fields_from_hf_config(config)
    assert fields["layer_pattern"] == ("gdn", "gdn", "gdn", "attention") and fields["num_layers"] == 8
    del config["layer_types"]  # falls back to full_attention_interval (default 4), as transformers does
    assert hf.model_fields_from_hf_config(config)["layer_pattern"] == ("gdn", "gdn", "gdn", "attention")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"model_type": "llama"}, "model_type"),
    ],
)
def test_unsupported_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        hf.model_fields_from_hf_config(fixture_config() | change)


def test_missing_config_field_is_named():
    config = fixture_config()
    del config["moe_intermediate_size"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        hf.model_fields_from_hf_config(config)


def test_renormalised_routing_is_required_for_qwen35_output():
    with pytest.raises(ValueError, match="norm_topk_prob"):
        hf.hf_config_from_model_fields(FIXTURE_FIELDS | {"norm_topk_prob": False})


# ----------------------------------------------------------------------------------------- weights


def test_fixture_round_trip_is_exact():
    state = fixture_state()
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in state)  # save_pretrained's per-expert form
    tree = hf.hf_to_native(state, FIXTURE_FIELDS)
    assert_states_equal(hf.native_to_hf(tree, FIXTURE_FIELDS), state)


def test_native_tree_layout():
    tree = hf.hf_to_native(fixture_state(), FIXTURE_FIELDS)
    state = fixture_state()
    gdn, attn = tree["blocks"][0], tree["blocks"][3]
    assert gdn["mixer"]["wq"].shape == (1, 64, 2, 16) and gdn["mixer"]["conv_v"].shape == (1, 4, 4, 16)
    assert attn["mixer"]["wq"].shape == (1, 64, 4, 32) and attn["moe"]["wi"].shape == (1, 8, 64, 64)
    # Query projection: per head [q_h | gate_h] along the last axis.
    q_proj = state["model.layers.3.self_attn.q_proj.weight"]  # [N * 2A, D]
    np.testing.assert_array_equal(attn["mixer"]["wq"][0, :, 1, :16], q_proj[32:48].T)   # head 1 query
    np.testing.assert_array_equal(attn["mixer"]["wq"][0, :, 1, 16:], q_proj[48:64].T)   # head 1 gate
    # Experts: columns [:F] gate, [F:] up.
    expert5 = "model.layers.3.mlp.experts.5."
    np.testing.assert_array_equal(attn["moe"]["wi"][0, 5, :, :32], state[expert5 + "gate_proj.weight"].T)
    np.testing.assert_array_equal(attn["moe"]["wi"][0, 5, :, 32:], state[expert5 + "up_proj.weight"].T)
    # Conv taps: native index W-1 is the current token = the last tap of the torch kernel.
    conv = state["model.layers.0.linear_attn.conv1d.weight"]  # [C, 1, W], channels [q | k | v]
    np.testing.assert_array_equal(gdn["mixer"]["conv_k"][0, 3, 1, :], conv[32 + 16:32 + 32, 0, 3])
    np.testing.assert_array_equal(gdn["mixer"]["conv_v"][0, 0, 2, :], conv[64 + 32:64 + 48, 0, 0])


def test_fused_expert_layout_reads_and_writes():
    state = fixture_state()
    fused = to_fused_experts(state)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    tree = hf.hf_to_native(state, FIXTURE_FIELDS)
    assert_trees_equal(hf.hf_to_native(fused, FIXTURE_FIELDS), tree)
    assert_states_equal(hf.native_to_hf(tree, FIXTURE_FIELDS, expert_layout="fused"), fused)


def test_interleaved_projections_round_trip():
    tree = hf.hf_to_native(fixture_state(), FIXTURE_FIELDS)
    interleaved = hf.native_to_hf(tree, FIXTURE_FIELDS, gdn_projections="interleaved")
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in interleaved
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" not in interleaved
    assert_trees_equal(hf.hf_to_native(interleaved, FIXTURE_FIELDS), tree)


def test_interleaved_layout_matches_qwen3_next_grouping():
    """Label every output row, lay the labels out the way Qwen3-Next's fix_query_key_value_ordering
    reads them (view [K, 2k + 2rv], split [k, k, rv, rv]; ba view [K, 2r], split [r, r]), and check
    that de-interleaving yields Qwen3.5's [q heads | k heads | v heads], z, b, a orders."""
    K, U, k, v = 2, 6, 3, 2  # r = 3 value heads per key head
    r = U // K
    d = {"D": 1, "K": K, "U": U, "k": k, "v": v}
    rows = []
    for g in range(K):
        rows += [("q", g, c) for c in range(k)] + [("k", g, c) for c in range(k)]
        rows += [("v", g * r + j, c) for j in range(r) for c in range(v)]
        rows += [("z", g * r + j, c) for j in range(r) for c in range(v)]
    ba_rows = [row for g in range(K) for row in
               [("b", g * r + j) for j in range(r)] + [("a", g * r + j) for j in range(r)]]
    labels = {row: i for i, row in enumerate(rows)}
    ba_labels = {row: i for i, row in enumerate(ba_rows)}
    qkvz = np.arange(len(rows), dtype=np.float64)[:, None]
    ba = np.arange(len(ba_rows), dtype=np.float64)[:, None]
    qkv, z, b, a = hf.deinterleave_qkvz(qkvz, ba, d)
    want_qkv = ([labels[("q", g, c)] for g in range(K) for c in range(k)]
                + [labels[("k", g, c)] for g in range(K) for c in range(k)]
                + [labels[("v", h, c)] for h in range(U) for c in range(v)])
    assert qkv[:, 0].tolist() == want_qkv
    assert z[:, 0].tolist() == [labels[("z", h, c)] for h in range(U) for c in range(v)]
    assert b[:, 0].tolist() == [ba_labels[("b", h)] for h in range(U)]
    assert a[:, 0].tolist() == [ba_labels[("a", h)] for h in range(U)]
    qkvz_back, ba_back = hf.interleave_qkvz(qkv, z, b, a, d)
    np.testing.assert_array_equal(qkvz_back, qkvz)
    np.testing.assert_array_equal(ba_back, ba)


def test_multimodal_prefix_and_ignored_tensors():
    state = fixture_state()
    nested = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
              for k, v in state.items()}
    nested["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    nested["mtp.layers.0.input_layernorm.weight"] = np.zeros((64,), np.float32)
    assert_trees_equal(hf.hf_to_native(nested, FIXTURE_FIELDS), hf.hf_to_native(state, FIXTURE_FIELDS))


def test_stacking_order_with_two_blocks():
    """Pattern position p holds layers p, p + P, ...: with 8 layers, block index b is layer p + 4b."""
    fields = FIXTURE_FIELDS | {"num_layers": 8}
    tree = random_native_tree(fields, seed=1)
    state = hf.native_to_hf(tree, fields)
    assert sum(k.endswith("input_layernorm.weight") for k in state) == 8
    for p in range(4):
        for b in range(2):
            np.testing.assert_array_equal(state[f"model.layers.{p + 4 * b}.input_layernorm.weight"],
                                          tree["blocks"][p]["input_norm"][b])
    np.testing.assert_array_equal(state["model.layers.7.self_attn.q_norm.weight"],
                                  tree["blocks"][3]["mixer"]["q_norm"][1])
    assert_trees_equal(hf.hf_to_native(state, fields), tree)


def test_bfloat16_round_trip(tmp_path):
    import ml_dtypes

    tree = hf.hf_to_native(fixture_state(), FIXTURE_FIELDS)
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf.native_to_hf(tree, FIXTURE_FIELDS).items()}
    hf.save_hf_checkpoint(str(tmp_path / "ckpt"), FIXTURE_FIELDS, hf.hf_to_native(bf16, FIXTURE_FIELDS))
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    _, loaded = hf.load_hf_checkpoint(str(tmp_path / "ckpt"))
    assert_states_equal(hf.native_to_hf(loaded, FIXTURE_FIELDS), bf16)


# ------------------------------------------------------------------------------------ tied embeddings


def tied_state() -> dict[str, np.ndarray]:
    """The fixture as a tied checkpoint: no lm_head.weight (transformers ties it to the embedding)."""
    return {k: v for k, v in fixture_state().items() if k != "lm_head.weight"}


TIED_FIELDS = FIXTURE_FIELDS | {"tie_word_embeddings": True}


def test_tied_config_is_read_in_either_place_and_written():
    assert hf.model_fields_from_hf_config(fixture_config() | {"tie_word_embeddings": True}) == TIED_FIELDS
    outer = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": fixture_config()
             | {"tie_word_embeddings": True}}
    assert hf.model_fields_from_hf_config(outer) == TIED_FIELDS
    del outer["text_config"]["tie_word_embeddings"]
    assert hf.model_fields_from_hf_config(outer) == TIED_FIELDS
    with pytest.raises(ValueError, match="text_config.tie_word_embeddings=False disagrees"):
        hf.model_fields_from_hf_config(outer | {"text_config": fixture_config()})
    assert hf.hf_config_from_model_fields(TIED_FIELDS)["tie_word_embeddings"] is True
    # Named nowhere: untied (the Qwen3.5-MoE and Qwen3-Next configs' default), the head read from lm_head.
    untied = {k: v for k, v in fixture_config().items() if k != "tie_word_embeddings"}
    assert hf.model_fields_from_hf_config(untied) == FIXTURE_FIELDS
    assert hf.model_fields_from_hf_config({"model_type": "qwen3_5_moe", "text_config": untied}) == FIXTURE_FIELDS


def test_tied_weights_read_as_one_tensor_and_write_without_a_head():
    state = tied_state()
    tree = hf.hf_to_native(state, TIED_FIELDS)
    assert "lm_head" not in tree
    np.testing.assert_array_equal(tree["embed"], state["model.embed_tokens.weight"])
    assert_states_equal(hf.native_to_hf(tree, TIED_FIELDS), state)
    # A tied checkpoint that also stores the head: accepted when it is the embedding, named when not.
    same = state | {"lm_head.weight": state["model.embed_tokens.weight"].copy()}
    assert_trees_equal(hf.hf_to_native(same, TIED_FIELDS), tree)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf.hf_to_native(fixture_state(), TIED_FIELDS)
    # An untied config needs its head.
    with pytest.raises(ValueError, match="missing tensor lm_head.weight"):
        hf.hf_to_native(state, FIXTURE_FIELDS)


def test_tied_checkpoint_saves_and_loads(tmp_path):
    tree = hf.hf_to_native(tied_state(), TIED_FIELDS)
    hf.save_hf_checkpoint(str(tmp_path / "tied"), TIED_FIELDS, tree)
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    fields, back = hf.load_hf_checkpoint(str(tmp_path / "tied"))
    assert fields == TIED_FIELDS
    assert_trees_equal(back, tree)


# ------------------------------------------------------------------------------------------ errors


def test_missing_tensor_is_named():
    state = fixture_state()
    del state["model.layers.3.self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.3\.self_attn\.q_norm\.weight"):
        hf.hf_to_native(state, FIXTURE_FIELDS)


def test_wrong_shape_is_named():
    state = to_fused_experts(fixture_state())
    state["model.layers.3.mlp.experts.gate_up_proj"] = state["model.layers.3.mlp.experts.gate_up_proj"][:, :48]
    want = "model.layers.3.mlp.experts.gate_up_proj: expected (8, 64, 64), got (8, 48, 64)"
    with pytest.raises(ValueError, match=re.escape(want)):
        hf.hf_to_native(state, FIXTURE_FIELDS)


def test_unused_tensor_is_an_error():
    state = fixture_state() | {"model.layers.0.self_attn.q_proj.bias": np.zeros((128,), np.float32)}
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        hf.hf_to_native(state, FIXTURE_FIELDS)


def test_checkpoint_errors_name_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(fixture_config()))
    state = fixture_state()
    first = {k: v for k, v in state.items() if "layers.3." not in k}
    second = {k: v for k, v in state.items() if "layers.3." in k}
    second["model.layers.3.self_attn.k_norm.weight"] = np.zeros((15,), np.float32)
    save_file(first, str(ckpt / "model-00001-of-00002.safetensors"))
    save_file(second, str(ckpt / "model-00002-of-00002.safetensors"))
    want = "model-00002-of-00002.safetensors: model.layers.3.self_attn.k_norm.weight: expected (16,), got (15,)"
    with pytest.raises(ValueError, match=re.escape(want)):
        hf.load_hf_checkpoint(str(ckpt))
    del second["model.layers.3.self_attn.k_norm.weight"]
    save_file(second, str(ckpt / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"{ckpt}: missing tensor model.layers.3.self_attn.k_norm.weight")):
        hf.load_hf_checkpoint(str(ckpt))


# ------------------------------------------------------------------------------------------- files


def test_load_sharded_checkpoint_matches(tmp_path):
    state = fixture_state()
    names = sorted(state)
    (tmp_path / "config.json").write_text(json.dumps(fixture_config()))
    save_file({k: state[k] for k in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    fields, tree = hf.load_hf_checkpoint(str(tmp_path))
    assert fields == FIXTURE_FIELDS
    assert_trees_equal(tree, hf.hf_to_native(state, FIXTURE_FIELDS))


def test_save_then_load_is_exact_and_atomic(tmp_path):
    fields, tree = hf.load_hf_checkpoint(FIXTURE)
    out = tmp_path / "export"
    hf.save_hf_checkpoint(str(out), fields, tree)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_states_equal(load_file(str(out / "model.safetensors")), fixture_state())
    fields_back, tree_back = hf.load_hf_checkpoint(str(out))
    assert fields_back == fields
    assert_trees_equal(tree_back, tree)
    # Saving over an existing folder replaces the files and drops stale shards of an earlier save.
    save_file({"stale": np.zeros(1, np.float32)}, str(out / "model-00001-of-00002.safetensors"))
    hf.save_hf_checkpoint(str(out), fields, tree)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["export"]  # no temporary folder left behind


def test_failed_save_leaves_nothing(tmp_path):
    fields, tree = hf.load_hf_checkpoint(FIXTURE)
    tree["blocks"][3]["mixer"]["q_norm"] = np.zeros((1, 15), np.float32)
    with pytest.raises(ValueError, match=r"blocks\[3\]/mixer/q_norm: expected \(1, 16\), got \(1, 15\)"):
        hf.save_hf_checkpoint(str(tmp_path / "export"), fields, tree)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- the model vs the fixture


def test_model_logprobs_match_reference_fixture():
    forward = pytest.importorskip("hybridmoe.model.forward")
    if not hasattr(forward, "token_logprobs"):
        pytest.skip("hybridmoe.model.forward.token_logprobs is not there yet")
    import jax
    import jax.numpy as jnp

    from hybridmoe.config.schema import ModelConfig

    fields, tree = hf.load_hf_checkpoint(FIXTURE)
    tokens = np.load(os.path.join(FIXTURE, "tokens.npy"))
    want = np.load(os.path.join(FIXTURE, "logprobs.npy"))
    assert tokens.shape == (2, 80) and tokens.dtype == np.int32 and want.shape == (2, 79)
    got = forward.token_logprobs(jax.tree.map(jnp.asarray, tree), ModelConfig(**fields), jnp.asarray(tokens))
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL)


# ------------------------------------------------------------------ live: the reference itself (torch)


def _hf_logprobs(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    ids = torch.as_tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0].numpy()


def _load_reference(path: str):
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        path, attn_implementation="eager", experts_implementation="eager")
    return model.eval()


def test_live_reference_reproduces_fixture():
    pytest.importorskip("torch")
    tokens = np.load(os.path.join(FIXTURE, "tokens.npy"))
    got = _hf_logprobs(_load_reference(FIXTURE), tokens)
    np.testing.assert_allclose(got, np.load(os.path.join(FIXTURE, "logprobs.npy")), rtol=0, atol=1e-5)


def test_live_reference_reads_our_export(tmp_path):
    """What save_hf_checkpoint writes loads in transformers and gives the fixture's log-probs."""
    pytest.importorskip("torch")
    fields, tree = hf.load_hf_checkpoint(FIXTURE)
    hf.save_hf_checkpoint(str(tmp_path / "export"), fields, tree)
    tokens = np.load(os.path.join(FIXTURE, "tokens.npy"))
    got = _hf_logprobs(_load_reference(str(tmp_path / "export")), tokens)
    np.testing.assert_allclose(got, np.load(os.path.join(FIXTURE, "logprobs.npy")), rtol=0, atol=1e-5)


def test_live_model_matches_reference_with_two_blocks(tmp_path):
    """8 layers (two stacked blocks per pattern position) and random weights: our model vs the reference."""
    torch = pytest.importorskip("torch")
    forward = pytest.importorskip("hybridmoe.model.forward")
    import jax
    import jax.numpy as jnp

    from hybridmoe.config.schema import ModelConfig

    fields = FIXTURE_FIELDS | {"num_layers": 8}
    tree = random_native_tree(fields, seed=2)
    hf.save_hf_checkpoint(str(tmp_path / "ckpt"), fields, tree)
    tokens = np.random.default_rng(4).integers(0, 256, (2, 70)).astype(np.int32)
    torch.set_num_threads(2)
    want = _hf_logprobs(_load_reference(str(tmp_path / "ckpt")), tokens)
    params = jax.tree.map(jnp.asarray, tree)
    got = np.asarray(forward.token_logprobs(params, ModelConfig(**fields), jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL)


def test_live_qwen3_next_gdn_equals_qwen35_gdn_after_deinterleave():
    """The Qwen3-Next GDN module with in_proj_qkvz/ba and the Qwen3.5 module with the de-interleaved
    split projections compute the same function."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    common = dict(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1,
                  moe_intermediate_size=8, shared_expert_intermediate_size=8, vocab_size=16)
    torch.manual_seed(0)
    nxt = Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**common), 0).eval()
    new = Qwen3_5MoeGatedDeltaNet(transformers.Qwen3_5MoeTextConfig(**common), 0).eval()
    with torch.no_grad():
        for p in nxt.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        d = {"D": 32, "K": 2, "U": 6, "k": 8, "v": 4}
        qkv, z, b, a = hf.deinterleave_qkvz(nxt.in_proj_qkvz.weight.numpy(), nxt.in_proj_ba.weight.numpy(), d)
        for name, value in {"in_proj_qkv": qkv, "in_proj_z": z, "in_proj_b": b, "in_proj_a": a}.items():
            getattr(new, name).weight.copy_(torch.as_tensor(value))
        for name in ("conv1d", "norm", "out_proj"):
            getattr(new, name).weight.copy_(getattr(nxt, name).weight)
        new.A_log.copy_(nxt.A_log)
        new.dt_bias.copy_(nxt.dt_bias)
        x = torch.randn(2, 20, 32)
        torch.testing.assert_close(new(x), nxt(x), rtol=1e-5, atol=1e-5)
