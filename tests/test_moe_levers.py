"""The four MoE grouped-matmul levers (docs/levers.md, "MoE: grouped matmuls, routing, experts"): validators, exactness
through the production MoE layer and the model on the 8-device mesh, program proofs, and the
broken variants each test must catch.

Exactness is checked in bfloat16 compute, where rounding points are visible: the stand-in
epilogue `match_unfused` must give the unfused path's bits; the real float32 epilogue must keep
the down projection's output, the loss and the wo gradient bit-identical and the rest within
bf16 rounding (relative L2 <= 1e-2).

The unfused baseline is the grouped-matmul path with the levers off, run with the experts sharded
(mesh.expert=2), where it is the production path. (With one expert rank and no lever the default
program is jax.lax.ragged_dot on every expert, whose autodiff weight gradient rounds differently
from the kernels' float32-accumulated transposed matmul; `test_off_is_the_program_without_levers`
proves that default program untouched.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from broken_variants import BROKEN
from helpers import ATTENTION_LAYERS, TWO_LAYERS, packed_batch, tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.config import ConfigError
from hybridmoe.kernels.gmm import epilogue as epi
from hybridmoe.model import forward
from hybridmoe.model import moe as moe_mod
from hybridmoe.parallel.rules import logical_to_spec
from hybridmoe.run.setup import build
from hybridmoe.run.step import nll_sum

BF16 = ("model.compute_dtype=bfloat16",)
EP2 = ("mesh.expert=2",)
MATCH = ("kernels.gmm.epilogue=match_unfused",)
WI = ("moe.wi_fused_swiglu=true",)
WO = ("moe.wo_fused_dswiglu=true",)
R = ("moe.router_grad_from_wo_input=true",)
TILED = ("kernels.gmm.tiling=explicit", "kernels.gmm.wi_fwd_tile_n_per_half=16")  # F = 32: 2 tiles
PALLAS = ("kernels.gmm.backend=pallas_tpu", "kernels.interpret=true", "kernels.gmm.tiling=explicit",
          "kernels.gmm.tm=8", "kernels.gmm.tk=64", "kernels.gmm.tn=32")


def _moe_params(cfg):
    return jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])


def _tokens(cfg):
    return jax.random.normal(jax.random.key(1), (8, 16, cfg.model.d_model)).astype(
        cfg.model.compute_dtype)


def _layer(cfg):
    def f(p, x):
        y = moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


def layer_run(*overrides):
    """((loss, y), (param grads, x grad)) of the production MoE layer on the 8-device mesh."""
    cfg = tiny_config(*TWO_LAYERS, *BF16, *overrides)
    p, x = _moe_params(cfg), _tokens(cfg)
    setup = build(cfg)
    with setup.context():
        return jax.jit(_layer(cfg))(p, x)


def layer_run_unsharded(*overrides):
    """The same without a mesh (one device, every expert)."""
    cfg = tiny_config(*TWO_LAYERS, *BF16, *overrides)
    return jax.jit(_layer(cfg))(_moe_params(cfg), _tokens(cfg))


@functools.cache
def unfused(*overrides, sharded=True):
    """The levers-off baselines, computed once per module. They run none of the functions the
    broken variants patch (the unfused path rounds with jnp and scale_rows only)."""
    return layer_run(*overrides) if sharded else layer_run_unsharded(*overrides)


def _leaves(tree):
    return [(jax.tree_util.keystr(k), np.asarray(v, np.float32))
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_bits(a, b, skip=()):
    for (name, x), (_, y) in zip(_leaves(a), _leaves(b)):
        if not any(s in name for s in skip):
            assert np.array_equal(x, y), f"{name}: not bit-identical (max |d| {np.abs(x - y).max():.3g})"


def assert_rel_l2(a, b, tol=1e-2):
    for (name, x), (_, y) in zip(_leaves(a), _leaves(b)):
        err = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        assert err <= tol, f"{name}: relative L2 {err:.3g} > {tol}"


# ---------------------------------------------------------------------------------------------
# Validators


def test_levers_accepted_where_they_can_work():
    tiny_config(*TWO_LAYERS, *WI, *WO, *R)
    tiny_config(*TWO_LAYERS, *WI, *WO, *R, *TILED, *MATCH)
    tiny_config(*TWO_LAYERS, *WI, *WO, *PALLAS, "kernels.gmm.wi_fwd_rhs_buffer_count=2")
    tiny_config(*TWO_LAYERS, *WO, "remat.policy=custom", "remat.save=[attn_out,gdn_core_out]")


def _problems(*overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        tiny_config(*TWO_LAYERS, *overrides)
    return dict(e.value.problems)


def test_dense_refuses_every_lever_and_the_buffer():
    probs = _problems("moe.impl=dense", *WI, *WO, *R, "moe.capacity_factor=1.0")
    for key in ("moe.wi_fused_swiglu", "moe.wo_fused_dswiglu", "moe.router_grad_from_wo_input",
                "moe.capacity_factor"):
        assert key in probs and ("sparse" in probs[key] or "dense" in probs[key]), key


def test_wo_fused_names_every_unmet_requirement():
    probs = _problems("moe.impl=dense", *WO, "remat.policy=custom", "remat.save=[moe_gate,moe_up]",
                      "kernels.gmm.tiling=explicit", "kernels.gmm.wi_fwd_tile_n_per_half=12")
    msg = probs["moe.wo_fused_dswiglu"]
    assert "moe.impl=sparse" in msg and "moe_gate" in msg and "tile_n_per_half=12 must divide" in msg
    assert "moe.wi_fused_swiglu" in probs["kernels.gmm.wi_fwd_tile_n_per_half"]


@pytest.mark.parametrize("overrides, needle", [
    (("kernels.gmm.wi_fwd_tile_n_per_half=12", "kernels.gmm.tiling=explicit", *WI), "tile_n_per_half=12"),
    (("kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit", "kernels.gmm.tm=8",
      "kernels.gmm.tk=64", "kernels.gmm.tn=32", *WO), "F=32 must be a multiple of 128"),
])
def test_tile_rules(overrides, needle):
    assert any(needle in m for m in _problems(*overrides).values())


def test_wi_fwd_rhs_buffer_count_names_every_unmet_requirement():
    msg = _problems("kernels.gmm.wi_fwd_rhs_buffer_count=-1")["kernels.gmm.wi_fwd_rhs_buffer_count"]
    for need in ("must be 0", "moe.wi_fused_swiglu", "tiling=explicit", "Pallas backend"):
        assert need in msg, need
    msg = _problems(*WI, *PALLAS, "kernels.gmm.tk=32", "kernels.gmm.wi_fwd_rhs_buffer_count=2")[
        "kernels.gmm.wi_fwd_rhs_buffer_count"]
    assert "one K tile" in msg
    # On hardware, Mosaic TPU (JAX 0.10.2) takes 1 or 2 buffers; and this CPU run cannot
    # run the Mosaic backend at all: both refused at load.
    probs = _problems(*WI, *[o for o in PALLAS if o != "kernels.interpret=true"],
                      "kernels.gmm.wi_fwd_rhs_buffer_count=3")
    assert "accepts 1 or 2" in probs["kernels.gmm.wi_fwd_rhs_buffer_count"]
    assert "cannot run on this platform" in probs["kernels.gmm.backend"]


def test_all_to_all_is_not_offered():
    assert "moe.expert_parallel" in _problems("moe.expert_parallel=all_to_all")


def test_the_rl_trainer_refuses_expert_buffers_naming_the_key():
    from hybridmoe.recipe.validate import check_rl_requirements
    check_rl_requirements(tiny_config(*TWO_LAYERS, *TWO_LAYERS))  # dropless: accepted
    with pytest.raises(ConfigError) as e:
        check_rl_requirements(tiny_config(*TWO_LAYERS, "moe.capacity_factor=1.0"))
    assert "dropless" in dict(e.value.problems)["moe.capacity_factor"]


# ---------------------------------------------------------------------------------------------
# Program: off is exactly the program without the levers


def _baseline_moe_layer(p, x_BTD, m, moe, kernels=None, *, return_dropped=False, replay_BTk=None,
                        return_routing=False, quant=None):
    """The MoE layer as it was before the levers and expert parallelism: route, the dropless
    sort-and-group experts over ragged_dot and the shared expert under one shard_map; the training
    loss calls it without drops, routing replay, routing outputs or fp8 grouped matmuls."""
    assert not return_dropped and replay_BTk is None and not return_routing and not (quant and quant.fp8_gmm)

    # The lever-free pieces (route, sparse_experts, shared_expert take no lever), dispatched as before.
    def moe_local(p, x_TD):
        w_Tk, idx_Tk, _ = moe_mod.route(p["router"], x_TD, m)
        y = moe_mod.sparse_experts(x_TD, w_Tk, idx_Tk, p["wi"], p["wo"], jax.lax.ragged_dot)
        if "shared_wi" in p:
            y = y + moe_mod.shared_expert(p, x_TD)
        return y

    B, T, D = x_BTD.shape

    def local(p, x_btd):
        b, t, _ = x_btd.shape
        return moe_local(p, x_btd.reshape(b * t, D)).reshape(b, t, D)

    token_spec = logical_to_spec(("batch", "seq", None))
    weight_specs = jax.tree.map(lambda _: PartitionSpec(), p)
    return jax.shard_map(local, in_specs=(weight_specs, token_spec), out_specs=token_spec)(p, x_BTD)


def test_off_is_the_program_without_levers(monkeypatch):
    """The whole training loss's jaxpr with every key off equals the one built on the MoE layer
    as it was before the levers (remat scan, 8-device mesh). The grouped matmul is pinned to
    ragged_dot, the GPU/TPU choice (on CPU the default program runs row tiles instead)."""
    cfg = tiny_config(*TWO_LAYERS, *BF16, "moe.wi_fused_swiglu=false", "moe.wo_fused_dswiglu=false",
                      "moe.router_grad_from_wo_input=false", "kernels.gmm.wi_fwd_rhs_buffer_count=0",
                      "kernels.gmm.xla_impl=ragged_dot", "remat.policy=full")
    params = tiny_params(cfg)
    batch = packed_batch(0, 8, 64, cfg.model.vocab_size)
    setup = build(cfg)

    def jaxpr():
        with setup.context():
            return str(jax.make_jaxpr(jax.grad(lambda p: nll_sum(p, cfg, batch)[0]))(params))

    ours = jaxpr()
    monkeypatch.setattr(forward, "moe_layer", _baseline_moe_layer)
    assert ours == jaxpr()


# ---------------------------------------------------------------------------------------------
# Exactness: the production MoE layer on the 8-device mesh


@pytest.mark.parametrize("levers", [WO, WI, WI + WO, WI + WO + TILED],
                         ids=["wo", "wi", "wi+wo", "wi+wo-tiled"])
def test_match_unfused_is_bit_identical(levers):
    assert_bits(layer_run(*EP2, *levers, *MATCH), unfused(*EP2))


@pytest.mark.parametrize("levers", [WI + WO + TILED], ids=["wi+wo-tiled"])
def test_match_unfused_with_router_grad_from_wo_input(levers):
    # Without a mesh: bit-identical, the routing weight's gradient (the epilogue's row dot)
    # included.
    assert_bits(layer_run_unsharded(*R, *levers, *MATCH), unfused(*R, sharded=False))
    # On the mesh: every weight gradient and the output bit-identical; the row dot's float32
    # sum lands in a different XLA fusion there, so the router and token gradients it feeds
    # agree to bf16 rounding (open point in the report).
    on, off = layer_run(*EP2, *R, *levers, *MATCH), unfused(*EP2, *R)
    assert_bits(on, off, skip=("['router']", "[1][1]"))
    assert_rel_l2(on, off, 1e-2)


def test_float32_epilogue_within_bf16_rounding():
    """wo_fused_dswiglu alone leaves the forward as it is: output, loss and the wo gradient
    bit-identical; the rest within bf16 rounding. With every lever the forward's SwiGLU is
    float32 too: output and gradients within bf16 rounding (the scalar loss, a sum of sines with
    cancellation, is not a relative-error measure)."""
    on, off = layer_run(*EP2, *WO), unfused(*EP2)
    (loss_on, y_on), (gp_on, _) = on
    (loss_off, y_off), (gp_off, _) = off
    assert_bits((loss_on, y_on, gp_on["wo"]), (loss_off, y_off, gp_off["wo"]))
    assert_rel_l2(on[1], off[1], 1e-2)
    on, off = layer_run(*EP2, *WI, *WO, *R, *TILED), unfused(*EP2, *R)
    assert_rel_l2((on[0][1], on[1]), (off[0][1], off[1]), 1e-2)


def test_model_path_bit_identical_on_the_mesh():
    def run(*overrides):
        # Attention layers only: the MoE layer is every layer's; a GDN layer would only add to each compile.
        cfg = tiny_config(*ATTENTION_LAYERS, *BF16, *EP2, *overrides)
        params = tiny_params(cfg)
        batch = packed_batch(0, 8, 64, cfg.model.vocab_size)
        setup = build(cfg)
        with setup.context():
            f = jax.jit(jax.value_and_grad(lambda p, b: nll_sum(p, cfg, b)[0]))
            return f(jax.device_put(params, setup.param_shardings),
                     jax.device_put(batch, jax.tree.map(lambda _: setup.batch_sharding(0), batch)))

    assert_bits(run(*WI, *WO, *TILED, *MATCH), run())


# ---------------------------------------------------------------------------------------------
# Program proofs


def test_activation_vjp_never_built():
    """With both fused levers, the backward adds exactly one logistic (the fused DLHS epilogue
    recomputing silu from the stored [gate | up]); the activation's own VJP (a second one, in
    wi_fused_swiglu's backward) is never built."""
    cfg = tiny_config(*TWO_LAYERS, *BF16, *WI, *WO)
    p, x = _moe_params(cfg), _tokens(cfg)

    def fwd(p, x):
        return jnp.sum(moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels).astype(jnp.float32))

    setup = build(cfg)
    with setup.context():
        n_fwd = program.primitive_counts(jax.make_jaxpr(fwd)(p, x))["logistic"]
        n_grad = program.primitive_counts(jax.make_jaxpr(jax.grad(fwd, (0, 1)))(p, x))["logistic"]
    assert n_grad - n_fwd == 1, (n_fwd, n_grad)


