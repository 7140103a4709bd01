"""config.json <-> model fields on a hand-made config whose every dimension differs from the others
(a field read from its neighbour shows), each refusal rule alone, and the safetensors header checks
and source-folder readers at the shapes the other tests do not use. No model is built."""

import json

import numpy as np
import pytest

from hybridmoe import hf
from hybridmoe.hf import config_fields as cf

# Every dimension distinct: a field taken from another key changes the result.
HF = {"model_type": "qwen3_5_moe_text", "vocab_size": 96, "hidden_size": 40, "num_hidden_layers": 6,
      "layer_types": ["linear_attention", "full_attention", "linear_attention"] * 2,
      "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12,
      "rope_parameters": {"rope_type": "default", "rope_theta": 123.0, "partial_rotary_factor": 0.5},
      "linear_num_key_heads": 3, "linear_num_value_heads": 6, "linear_key_head_dim": 7, "linear_value_head_dim": 9,
      "linear_conv_kernel_dim": 3, "num_experts": 10, "num_experts_per_tok": 4, "moe_intermediate_size": 11,
      "shared_expert_intermediate_size": 13, "rms_norm_eps": 1e-5, "norm_topk_prob": True}
FIELDS = {"vocab_size": 96, "d_model": 40, "num_layers": 6, "layer_pattern": ("gdn", "attention", "gdn"),
          "num_heads": 5, "num_kv_heads": 1, "head_dim": 12, "rope_theta": 123.0, "partial_rotary_factor": 0.5,
          "gdn_num_key_heads": 3, "gdn_num_value_heads": 6, "gdn_key_dim": 7, "gdn_value_dim": 9,
          "gdn_conv_kernel": 3, "num_experts": 10, "num_experts_per_tok": 4, "moe_intermediate_size": 11,
          "shared_expert_intermediate_size": 13, "norm_topk_prob": True, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False}


def test_every_model_field_comes_from_its_own_config_key():
    assert cf.model_fields_from_hf_config(HF) == FIELDS


def test_the_written_config_holds_every_field_under_its_hf_key():
    assert cf.hf_config_from_model_fields({**FIELDS, "tie_word_embeddings": True}, dtype="bfloat16") == {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "dtype": "bfloat16",
        "vocab_size": 96, "hidden_size": 40, "num_hidden_layers": 6,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"] * 2,
        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12, "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 123.0, "partial_rotary_factor": 0.5},
        "linear_num_key_heads": 3, "linear_num_value_heads": 6, "linear_key_head_dim": 7,
        "linear_value_head_dim": 9, "linear_conv_kernel_dim": 3, "num_experts": 10, "num_experts_per_tok": 4,
        "moe_intermediate_size": 11, "shared_expert_intermediate_size": 13, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    assert cf.hf_config_from_model_fields(FIELDS)["dtype"] == "float32"


def test_a_written_config_reads_back_to_the_same_fields():
    assert cf.model_fields_from_hf_config(cf.hf_config_from_model_fields(FIELDS)) == FIELDS


def test_unrenormalised_top_k_has_no_written_form():
    with pytest.raises(ValueError, match="model.norm_topk_prob=False has no Qwen3.5-MoE form"):
        cf.hf_config_from_model_fields({**FIELDS, "norm_topk_prob": False})


def test_missing_model_fields_are_named():
    partial = {k: v for k, v in FIELDS.items() if k not in ("head_dim", "rms_norm_eps")}
    with pytest.raises(ValueError, match="model fields: missing head_dim, rms_norm_eps"):
        cf.field_dict(partial)


def test_tied_embeddings_default_to_untied_and_the_outer_value_wins_alone():
    assert cf.model_fields_from_hf_config(HF)["tie_word_embeddings"] is False
    outer = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True, "text_config": HF}
    assert cf.model_fields_from_hf_config(outer)["tie_word_embeddings"] is True
    inner = {"model_type": "qwen3_5_moe", "text_config": {**HF, "tie_word_embeddings": True}}
    assert cf.model_fields_from_hf_config(inner)["tie_word_embeddings"] is True
    # 1 and True are the same truth: no disagreement.
    both = {"model_type": "qwen3_5_moe", "tie_word_embeddings": 1, "text_config": {**HF, "tie_word_embeddings": True}}
    assert cf.model_fields_from_hf_config(both)["tie_word_embeddings"] is True
    clash = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
             "text_config": {**HF, "tie_word_embeddings": True}}
    with pytest.raises(ValueError, match="tie_word_embeddings=False is not supported: "
                                         "text_config.tie_word_embeddings=True disagrees"):
        cf.model_fields_from_hf_config(clash)


