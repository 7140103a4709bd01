"""The model's invariances and its blocks against references (8 simulated CPU devices)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TWO_LAYERS, assert_rel_l2, packed_batch, tiny_config, tiny_params
from hybridmoe.kernels.attention import attention
from hybridmoe.kernels.attention.reference import attention_reference
from hybridmoe.model import moe as moe_mod
from hybridmoe.model.forward import decoder_hidden, logits
from hybridmoe.run.setup import build
from hybridmoe.run.step import nll_sum


def _close(a, b, rtol=1e-5, atol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def test_attention_matches_reference():
    rng = np.random.default_rng(0)
    B, T, N, G, A = 2, 12, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(B, T, N, A), (B, T, G, A), (B, T, G, A)])
    seg = jnp.asarray([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12], jnp.int32)
    pos = jnp.asarray([list(range(5)) + list(range(5)) + [0, 0], list(range(12))], jnp.int32)
    got = attention(q, k, v, q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=A ** -0.5)
    want = attention_reference(q, k, v, pos, pos, seg, seg, A ** -0.5)
    _close(got, want, 1e-5, 1e-5)


def test_moe_sparse_matches_dense_with_empty_experts():
    cfg = tiny_config()
    p = tiny_params(cfg)["blocks"][0]["moe"]
    p = jax.tree.map(lambda a: a[0], p)
    x = jax.random.normal(jax.random.key(3), (5, cfg.model.d_model))  # 5 tokens x top-2 < 8 experts: some empty

    def run(impl):
        def f(p, x):
            w, idx, _ = moe_mod.route(p["router"], x, cfg.model)
            fn = moe_mod.sparse_experts if impl == "sparse" else moe_mod.dense_experts
            return fn(x, w, idx, p["wi"], p["wo"])
        # Jitted: one compile each (eager, every op would dispatch and compile on its own).
        y = jax.jit(f)(p, x)
        g = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(f(p, x))), argnums=(0, 1)))(p, x)
        return y, g

    _, idx, _ = moe_mod.route(p["router"], x, cfg.model)
    assert len(np.unique(np.asarray(idx))) < cfg.model.num_experts  # the case under test
    _close(run("sparse"), run("dense"), 1e-5, 1e-6)


def test_causality_through_gradients():
    cfg = tiny_config("model.vocab_size=256", *TWO_LAYERS)  # one layer of each mixer
    params = tiny_params(cfg)
    T, t = 48, 20
    tokens = jnp.asarray(np.random.default_rng(0).permutation(256)[:T][None], jnp.int32)  # distinct ids
    # One compile (eager, the model's ops would dispatch and compile one by one).
    g = jax.jit(jax.grad(lambda e, p: jnp.sum(decoder_hidden({**p, "embed": e}, cfg, tokens)[0, t])))(
        params["embed"], params)
    row_norm = np.linalg.norm(np.asarray(g)[np.asarray(tokens[0])], axis=-1)
    assert np.all(row_norm[t + 1:] == 0.0), "a later token influenced an earlier position"
    assert np.all(row_norm[: t + 1] > 0.0)


def test_packed_batch_equals_documents_run_separately():
    cfg = tiny_config(*TWO_LAYERS)  # one layer of each mixer
    params = tiny_params(cfg)
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 256, size=n) for n in (7, 70, 40)]  # 70 crosses the 64-token GDN chunk
    toks = np.concatenate(docs)
    seg = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])
    pos = np.concatenate([np.arange(len(d)) for d in docs])
    pad = 128 - len(toks)
    run = jax.jit(lambda p, *a: logits(p, cfg, *a))  # a compile per length (eager: every op on its own)
    packed = run(params, jnp.asarray(np.pad(toks, (0, pad)))[None], jnp.asarray(np.pad(seg, (0, pad)))[None],
                 jnp.asarray(np.pad(pos, (0, pad)))[None])[0]
    start = 0
    for d in docs:
        alone = run(params, jnp.asarray(d)[None])[0]
        _close(packed[start:start + len(d)], alone, 2e-5, 2e-5)
        start += len(d)


def _loss_and_grads(cfg, params, batch):
    f = jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0])
    return jax.jit(f)(params)


# Two blocks of a one-GDN-one-attention pattern: the layer scan loops, each block holds both mixers
# and more than one layer (what remat.unit=layer/sublayer split), at half the program of tiny's
# four-layer pattern (each arm below is a compile: ~12 s each at tiny's pattern on 2 cores).
TWO_BLOCKS = ("model.layer_pattern=[gdn,attention]", "model.num_layers=4")


@functools.cache
def _two_blocks(*overrides: str):
    """(loss and gradients, the program's jaxpr, its compiled temporaries' bytes) of tiny at
    TWO_BLOCKS under `overrides`, on one set of params and one batch (remat settings do not change
    either): traced and compiled once per config for the remat family's tests, which compare many
    arms against the same reference."""
    from hybridmoe.analysis import program

    cfg = tiny_config(*TWO_BLOCKS, *overrides)
    params, batch = tiny_params(cfg), packed_batch(0, 2, 64, cfg.model.vocab_size)
    traced = jax.jit(jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0])).trace(params)
    compiled = traced.lower().compile()
    return jax.device_get(compiled(params)), traced.jaxpr, program.memory_figures(compiled)["temp"]


def test_sharded_on_8_devices_equals_one_device():
    cfg = tiny_config("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *TWO_LAYERS)
    params = tiny_params(cfg)
    batch = packed_batch(0, 8, 64, cfg.model.vocab_size)
    single = _loss_and_grads(cfg, params, batch)
    setup = build(cfg)
    with setup.context():
        sharded_params = jax.device_put(params, setup.param_shardings)
        sharded_batch = jax.device_put(batch, jax.tree.map(lambda _: setup.batch_sharding(0), batch))
        multi = _loss_and_grads(cfg, sharded_params, sharded_batch)
    assert len(multi[1]["embed"].sharding.device_set) == 8
    assert_rel_l2(single, multi, 1e-4)


@pytest.mark.parametrize("overrides", [
    ("remat.scan_layers=false",),
    ("remat.policy=none",),
    ("remat.policy=minimal",),
    ("remat.policy=minimal", "remat.save=[moe_gate,moe_up]"),
    ("remat.policy=custom", "remat.save=[gdn_core_out,moe_gate,moe_up,attn_out]"),
    ("remat.policy=full", "remat.unit=layer"),
    ("remat.policy=custom", "remat.save=[moe_gate]", "remat.unit=layer"),
    ("remat.policy=full", "remat.unit=sublayer"),
])
def test_scan_and_remat_variants_equal_the_scanned_full_remat(overrides):
    # Remat changes what is recomputed, hence XLA's fusion and float32 summation order (~5e-6 at
    # LLVM -O2, up to 2.3e-5 at the suite's -O0: tests/conftest.py), never the maths: a wrong save
    # or replay is O(1).
    assert_rel_l2(_two_blocks("remat.policy=full")[0], _two_blocks(*overrides)[0], 1e-4)


def _block_residuals(cfg, B=2, T=64):
    """What one layer block's forward keeps for its backward, but for its arguments and constants (the
    weights, the block's input, positions: the scan holds them anyway): (shape, jax's description) each."""
    from hybridmoe.model.forward import block_fn
    from hybridmoe.model.remat import checkpointed
    from hybridmoe.analysis import program

    params = tiny_params(cfg)
    bp = jax.tree.map(lambda a: a[0], params["blocks"])
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    x = jnp.ones((B, T, cfg.model.d_model), jnp.float32)
    block = lambda x, bp: checkpointed(block_fn(cfg, pos, seg), cfg, B * T, unit="block")(x, bp)  # noqa: E731
    return [(r.shape, r.source) for r in program.saved_residuals(block, x, bp) 
            if "from the argument" not in r.source and "constant" not in r.source]


def test_layer_remat_keeps_each_layers_input_and_nothing_else():
    # remat.unit=block: the block's input (an argument) is all it keeps; unit=layer: also the input
    # of every later layer of the pattern, one [B, T, D] each, and under a save list the names.
    block = tiny_config("remat.policy=full")
    layer = tiny_config("remat.policy=full", "remat.unit=layer")
    P, D = len(layer.model.layer_pattern), layer.model.d_model
    assert _block_residuals(block) == []
    kept = _block_residuals(layer)
    assert [shape for shape, _ in kept] == [(2, 64, D)] * (P - 1), kept
    assert all("moe_sublayer" in source for _, source in kept), kept  # each layer's output


def test_sublayer_remat_keeps_each_sublayers_input_and_nothing_else():
    # remat.unit=sublayer: also the input of every layer's MoE block (the mixer's residual output),
    # so two [B, T, D] per layer but the block's first; nothing of the mixer or the MoE block inside.
    cfg = tiny_config("remat.policy=full", "remat.unit=sublayer")
    P, D = len(cfg.model.layer_pattern), cfg.model.d_model
    kept = _block_residuals(cfg)
    assert [shape for shape, _ in kept] == [(2, 64, D)] * (2 * P - 1), kept
    sources = [source.split("(")[-1] for _, source in kept]
    assert sorted(set(sources)) == ["mixer_sublayer)", "moe_sublayer)"], kept


def _check_minimal_save_list():
    # remat.policy=minimal keeps the weight matmuls' outputs (dot_general) but recomputes the grouped
    # expert matmuls (ragged dots and row tiles are not dot_generals); its save list adds the named
    # tensors. Per layer of the tiny block (each has a MoE block): the routed experts' moe_gate and
    # moe_up of [rows >= B * T * k, F], the shared expert's of [B * T, Fs]; the shared expert's fused
    # [gate | up] dot is then kept as its two named halves instead, every other dot as before.
    from collections import Counter

    overrides = ("remat.policy=minimal", "moe.impl=sparse")
    m = tiny_config(*overrides).model
    B, T, P, F, Fs = 2, 64, len(m.layer_pattern), m.moe_intermediate_size, m.shared_expert_intermediate_size
    site = lambda source: source.rsplit("(", 1)[-1].rstrip(")")  # noqa: E731  (the function that made it)
    dots = lambda kept: Counter((shape, site(s)) for shape, s in kept if "dot_general" in s)  # noqa: E731
    names = lambda kept: Counter((shape, s.split("'")[1]) for shape, s in kept if "named '" in s)  # noqa: E731
    plain = _block_residuals(tiny_config(*overrides))
    named = _block_residuals(tiny_config(*overrides, "remat.save=[moe_gate,moe_up]"))
    assert names(plain) == Counter() and dots(plain), plain
    assert dots(plain) - dots(named) == Counter({((B * T, 2 * Fs), "shared_expert"): P}), (plain, named)
    assert dots(named) - dots(plain) == Counter(), (plain, named)
    shared = Counter({((B * T, Fs), "moe_gate"): P, ((B * T, Fs), "moe_up"): P})
    routed = names(named) - shared
    assert names(named) - routed == shared, named
    assert sorted(routed.values()) == [P, P] and {n for _, n in routed} == {"moe_gate", "moe_up"}, routed
    assert all(rows >= B * T * m.num_experts_per_tok and f == F for (rows, f), _ in routed), routed


def test_minimal_with_a_save_list_keeps_the_named_expert_matmuls_besides_the_dots():
    _check_minimal_save_list()


def _broken_minimal(keep_dots: bool, keep_names: bool):
    """remat_policy with minimal's save list handled wrongly: the names ignored, or the dots dropped."""
    from hybridmoe.model import remat

    real = remat.remat_policy

    def policy(cfg, policy=None):
        if (policy or cfg.remat.policy) != "minimal" or not cfg.remat.save:
            return real(cfg, policy)
        cp = jax.checkpoint_policies
        if not keep_names:
            return cp.dots_with_no_batch_dims_saveable
        return cp.save_only_these_names(*cfg.remat.save) if not keep_dots else real(cfg, policy)
    return policy


