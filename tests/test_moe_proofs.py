"""The MoE levers' proofs that a sabotage must break, and their broken variants.

- moe.router_grad_from_wo_input on vs off through the whole model on the 8-device mesh: loss,
  logits and every gradient within float32 reassociation (relative L2 <= ROUTER_TOL).
- moe.capacity_factor: the dropped-token semantics against an independent float32 reference
  (keep mask from a running count per expert, every expert computed densely): values, the drop
  count and every gradient, with drops happening, with one expert rank and on the ring (EP=2).
- The real float32 epilogue (every fused lever, two forward tiles per half) against a float32
  evaluation of the unfused math, in float32 compute: the clean error is reassociation, every
  epilogue broken variant at least 10x above the bound the clean error must meet.
- One program fact per MoE key, read with hybridmoe.analysis.program from the traced layer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from broken_variants import BROKEN, BROKEN_MOE
# The lever override sets and the shared epilogue-variant fixture of the lever tests.
from test_moe_levers import BF16, EP2, PALLAS, R, TILED, WI, WO, broken_epilogue  # noqa: F401
from helpers import ATTENTION_LAYERS, TWO_LAYERS, packed_batch, tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.kernels.gmm import row_tiled_dot
from hybridmoe.model import moe as moe_mod
from hybridmoe.model.forward import logits
from hybridmoe.run.setup import build
from hybridmoe.run.step import nll_sum

# float32 reassociation: the router key moves the worst gradient leaf by 5.8e-6 (measured); the
# sabotages below move some leaf by far more than 1e-3 (printed on failure).
ROUTER_TOL = 1e-4
DROP_TOL = 1e-5
# The float32 epilogue's clean error must stay below EPILOGUE_CLEAN; each broken epilogue must
# exceed 10x that (the margin the charter asks for).
EPILOGUE_CLEAN = 1e-5


def rel_l2_by_leaf(a, b) -> dict[str, float]:
    out = {}
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out[jax.tree_util.keystr(path)] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    return out


def worst(errors: dict[str, float]) -> tuple[str, float]:
    name = max(errors, key=errors.get)
    return name, errors[name]


def _moe_params(cfg):
    return jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])


def _tokens(cfg):
    return jax.random.normal(jax.random.key(1), (8, 16, cfg.model.d_model)).astype(cfg.model.compute_dtype)


# ---------------------------------------------------------------------------------------------
# 1. The router key through the model


def model_run(*overrides):
    """Loss, logits and every gradient of the training loss on the 8-device mesh (float32), attention
    layers only (the router is every layer's; a GDN layer would only add to each compile)."""
    cfg = tiny_config(*ATTENTION_LAYERS, *overrides)
    params = tiny_params(cfg)
    batch = packed_batch(0, 8, 64, cfg.model.vocab_size)
    setup = build(cfg)

    def f(p, b):
        return nll_sum(p, cfg, b)[0], logits(p, cfg, b["tokens"], b["segment_ids"], b["positions"])

    with setup.context():
        (loss, lg), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(
            jax.device_put(params, setup.param_shardings),
            jax.device_put(batch, jax.tree.map(lambda _: setup.batch_sharding(0), batch)))
    return {"loss": loss, "logits": lg, "grads": grads}


@functools.cache
def router_off():
    return model_run()


def check_router_on_vs_off():
    name, err = worst(rel_l2_by_leaf(model_run(*R), router_off()))
    assert err <= ROUTER_TOL, f"router key on vs off: {name} relative L2 {err:.3g} > {ROUTER_TOL}"
    return err


def test_router_grad_from_wo_input_on_vs_off_through_the_model():
    check_router_on_vs_off()


# ---------------------------------------------------------------------------------------------
# 2. Dropped tokens against an independent reference


def reference_moe(p, x_BTD, m, capacity_factor: float, token_groups: int):
    """The MoE block in float32 with per-expert buffers, written without sorting: the batch is
    split into `token_groups` contiguous groups (each shares the buffers: one token shard, or
    the shards an expert ring gathers), a (token, slot) row is kept iff fewer than `cap` rows of
    its group routed to the same expert come before it in token-major order, and every expert
    is computed densely. Returns (y, dropped rows)."""
    B, T, D = x_BTD.shape
    E, k = m.num_experts, m.num_experts_per_tok
    x_TD = x_BTD.reshape(B * T, D).astype(jnp.float32)
    probs = jax.nn.softmax(x_TD @ p["router"].astype(jnp.float32), axis=-1)
    w_Tk, idx_Tk = jax.lax.top_k(probs, k)
    w_Tk = w_Tk / jnp.sum(w_Tk, axis=-1, keepdims=True)
    rows = B * T * k // token_groups
    cap = max(1, math.ceil(capacity_factor * rows / E))
    onehot_GRE = jax.nn.one_hot(idx_Tk.reshape(token_groups, rows), E, dtype=jnp.int32)
    before_GRE = jnp.cumsum(onehot_GRE, axis=1) - onehot_GRE
    keep_Tk = (jnp.sum(before_GRE * onehot_GRE, axis=-1) < cap).reshape(B * T, k)
    f = m.moe_intermediate_size
    h_ETF2 = jnp.einsum("td,edf->etf", x_TD, p["wi"].astype(jnp.float32))
    a_ETF = jax.nn.silu(h_ETF2[..., :f]) * h_ETF2[..., f:]
    y_ETD = jnp.einsum("etf,efd->etd", a_ETF, p["wo"].astype(jnp.float32))
    y_TkD = y_ETD[idx_Tk, jnp.arange(B * T)[:, None]]
    y_TD = jnp.sum(jnp.where(keep_Tk[..., None], w_Tk[..., None] * y_TkD, 0.0), axis=1)
    shared = (jax.nn.silu(x_TD @ p["shared_wi"][:, :f]) * (x_TD @ p["shared_wi"][:, f:])) @ p["shared_wo"]
    y_TD = y_TD + shared * jax.nn.sigmoid((x_TD @ p["shared_gate"]).reshape(-1, 1))
    return y_TD.reshape(B, T, D), jnp.sum(~keep_Tk)


def _sin_loss_and_grads(fn, p, x):
    def f(p, x):
        y, dropped = fn(p, x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, dropped)

    (loss, (y, dropped)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, x)
    return {"loss": loss, "y": y, "grads": grads}, int(dropped)


CAPACITY = 0.5


def check_drops(ep: bool):
    """Production layer with capacity_factor=0.5 vs the reference, on the 8-device mesh."""
    cfg = tiny_config(*TWO_LAYERS, f"moe.capacity_factor={CAPACITY}", *(EP2 if ep else ()))
    p, x = _moe_params(cfg), _tokens(cfg)
    setup = build(cfg)
    # Batch rows are sharded over data x fsdp x expert (one row each here); the ring gathers
    # over the expert axis, so its buffers serve the rows of `expert` neighbouring shards.
    groups = x.shape[0] // (2 if ep else 1)
    with setup.context():
        got, dropped = _sin_loss_and_grads(
            lambda p, x: moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels, return_dropped=True), p, x)
    want, want_dropped = _sin_loss_and_grads(
        lambda p, x: reference_moe(p, x, cfg.model, CAPACITY, groups), p, x)
    assert want_dropped > 0, "the reference drops nothing: the test would not see drops"
    assert dropped == want_dropped, f"dropped rows {dropped}, reference {want_dropped}"
    name, err = worst(rel_l2_by_leaf(got, want))
    assert err <= DROP_TOL, f"capacity {CAPACITY}, ep={ep}: {name} relative L2 {err:.3g} > {DROP_TOL}"
    return err


