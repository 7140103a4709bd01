"""Config: every recipe loads; bad input gives one error naming the key."""

import json

import pytest

from hybridmoe.cli import main
from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config, recipe_names
from hybridmoe.model.params import count_active_params, count_params, declare_params


# Recipes for a TPU only, with the key a CPU host is refused by: the Pallas TPU kernels, and gather
# backwards (on a CPU the grouped matmuls run row tiles, whose backward is gathers already).
TPU_RECIPES = {"qwen3.5-397b-a17b-v7x-128": "kernels.gmm.backend", "qwen3.5-35b-a3b-v5e-1": "kernels.gmm.backend"}


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_loads(name):
    if name in TPU_RECIPES:
        with pytest.raises(ConfigError, match=TPU_RECIPES[name]):
            load_config(name)  # this CPU host cannot run them: refused, naming the key
        cfg = load_config(name, platform="tpu")
    else:
        cfg = load_config(name)
    assert cfg.model.num_layers % len(cfg.model.layer_pattern) == 0


def test_recipe_base_chain_and_override_order():
    cfg = load_config("qwen3.5-397b-a17b", ["model.num_experts=64", "train.steps=7"])
    assert cfg.model.num_experts == 64  # override beats recipe
    assert cfg.model.vocab_size == 248320  # inherited through base:
    assert cfg.train.steps == 7


@pytest.mark.parametrize("overrides, key", [
    (["model.no_such_key=1"], "model.no_such_key"),
    (["train.steps=many"], "train.steps"),
    (["model.num_heads=3"], "model.num_heads"),
    (["model.gdn_num_value_heads=3"], "model.gdn_num_value_heads"),
    (["mesh.fsdp=3"], "mesh"),
    (["mesh.data=-1"], "mesh"),
    (["model.num_layers=6"], "model.num_layers"),
    (["remat.save=[attn_q]"], "remat.save"),
    (["remat.policy=custom", "remat.save=[nope]"], "remat.save"),
    (["train"], "train"),
])
def test_bad_overrides_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert any(k == key for k, _ in e.value.problems), e.value.problems


def test_every_unmet_requirement_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["model.num_heads=3", "model.num_layers=6", "model.num_experts_per_tok=99"])
    keys = {k for k, _ in e.value.problems}
    assert {"model.num_heads", "model.num_layers", "model.num_experts_per_tok"} <= keys


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(ConfigError, match="tiny"):
        load_config("no-such-recipe")


@pytest.mark.parametrize("name, total, active", [
    ("qwen3.5-397b-a17b", 397e9, 17e9), ("qwen3.5-35b-a3b", 35e9, 3.5e9), ("qwen3-next-80b-a3b", 80e9, 3.9e9)])
def test_real_shapes_have_their_published_size(name, total, active):
    m = load_config(name).model
    assert abs(count_params(declare_params(m)) - total) / total < 0.02
    assert abs(count_active_params(m) - active) / active < 0.05


def test_describe_json(capsys):
    assert main(["describe", "recipe=qwen3.5-35b-a3b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_params"] > out["active_params"] > 0
    assert out["config"]["model"]["num_experts"] == 256


def test_describe_prints_the_published_totals(capsys):
    """describe's two count lines for Qwen3.5-35B-A3B: 35 B parameters, 3.5 B active a token (the
    published figures, within the 2% and 5% above), each its own count and its billions."""
    import re

    assert main(["describe", "recipe=qwen3.5-35b-a3b"]) == 0
    lines = {m.group(1): (int(m.group(2).replace(",", "")), float(m.group(3)))
             for m in re.finditer(r"^(total parameters|active per token):\s+([\d,]+) \(([\d.]+) B\)$",
                                  capsys.readouterr().out, re.M)}
    (total, total_b), (active, active_b) = lines["total parameters"], lines["active per token"]
    assert abs(total - 35e9) / 35e9 < 0.02 and abs(active - 3.5e9) / 3.5e9 < 0.05
    assert (total_b, active_b) == (round(total / 1e9, 2), round(active / 1e9, 2))


def test_cli_bad_override_exits_cleanly(capsys):
    assert main(["describe", "model.d_model=abc"]) == 2
    assert "model.d_model" in capsys.readouterr().err


def test_every_validator_rule_names_the_keys_it_checks():
    """A search for a key finds its rule: each rule declares the config keys it states requirements
    of (real fields or sections of the schema), and a rule of one key is named after it."""
    from hybridmoe.config.schema import Config
    from hybridmoe.recipe.validate import RL_RULES, RULES

    def exists(key):
        node = Config
        for part in key.split("."):
            fields = getattr(node, "model_fields", {})
            if part not in fields:
                return False
            node = fields[part].annotation
        return True

    assert len(RULES) >= 18 and len(RL_RULES) >= 2
    for fn in (*RULES, *RL_RULES):
        assert fn.keys, f"{fn.__name__} declares no keys"
        missing = [k for k in fn.keys if not exists(k)]
        assert not missing, f"{fn.__name__} declares keys not in the schema: {missing}"
        assert fn.__name__.startswith("_" + fn.keys[0].split(".")[0] + "_"), fn.__name__
        if len(fn.keys) == 1 and "." in fn.keys[0]:
            assert fn.__name__ == "_" + fn.keys[0].replace(".", "_"), (fn.__name__, fn.keys)