@pytest.mark.parametrize("variant", ["save_list_ignored", "save_list_replaces_the_dots"])
def test_the_minimal_save_lists_broken_variants_are_caught(variant, monkeypatch):
    from hybridmoe.model import remat

    keep = {"save_list_ignored": (True, False), "save_list_replaces_the_dots": (False, True)}[variant]
    monkeypatch.setattr(remat, "remat_policy", _broken_minimal(*keep))
    with pytest.raises(AssertionError):
        _check_minimal_save_list()


@pytest.mark.parametrize("unit", ["sublayer", "layer"])
def test_expert_grad_barrier_ties_each_layers_input_cotangent_to_its_moe_gradient(unit):
    # remat.expert_grad_barrier: the values are the lever off's (up to XLA's fusion, as the remat
    # family), and the backward of every layer of the block holds one barrier over its MoE weights'
    # gradient (wi [E, D, 2F] among it) and a scalar that the layer input's cotangent [B, T, D] adds,
    # so the layers below cannot start before that gradient is reduced.
    from hybridmoe.analysis.program import iter_eqns

    overrides = ("remat.policy=full", f"remat.unit={unit}")
    (off, off_jaxpr, _), (on, on_jaxpr, _) = _two_blocks(*overrides), _two_blocks(*overrides, "remat.expert_grad_barrier=true")
    assert_rel_l2(off, on, 1e-4)

    m = tiny_config(*TWO_BLOCKS).model
    wi = off[1]["blocks"][0]["moe"]["wi"].shape[1:]
    barriers = lambda eqns: [e for e in eqns if e.primitive.name == "optimization_barrier"]  # noqa: E731
    assert barriers(iter_eqns(off_jaxpr)) == []
    eqns = list(iter_eqns(on_jaxpr))
    found = barriers(eqns)
    assert len(found) == len(m.layer_pattern), found  # once per layer, in the scan's body
    for barrier in found:
        assert wi in [tuple(v.aval.shape) for v in barrier.invars], barrier
        token = barrier.outvars[-1]
        assert token.aval.shape == ()
        users = [e for e in eqns if any(v is token for v in e.invars)]
        assert [(e.primitive.name, e.outvars[0].aval.shape) for e in users] == [("add", (2, 64, m.d_model))], users