def _pallas_kernels(depth: int, *levers):
    cfg = tiny_config(*TWO_LAYERS, *PALLAS, *levers, f"kernels.gmm.wi_fwd_rhs_buffer_count={depth}")
    p, x = _moe_params(cfg), _tokens(cfg)
    setup = build(cfg)
    with setup.context():
        return cfg, p, x, setup, program.pallas_kernels(jax.make_jaxpr(_layer(cfg))(p, x))


def test_wi_fwd_rhs_buffer_count_reaches_only_the_fused_forward_kernel():
    _, _, _, _, default = _pallas_kernels(0, *WI, *WO)
    _, _, _, _, deep = _pallas_kernels(2, *WI, *WO)
    assert all(all(m is None for m in modes) for _, modes in default)
    assert not any("rhsbuf" in name for name, _ in default)
    changed = [(a, b) for a, b in zip(default, deep) if a != b]
    assert len(changed) == 1 and len(default) == len(deep) == 6
    (name0, _), (name2, modes2) = changed[0]
    assert name0 == "wi_fused_swiglu_fwd" and name2 == "wi_fused_swiglu_fwd_rhsbuf2"
    # The two weight halves (gate, up) get the depth; tokens and outputs keep the default.
    assert [getattr(m, "buffer_count", None) for m in modes2] == [None, 2, 2, None, None]