@pytest.mark.parametrize("change, needle", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers=[2] is not supported"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_parameters.rope_type='yarn'"),
    ({"rope_parameters": {"type": "linear", "rope_theta": 1.0}}, "rope_parameters.rope_type='linear'"),
    ({"layer_types": ["linear_attention"] * 5 + ["sliding_attention"]}, "layer_types=['sliding_attention']"),
    ({"layer_types": ["linear_attention"] * 5}, "has 5 entries for num_hidden_layers=6"),
    ({"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size=-1 is not supported"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported"),
    ({"num_experts": -2}, "num_experts=-2 is not supported"),
    ({"model_type": "qwen3_moe"}, "model_type='qwen3_moe' is not supported"),
])
def test_each_further_unsupported_field_is_refused_by_its_own_rule(change, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        cf.model_fields_from_hf_config({**HF, **change})


def test_the_fields_a_checkpoint_may_leave_out_take_the_supported_values():
    """No attention_bias / hidden_act / mlp_only_layers / decoder_sparse_step / attn_output_gate: accepted;
    the ones given at their supported values also; rope without a type is the default."""
    given = {**HF, "attention_bias": False, "hidden_act": "silu", "mlp_only_layers": [], "decoder_sparse_step": 1,
             "attn_output_gate": True, "rope_scaling": None}
    assert cf.model_fields_from_hf_config(given) == FIELDS
    untyped = {**HF, "rope_parameters": {"rope_theta": 123.0, "partial_rotary_factor": 0.5}}
    assert cf.model_fields_from_hf_config(untyped) == FIELDS
    flat = {k: v for k, v in HF.items() if k != "rope_parameters"}
    flat.update(rope_theta=123.0, partial_rotary_factor=0.5)
    assert cf.model_fields_from_hf_config(flat) == FIELDS


@pytest.mark.parametrize("key", ["num_key_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                                 "linear_conv_kernel_dim", "num_experts_per_tok", "moe_intermediate_size",
                                 "vocab_size", "rms_norm_eps", "num_hidden_layers"])
def test_each_required_key_is_named_when_missing(key):
    with pytest.raises(ValueError, match=f"config.json: missing field '{key}'"):
        cf.model_fields_from_hf_config({k: v for k, v in HF.items() if k != key})


def test_config_changes_compare_every_field():
    """Each field changed alone is reported, under its own name."""
    for k, v in FIELDS.items():
        new = (not v) if isinstance(v, bool) else ("attention",) * 6 if k == "layer_pattern" else v * 2
        assert cf.config_changes(HF, {**FIELDS, k: new}) == [f"model.{k}: {v!r} -> {new!r}"]


# ------------------------------------------------------------------------------------------------
# safetensors headers and the source folder


def _header_file(path, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def test_a_header_that_fits_the_file_exactly_is_read(tmp_path):
    from hybridmoe.hf.source import shard_header
    f = tmp_path / "x.safetensors"
    _header_file(f, {"__metadata__": {"format": "pt"}}, b"")
    header, start = shard_header(str(f))
    n = len(json.dumps({"__metadata__": {"format": "pt"}}))
    assert header == {"__metadata__": {"format": "pt"}} and start == 8 + n
    f.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00")  # 7 bytes: no full length field
    with pytest.raises(ValueError, match="truncated safetensors file \\(no header\\)"):
        shard_header(str(f))


def test_a_source_form_refuses_a_trained_tensor_in_an_unwritable_dtype(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for dtype in ("I8", "F8_E4M3", "I32"):
        _header_file(tmp_path / "a.safetensors", {"model.norm.weight": {"dtype": dtype, "shape": [2],
                                                                        "data_offsets": [0, 2]}}, b"\x00\x00")
        with pytest.raises(ValueError, match=rf"model.norm.weight is stored as {dtype}; .* one of "
                                             r"\['BF16', 'F16', 'F32', 'F64'\]"):
            hf.read_source_form(str(tmp_path), [str(tmp_path / "a.safetensors")])


def test_a_text_only_source_with_per_expert_and_interleaved_projections(tmp_path):
    """Text prefix, per-expert experts, Qwen3-Next's in_proj_qkvz; kept bytes count each kept tensor's
    own span (offsets 4..10 and 10..13: 6 + 3 bytes), and __metadata__ is no tensor."""
    (tmp_path / "config.json").write_text("{}")
    for name in ("model.safetensors.index.json", ".cache.json", "README.md", "notes.txt", "vocab.txt", "w.bin"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub.json").mkdir()
    header = {"__metadata__": {"format": "pt"},
              "model.layers.0.linear_attn.in_proj_qkvz.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "model.visual.a": {"dtype": "U8", "shape": [6], "data_offsets": [4, 10]},
              "mtp.b": {"dtype": "U8", "shape": [3], "data_offsets": [10, 13]},
              "model.layers.0.mlp.experts.0.gate_proj.weight": {"dtype": "F64", "shape": [0], "data_offsets": [13, 13]},
              "lm_head.weight": {"dtype": "F32", "shape": [0], "data_offsets": [13, 13]}}
    _header_file(tmp_path / "a.safetensors", header, bytes(13))
    form = hf.read_source_form(str(tmp_path), [str(tmp_path / "a.safetensors")])
    assert not form.multimodal and form.prefix == "model."
    assert (form.expert_layout, form.gdn_projections) == ("per_expert", "interleaved")
    assert form.kept_bytes == 9 and form.kept == {str(tmp_path / "a.safetensors"): ["model.visual.a", "mtp.b"]}
    assert len(form.names) == 5 and "__metadata__" not in form.names
    assert form.source_name("model.norm.weight") == "model.norm.weight"
    assert form.numpy_dtype("model.layers.0.mlp.experts.0.gate_proj.weight") is np.float64
    assert form.side_files() == ["README.md", "config.json", "notes.txt", "vocab.txt"]


def test_a_fused_head_only_name_does_not_make_the_layout_fused(tmp_path):
    """The layouts are read from the text model's tensors; the LM head is not one of them."""
    (tmp_path / "config.json").write_text("{}")
    header = {"lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    _header_file(tmp_path / "a.safetensors", header, bytes(4))
    form = hf.read_source_form(str(tmp_path), [str(tmp_path / "a.safetensors")])
    assert (form.expert_layout, form.gdn_projections, form.kept_bytes) == ("per_expert", "split", 0)


def test_a_copy_starts_its_data_8_byte_aligned_and_packs_the_tensors_in_source_order(tmp_path):
    """Tensors asked for out of order are written in the source's order, their offsets restarting at 0."""
    from hybridmoe.hf.source import shard_header
    src, dst = tmp_path / "s.safetensors", tmp_path / "d.safetensors"
    _header_file(src, {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                       "b": {"dtype": "U8", "shape": [4], "data_offsets": [3, 7]},
                       "c": {"dtype": "U8", "shape": [4], "data_offsets": [7, 11]}}, b"AAABBBBCCCC")
    assert hf.copy_tensors(str(src), ["c", "a"], str(dst)) == 3 + 4
    header, start = shard_header(str(dst))
    assert start % 8 == 0
    offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    assert offsets == {"a": [0, 3], "c": [3, 7]} and header["__metadata__"] == {"format": "pt"}
    assert dst.read_bytes()[start:] == b"AAACCCC" and dst.stat().st_size == start + 7
    for n in range(1, 9):  # headers of every length mod 8: the data still starts aligned
        _header_file(src, {"x" * n: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"Z")
        hf.copy_tensors(str(src), ["x" * n], str(dst))
        header, start = shard_header(str(dst))
        assert start % 8 == 0 and dst.read_bytes()[start:] == b"Z"


# ------------------------------------------------------------------------------------------------
# checkpoint folders


def test_folder_readers_name_what_is_wrong(tmp_path):
    with pytest.raises(hf.CheckpointError, match="no such checkpoint folder"):
        hf.read_hf_config(str(tmp_path / "absent"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(hf.CheckpointError, match="no such checkpoint folder"):
        hf.read_hf_config(str(tmp_path / "f"))
    with pytest.raises(hf.CheckpointError, match="config.json: missing"):
        hf.read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(hf.CheckpointError, match="expected a JSON object"):
        hf.read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(hf.CheckpointError, match="not valid JSON"):
        hf.read_hf_config(str(tmp_path))
    with pytest.raises(hf.CheckpointError, match="no \\*.safetensors files"):
        hf.checkpoint_shards(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text('{"nothing": 1}')
    with pytest.raises(hf.CheckpointError, match="not a safetensors index"):
        hf.checkpoint_shards(str(tmp_path))


def test_an_index_lists_its_shards_in_name_order_and_names_each_missing_one(tmp_path):
    for name in ("b.safetensors", "a.safetensors", "stray.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}))
    assert hf.checkpoint_shards(str(tmp_path)) == [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "c.safetensors"}}))
    with pytest.raises(hf.CheckpointError, match="missing from the folder: c.safetensors;"):
        hf.checkpoint_shards(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").unlink()
    assert hf.checkpoint_shards(str(tmp_path)) == [str(tmp_path / n) for n in
                                                   ("a.safetensors", "b.safetensors", "stray.safetensors")]


def test_a_save_over_a_sharded_checkpoint_leaves_only_its_own_two_files(tmp_path):
    """The earlier save's shards and index would otherwise be read beside the new weights; other files stay."""
    import os
    fields, tree = hf.load_hf_checkpoint(os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny"))
    out = tmp_path / "ck"
    out.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json"):
        (out / name).write_text("old")
    hf.save_hf_checkpoint(str(out), fields, tree)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert hf.load_hf_checkpoint(str(out))[0] == fields


# ------------------------------------------------------------------------------------------------
# the weight tree's refusals (the tiny fixture: 4 layers, pattern gdn, gdn, gdn, attention; V 256, D 64)


def _fixture_state():
    import os

    from safetensors.numpy import load_file
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
    fields, tree = hf.load_hf_checkpoint(fixture)
    return fields, tree, load_file(os.path.join(fixture, "model.safetensors"))


def test_layers_that_are_not_whole_patterns_are_refused_both_ways():
    fields, tree, state = _fixture_state()
    for layers in (6, 5, 2):
        bad = {**fields, "num_layers": layers}
        with pytest.raises(ValueError, match=f"model.num_layers={layers} is not a multiple of "
                                             r"len\(model.layer_pattern\)=4"):
            hf.hf_to_native(state, bad)
        with pytest.raises(ValueError, match=f"model.num_layers={layers} is not a multiple of "
                                             r"len\(model.layer_pattern\)=4"):
            hf.native_to_hf(tree, bad)


def test_a_tree_with_another_block_count_than_the_pattern_is_refused():
    fields, tree, _ = _fixture_state()
    for blocks in (tree["blocks"][:3], tree["blocks"] + tree["blocks"][:1]):
        with pytest.raises(ValueError, match=f"native tree: blocks has {len(blocks)} entries for a layer pattern of 4"):
            hf.native_to_hf({**tree, "blocks": blocks}, fields)


def test_a_tied_checkpoint_whose_head_differs_at_all_from_the_embedding_is_refused():
    fields, _, state = _fixture_state()
    tied = {**fields, "tie_word_embeddings": True}
    embed = state["model.embed_tokens.weight"]
    tree = hf.hf_to_native({**state, "lm_head.weight": embed.copy()}, tied)  # equal: read once, as the embedding
    assert "lm_head" not in tree
    near = embed.copy()
    near[3, 5] += 1e-4
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf.hf_to_native({**state, "lm_head.weight": near}, tied)
    with pytest.raises(ValueError, match="an lm_head leaf with model.tie_word_embeddings=true"):
        hf.native_to_hf({**tree, "lm_head": np.zeros((64, 256), np.float32)}, tied)
    out = hf.native_to_hf(tree, tied)
    assert "lm_head.weight" not in out and out["model.embed_tokens.weight"].shape == (256, 64)


def test_a_layer_without_expert_tensors_names_the_fused_tensor():
    fields, _, state = _fixture_state()
    no_experts = {k: v for k, v in state.items() if not k.startswith("model.layers.1.mlp.experts.")}
    with pytest.raises(ValueError, match=r"missing tensor model.layers.1.mlp.experts.gate_up_proj \(expected shape "
                                         r"\(8, 64, 64\)\)"):
        hf.hf_to_native(no_experts, fields)


def test_a_piece_of_a_layers_experts_is_written_under_its_own_expert_numbers():
    """Experts 2 and 3 of layer 0 (8 in all): named experts.2 and experts.3, gate the first F=32 columns of
    wi, up the next; the fused layout has no pieces."""
    from hybridmoe.hf.weights import layer_to_hf
    fields, tree, state = _fixture_state()
    layer = {k: ({kk: np.asarray(vv)[0] for kk, vv in v.items()} if isinstance(v, dict) else np.asarray(v)[0])
             for k, v in tree["blocks"][0].items()}
    layer["moe"] = {**layer["moe"], "wi": layer["moe"]["wi"][2:4], "wo": layer["moe"]["wo"][2:4]}
    out = layer_to_hf("gdn", 0, layer, fields, experts=(2, 4), parts=("experts",))
    pre = "model.layers.0.mlp.experts."
    assert sorted(out) == sorted(f"{pre}{e}.{w}_proj.weight" for e in (2, 3) for w in ("gate", "up", "down"))
    for e in (2, 3):
        for w in ("gate", "up", "down"):
            name = f"{pre}{e}.{w}_proj.weight"
            assert np.array_equal(out[name], state[name])
    with pytest.raises(ValueError, match="a piece of a layer's experts has only the per_expert layout"):
        layer_to_hf("gdn", 0, layer, fields, experts=(2, 4), parts=("experts",), expert_layout="fused")


# ------------------------------------------------------------------------------------------------
# the weight tree <-> HF tensors at the distinct dimensions of FIELDS (6 layers, pattern gdn, attention,
# gdn: 2 stacked blocks; D 40, V 96, E 10, F 11, S 13, N 5, G 1, A 12, K 3, U 6, k 7, v 9, W 3)

# Per layer kind, every HF tensor's shape by hand: GDN conv channels 2 K k + U v = 42 + 54 = 96.
HF_SHAPES = {
    "gdn": {"linear_attn.in_proj_qkv.weight": (96, 40), "linear_attn.in_proj_z.weight": (54, 40),
            "linear_attn.in_proj_b.weight": (6, 40), "linear_attn.in_proj_a.weight": (6, 40),
            "linear_attn.conv1d.weight": (96, 1, 3), "linear_attn.A_log": (6,), "linear_attn.dt_bias": (6,),
            "linear_attn.norm.weight": (9,), "linear_attn.out_proj.weight": (40, 54)},
    "attention": {"self_attn.q_proj.weight": (120, 40), "self_attn.k_proj.weight": (12, 40),
                  "self_attn.v_proj.weight": (12, 40), "self_attn.o_proj.weight": (40, 60),
                  "self_attn.q_norm.weight": (12,), "self_attn.k_norm.weight": (12,)},
}
COMMON = {"input_layernorm.weight": (40,), "post_attention_layernorm.weight": (40,), "mlp.gate.weight": (10, 40),
          "mlp.shared_expert.gate_proj.weight": (13, 40), "mlp.shared_expert.up_proj.weight": (13, 40),
          "mlp.shared_expert.down_proj.weight": (40, 13), "mlp.shared_expert_gate.weight": (1, 40)}


def _random_tree():
    from hybridmoe.hf.weights import _dims, layer_shapes
    rng = np.random.default_rng(0)
    d = _dims(FIELDS)
    blocks = []
    for kind in FIELDS["layer_pattern"]:
        block = {}
        for path, shape in layer_shapes(kind, d).items():
            node = block
            *parents, leaf = path.split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = rng.standard_normal((2, *shape)).astype(np.float32)
        blocks.append(block)
    return {"embed": rng.standard_normal((96, 40)).astype(np.float32), "blocks": blocks,
            "final_norm": rng.standard_normal(40).astype(np.float32),
            "lm_head": rng.standard_normal((40, 96)).astype(np.float32)}


def test_every_hf_tensor_has_its_shape_at_distinct_dimensions_and_reads_back():
    tree = _random_tree()
    out = hf.native_to_hf(tree, FIELDS)
    want = {"model.embed_tokens.weight": (96, 40), "model.norm.weight": (40,), "lm_head.weight": (96, 40)}
    for i, kind in enumerate(["gdn", "attention", "gdn"] * 2):
        pre = f"model.layers.{i}."
        want.update({pre + k: v for k, v in {**HF_SHAPES[kind], **COMMON}.items()})
        for e in range(10):
            want.update({f"{pre}mlp.experts.{e}.gate_proj.weight": (11, 40), f"{pre}mlp.experts.{e}.up_proj.weight":
                         (11, 40), f"{pre}mlp.experts.{e}.down_proj.weight": (40, 11)})
    assert {k: v.shape for k, v in out.items()} == want
    back = hf.hf_to_native(out, FIELDS)
    import jax
    a, b = ({jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
            for t in (tree, back))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # Layer 4 is block 1 (gdn) of its stacked axis 1: layer i is blocks[i % 3][i // 3].
    assert np.array_equal(out["model.layers.3.linear_attn.A_log"], tree["blocks"][0]["mixer"]["A_log"][1])
    assert np.array_equal(out["model.layers.4.self_attn.q_norm.weight"], tree["blocks"][1]["mixer"]["q_norm"][1])


def test_the_fused_and_interleaved_layouts_have_their_shapes_and_read_back():
    """Fused experts [E, 2F, D] = [10, 22, 40] and [E, D, F] = [10, 40, 11]; Qwen3-Next's in_proj_qkvz
    [2 K k + 2 U v, D] = [150, 40], in_proj_ba [2 U, D] = [12, 40]."""
    tree = _random_tree()
    out = hf.native_to_hf(tree, FIELDS, expert_layout="fused", gdn_projections="interleaved")
    assert out["model.layers.0.mlp.experts.gate_up_proj"].shape == (10, 22, 40)
    assert out["model.layers.0.mlp.experts.down_proj"].shape == (10, 40, 11)
    assert out["model.layers.2.linear_attn.in_proj_qkvz.weight"].shape == (150, 40)
    assert out["model.layers.2.linear_attn.in_proj_ba.weight"].shape == (12, 40)
    split = hf.native_to_hf(tree, FIELDS)
    g2 = "model.layers.2.linear_attn."
    qkvz, qkv = out[g2 + "in_proj_qkvz.weight"], split[g2 + "in_proj_qkv.weight"]
    # Key head g = 1 of 3 (r = 2 value heads each): its group starts at row 1 x (14 + 18 + 18) = 50; its
    # k rows at 50 + 7 are split rows 21 + 7; its first value row (50 + 14) is split row 42 + 1 x 18.
    assert np.array_equal(qkvz[50 + 7:50 + 14], qkv[21 + 7:21 + 14])
    assert np.array_equal(qkvz[64:82], qkv[60:78])
    ba, b = out["model.layers.2.linear_attn.in_proj_ba.weight"], split["model.layers.2.linear_attn.in_proj_b.weight"]
    a = split["model.layers.2.linear_attn.in_proj_a.weight"]
    # Group g holds rows 4g .. 4g + 3: [b of its value heads 2g, 2g + 1 | a of the same].
    assert np.array_equal(ba[0:2], b[0:2]) and np.array_equal(ba[4:6], b[2:4]) and np.array_equal(ba[6:8], a[2:4])
    back = hf.hf_to_native(out, FIELDS)
    assert np.array_equal(back["blocks"][2]["mixer"]["wz"], tree["blocks"][2]["mixer"]["wz"])
    assert np.array_equal(back["blocks"][0]["moe"]["wo"], tree["blocks"][0]["moe"]["wo"])


def test_a_tensor_of_the_right_size_but_another_shape_is_refused_on_both_sides():
    tree = _random_tree()
    out = hf.native_to_hf(tree, FIELDS)
    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=rf"ck: {name}: expected \(120, 40\), got \(40, 120\)"):
        hf.hf_to_native({**out, name: out[name].T.copy()}, FIELDS, where="ck")
    wk = tree["blocks"][0]["mixer"]["wk"]  # [2, 40, 3, 7] -> [2, 40, 7, 3]: the same size
    bad = {**tree["blocks"][0], "mixer": {**tree["blocks"][0]["mixer"], "wk": wk.transpose(0, 1, 3, 2).copy()}}
    with pytest.raises(ValueError, match=r"native tree: blocks\[0\]/mixer/wk: expected \(2, 40, 3, 7\), "
                                         r"got \(2, 40, 7, 3\)"):
        hf.native_to_hf({**tree, "blocks": [bad, *tree["blocks"][1:]]}, FIELDS)