THREE_LAYER_BLOCKS = ("model.layer_pattern=[gdn,gdn,attention]", "model.num_layers=6")


def _expert_grad_barriers(*overrides):
    """(loss and gradients, [the number of MoE weight gradients each of the backward's barriers holds])
    of tiny at THREE_LAYER_BLOCKS under remat.expert_grad_barrier and `overrides`. A held gradient is
    counted only where the backward computes it: a tie to weights the layer had already read would
    hold a zero (a broadcast constant), and that tie would hold nothing back."""
    from hybridmoe.analysis.program import iter_eqns

    cfg = tiny_config(*THREE_LAYER_BLOCKS, "remat.policy=full", "remat.unit=sublayer", "remat.expert_grad_barrier=true",
                      *overrides)
    params, batch = tiny_params(cfg), packed_batch(0, 2, 64, cfg.model.vocab_size)
    traced = jax.jit(jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0])).trace(params)
    wi = params["blocks"][0]["moe"]["wi"].shape[1:]
    eqns = list(iter_eqns(traced.jaxpr))
    made_by = {id(v): e for e in eqns for v in e.outvars}
    zeros = lambda v: (e := made_by.get(id(v))) is not None and e.primitive.name == "broadcast_in_dim" \
        and not hasattr(e.invars[0], "count")  # noqa: E731 (a literal broadcast: a symbolic zero instantiated)
    held = [sum(1 for v in e.invars if tuple(v.aval.shape) == wi and not zeros(v))
            for e in eqns if e.primitive.name == "optimization_barrier"]
    return jax.device_get(traced.lower().compile()(params)), held


