"""Hugging Face glue pinned on hand-made configs and fakes: config.json fields <-> model fields at the
defaults a checkpoint may leave out, the export's log line and its figures, the source-form cast
count and the name check. No model is built."""

import json
import os
import types

import numpy as np
import pytest

from hybridmoe import hf
from hybridmoe.run import hf_export
from hybridmoe.run.hf_export import ExportReport

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


def _config():
    with open(os.path.join(FIXTURE, "config.json")) as fh:
        return json.load(fh)


def test_head_dim_defaults_to_hidden_over_query_heads():
    c = _config()
    del c["head_dim"]
    # hidden 64 / 4 query heads = 16 (not 64 / 2 key-value heads = 32)
    assert hf.model_fields_from_hf_config(c)["head_dim"] == 16
    c["num_attention_heads"] = 8
    assert hf.model_fields_from_hf_config(c)["head_dim"] == 8


def test_a_rope_without_a_partial_factor_rotates_every_dimension():
    c = _config()
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    f = hf.model_fields_from_hf_config(c)
    assert f["partial_rotary_factor"] == 1.0 and f["rope_theta"] == 500.0
    # A nested value wins over a flat one the older files keep.
    c["rope_parameters"]["partial_rotary_factor"] = 0.5
    c["partial_rotary_factor"] = 0.25
    assert hf.model_fields_from_hf_config(c)["partial_rotary_factor"] == 0.5
    c["rope_parameters"] = {}
    with pytest.raises(ValueError, match="missing field 'rope_parameters.rope_theta'"):
        hf.model_fields_from_hf_config(c)