def test_wi_fwd_rhs_buffer_count_keeps_the_bits():
    """Off (the kernel default), one buffer and two: the same bits (interpreted kernels)."""
    outs = []
    for depth in (0, 1, 2):
        cfg, p, x, setup, _ = _pallas_kernels(depth, *WI, *WO)
        with setup.context():
            outs.append(jax.jit(_layer(cfg))(p, x))
    assert_bits(outs[0], outs[1])
    assert_bits(outs[0], outs[2])


def test_tiny_recipe_trains_with_all_four_levers():
    from hybridmoe.train.loop import train

    cfg = tiny_config(*TWO_LAYERS, *WI, *WO, *R, *PALLAS, "kernels.gmm.wi_fwd_rhs_buffer_count=2",
                      "train.steps=4", "train.seq_len=32", "train.warmup_steps=0")
    hist = train(cfg, None, progress=False)
    losses = [h["loss"] for h in hist]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# ---------------------------------------------------------------------------------------------
# Broken variants (docs/levers.md, `moe.wo_fused_dswiglu`): each patched into the epilogue module, each caught.


@pytest.fixture(params=list(BROKEN))
def broken_epilogue(request, monkeypatch):
    name, fn = BROKEN[request.param]
    monkeypatch.setattr(epi, name, fn)
    return request.param


