"""--export-hf: sharded safetensors with an index, written in units by every host's shards, with
the side files and normal file modes; reloads to the same weights."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from hybridmoe.recipe import load_config
from hybridmoe import hf
from hybridmoe.run import hf_export
from hybridmoe.run.hf_io import params_from_hf
from hybridmoe.run.setup import build

HF_TINY = Path(__file__).parent / "fixtures" / "hf_tiny"
SMALL_FILES = 300_000  # bytes: the 1.3 MB fixture becomes several files


@pytest.fixture(scope="module", params=["fsdp", "fsdp_x_expert"])
def loaded(request):
    mesh = ["mesh.data=1", "mesh.fsdp=-1"] if request.param == "fsdp" else ["mesh.data=2", "mesh.expert=2", "mesh.fsdp=-1"]
    cfg = load_config(f"hf:{HF_TINY}", mesh)
    setup = build(cfg)
    return cfg, params_from_hf(setup, HF_TINY)


def export(tmp_path, loaded, **kw):
    cfg, params = loaded
    out = tmp_path / "export"
    report = hf_export.export_hf_sharded(out, cfg, params, side_files_from=HF_TINY, max_file_bytes=SMALL_FILES, **kw)
    return out, report


def test_export_is_sharded_indexed_exact_and_complete(tmp_path, loaded):
    out, report = export(tmp_path, loaded)
    index = json.loads((out / hf.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == sorted(report.files)
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    got = {}
    for f in files:
        part = load_file(out / f)
        assert all(index["weight_map"][name] == f for name in part)
        got.update(part)
    want = load_file(HF_TINY / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in files)
    # Our own loader reads it back through the index, and the model section is the same.
    fields, _ = hf.load_hf_checkpoint(str(out))
    assert fields == hf.model_fields_from_hf_config(json.loads((HF_TINY / "config.json").read_text()))


def test_side_files_travel_and_modes_are_normal(tmp_path, loaded):
    out, _ = export(tmp_path, loaded)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (HF_TINY / name).read_bytes(), name
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert not list(tmp_path.glob(".export*"))  # the temporary folder is gone


def test_no_device_holds_more_than_its_shards_and_no_host_more_than_a_unit(tmp_path, loaded):
    cfg, params = loaded
    _, report = export(tmp_path, loaded)
    over = [(n, piece, source) for n, piece, source in report.device_bytes if piece > source]
    assert not over, over
    model_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    assert report.max_host_unit_bytes <= SMALL_FILES < model_bytes / 4


def test_the_device_check_catches_a_gathering_export(tmp_path, loaded, monkeypatch):
    """Broken variant: slices gathered whole onto every device (replicated) break the bound."""
    monkeypatch.setattr(hf_export, "_spec_without", lambda sharding, drop, keep_axis=None, size=None: [None] * 8)
    _, report = export(tmp_path, loaded)
    assert any(piece > source for _, piece, source in report.device_bytes)


def test_export_over_an_earlier_one_drops_stale_shards(tmp_path, loaded):
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    (out / "notes.txt").write_text("kept")
    out, _ = export(tmp_path, loaded)
    assert not (out / "model.safetensors").exists() and (out / "notes.txt").read_text() == "kept"
    hf.load_hf_checkpoint(str(out))