@pytest.mark.parametrize("ep", [False, True], ids=["one-expert-rank", "ring-ep2"])
def test_capacity_factor_dropped_tokens_match_the_reference(ep):
    check_drops(ep)


# ---------------------------------------------------------------------------------------------
# 3. The float32 epilogue against float32 unfused math


def _layer_unsharded(*overrides):
    cfg = tiny_config(*TWO_LAYERS, *overrides)
    p, x = _moe_params(cfg), _tokens(cfg)
    out, _ = _sin_loss_and_grads(lambda p, x: (moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels),
                                               jnp.int32(0)), p, x)
    return out


@functools.cache
def unfused_float32():
    """The MoE layer with every key off, float32 compute: the unfused math."""
    return _layer_unsharded()


def epilogue_error() -> tuple[str, float]:
    """Worst-leaf error of every fused lever (float32 epilogue, two tiles per half) vs unfused."""
    return worst(rel_l2_by_leaf(_layer_unsharded(*WI, *WO, *R, *TILED), unfused_float32()))


@pytest.fixture(scope="module")
def clean_epilogue() -> tuple[str, float]:
    """The clean error, computed before any function-scoped fixture patches a variant in."""
    return epilogue_error()


def test_float32_epilogue_against_float32_unfused_math(clean_epilogue):
    name, err = clean_epilogue
    assert err <= EPILOGUE_CLEAN, (f"float32 epilogue vs float32 unfused: {name} relative L2 {err:.3g} > "
                                   f"{EPILOGUE_CLEAN} (broken variants must exceed {10 * EPILOGUE_CLEAN:.3g})")


