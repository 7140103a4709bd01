"""Every declared weight's name, shape, dtype, logical axes and initial value, written out by hand
for a tiny model whose sizes all differ (model/params.py), the remat wrapper's choice of unit
and policy (model/remat.py) and the weight-split refusal's text (model/fit.py). A wrong axis name changes how a weight shards, not what the model
computes, so only a table like this one sees it. Nothing compiles."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.config.schema import ModelConfig
from hybridmoe.model import params as P
from hybridmoe.model import remat

# D 8, V 10, 2 layers (gdn, attention) = 1 block; attention N 4, G 2, A 8; GDN K 2, U 4, k 3, v 5,
# W 4; E 6 experts of F 7, shared S 9; weights bfloat16.
DIMS = dict(vocab_size=10, d_model=8, num_layers=2, layer_pattern=("gdn", "attention"), num_heads=4, num_kv_heads=2,
            head_dim=8, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_dim=3, gdn_value_dim=5, gdn_conv_kernel=4,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=7, shared_expert_intermediate_size=9,
            param_dtype="bfloat16")
BF, F32 = "bfloat16", "float32"
L = "layers"
MOE = {  # per layer: router [D, E], wi [E, D, 2F], wo [E, F, D], shared [D, 2S], [S, D], gate [D]
    "moe/router": ((1, 8, 6), BF, (L, "embed", None)),
    "moe/shared_gate": ((1, 8), BF, (L, "embed")),
    "moe/shared_wi": ((1, 8, 18), BF, (L, "embed", "mlp")),
    "moe/shared_wo": ((1, 9, 8), BF, (L, "mlp", "embed")),
    "moe/wi": ((1, 6, 8, 14), BF, (L, "exp", "embed", "mlp")),
    "moe/wo": ((1, 6, 7, 8), BF, (L, "exp", "mlp", "embed")),
    "input_norm": ((1, 8), F32, (L, "embed")),
    "post_norm": ((1, 8), F32, (L, "embed")),
}
GDN = {
    "mixer/A_log": ((1, 4), F32, (L, "heads")),
    "mixer/dt_bias": ((1, 4), F32, (L, "heads")),
    "mixer/conv_q": ((1, 4, 2, 3), BF, (L, None, "heads", None)),   # [W, K, k]
    "mixer/conv_k": ((1, 4, 2, 3), BF, (L, None, "heads", None)),
    "mixer/conv_v": ((1, 4, 4, 5), BF, (L, None, "heads", None)),   # [W, U, v]
    "mixer/norm": ((1, 5), F32, (L, None)),
    "mixer/wa": ((1, 8, 4), BF, (L, "embed", "heads")),
    "mixer/wb": ((1, 8, 4), BF, (L, "embed", "heads")),
    "mixer/wq": ((1, 8, 2, 3), BF, (L, "embed", "heads", None)),
    "mixer/wk": ((1, 8, 2, 3), BF, (L, "embed", "heads", None)),
    "mixer/wv": ((1, 8, 4, 5), BF, (L, "embed", "heads", None)),
    "mixer/wz": ((1, 8, 4, 5), BF, (L, "embed", "heads", None)),
    "mixer/wo": ((1, 4, 5, 8), BF, (L, "heads", None, "embed")),    # [U, v, D]
}
ATTENTION = {
    "mixer/q_norm": ((1, 8), F32, (L, None)),
    "mixer/k_norm": ((1, 8), F32, (L, None)),
    "mixer/wq": ((1, 8, 4, 16), BF, (L, "embed", "heads", None)),   # [D, N, 2A]: query and gate
    "mixer/wk": ((1, 8, 2, 8), BF, (L, "embed", "kv_heads", None)),
    "mixer/wv": ((1, 8, 2, 8), BF, (L, "embed", "kv_heads", None)),
    "mixer/wo": ((1, 4, 8, 8), BF, (L, "heads", None, "embed")),    # [N, A, D]
}
OUTER = {
    "embed": ((10, 8), BF, ("vocab", "embed")),
    "final_norm": ((8,), F32, ("embed",)),
    "lm_head": ((8, 10), BF, ("embed", "vocab")),
}


def test_every_weight_is_declared_with_its_shape_dtype_and_axes():
    want = {**{f"blocks/0/{k}": v for k, v in {**GDN, **MOE}.items()},
            **{f"blocks/1/{k}": v for k, v in {**ATTENTION, **MOE}.items()}, **OUTER}
    got = {name: (shape, dtype, axes) for name, shape, dtype, axes in P.param_table(P.declare_params(ModelConfig(**DIMS)))}
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


def test_norms_start_at_zero_except_the_gdn_output_norm_at_one():
    """Qwen's RMSNorm scales by (1 + w): its weights start at 0; the GDN gated norm scales by w."""
    tree = P.declare_params(ModelConfig(**DIMS))
    key = jax.random.key(0)
    init = lambda spec: np.asarray(spec.init(key, (4,), jnp.float32))  # noqa: E731 (one shape: one compile)
    gdn, attn = tree["blocks"]
    for spec in (gdn["input_norm"], gdn["post_norm"], attn["input_norm"], attn["post_norm"], tree["final_norm"],
                 attn["mixer"]["q_norm"], attn["mixer"]["k_norm"]):
        assert np.all(init(spec) == 0.0)
    assert np.all(init(gdn["mixer"]["norm"]) == 1.0)
    # weights are random, not constant
    for spec in (attn["mixer"]["wq"], gdn["moe"]["router"], tree["embed"], tree["lm_head"], gdn["moe"]["shared_gate"]):
        assert np.unique(init(spec).astype(np.float32)).size > 1