@pytest.mark.parametrize("change, needle", [
    ({"num_experts": 0}, "num_experts=0 is not supported"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 is not supported"),
    ({"attn_output_gate": False}, "attn_output_gate=False is not supported"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling="),
    ({"layer_types": ["linear_attention"] * 5}, "has 5 entries for num_hidden_layers=4"),
    ({"linear_num_value_heads": 3}, "must be a multiple of linear_num_key_heads=2"),
])
def test_each_unsupported_field_is_refused_by_its_own_rule(change, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        hf.model_fields_from_hf_config({**_config(), **change})


def test_value_heads_four_times_the_key_heads_are_accepted():
    f = hf.model_fields_from_hf_config({**_config(), "linear_num_key_heads": 1, "linear_num_value_heads": 4})
    assert (f["gdn_num_key_heads"], f["gdn_num_value_heads"]) == (1, 4)


def test_tied_embeddings_agreeing_in_both_places_are_read_once():
    outer = {"model_type": "qwen3_5_moe", "tie_word_embeddings": True,
             "text_config": {**_config(), "tie_word_embeddings": True}}
    assert hf.model_fields_from_hf_config(outer)["tie_word_embeddings"] is True
    outer["text_config"]["tie_word_embeddings"] = False
    with pytest.raises(ValueError, match="text_config.tie_word_embeddings=False disagrees"):
        hf.model_fields_from_hf_config(outer)


def test_an_interval_of_two_makes_every_second_layer_attention():
    c = _config()
    del c["layer_types"]
    c["full_attention_interval"] = 2
    # Layers 1 and 3 ((i + 1) % 2 == 0) are full attention: the pattern (gdn, attention).
    assert hf.model_fields_from_hf_config(c)["layer_pattern"] == ("gdn", "attention")


def test_config_changes_name_each_changed_field_from_old_to_new():
    c = _config()
    fields = hf.model_fields_from_hf_config(c)
    assert hf.config_changes(c, {**fields, "layer_pattern": list(fields["layer_pattern"])}) == []  # list == tuple
    changed = {**fields, "num_experts": 16, "rms_norm_eps": 1e-5}
    assert hf.config_changes(c, changed) == ["model.num_experts: 8 -> 16", "model.rms_norm_eps: 1e-06 -> 1e-05"]


def test_written_config_repeats_the_pattern_over_the_layers():
    fields = {**hf.model_fields_from_hf_config(_config()), "num_layers": 4, "layer_pattern": ("gdn", "attention")}
    c = hf.hf_config_from_model_fields(fields, dtype="bfloat16")
    assert c["layer_types"] == ["linear_attention", "full_attention"] * 2 and c["dtype"] == "bfloat16"
    assert (c["hidden_size"], c["num_key_value_heads"], c["linear_num_value_heads"]) == (64, 2, 4)
    with pytest.raises(ValueError, match="model.num_layers=3 is not a multiple of len"):
        hf.hf_config_from_model_fields({**fields, "num_layers": 3})


# ------------------------------------------------------------------------------------------------
# the export's report, cast count and name check


def test_the_export_log_of_a_source_form_says_mib_and_casts():
    r = ExportReport(source="/ckpt", trained_tensors=7, kept_tensors=3, kept_bytes=3 * 2**20 + 2**19,
                     dtype_changes={"float32 -> bfloat16": 2, "bfloat16 -> float32": 1},
                     side_files=["config.json", "tokenizer.json"])
    assert r.summary("/out") == (
        "--export-hf /out: the form of /ckpt: 7 trained tensors under the source's names; 1 trained tensor(s) "
        "written bfloat16 -> float32 as the source stores them; 2 trained tensor(s) written float32 -> bfloat16 "
        "as the source stores them; 3 tensors the trainer does not own copied byte for byte (3.5 MiB); unchanged "
        "copies of config.json, tokenizer.json (training changes no config.json field)")


def test_the_export_log_of_a_recipe_run_names_the_side_files_it_copied():
    r = ExportReport(trained_tensors=12)
    assert r.summary("o") == ("--export-hf o: a text-only Qwen3_5MoeForCausalLM checkpoint (12 tensors, config.json "
                              "from the model section)")
    r.side_files = ["tokenizer.json", "chat_template.jinja"]
    assert r.summary("o").endswith("from the model section; copied tokenizer.json, chat_template.jinja)")


def _form():
    trained = {"model.language_model.norm.weight": "BF16", "model.language_model.embed_tokens.weight": "F32"}
    return types.SimpleNamespace(
        path="/src", trained=trained,
        source_name=lambda n: "model.language_model." + n.removeprefix("model."),
        numpy_dtype=lambda n: {"BF16": "bfloat16", "F32": "float32"}[trained[n]])


def test_tensors_take_the_sources_names_and_dtypes_and_casts_are_counted():
    import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
    report = ExportReport()
    out = hf_export.in_source_form({"model.norm.weight": np.ones(3, np.float32),
                                    "model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, _form(), report)
    assert sorted(out) == ["model.language_model.embed_tokens.weight", "model.language_model.norm.weight"]
    assert out["model.language_model.norm.weight"].dtype.name == "bfloat16"
    assert out["model.language_model.embed_tokens.weight"].dtype.name == "float32"
    assert report.dtype_changes == {"float32 -> bfloat16": 1}  # the float32 one already matched
    with pytest.raises(ValueError, match="the run writes model.language_model.lm_head.weight, which the source "
                                         "checkpoint /src does not hold"):
        hf_export.in_source_form({"model.lm_head.weight": np.ones(1)}, _form())


def test_an_export_with_other_names_than_its_source_is_refused_naming_both_sides():
    hf_export._check_names({"a", "b"}, {"a", "b"}, "/src")
    with pytest.raises(ValueError, match=r"missing \['c'\], not in the source \['x'\]; nothing was written"):
        hf_export._check_names({"a", "x"}, {"a", "c"}, "/src")
    with pytest.raises(ValueError, match=r"missing \['c'\], not in the source none"):
        hf_export._check_names({"a"}, {"a", "c"}, "/src")


def test_a_units_spec_drops_the_stacked_axis_and_unshards_an_axis_its_size_does_not_split():
    mesh = types.SimpleNamespace(shape={"data": 2, "expert": 4})
    sharding = types.SimpleNamespace(spec=(None, "expert", "data"), mesh=mesh)
    assert hf_export._spec_without(sharding, 1)[:2] == ["expert", "data"]
    # 8 experts split 4 ways; 2 of them do not (2 % 4 != 0) and stay whole.
    assert hf_export._spec_without(sharding, 1, keep_axis=0, size=8)[:2] == ["expert", "data"]
    assert hf_export._spec_without(sharding, 1, keep_axis=0, size=2)[:2] == [None, "data"]
    assert hf_export._spec_without(sharding, 1, keep_axis=0, size=6)[:2] == [None, "data"]  # 6 % 4 != 0
    two = types.SimpleNamespace(spec=(None, ("data", "expert")), mesh=mesh)
    assert hf_export._spec_without(two, 1, keep_axis=0, size=4)[:1] == [None]  # 4 % (2 x 4) != 0
    assert hf_export._spec_without(two, 1, keep_axis=0, size=16)[:1] == [("data", "expert")]


# ------------------------------------------------------------------------------------------------
# a source checkpoint's form, read from its headers, and the byte-for-byte copy


@pytest.fixture
def source_dir(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file
    d = tmp_path / "src"
    d.mkdir()
    (d / "config.json").write_text("{}")
    for name in ("tokenizer.json", "chat_template.jinja", "LICENSE", "model.safetensors.index.json", ".hidden.json",
                 "weights.bin"):
        (d / name).write_text("x")
    save_file({"model.language_model.norm.weight": np.ones(4, ml_dtypes.bfloat16),         # 8 bytes
               "model.visual.proj": np.arange(6, dtype=np.float32).reshape(2, 3),          # 24 bytes, kept
               "lm_head.weight": np.zeros((2, 2), np.float32)}, str(d / "a.safetensors"))
    save_file({"model.language_model.layers.0.mlp.experts.gate_up_proj": np.zeros((2, 2), np.float16),
               "mtp.fc": np.arange(5, dtype=np.int64)}, str(d / "b.safetensors"))          # 40 bytes, kept
    return d


def test_a_sources_form_separates_the_trained_tensors_from_the_kept_ones(source_dir):
    shards = [str(source_dir / "a.safetensors"), str(source_dir / "b.safetensors")]
    form = hf.read_source_form(str(source_dir), shards)
    assert form.multimodal and form.expert_layout == "fused" and form.gdn_projections == "split"
    assert form.trained == {"model.language_model.norm.weight": "BF16", "lm_head.weight": "F32",
                            "model.language_model.layers.0.mlp.experts.gate_up_proj": "F16"}
    assert form.kept == {shards[0]: ["model.visual.proj"], shards[1]: ["mtp.fc"]}
    assert form.kept_bytes == 2 * 3 * 4 + 5 * 8
    assert form.source_name("model.norm.weight") == "model.language_model.norm.weight"
    assert form.source_name("lm_head.weight") == "lm_head.weight"
    assert form.side_files() == ["LICENSE", "chat_template.jinja", "config.json", "tokenizer.json"]
    assert len(form.names) == 5


def test_tensors_are_copied_byte_for_byte_in_small_pieces(source_dir, tmp_path):
    from safetensors import safe_open
    dst = tmp_path / "out.safetensors"
    copied = hf.copy_tensors(str(source_dir / "b.safetensors"), ["mtp.fc"], str(dst), chunk_bytes=3)
    assert copied == 40
    with safe_open(str(dst), framework="numpy") as fh:
        assert list(fh.keys()) == ["mtp.fc"] and fh.get_tensor("mtp.fc").tolist() == [0, 1, 2, 3, 4]
    both = hf.copy_tensors(str(source_dir / "a.safetensors"), ["model.visual.proj", "lm_head.weight"], str(dst))
    assert both == 24 + 16
    with safe_open(str(dst), framework="numpy") as fh:
        assert fh.get_tensor("model.visual.proj").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_truncated_shard_is_named(tmp_path):
    from hybridmoe.hf.source import shard_header
    f = tmp_path / "t.safetensors"
    f.write_bytes((100).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header of 100 bytes"):
        shard_header(str(f))
    f.write_bytes((5).to_bytes(8, "little") + b"{}")  # 5 header bytes said, 2 there
    with pytest.raises(ValueError, match="header of 5 bytes"):
        shard_header(str(f))
    f.write_bytes(b"abc")
    with pytest.raises(ValueError, match="no header"):
        shard_header(str(f))


# ------------------------------------------------------------------------------------------------
# --init-hf weights against the model's


def test_init_hf_weights_are_checked_leaf_by_leaf_and_cast_to_the_models_dtypes(monkeypatch):
    import jax
    from hybridmoe.run import hf_io
    from hybridmoe.run.run_dir import RunError
    want = {"a": jax.ShapeDtypeStruct((2, 3), np.float32), "b": jax.ShapeDtypeStruct((4,), np.int32)}
    monkeypatch.setattr(hf_io, "abstract_params", lambda specs: want)
    monkeypatch.setattr(hf_io, "put_global", lambda tree, shardings: (tree, shardings))
    setup = types.SimpleNamespace(specs=None, param_shardings="sh")
    tree, sh = hf_io.params_from_hf(setup, "dir", {"a": np.ones((2, 3), np.float64), "b": np.arange(4.0)})
    assert sh == "sh" and tree["a"].dtype == np.float32 and tree["b"].dtype == np.int32
    assert tree["b"].tolist() == [0, 1, 2, 3]
    with pytest.raises(RunError, match=r"--init-hf dir: weight shapes differ from the model's: \['\(3, 2\) != \(2, 3\)'\]"):
        hf_io.params_from_hf(setup, "dir", {"a": np.ones((3, 2)), "b": np.arange(4.0)})
    with pytest.raises(RunError, match="--init-hf dir: its weight tree does not match the model's"):
        hf_io.params_from_hf(setup, "dir", {"a": np.ones((2, 3))})


def test_init_hf_weights_are_not_read_on_a_resume_that_will_restore(tmp_path, monkeypatch):
    import hybridmoe.hf as hf_pkg
    from hybridmoe.run import hf_io
    monkeypatch.setattr(hf_pkg, "load_hf_checkpoint", lambda path: ("fields", f"tree of {path}"))
    assert hf_io.read_hf_weights(None, tmp_path, False) is None
    assert hf_io.read_hf_weights("ck", tmp_path, True) == "tree of ck"  # nothing finished to restore yet
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    assert hf_io.read_hf_weights("ck", tmp_path, True) is None
    assert hf_io.read_hf_weights("ck", tmp_path, False) == "tree of ck"  # a fresh start reads them


def test_init_hf_takes_the_checkpoints_fields_but_names_a_shape_the_recipe_disagrees_on():
    from hybridmoe.config import ConfigError
    from hybridmoe.recipe import load_config
    from hybridmoe.run.hf_io import config_with_hf_model
    # The recipe's rope_theta 1e7 gives way to the checkpoint's 1e4 (not a shape field).
    cfg = config_with_hf_model(load_config("tiny", ["model.rope_theta=1e7"]), FIXTURE)
    assert cfg.model.rope_theta == 10000.0 and cfg.model.d_model == 64
    with pytest.raises(ConfigError, match="model.d_model: .* recipe 128, checkpoint 64; .* pass: model.d_model=64"):
        config_with_hf_model(load_config("tiny", ["model.d_model=128"]), FIXTURE)


# ------------------------------------------------------------------------------------------------
# checkpoint folders: shards, the index, tensors outside the text model, the saved folder's mode


def _fixture_copy(tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(FIXTURE, d)
    return d


def test_an_index_lists_each_shard_once_and_every_shard_it_names_must_be_there(tmp_path):
    d = _fixture_copy(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}}))
    assert hf.checkpoint_shards(str(d)) == [str(d / "model.safetensors")]
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}}))
    with pytest.raises(hf.CheckpointError, match="names shard\\(s\\) missing from the folder: model-2.safetensors"):
        hf.checkpoint_shards(str(d))


def test_a_tensor_in_two_shards_is_refused_and_tensors_outside_the_text_model_are_not_read(tmp_path):
    import shutil
    from safetensors.numpy import save_file
    d = _fixture_copy(tmp_path)
    save_file({"model.visual.patch_embed.weight": np.ones((2, 2), np.float32)}, str(d / "vision.safetensors"))
    fields, tree = hf.load_hf_checkpoint(str(d))
    assert fields["d_model"] == 64 and "visual" not in json.dumps(list(tree))
    shutil.copyfile(d / "model.safetensors", d / "model-copy.safetensors")
    with pytest.raises(hf.CheckpointError, match="is also in"):
        hf.load_hf_checkpoint(str(d))


def test_a_saved_checkpoint_folder_is_an_ordinary_folder(tmp_path):
    fields, tree = hf.load_hf_checkpoint(FIXTURE)
    out = tmp_path / "saved"
    hf.save_hf_checkpoint(str(out), fields, tree)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_mtp_layers_are_ignored_and_unused_tensors_are_counted_past_the_eighth():
    from safetensors.numpy import load_file
    fields = hf.model_fields_from_hf_config(_config())
    state = load_file(os.path.join(FIXTURE, "model.safetensors"))
    extra = {"model.mtp.layers.0.w": np.ones(2, np.float32), "mtp.fc.weight": np.ones(2, np.float32)}
    hf.hf_to_native({**state, **extra}, fields)  # multi-token-prediction layers are not the trainer's
    unused = {f"model.layers.0.extra{i}": np.ones(1, np.float32) for i in range(10)}
    with pytest.raises(ValueError, match=r"extra1, .*, \.\.\. \(10 in all\)"):
        hf.hf_to_native({**state, **unused}, fields, where="ck")