def test_float32_epilogue_check_catches(clean_epilogue, broken_epilogue):
    name, err = epilogue_error()
    assert err >= 10 * EPILOGUE_CLEAN, (
        f"{broken_epilogue}: worst leaf {name} relative L2 {err:.3g} is not 10x above the clean bound "
        f"{EPILOGUE_CLEAN} (clean error {clean_epilogue[1]:.3g})")


# ---------------------------------------------------------------------------------------------
# 4. Program facts, one per MoE key (the layer traced with the Pallas kernels, interpreted)


@functools.cache
def layer_program(*levers):
    """(forward kernels, backward-only kernels, ops outside kernels fwd / grad, residual bytes,
    kernel operand shapes) of the MoE layer with these levers."""
    cfg = tiny_config(*TWO_LAYERS, *BF16, *PALLAS, *levers)
    p, x = _moe_params(cfg), _tokens(cfg)

    def fwd(p, x):
        return jnp.sum(moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels).astype(jnp.float32))

    with build(cfg).context():
        jf = jax.make_jaxpr(fwd)(p, x)
        jg = jax.make_jaxpr(jax.value_and_grad(fwd, (0, 1)))(p, x)
        residuals = program.saved_residuals(fwd, p, x)
    kf = [n for n, _ in program.pallas_kernels(jf)]
    kg = [n for n, _ in program.pallas_kernels(jg)]
    bwd = list(kg)
    for n in kf:
        bwd.remove(n)
    return {"fwd_kernels": sorted(kf), "bwd_kernels": sorted(bwd),
            "fwd_ops": program.ops_by_shape(jf), "grad_ops": program.ops_by_shape(jg),
            "residual_bytes": sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize for r in residuals),
            "kernel_shapes": program.pallas_operand_shapes(jf)}


# Per shard (8 token shards of one 16-token sequence each): routed rows (16 tokens x top-2),
# model and expert hidden widths.
SHARDS, M_ROWS, D, F = 8, 32, 64, 32


def test_program_wi_fused_swiglu():
    """The up projection's grouped matmul is the fused kernel, and the forward's SwiGLU runs in
    it: no logistic over the [M, F] rows outside the kernels."""
    off, on = layer_program(), layer_program(*WI)
    assert off["fwd_kernels"] == ["gmm", "gmm"] and on["fwd_kernels"] == ["gmm", "wi_fused_swiglu_fwd"]
    logistic = ("logistic", (M_ROWS, F), "bfloat16")
    assert off["fwd_ops"][logistic] == 1 and on["fwd_ops"][logistic] == 0


def test_program_wo_fused_dswiglu_alone_and_with_wi():
    """The down projection's input-gradient matmul is the fused-epilogue kernel, with and
    without the fused up projection (wi alone keeps the plain one): the check tells wi + wo
    from wi alone."""
    plain = ["gmm_t", "gmm_t", "tgmm", "tgmm"]
    fused = ["gmm_t", "tgmm", "tgmm", "wo_fused_dswiglu_dlhs"]
    # The kernels as a multiset: the order the backward emits independent kernels in is the tracer's.
    assert sorted(layer_program()["bwd_kernels"]) == plain
    assert sorted(layer_program(*WI)["bwd_kernels"]) == plain
    assert sorted(layer_program(*WO)["bwd_kernels"]) == fused
    assert sorted(layer_program(*WI, *WO)["bwd_kernels"]) == fused


def _activation_vjp_muls(prog) -> int:
    """Multiplies over the [M, F] rows (any dtype) that the backward adds outside the kernels."""
    extra = prog["grad_ops"] - prog["fwd_ops"]
    return sum(n for (prim, shape, _), n in extra.items() if prim == "mul" and shape == (M_ROWS, F))


def test_program_activation_vjp_absent():
    """With wo_fused_dswiglu the SwiGLU's VJP (the [M, F] multiplies of d gate and d up) is
    not built outside the kernels; without it, it is: 6 multiplies unfused (bf16 autodiff), 8
    with the fused up projection alone (its float32 VJP in wi_fused_swiglu's backward). wo alone
    leaves 1: autodiff's linearisation of the jnp SwiGLU forward computes a factor of silu's
    derivative that nothing reads; with both levers there is no SwiGLU outside a kernel."""
    assert _activation_vjp_muls(layer_program()) == 6
    assert _activation_vjp_muls(layer_program(*WI)) == 8
    assert _activation_vjp_muls(layer_program(*WO)) == 1
    assert _activation_vjp_muls(layer_program(*WI, *WO)) == 0


