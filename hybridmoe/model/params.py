"""Weights, declared once and abstractly.

`declare_params(cfg)` returns a tree of `ParamSpec` (shape, dtype, logical axes, initializer).
Initialisation, shardings, abstract targets for checkpoint restore, the Hugging Face import and
parameter counts are all derived from that one tree.

Shape legend: D model width, V vocab, E routed experts, F expert hidden, S shared-expert hidden,
N attention query heads, G attention key/value heads, A attention head dim, K GDN key heads,
U GDN value heads, k GDN key dim, v GDN value dim, W conv width, L stacked blocks (layer scan).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.config.schema import ModelConfig
from hybridmoe.parallel.rules import named_sharding

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def normal(std: float) -> Initializer:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def constant(value: float) -> Initializer:
    return lambda key, shape, dtype: jnp.full(shape, value, dtype)


def a_log_init(key, shape, dtype):
    # A = exp(A_log) drawn uniformly in [1, 16], as in the Mamba-2 / GDN initialisation.
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def dt_bias_init(key, shape, dtype):
    # softplus(dt_bias) = dt with dt log-uniform in [1e-3, 1e-1]: the inverse softplus of dt.
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Initializer
    dtype: Any = jnp.float32

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _stack(spec: ParamSpec, n: int) -> ParamSpec:
    return dataclasses.replace(spec, shape=(n, *spec.shape), axes=("layers", *spec.axes))


def attention_params(m: ModelConfig, dtype, std: float) -> dict[str, ParamSpec]:
    D, N, G, A = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    return {
        # Per head [q_h | gate_h]: the query and its sigmoid output gate from one projection.
        "wq": ParamSpec((D, N, 2 * A), ("embed", "heads", None), normal(std), dtype),
        "wk": ParamSpec((D, G, A), ("embed", "kv_heads", None), normal(std), dtype),
        "wv": ParamSpec((D, G, A), ("embed", "kv_heads", None), normal(std), dtype),
        "q_norm": ParamSpec((A,), (None,), constant(0.0), jnp.float32),
        "k_norm": ParamSpec((A,), (None,), constant(0.0), jnp.float32),
        "wo": ParamSpec((N, A, D), ("heads", None, "embed"), normal(std), dtype),
    }


def gdn_params(m: ModelConfig, dtype, std: float) -> dict[str, ParamSpec]:
    D, K, U, k, v, W = (m.d_model, m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_dim,
                        m.gdn_value_dim, m.gdn_conv_kernel)
    conv_std = 1.0 / math.sqrt(W)
    return {
        "wq": ParamSpec((D, K, k), ("embed", "heads", None), normal(std), dtype),
        "wk": ParamSpec((D, K, k), ("embed", "heads", None), normal(std), dtype),
        "wv": ParamSpec((D, U, v), ("embed", "heads", None), normal(std), dtype),
        "wz": ParamSpec((D, U, v), ("embed", "heads", None), normal(std), dtype),
        "wb": ParamSpec((D, U), ("embed", "heads"), normal(std), dtype),
        "wa": ParamSpec((D, U), ("embed", "heads"), normal(std), dtype),
        # Depthwise causal conv taps; tap W-1 multiplies the current token.
        "conv_q": ParamSpec((W, K, k), (None, "heads", None), normal(conv_std), dtype),
        "conv_k": ParamSpec((W, K, k), (None, "heads", None), normal(conv_std), dtype),
        "conv_v": ParamSpec((W, U, v), (None, "heads", None), normal(conv_std), dtype),
        "A_log": ParamSpec((U,), ("heads",), a_log_init, jnp.float32),
        "dt_bias": ParamSpec((U,), ("heads",), dt_bias_init, jnp.float32),
        "norm": ParamSpec((v,), (None,), constant(1.0), jnp.float32),
        "wo": ParamSpec((U, v, D), ("heads", None, "embed"), normal(std), dtype),
    }


def moe_params(m: ModelConfig, dtype, std: float) -> dict[str, ParamSpec]:
    D, E, F, S = m.d_model, m.num_experts, m.moe_intermediate_size, m.shared_expert_intermediate_size
    out = {
        "router": ParamSpec((D, E), ("embed", None), normal(std), dtype),
        # Prefused [gate | up]: columns [:F] are the gate, [F:] the up projection.
        "wi": ParamSpec((E, D, 2 * F), ("exp", "embed", "mlp"), normal(std), dtype),
        "wo": ParamSpec((E, F, D), ("exp", "mlp", "embed"), normal(std), dtype),
    }
    if S:
        out |= {
            "shared_wi": ParamSpec((D, 2 * S), ("embed", "mlp"), normal(std), dtype),
            "shared_wo": ParamSpec((S, D), ("mlp", "embed"), normal(std), dtype),
            "shared_gate": ParamSpec((D,), ("embed",), normal(std), dtype),
        }
    return out


def declare_params(m: ModelConfig) -> dict:
    dtype = jnp.dtype(m.param_dtype)
    std = m.init_std
    mixers = {"attention": attention_params, "gdn": gdn_params}
    blocks = []
    for kind in m.layer_pattern:
        layer = {
            # Qwen RMSNorm scales by (1 + w): w starts at zero.
            "input_norm": ParamSpec((m.d_model,), ("embed",), constant(0.0), jnp.float32),
            "post_norm": ParamSpec((m.d_model,), ("embed",), constant(0.0), jnp.float32),
            "mixer": mixers[kind](m, dtype, std),
            "moe": moe_params(m, dtype, std),
        }
        blocks.append(jax.tree.map(lambda s: _stack(s, m.num_blocks), layer, is_leaf=is_spec))
    tree = {
        "embed": ParamSpec((m.vocab_size, m.d_model), ("vocab", "embed"), normal(std), dtype),
        "blocks": blocks,
        "final_norm": ParamSpec((m.d_model,), ("embed",), constant(0.0), jnp.float32),
    }
    if not m.tie_word_embeddings:  # tied: the head is the embedding's transpose (forward.lm_head_at_use)
        tree["lm_head"] = ParamSpec((m.d_model, m.vocab_size), ("embed", "vocab"), normal(std), dtype)
    return tree


def layer_axes(m: ModelConfig) -> list:
    """Per pattern position, the logical axes of one layer's weights (the stacked axis dropped)."""
    return [jax.tree.map(lambda s: s.axes[1:], block, is_leaf=is_spec) for block in declare_params(m)["blocks"]]


def init_params(specs, key: jax.Array):
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [s.init(k, s.shape, s.dtype) for s, k in zip(leaves, keys)])


def param_shardings(specs, mesh, rules=None):
    return jax.tree.map(lambda s: named_sharding(mesh, s.axes, rules), specs, is_leaf=is_spec)


def abstract_params(specs, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs, is_leaf=is_spec)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), specs, shardings,
                        is_leaf=is_spec)


def count_params(specs) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def count_active_params(m: ModelConfig) -> int:
    """What one token uses: every weight except the routed experts it is not sent to."""
    specs = declare_params(m)
    total = count_params(specs)
    per_expert = 3 * m.d_model * m.moe_intermediate_size
    idle = (m.num_experts - m.num_experts_per_tok) * per_expert * m.num_layers
    return total - idle


def param_table(specs) -> list[tuple[str, tuple[int, ...], str, tuple]]:
    rows = []
    for path, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        rows.append((name, s.shape, np.dtype(s.dtype).name, s.axes))
    return rows
