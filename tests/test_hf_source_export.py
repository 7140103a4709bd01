"""--export-hf of a run that started from a checkpoint folder keeps the folder's form: the source
checkpoint with the trained tensors replaced.

Proofs, on the three layouts of tests/hf_layouts.py (text-only, the published multimodal one with a
vision tower and MTP tensors in three shards, tied): every source tensor outside the trained set
is byte-identical in the export; config.json and every other file of the folder are the source's
bytes (so every field, nested ones included, keeps its value); the trained tensors carry the
trained values under the source's names, in the source's dtypes; the export holds exactly the
source's tensor names. The weights are "trained" by adding a distinct offset to every leaf, so a
tensor the export took from the source instead of the run shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import hf_layouts
from hybridmoe import hf
from hybridmoe.recipe import load_config
from hybridmoe.run import hf_export
from hybridmoe.run.hf_io import params_from_hf
from hybridmoe.run.setup import build


def tensors_of(folder: Path) -> dict[str, tuple[str, list, bytes]]:
    """name -> (safetensors dtype, shape, raw bytes) over every shard of a checkpoint folder."""
    out = {}
    for shard in hf.checkpoint_shards(str(folder)):
        header, start = hf.shard_header(shard)
        data = Path(shard).read_bytes()
        for name, e in header.items():
            if name != "__metadata__":
                a, b = e["data_offsets"]
                out[name] = (e["dtype"], e["shape"], data[start + a:start + b])
    return out


def trained_offset(params):
    """A distinct, exactly representable offset per leaf: the 'trained' weights."""
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [x + (i + 1) / 8 for i, x in enumerate(leaves)])


@pytest.fixture(scope="module", params=hf_layouts.LAYOUTS)
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    source = hf_layouts.build(request.param, root / "source")
    cfg = load_config(f"hf:{source}", ["mesh.data=2", "mesh.expert=2", "mesh.fsdp=-1"])
    params = trained_offset(params_from_hf(build(cfg), source))
    form = hf.read_source_form(str(source), hf.checkpoint_shards(str(source)))
    report = hf_export.export_hf_sharded(root / "export", cfg, params, source=form, max_file_bytes=300_000)
    return request.param, source, root / "export", cfg, params, form, report


def kept_differences(source: Path, export: Path, form) -> list[str]:
    src, out = tensors_of(source), tensors_of(export)
    kept = [n for names in form.kept.values() for n in names]
    return [n for n in kept if out.get(n) != src[n]]


def test_every_untouched_tensor_is_byte_identical(exported):
    layout, source, export, _, _, form, report = exported
    kept = [n for names in form.kept.values() for n in names]
    if layout == "multimodal":  # the vision tower and the MTP layers, bf16 ones included
        assert {n.split(".")[0] + "." + n.split(".")[1] for n in kept} == {"model.visual", "mtp.fc", "mtp.norm",
                                                                          "mtp.pre_fc_norm_embedding",
                                                                          "mtp.pre_fc_norm_hidden", "mtp.layers"}
        assert any(tensors_of(source)[n][0] == "BF16" for n in kept) and report.kept_tensors == len(kept) == 38
    else:
        assert kept == []
    assert kept_differences(source, export, form) == []


def test_export_holds_exactly_the_sources_tensor_names_and_files(exported):
    layout, source, export, *_ = exported
    assert sorted(tensors_of(export)) == sorted(tensors_of(source))
    assert ("lm_head.weight" in tensors_of(export)) == (layout != "tied")
    index = json.loads((export / hf.INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in export.glob("*.safetensors"))
    others = {p.name for p in source.iterdir() if not p.name.endswith((".safetensors", ".npy")) and p.name != hf.INDEX_FILE}
    assert others <= {p.name for p in export.iterdir()} and not list(export.glob("*.npy"))  # fixture data stays
    for name in others:  # config.json, generation_config.json, tokenizer, chat template, processor: the same bytes
        assert (export / name).read_bytes() == (source / name).read_bytes(), name


def _nested_items(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _nested_items(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_every_config_field_keeps_its_source_value(exported):
    layout, source, export, *_ = exported
    src, out = json.loads((source / "config.json").read_text()), json.loads((export / "config.json").read_text())
    assert dict(_nested_items(out)) == dict(_nested_items(src))
    if layout == "multimodal":
        assert out["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and out["model_type"] == "qwen3_5_moe"
        assert out["text_config"]["max_position_embeddings"] == 4096 and "vision_config" in out


def test_trained_tensors_carry_the_trained_values_under_the_sources_names_and_dtypes(exported):
    layout, source, export, cfg, params, form, report = exported
    want = hf.native_to_hf(jax.tree.map(np.asarray, jax.device_get(params)), cfg.model)
    src, out = tensors_of(source), tensors_of(export)
    assert len(want) == len(form.trained) == report.trained_tensors
    for name, value in want.items():
        src_name = form.source_name(name)
        dtype, shape, raw = out[src_name]
        assert (dtype, shape) == src[src_name][:2], src_name  # the source's dtype and shape
        got = np.frombuffer(raw, form.numpy_dtype(src_name)).reshape(shape)
        np.testing.assert_array_equal(got, value.astype(form.numpy_dtype(src_name)), err_msg=src_name)
        assert raw != src[src_name][2], f"{src_name} still holds the source's values"
    if layout == "multimodal":
        assert report.dtype_changes == {"float32 -> bfloat16": 2}  # the two bf16 norms of the source
    # Our loader reads the export back to the trained weights (bf16 tensors rounded as stored).
    _, back = hf.load_hf_checkpoint(str(export))
    assert "lm_head" not in back if layout == "tied" else "lm_head" in back
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(back)[0], jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2 ** -7, atol=0,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_log_says_what_was_kept_and_what_was_written(exported):
    layout, source, export, *_, report = exported
    line = report.summary(export)
    assert str(source) in line and f"{report.trained_tensors} trained tensors under the source's names" in line
    assert "config.json" in line and "training changes no config.json field" in line
    if layout == "multimodal":
        assert "38 tensors the trainer does not own copied byte for byte" in line
        assert "2 trained tensor(s) written float32 -> bfloat16" in line


def _copy_through_float32(src, names, dst, chunk_bytes=0):
    with safe_open(src, framework="numpy") as fh:
        tensors = {n: fh.get_tensor(n) for n in names}
    tensors = {n: v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v for n, v in tensors.items()}
    save_file(tensors, dst, metadata={"format": "pt"})
    return sum(v.nbytes for v in tensors.values())


def test_broken_variant_kept_tensors_reencoded_is_caught(exported, tmp_path, monkeypatch):
    """Broken: the kept tensors loaded and saved again through float32 (a naive copy of bf16 ones)."""
    layout, source, _, cfg, params, form, _ = exported
    if layout != "multimodal":
        pytest.skip("only the multimodal source has tensors the trainer does not own")
    monkeypatch.setattr(hf, "copy_tensors", _copy_through_float32)
    hf_export.export_hf_sharded(tmp_path / "e", cfg, params, source=form, max_file_bytes=300_000)
    assert kept_differences(source, tmp_path / "e", form) != []


def test_broken_variant_text_only_names_for_a_multimodal_source_is_caught(exported, tmp_path, monkeypatch):
    """Broken: the trained tensors keep the text-only names (what the export wrote before)."""
    layout, _, _, cfg, params, form, _ = exported
    if layout != "multimodal":
        pytest.skip("only the multimodal source renames")
    monkeypatch.setattr(type(form), "source_name", lambda self, name: name)
    with pytest.raises(ValueError, match="does not hold"):
        hf_export.export_hf_sharded(tmp_path / "e", cfg, params, source=form, max_file_bytes=300_000)
    assert not (tmp_path / "e").exists()


def test_missing_kept_tensors_are_refused_before_anything_is_moved(exported, tmp_path):
    layout, _, _, cfg, params, form, _ = exported
    if layout != "multimodal":
        pytest.skip("only the multimodal source has tensors the trainer does not own")
    import dataclasses
    dropped = dataclasses.replace(form, kept=dict(list(form.kept.items())[:1]))
    with pytest.raises(ValueError, match="missing"):
        hf_export.export_hf_sharded(tmp_path / "e", cfg, params, source=dropped, max_file_bytes=300_000)
    assert not (tmp_path / "e").exists()


def test_fused_experts_and_interleaved_projections_keep_their_layout(tmp_path):
    """A source with fused experts and Qwen3-Next's interleaved GDN projections exports in that layout."""
    fields = hf.model_fields_from_hf_config(hf_layouts.text_config())
    tree = hf.hf_to_native(hf_layouts.text_state(), fields)
    state = hf.native_to_hf(tree, fields, expert_layout="fused", gdn_projections="interleaved")
    source = hf_layouts.write_checkpoint(tmp_path / "source", hf_layouts.text_config(), [state])
    cfg = load_config(f"hf:{source}", [])
    params = trained_offset(params_from_hf(build(cfg), source))
    form = hf.read_source_form(str(source), hf.checkpoint_shards(str(source)))
    assert (form.expert_layout, form.gdn_projections) == ("fused", "interleaved")
    hf_export.export_hf_sharded(tmp_path / "export", cfg, params, source=form)
    out = tensors_of(tmp_path / "export")
    assert sorted(out) == sorted(state)
    want = hf.native_to_hf(jax.tree.map(np.asarray, jax.device_get(params)), fields, expert_layout="fused",
                           gdn_projections="interleaved")
    for name, value in want.items():
        np.testing.assert_array_equal(np.frombuffer(out[name][2], np.float32).reshape(value.shape), value,
                                      err_msg=name)