def test_program_saved_residual_bytes():
    """What the forward keeps for the backward (every residual's bytes, all shards), per key:
    wi_fused_swiglu keeps three bf16 [M, F] arrays fewer (gate, up and their product: the kernel
    stores h); wo_fused_dswiglu alone keeps the bf16 pre-activation [M, 2F] more; both together
    keep what wi alone keeps; router_grad_from_wo_input keeps one bf16 [M, D] array fewer (the
    down projection's output, which the routing weight's gradient no longer reads)."""
    off = layer_program()["residual_bytes"]
    rows = SHARDS * M_ROWS * 2  # bytes of one bf16 column over every shard's rows
    assert layer_program(*WI)["residual_bytes"] == off - 3 * F * rows
    assert layer_program(*WO)["residual_bytes"] == off + 2 * F * rows
    assert layer_program(*WI, *WO)["residual_bytes"] == off - 3 * F * rows
    assert layer_program(*R)["residual_bytes"] == off - D * rows


def _routing_multiplies(prog) -> dict[int, int]:
    """float32 multiplies over the routed rows outside the kernels, by operand width."""
    return {w: n for (prim, shape, dt), n in prog["fwd_ops"].items()
            if prim == "mul" and dt == "float32" and len(shape) == 2 and shape[0] == M_ROWS
            for w in (shape[1],)}


def test_program_router_grad_from_wo_input_multiplies_the_down_projection_input():
    """Off: the routing weight scales the down projection's output rows [M, D]; on: its input
    rows [M, F]."""
    off, on = _routing_multiplies(layer_program()), _routing_multiplies(layer_program(*R))
    assert off.get(D, 0) == 1 and off.get(F, 0) == 0, off
    assert on.get(F, 0) == 1 and on.get(D, 0) == 0, on


def test_program_capacity_buffer_rows():
    """capacity_factor=0.5 gives the grouped matmuls a buffer of E * ceil(0.5 * M / E) rows
    instead of all M routed rows."""
    def rows(prog):
        # Operands: the group offset, four scalar-prefetch metadata arrays, then rows, weight.
        return sorted({shapes[-2][0] for name, shapes in prog["kernel_shapes"] if name == "gmm"})

    assert rows(layer_program()) == [M_ROWS]
    assert rows(layer_program("moe.capacity_factor=0.5")) == [M_ROWS // 2]


# ---------------------------------------------------------------------------------------------
# Broken variants of the plumbing: each patched in, each caught by its check.


def check_row_tiles():
    """row_tiled_dot against ragged_dot, groups of uneven sizes crossing tile boundaries."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([5, 0, 11, 3, 13], jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((5, 8, 4)), jnp.float32)
    got = row_tiled_dot(lhs, rhs, sizes, tile_rows=4)
    want = jax.lax.ragged_dot(lhs, rhs, sizes)
    err = float(jnp.max(jnp.abs(got - want)))
    assert err <= 1e-5, f"row_tiled_dot vs ragged_dot: max |d| {err:.3g}"


def check_buffer_depth():
    """The depth reaches exactly the fused forward kernel's two weight operands, as asked."""
    from test_moe_levers import _pallas_kernels
    _, _, _, _, kernels = _pallas_kernels(2, *WI, *WO)
    fwd = [modes for name, modes in kernels if name.startswith("wi_fused_swiglu_fwd")]
    assert len(fwd) == 1, kernels
    assert [getattr(m, "buffer_count", None) for m in fwd[0]] == [None, 2, 2, None, None], fwd


def test_row_tiles_match_ragged_dot():
    check_row_tiles()


def test_wi_fwd_rhs_buffer_count_reaches_the_fused_weights():
    check_buffer_depth()


CATCHERS = {
    "router_sqrt_weight": check_router_on_vs_off,
    "capacity_keeps_one_more": lambda: check_drops(ep=False),
    "ring_mirrored_expert_offset": lambda: check_drops(ep=True),
    "row_tiles_group_boundary": check_row_tiles,
    "buffer_depth_ignored": check_buffer_depth,
    "buffer_depth_off_by_one": check_buffer_depth,
}


def test_every_moe_variant_has_a_catcher():
    assert set(CATCHERS) == set(BROKEN_MOE)


@pytest.fixture(params=list(BROKEN_MOE))
def broken_moe(request, monkeypatch):
    for module, attr, fn in BROKEN_MOE[request.param]:
        monkeypatch.setattr(module, attr, fn)
    return request.param


def test_broken_moe_variant_is_caught(broken_moe):
    with pytest.raises(AssertionError):
        CATCHERS[broken_moe]()