def test_broken_variant_is_caught(broken_epilogue):
    """The exactness checks above, through the MoE layer with all three levers and two tiles
    per half: match_unfused bit-identity and the float32 epilogue's tolerance. At least one
    must fail for every broken variant."""
    off = unfused(*R, sharded=False)
    try:
        assert_bits(layer_run_unsharded(*R, *WI, *WO, *TILED, *MATCH), off)
    except AssertionError:
        return  # caught by the bit-identity of the stand-in epilogue
    on = layer_run_unsharded(*R, *WI, *WO, *TILED)
    with pytest.raises(AssertionError):  # else by the real epilogue's tolerance
        assert_rel_l2((on[0][1], on[1]), (off[0][1], off[1]), 1e-2)


# ---------------------------------------------------------------------------------------------
# moe.token_chunks: the routed experts over the tokens in chunks, one replayed at a time

CHUNKS = ("moe.token_chunks=4",)


def test_token_chunks_refused_where_they_cannot_work():
    assert "dropless" in _problems(*CHUNKS, "moe.capacity_factor=1.5")["moe.token_chunks"]
    assert "moe.impl=sparse" in _problems(*CHUNKS, "moe.impl=dense")["moe.token_chunks"]
    # 64-token rows over context 2: 32 tokens a rank, which 3 does not divide.
    msg = _problems("moe.token_chunks=3", "mesh.context=2", "mesh.fsdp=2")["moe.token_chunks"]
    assert "32 tokens" in msg and "mesh.context=2" in msg, msg


