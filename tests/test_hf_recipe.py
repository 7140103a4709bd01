"""`recipe=hf:DIR`: the model section from a checkpoint's config.json, the rest from a base recipe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridmoe.cli import main
from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config
from hybridmoe import hf

FIXTURES = Path(__file__).parent / "fixtures"
HF_TINY = FIXTURES / "hf_tiny"
# config.json of the published checkpoints (text fields as released; no weights), and the named
# recipe each must reproduce.
REAL_SHAPES = ["qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b"]


def describe(capsys, *words) -> dict:
    assert main(["describe", "--json", *words]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_published_configs_give_the_named_recipes_totals(name, capsys):
    got = describe(capsys, f"recipe=hf:{FIXTURES / 'hf_configs' / name}")
    want = describe(capsys, f"recipe={name}")
    assert (got["total_params"], got["active_params"]) == (want["total_params"], want["active_params"])
    assert got["params"] == want["params"]
    for key in hf.FIELD_NAMES:
        assert got["config"]["model"][key] == want["config"]["model"][key], key


def test_fixture_model_section_and_base_recipe():
    cfg = load_config(f"hf:{HF_TINY}@demo", ["train.steps=3"])
    assert cfg.model.rope_theta == 10000.0  # the checkpoint's, not the demo recipe's 1e7
    assert cfg.model.max_seq_len == 32768 and cfg.model.param_dtype == "float32"
    assert cfg.rl.task == "arithmetic" and cfg.rl.steps == 60  # from the base recipe
    assert cfg.train.steps == 3  # overrides still win
    assert load_config(f"hf:{HF_TINY}").train.seq_len == load_config("tiny").train.seq_len  # default base


def test_fixture_score_uses_the_same_section(tmp_path):
    from hybridmoe.recipe.load import hf_model_section
    fields = hf.model_fields_from_hf_config(json.loads((HF_TINY / "config.json").read_text()))
    section = hf_model_section(HF_TINY)
    assert {k: section[k] for k in fields} == {**fields, "layer_pattern": list(fields["layer_pattern"])}


def _folder(tmp_path, config) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


@pytest.mark.parametrize("config, needle", [
    (None, "config.json: missing"),
    ("{not json", "not valid JSON"),
    ({"model_type": "llama"}, "model_type='llama' is not supported"),
])
def test_bad_checkpoint_folder_is_one_clear_error(tmp_path, capsys, config, needle):
    d = _folder(tmp_path, config)
    with pytest.raises(ConfigError, match=needle):
        load_config(f"hf:{d}")
    assert main(["describe", f"recipe=hf:{d}"]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(d) in err and "Traceback" not in err


@pytest.mark.parametrize("damage", ["truncate", "garbage", "index_names_missing_shard"])
def test_corrupt_weights_name_the_file_and_write_nothing(tmp_path, capsys, damage):
    import numpy as np
    d = tmp_path / "ckpt"
    shutil.copytree(HF_TINY, d)
    weights = d / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"garbage")
    else:
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(hf.CheckpointError, match="safetensors"):
        hf.load_hf_checkpoint(str(d))
    out = tmp_path / "lp.npy"
    np.save(tmp_path / "t.npy", np.zeros((1, 4), np.int32))
    assert main(["score", "--hf", str(d), "--tokens", str(tmp_path / "t.npy"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "safetensors" in err and str(d) in err and "Traceback" not in err
    assert not out.exists()
