"""Config sources, later wins: the recipe YAML (with its `base:` chain), then `section.key=value`.

A recipe is a name (`tiny`, `qwen3.5-35b-a3b`, ...), a YAML file, or `hf:DIR` / `hf:DIR@BASE`: the
model section read from a Hugging Face checkpoint's config.json, every other section from the named
base recipe (`tiny` unless given).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridmoe.config.schema import Config
from hybridmoe.config.errors import ConfigError
from hybridmoe.recipe.validate import check_requirements

RECIPE_DIR = resources.files("hybridmoe.config") / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.name[: -len(".yml")] for p in RECIPE_DIR.iterdir() if p.name.endswith(".yml"))


HF_PREFIX, DEFAULT_HF_BASE = "hf:", "tiny"


def split_hf_recipe(name: str) -> tuple[Path, str]:
    """`hf:DIR[@BASE]` -> (DIR, BASE). A DIR that exists with an '@' in its name is taken whole."""
    spec = name[len(HF_PREFIX):]
    if "@" in spec and not Path(spec).is_dir():
        spec, base = spec.rsplit("@", 1)
        return Path(spec), base or DEFAULT_HF_BASE
    return Path(spec), DEFAULT_HF_BASE


def hf_model_section(hf_dir: str | Path) -> dict[str, Any]:
    """The `model.*` values of a Hugging Face checkpoint folder, from its config.json: the shape
    fields, max_seq_len from max_position_embeddings and both dtypes from the stored dtype."""
    from hybridmoe.hf import CheckpointError, model_fields_from_hf_config, read_hf_config
    try:
        config_json = read_hf_config(str(hf_dir))
        fields = dict(model_fields_from_hf_config(config_json))
    except CheckpointError as e:
        raise ConfigError([("recipe", str(e))]) from None
    except ValueError as e:  # an unsupported architecture or field, named by model_fields_from_hf_config
        raise ConfigError([("recipe", f"{Path(hf_dir) / 'config.json'}: {str(e).removeprefix('config.json: ')}")]) from None
    fields["layer_pattern"] = list(fields["layer_pattern"])
    text = config_json.get("text_config", config_json)
    if text.get("max_position_embeddings"):
        fields["max_seq_len"] = int(text["max_position_embeddings"])
    dtype = text.get("dtype") or text.get("torch_dtype") or config_json.get("dtype") or config_json.get("torch_dtype")
    if dtype in ("float32", "bfloat16"):
        fields["param_dtype"] = fields["compute_dtype"] = dtype
    return fields


def _read_recipe(name: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    if name.startswith(HF_PREFIX):
        hf_dir, base = split_hf_recipe(name)
        data = _read_recipe(base, chain + (name,))
        data["model"] = {**{k: v for k, v in data.get("model", {}).items() if k == "init_std"},
                         **hf_model_section(hf_dir)}
        if (hf_dir / "tokenizer.json").is_file():  # the checkpoint's own vocabulary, unless the recipe names one
            data["data"] = {"tokenizer": str(hf_dir), **data.get("data", {})}
        return data
    path = Path(name) if name.endswith((".yml", ".yaml")) else None
    if path is None:
        candidate = RECIPE_DIR / f"{name}.yml"
        if not candidate.is_file():
            raise ConfigError([("recipe", f"unknown recipe {name!r}; known: {', '.join(recipe_names())}")])
        text = candidate.read_text()
    else:
        if not path.is_file():
            raise ConfigError([("recipe", f"no recipe file at {str(path)!r}")])
        text = path.read_text()
    if name in chain:
        raise ConfigError([("recipe", f"base chain loops: {' -> '.join(chain + (name,))}")])
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError([("recipe", f"{name!r} is not valid YAML: {e}")]) from None
    if not isinstance(data, dict):
        raise ConfigError([("recipe", f"{name!r} must be a mapping of sections")])
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read_recipe(str(base), chain + (name,)), data)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError([(item, "an override is section.key=value")])
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError([(key, "an override key is section.key (e.g. train.steps=10)")])
    # YAML scalars: numbers, booleans, lists ([a, b]); anything else stays a string.
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError([(".".join(parts), f"{p!r} is a value, not a section")])
    node[parts[-1]] = value


def _pydantic_errors(e: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (see `hybridmoe describe` for the config tree)"
        elif "input" in err and not isinstance(err["input"], dict):
            msg = f"{msg} (got {err['input']!r})"
        out.append((key, msg))
    return out


def load_config(recipe: str = "tiny", overrides: list[str] | tuple[str, ...] = (), *,
                platform: str | None = None) -> Config:
    """Resolve a recipe plus overrides into a Config validated for `platform` (None: the config's
    own; "tpu" for a program compiled for a TPU target), or raise one ConfigError."""
    return config_with_overrides(_read_recipe(recipe), overrides, platform=platform)


def config_with_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), *,
                          platform: str | None = None) -> Config:
    """`section.key=value` overrides applied to a config's sections (e.g. a run's saved config),
    validated for `platform` (see load_config)."""
    data = _merge({}, data)
    for item in overrides:
        parts, value = _parse_override(item)
        if parts == ["recipe"]:
            continue
        _apply_override(data, parts, value)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_pydantic_errors(e)) from None
    check_requirements(cfg, platform=platform)
    return cfg


def split_args(args: list[str]) -> tuple[str, list[str]]:
    """Split command-line words into (recipe, overrides): `recipe=NAME` and `section.key=value`."""
    recipe, overrides = "tiny", []
    for a in args:
        if a.startswith("recipe="):
            recipe = a.split("=", 1)[1]
        else:
            overrides.append(a)
    return recipe, overrides