def test_token_chunks_equal_one_pass():
    # Against the same levers in one pass (the chunk scan is what differs): each token's output and
    # input gradient are bit-identical (rows are independent); the weights' gradients are summed
    # over the chunks in bfloat16 instead of inside one grouped matmul.
    on, off = layer_run(*EP2, *WI, *WO, *R, *CHUNKS), layer_run(*EP2, *WI, *WO, *R)
    assert_bits((on[0], on[1][1]), (off[0], off[1][1]))
    assert_bits(on[1][0], off[1][0], skip=("'wi'", "'wo'"))
    err = {k: np.linalg.norm(np.float32(on[1][0][k]) - np.float32(off[1][0][k])) / np.linalg.norm(np.float32(off[1][0][k]))
           for k in ("wi", "wo")}
    assert max(err.values()) < 1e-2, err  # clean 3.0e-3; a gradient lost in the scan: 1.0
    # And against the levers off (the default program, no grouped_experts at all).
    ref = unfused(*EP2)
    assert_rel_l2((on[0][1], on[1]), (ref[0][1], ref[1]), 2e-2)


def test_token_chunks_add_weight_gradients_in_place():
    # On the Pallas kernels: the backward scan's two carried weight gradients each go into a
    # weight-gradient kernel as the operand its output aliases, and that output is the carry the
    # trip hands on. No add, no per-chunk [G, K, N] gradient beside the carried one.
    cfg = tiny_config(*TWO_LAYERS, *BF16, *EP2, *WI, *WO, *R, *PALLAS, "moe.token_chunks=4")
    x = jax.random.normal(jax.random.key(1), (8, 32, cfg.model.d_model)).astype(cfg.model.compute_dtype)
    with build(cfg).context():
        jaxpr = jax.make_jaxpr(_layer(cfg))(_moe_params(cfg), x)
    backward = [e for e in program.iter_eqns(jaxpr)
                if e.primitive.name == "scan" and e.params["length"] == 4 and e.params["num_carry"] == 2]
    assert len(backward) == 1, [e.params["num_carry"] for e in program.iter_eqns(jaxpr) if e.primitive.name == "scan"]
    e = backward[0]
    body, consts = e.params["jaxpr"].jaxpr, e.params["num_consts"]
    carries = list(zip(body.invars[consts:consts + 2], body.outvars[:2]))
    in_place = {(str(v), str(w)) for b in program.iter_eqns(body) if b.primitive.name == "pallas_call"
                and b.params["input_output_aliases"] for v in b.invars for w in b.outvars}
    assert {(str(i), str(o)) for i, o in carries} <= in_place, (carries, in_place)