def test_copy_tensors_streams_in_chunks_and_the_library_reads_the_result(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16), "b": np.arange(11, dtype=np.int64),
               "c": rng.standard_normal(3).astype(np.float32)}
    save_file(tensors, str(tmp_path / "src.safetensors"), metadata={"format": "pt", "note": "kept"})
    n = hf.copy_tensors(str(tmp_path / "src.safetensors"), ["c", "a"], str(tmp_path / "dst.safetensors"),
                        chunk_bytes=3)  # a chunk smaller than any tensor
    assert n == tensors["a"].nbytes + tensors["c"].nbytes
    with safe_open(str(tmp_path / "dst.safetensors"), framework="numpy") as fh:
        assert sorted(fh.keys()) == ["a", "c"] and fh.metadata() == {"format": "pt", "note": "kept"}
        for name in ("a", "c"):
            got = fh.get_tensor(name)
            assert got.dtype == tensors[name].dtype and got.tobytes() == tensors[name].tobytes()


@pytest.mark.parametrize("layout", ["multimodal", pytest.param("tied", marks=pytest.mark.slow)])
def test_train_init_hf_export_hf_round_trips_the_source_form(layout, tmp_path, capsys):
    """The user's command: `train --init-hf SRC --export-hf OUT` on a published-layout multimodal
    checkpoint and on a tied one; the log names what was kept."""
    from hybridmoe.cli import main
    source = hf_layouts.build(layout, tmp_path / "source")
    out = tmp_path / "export"
    assert main(["train", "train.steps=1", "train.warmup_steps=0", "train.batch_size=8", "train.seq_len=32",
                 "--init-hf", str(source), "--export-hf", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"--export-hf {out}: the form of {source}" in err
    form = hf.read_source_form(str(source), hf.checkpoint_shards(str(source)))
    assert kept_differences(source, out, form) == []
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    src, got = tensors_of(source), tensors_of(out)
    assert sorted(got) == sorted(src)
    embed = form.source_name("model.embed_tokens.weight")
    assert got[embed][:2] == src[embed][:2] and got[embed][2] != src[embed][2]  # one optimizer step moved it
