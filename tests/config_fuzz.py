"""Random override sets over the whole config schema, and the one property every draw must have:
it validates and the training step's abstract shapes build (jax.eval_shape, no compile), or it
fails with a ConfigError that names an overridden key. Shared by the fuzz test and its record."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
from hypothesis import strategies as st
from pydantic import BaseModel

from helpers import TWO_LAYERS
from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config
from hybridmoe.config.schema import Config
from hybridmoe.parallel.mesh import MESH_AXES


def schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, typing.Any]:
    """Every leaf key of the config tree, dotted, with its annotation."""
    out = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out |= schema_keys(ann, f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = ann
    return out


KEYS = schema_keys()
ODD = st.sampled_from(["", "abc", "[]", "[1, 2]", "{a: 1}", "null", "true", "-1", "0", "1e9", "nan", "inf", "-inf",
                       "1.5", "[gdn]", "[attention, gdn]", "0x10", "'4'"])
SMALL_INT = st.sampled_from([-2, -1, 0, 1, 2, 3, 4, 6, 8, 16, 32, 64, 10**6])
FLOAT = st.sampled_from([-1.0, 0.0, 1e-9, 0.25, 0.5, 1.0, 2.0, float("nan"), float("inf")])


def _value_for(ann) -> st.SearchStrategy[str]:
    """A YAML value string: usually of the key's own type (edge values included), sometimes odd."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is bool:
        typed = st.sampled_from(["true", "false"])
    elif ann is int:
        typed = SMALL_INT.map(str)
    elif ann is float:
        typed = FLOAT.map(str)
    elif origin is typing.Literal:
        typed = st.sampled_from([str(a) for a in args])
    elif origin is tuple:
        inner = typing.get_args(args[0]) if typing.get_origin(args[0]) is typing.Literal else ("attn_q", "moe_up")
        typed = st.lists(st.sampled_from(inner), max_size=5).map(lambda xs: "[" + ", ".join(xs) + "]")
    elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        typed = st.one_of(*[_value_for(a) for a in args if a is not type(None)], st.just("null"))
    else:
        typed = st.text(max_size=4)
    return st.one_of(typed, typed, typed, ODD)


@st.composite
def override_sets(draw) -> list[str]:
    """A few keys from anywhere in the schema, a mesh shape, and the MoE levers together."""
    keys = draw(st.lists(st.sampled_from(sorted(KEYS)), min_size=0, max_size=4, unique=True))
    out = [f"{k}={draw(_value_for(KEYS[k]))}" for k in keys]
    if draw(st.booleans()):
        sizes = draw(st.lists(st.sampled_from([-1, 1, 2, 4, 8]), min_size=len(MESH_AXES), max_size=len(MESH_AXES)))
        out += [f"mesh.{a}={v}" for a, v in zip(MESH_AXES, sizes)]
    if draw(st.booleans()):
        levers = ("moe.wi_fused_swiglu", "moe.wo_fused_dswiglu", "moe.router_grad_from_wo_input")
        out += [f"{k}={draw(st.sampled_from(['true', 'false']))}" for k in levers]
        out.append(f"moe.impl={draw(st.sampled_from(['sparse', 'dense']))}")
    # Keep tracing cheap: at most a handful of layers traced one by one.
    out.append("remat.scan_layers=true") if any(o.startswith("model.num_layers=") for o in out) else None
    return out


def _names_an_override(error: ConfigError, overrides: list[str]) -> bool:
    keys = [o.split("=", 1)[0] for o in overrides]
    # A problem key may be the override's (rl.reward_weights), above it, or one of its elements
    # (rl.reward_weights.3, pydantic's name for a bad list item).
    return any(k == pk or k.startswith(pk + ".") or pk.startswith(k + ".") or k in msg
               for pk, msg in error.problems for k in keys)


# Keys that do not reach the training step's program: draws differing only in these share a trace.
OFF_STEP = {"rl": None, "bench": None, "train": ("steps", "seed", "checkpoint_every", "log_every", "data",
                                                 "on_nonfinite", "max_nonfinite_skips")}
_traced: dict[str, dict] = {}


def _step_key(cfg) -> str:
    data = cfg.model_dump()
    for section, keys in OFF_STEP.items():
        if keys is None:
            data.pop(section)
        else:
            data[section] = {k: v for k, v in data[section].items() if k not in keys}
    return repr(data)


def abstract_step(cfg) -> dict:
    """The training step's output shapes from abstract inputs (traced, not compiled)."""
    key = _step_key(cfg)
    if key not in _traced:
        _traced[key] = _trace_step(cfg)
    return _traced[key]


def _trace_step(cfg) -> dict:
    from hybridmoe.run.setup import build, jit_train_step

    setup = build(cfg)
    t = cfg.train
    batch = {k: jax.ShapeDtypeStruct((t.fewest_micro_batches, t.rows_per_micro_batch, t.seq_len), jnp.int32)
             for k in ("tokens", "segment_ids", "positions")}
    with setup.context():
        _, metrics = jax.eval_shape(jit_train_step(setup), setup.abstract_state(), batch)
    return metrics


def check(overrides: list[str]) -> str:
    """'valid' or 'config_error'; any other outcome raises (the property fails). The draws apply
    over tiny with one layer of each mixer (TWO_LAYERS: a valid draw traces the step, in half the
    time of tiny's four layers); an error must name one of the draw's keys, never only the base's."""
    try:
        cfg = load_config("tiny", [*TWO_LAYERS, *overrides])
        abstract_step(cfg)
    except ConfigError as e:
        assert _names_an_override(e, overrides) or not overrides, (overrides, e.problems)
        return "config_error"
    return "valid"