def test_no_shared_expert_and_tied_embeddings_drop_their_weights():
    names = [r[0] for r in P.param_table(P.declare_params(ModelConfig(**{**DIMS, "shared_expert_intermediate_size": 0,
                                                                        "tie_word_embeddings": True})))]
    assert not [n for n in names if "shared" in n or n == "lm_head"]
    assert "embed" in names and "blocks/0/moe/router" in names
    # a shared expert of one hidden unit is still a shared expert
    one = P.declare_params(ModelConfig(**{**DIMS, "shared_expert_intermediate_size": 1}))["blocks"][0]["moe"]
    assert (one["shared_wi"].shape, one["shared_wo"].shape) == ((1, 8, 2), (1, 1, 8))


# ---------------------------------------------------------------------------------------------
# model/remat.py: checkpointed


def _cfg(policy="full", unit="block", scan_layers=True):
    return SimpleNamespace(remat=SimpleNamespace(policy=policy, unit=unit, scan_layers=scan_layers, save=()),
                           attention=SimpleNamespace(cp_load_balance_hoist_ids=False))


def test_checkpointed_wraps_only_its_own_unit_and_not_under_none(monkeypatch):
    def fn(x):
        return x

    seen = []
    monkeypatch.setattr(jax, "checkpoint", lambda f, policy, prevent_cse: seen.append((f, policy, prevent_cse)) or "wrapped")
    assert remat.checkpointed(fn, _cfg(unit="layer"), 16, unit="block") is fn
    assert remat.checkpointed(fn, _cfg(policy="none"), 16, unit="block") is fn
    assert remat.checkpointed(fn, _cfg(), 16, unit="block") == "wrapped"
    assert seen == [(fn, jax.checkpoint_policies.nothing_saveable, False)]  # scanned: no CSE prevention
    remat.checkpointed(fn, _cfg(policy="minimal", unit="layer", scan_layers=False), 16, unit="layer")
    assert seen[-1] == (fn, jax.checkpoint_policies.dots_with_no_batch_dims_saveable, True)


# ---------------------------------------------------------------------------------------------
# model/fit.py: a dimension more than one field sizes


def test_weight_split_refusal_names_the_other_fields_behind_the_dimension(monkeypatch):
    from hybridmoe.model import fit
    from hybridmoe.parallel.rules import DEFAULT_RULES

    monkeypatch.setattr(fit, "_fields_behind", lambda perturbed, name, dim, size: ["num_experts", "vocab_size", "d_model"])
    m = ModelConfig(**{**DIMS, "param_dtype": "float32"})
    # 6 experts over expert=4: wi and wo of both layers; the first field is the key, the others named with it
    assert fit.sharding_problems(m, DEFAULT_RULES, {"expert": 4}) == [(
        "model.num_experts", "a dimension of 6 (with model.vocab_size, model.d_model) does not split over the 4 shards "
        "of mesh.expert=4, which the rules give logical axis 'exp' (blocks/0/moe/wi, blocks/0/moe/wo, blocks/1/moe/wi "
        "and 1 more); make it a multiple of 4 or change the mesh")]


def test_fields_behind_a_dimension_are_those_whose_change_alters_it():
    from hybridmoe.model import fit

    perturbed = {"a": {"w": ((4, 6), None)}, "b": {"w": ((2, 12), None)}, "c": {"v": ((2, 3), None)}}
    assert fit._fields_behind(perturbed, "w", 1, 6) == ["b"]
    assert fit._fields_behind(perturbed, "w", 0, 2) == ["a"]
