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


def test_the_file_plan_fills_each_file_up_to_its_budget_exactly():
    """Units packed into files of at most 100 bytes, by hand. One host: 60 + 40 fill file 0 exactly,
    100 is file 1, 1 + 99 file 2 (3 files). Two hosts, units dealt round robin: host 0 takes 60, 40
    (file 0, full) and 10 (file 1), host 1 takes 50 + 50 (its file 0, numbered 2 after host 0's two)."""
    from types import SimpleNamespace

    units = lambda *sizes: [SimpleNamespace(nbytes=n) for n in sizes]  # noqa: E731
    assert hf_export._file_plan(units(60, 40, 100, 1, 99), 1, 100) == ([(0, 0), (0, 0), (0, 1), (0, 2), (0, 2)], 3)
    assert hf_export._file_plan(units(60, 50, 40, 50, 10), 2, 100) == ([(0, 0), (1, 2), (0, 0), (1, 2), (0, 1)], 3)


def test_experts_go_in_the_largest_chunks_that_fill_a_file_exactly(loaded):
    """hf_tiny: 8 experts of 3 x 64 x 32 float32 = 24,576 bytes each. A budget of exactly 4 experts
    (98,304 bytes) takes each layer's experts in 2 chunks of 4 (on the 2-way expert mesh also one
    shard's worth); a byte less, in 4 chunks of 2."""
    cfg, params = loaded
    per_expert = 3 * 64 * 32 * 4

    def chunks(budget):
        return [(u.name, u.nbytes) for u in hf_export.plan_units(cfg, params, budget) if u.name.startswith("layer 0 experts")]

    assert chunks(4 * per_expert) == [("layer 0 experts 0..3", 4 * per_expert), ("layer 0 experts 4..7", 4 * per_expert)]
    assert [name for name, _ in chunks(4 * per_expert - 1)] == [f"layer 0 experts {e}..{e + 1}" for e in (0, 2, 4, 6)]