def _moe_jaxpr(*overrides):
    cfg = tiny_config(*TWO_LAYERS, *BF16, *EP2, *WI, *WO, *overrides)
    x = jax.random.normal(jax.random.key(1), (8, 32, cfg.model.d_model)).astype(cfg.model.compute_dtype)
    with build(cfg).context():
        return jax.make_jaxpr(_layer(cfg))(_moe_params(cfg), x), cfg


def test_token_chunks_hold_no_full_row_buffer():
    # The program: scans of 8 trips over the chunks, and no array with one row per
    # (token, expert) of the whole gathered batch, forward or backward. 8 x 32 tokens over the
    # batch shards (data x fsdp x expert = 8): 32 a device, 64 after the ring's gather, 64 k rows.
    chunked, cfg = _moe_jaxpr("moe.token_chunks=8")
    whole, _ = _moe_jaxpr()
    rows_all = 64 * cfg.model.num_experts_per_tok

    def row_dims(jaxpr):  # leading dims of the [rows, d_model] arrays inside the layer's shard_map
        bodies = [e.params["jaxpr"] for e in program.iter_eqns(jaxpr) if e.primitive.name == "shard_map"]
        return {v.aval.shape[0] for body in bodies for e in program.iter_eqns(body) for v in e.outvars
                if hasattr(v.aval, "shape") and len(v.aval.shape) == 2 and v.aval.shape[1] == cfg.model.d_model}

    scans = [e for e in program.iter_eqns(chunked) if e.primitive.name == "scan" and e.params["length"] == 8]
    assert rows_all in row_dims(whole), row_dims(whole)
    assert rows_all not in row_dims(chunked) and rows_all // 8 in row_dims(chunked), row_dims(chunked)
    # Two scans of the 8 chunks: the forward, which stacks nothing but each chunk's output and drop
    # count (no residual for the backward: that replays), and the backward, which carries the two
    # expert weights' gradients (the local experts' [G, D, 2F] and [G, F, D]) and stacks each
    # chunk's token and routing-weight gradients.
    m = cfg.model
    G = m.num_experts // 2
    weights = {(G, m.d_model, 2 * m.moe_intermediate_size), (G, m.moe_intermediate_size, m.d_model)}
    shapes = sorted(([tuple(v.aval.shape) for v in e.outvars[:e.params["num_carry"]]],
                     [tuple(v.aval.shape) for v in e.outvars[e.params["num_carry"]:]]) for e in scans)
    assert len(scans) == 2, shapes
    forward, backward = sorted(shapes, key=lambda s: len(s[0]))
    assert forward[0] == [] and len(forward[1]) == 2 and forward[1][0][-1] == m.d_model, forward
    assert set(backward[0]) == weights and len(backward[1]) == 2, backward