@functools.cache
def _lag_arms():
    return {lag: _expert_grad_barriers(f"remat.expert_grad_lag={lag}") for lag in (0, 1, 2)}


def test_expert_grad_lag_ties_each_layers_input_to_the_moe_gradient_of_the_layer_lag_above():
    # remat.expert_grad_lag over blocks of three layers (the barriers in the backward's order, top layer
    # first): lag 0 one barrier per layer, each holding its own wi gradient; lag 1 the second layer's
    # input holds the third's and the block's input the first two layers'; lag 2 the block's input
    # holds all three. The values are the lag 0 arm's (up to XLA's fusion, as the remat family).
    arms = _lag_arms()
    assert [arms[lag][1] for lag in (0, 1, 2)] == [[1, 1, 1], [1, 2], [3]], {k: v[1] for k, v in arms.items()}
    for lag in (1, 2):
        assert_rel_l2(arms[0][0], arms[lag][0], 1e-4)


@pytest.mark.parametrize("variant", ["lag_ignored", "tied_below_not_above", "one_too_far"])
def test_expert_grad_lag_broken_variants_are_caught(variant, monkeypatch):
    from hybridmoe.model import forward

    real = forward.expert_grad_ties
    broken = {"lag_ignored": lambda p, n, lag: real(p, n, 0),
              "tied_below_not_above": lambda p, n, lag: real(p, n, lag) if p == 0 else [p - lag] if p >= lag else [],
              "one_too_far": lambda p, n, lag: real(p, n, lag) if p == 0 else [p + lag + 1] if p + lag + 1 < n else []}
    monkeypatch.setattr(forward, "expert_grad_ties", broken[variant])
    with pytest.raises(AssertionError):
        held = _expert_grad_barriers("remat.expert_grad_lag=1")[1]
        assert held == [1, 2], held


def test_layer_remat_lowers_the_compiled_backwards_temporaries():
    # The backward replays one layer at a time: less live at its peak than replaying the block (XLA's
    # buffer assignment, exact). Two blocks so the scan loops: the remat family's programs
    # (_two_blocks, unit=block the default; at 2 x 64 tokens layer/block is 0.77).
    assert tiny_config().remat.unit == "block"
    block = _two_blocks("remat.policy=full")[2]
    layer = _two_blocks("remat.policy=full", "remat.unit=layer")[2]
    assert layer < 0.95 * block, (layer, block)
