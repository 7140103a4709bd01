"""quant.fp8_gmm (seed 003): the MoE grouped matmuls in fp8, forward and both gradients.

Tolerance table (relative L2 against float32 with HIGHEST precision, random data whose rows,
columns and groups span several binades): e4m3 keeps 3 significant bits (rounding error up to
2**-4 of a value), e5m2 2 bits (2**-3).

    forward      out = x @ w         e4m3 x e4m3   <= 0.08
    input grad   dx  = d @ w^T       e5m2 x e4m3   <= 0.12
    weight grad  dw  = x^T @ d       e4m3 x e5m2   <= 0.12
    forward, the worst (group, column) channel     <= 0.05  (error / |x| @ |w|, no floor)

The weight's output channels span 24 binades (fp8_reference.spread_channels): a scale shared
across channels (per tensor) flushes the small ones to zero, which only the per-channel figure sees.

Each error must also stay above 1e-2 (the fp8 rounding is really there) and at least 10x below
the error of every broken variant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import spread_channels, spread_experts
from helpers import tiny_config, tiny_params
from hybridmoe.config import ConfigError
from hybridmoe.quant import fp8 as kernels_fp8
from hybridmoe.quant import gmm_fp8 as kfp8
from hybridmoe.kernels.gmm import reference as ref
from hybridmoe.model import moe as moe_mod
from hybridmoe.run.setup import build

TOL = {"forward": 0.08, "input_grad": 0.12, "weight_grad": 0.12, "forward_worst_channel": 0.05}
FP8_FLOOR = 1e-2
GMM = ("quant.fp8_gmm=true",)

CASES = {"every_group_local": (8, 0), "expert_shard_at_offset_2": (4, 2)}
SIZES = (5, 0, 9, 3, 7, 0, 4, 2)  # empty groups; 6 padding rows follow


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def kernel_errors(case: str) -> dict[str, float]:
    num_local, offset = CASES[case]
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(SIZES, jnp.int32)
    m, k, n = sum(SIZES) + 6, 64, 48
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1))), jnp.float32)
    w = spread_channels(rng.standard_normal((num_local, k, n)).astype(np.float32), seed=3, binades=24)
    ct = jnp.asarray(rng.standard_normal((m, n)) * np.exp(rng.standard_normal((m, 1))), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) * ct)

    fp8_fn = lambda x, w: kfp8.gmm_fp8(x, w, sizes, group_offset=offset)  # noqa: E731
    ref_fn = lambda x, w: ref.gmm(x, w, sizes, group_offset=offset)  # noqa: E731
    both = lambda fn: jax.jit(lambda x, w: (fn(x, w), jax.grad(loss(fn), (0, 1))(x, w)))  # noqa: E731
    out, (dx, dw) = both(fp8_fn)(x, w)
    out_r, (dx_r, dw_r) = both(ref_fn)(x, w)
    # The contract: padding rows and foreign rows are zero, value and gradient.
    outside = np.asarray(out_r)[:, 0] == 0
    assert np.all(np.asarray(out)[outside] == 0) and np.all(np.asarray(dx)[outside] == 0)
    # Per (group, column): the error against the column's sum of magnitudes |x| @ |w| (a dot product
    # of random signs cancels, so its own norm would not bound the rounding).
    ends, err = np.cumsum(SIZES), np.abs(np.asarray(out, np.float64) - np.asarray(out_r, np.float64))
    magnitude = np.asarray(ref.gmm(jnp.abs(x), jnp.abs(w), sizes, group_offset=offset), np.float64)
    channels = [np.linalg.norm(err[ends[g] - SIZES[g]:ends[g], c]) / np.linalg.norm(magnitude[ends[g] - SIZES[g]:ends[g], c])
                for g in range(offset, offset + num_local) if SIZES[g] for c in range(n)]
    return {"forward": rel_l2(out, out_r), "input_grad": rel_l2(dx, dx_r), "weight_grad": rel_l2(dw, dw_r),
            "forward_worst_channel": max(channels)}


@pytest.mark.parametrize("case", list(CASES))
def test_three_fp8_matmuls_within_the_tolerance_table(case):
    errs = kernel_errors(case)
    for what, err in errs.items():
        floor = 0.0 if what == "forward_worst_channel" else FP8_FLOOR
        assert floor < err <= TOL[what], f"{case} {what}: relative L2 {err:.3g} (table {TOL[what]})"


def _per_tensor_absmax(x, axis: int):
    """Broken: one absmax for the whole tensor, broadcast to the per-row / per-channel shape."""
    per_slice = jnp.max(jnp.abs(jax.lax.stop_gradient(x)).astype(jnp.float32), axis=axis, keepdims=True)
    return jnp.broadcast_to(jnp.max(per_slice), per_slice.shape)


BROKEN = {
    "neighbouring_group_weight_scale": (kfp8, "weight_scale_of_rows", lambda s, g: s[(g + 1) % s.shape[0], 0, :]),
    "scale_not_moved_onto_the_gradient": (kfp8, "fold_scale", lambda d, s: d),
    "per_tensor_absmax": (kernels_fp8, "absmax", _per_tensor_absmax),
}


# One-line bugs of gmm_fp8 that no tolerance can see (a better-than-e5m2 gradient format, a scale
# shared with padding or other groups), each recompiled from the source with one fragment replaced:
# the program's operand formats or the isolation test must catch each.
PROGRAM_BROKEN = {
    "gradients_in_e4m3": ("grad_dtype=fp8.E5M2", "grad_dtype=fp8.E4M3"),
    "input_grad_from_the_unquantized_gradient": ("dx = (mm(d_codes, w_codes,",
                                                 "dx = (mm(fold_scale(d, weight_scale_of_rows(s_w, g_M)), w_codes,"),
    "padding_rows_enter_the_weight_grad_scale": ("jnp.where(keep_M[:, None], jnp.abs(d_rows), 0.0)",
                                                 "jnp.abs(d_rows)"),
    "one_weight_grad_scale_for_all_groups": (
        "jax.ops.segment_max(jnp.where(keep_M[:, None], jnp.abs(d_rows), 0.0), g_M, num_segments=G)",
        "jnp.broadcast_to(jnp.where(keep_M[:, None], jnp.abs(d_rows), 0.0).max(axis=0), (G, d_rows.shape[1]))"),
}


@pytest.mark.parametrize("variant", list(PROGRAM_BROKEN))
def test_broken_operand_format_or_scale_is_caught(variant, monkeypatch):
    from broken_variants import mutated
    monkeypatch.setattr(kfp8, "gmm_fp8", mutated(kfp8, "gmm_fp8", *PROGRAM_BROKEN[variant]))
    formats, diffs = kernel_operand_formats(), isolation_differences()
    assert formats != OPERAND_FORMATS or any(diffs.values()), (variant, formats, diffs)


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variant_far_outside_the_table(variant, monkeypatch):
    clean = kernel_errors("expert_shard_at_offset_2")
    monkeypatch.setattr(*BROKEN[variant])
    broken = kernel_errors("expert_shard_at_offset_2")
    worst = max(broken, key=lambda w: broken[w] / TOL[w])
    assert broken[worst] > TOL[worst] and broken[worst] >= 10 * clean[worst], (
        f"{variant}: clean {clean}, broken {broken}")


# ---------------------------------------------------------------------------------------------
# What the program feeds each grouped matmul (read from the jaxpr): the codes of every operand of
# the three matmuls, followed back through the casts and transposes to the fp8 value they hold.

_LAYOUT = ("convert_element_type", "transpose", "reshape", "copy", "copy_p")


def _operand_formats(jaxpr) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(the fp8 format of lhs and rhs, the output shape) of every ragged_dot(_general) in the program:
    each operand followed back through layout ops and casts to the first fp8 value (else its dtype)."""
    out = []

    def origin(var, producer):
        while True:
            dtype = str(var.aval.dtype)
            if dtype.startswith("float8"):
                return dtype
            eqn = producer.get(var)
            if eqn is None or eqn.primitive.name not in _LAYOUT:
                return dtype
            var = eqn.invars[0]

    def walk(j):
        producer = {v: e for e in j.eqns for v in e.outvars}
        for e in j.eqns:
            if e.primitive.name.startswith("ragged_dot"):
                out.append((tuple(origin(v, producer) for v in e.invars[:2]), tuple(e.outvars[0].aval.shape)))
            for param in e.params.values():
                inner = getattr(param, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr)
    return out


def kernel_operand_formats() -> dict[str, tuple[str, ...]]:
    """{forward, input_grad, weight_grad: (lhs, rhs) formats} of gmm_fp8's value and both gradients."""
    m, k, n, sizes = 20, 16, 8, jnp.asarray((5, 0, 9, 3), jnp.int32)
    loss = lambda x, w: jnp.sum(kfp8.gmm_fp8(x, w, sizes) * jnp.arange(m * n, dtype=jnp.float32).reshape(m, n))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(jnp.ones((m, k)), jnp.ones((4, k, n)))
    which = {(m, n): "forward", (m, k): "input_grad", (4, k, n): "weight_grad"}
    return {which[shape]: formats for formats, shape in _operand_formats(jaxpr.jaxpr)}


E4, E5 = "float8_e4m3fn", "float8_e5m2"
OPERAND_FORMATS = {"forward": (E4, E4), "input_grad": (E5, E4), "weight_grad": (E4, E5)}


def test_program_feeds_e4m3_forward_and_e5m2_gradient_codes():
    """x and w as e4m3 codes in the forward; the output gradient as e5m2 codes in both backward
    matmuls, against the forward's own e4m3 codes of w (input grad) and x (weight grad)."""
    assert kernel_operand_formats() == OPERAND_FORMATS


# Rows outside a group (padding after the last group, rows of the groups another expert rank
# holds) and rows of other groups never enter a scale: huge values there change no bit of any
# group's output, input gradient or weight gradient; a huge gradient in one group changes no bit
# of the other groups' weight gradients.

# Huge, yet finite after the row scale moves onto the gradient (x 1e6 has scale 2**12; 1e30 * 2**12
# < float32 max): a scale is a power of two, so only a value ~30 binades off (e5m2's normal range)
# pushes the other rows' codes to zero; a smaller one would leave their bits as they are.
HUGE_X, HUGE_GRAD = 1e6, 1e30


def isolation_differences() -> dict[str, int]:
    """How many values of the group rows (output, input grad) and of the weight grads change when
    the rows outside the local groups hold huge values (x and the output gradient), and how many of the
    other groups' weight grads change when one group's output gradient is multiplied by 2**40."""
    num_local, offset = CASES["expert_shard_at_offset_2"]
    sizes_np = np.asarray(SIZES)
    sizes = jnp.asarray(SIZES, jnp.int32)
    rng = np.random.default_rng(1)
    m, k, n = sum(SIZES) + 6, 32, 16
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((num_local, k, n)), jnp.float32)
    ct = rng.standard_normal((m, n)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(sizes_np)])
    inside = np.zeros(m, bool)
    inside[starts[offset]:starts[offset + num_local]] = True
    assert (~inside).sum() > 6  # padding rows and the rows of groups 0, 1 and 6, 7

    @jax.jit
    def both(x, ct):
        f = lambda x, w: jnp.sum(kfp8.gmm_fp8(x, w, sizes, group_offset=offset) * ct)  # noqa: E731
        return kfp8.gmm_fp8(x, w, sizes, group_offset=offset), *jax.grad(f, (0, 1))(x, w)

    run = lambda x, ct: tuple(np.asarray(a) for a in both(x, ct))  # noqa: E731

    clean = run(x, ct)
    outside = run(np.where(inside[:, None], x, HUGE_X), np.where(inside[:, None], ct, HUGE_GRAD))
    group = offset + 2  # the local group 2 (7 rows): its gradient 2**40 larger
    rows = np.arange(m)
    in_group = (rows >= starts[group]) & (rows < starts[group + 1])
    loud = run(x, np.where(in_group[:, None], ct * 2.0 ** 40, ct))
    others = np.arange(num_local) != group - offset
    return {"outside: output": int((clean[0] != outside[0])[inside].sum()),
            "outside: input grad": int((clean[1] != outside[1])[inside].sum()),
            "outside: weight grad": int((clean[2] != outside[2]).sum()),
            "another group: weight grad": int((clean[2] != loud[2])[others].sum())}


def test_rows_outside_a_group_never_enter_a_scale():
    diffs = isolation_differences()
    assert all(v == 0 for v in diffs.values()), diffs


# ---------------------------------------------------------------------------------------------
# The MoE layer: default grouped path and expert parallelism, against float32 without fp8


def _layer_grads(cfg, p, x, setup=None):
    # A fixed cotangent: the gradients compare the fp8 backward, not cotangents of a loss that
    # depends on y (sin(y) of outputs in the thousands, as the spread weights give, turns an fp8
    # error of y into a random cotangent).
    ct = jax.random.normal(jax.random.key(7), x.shape)

    def f(p, x):
        y = moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels, quant=cfg.quant)
        return jnp.sum(y * ct), y

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    if setup is None:
        return fn(p, x)
    with setup.context():
        return fn(p, x)


# The output is two fp8 matmuls in a row, the second on h = silu(x wi_gate) * (x wi_up), whose
# columns span the routed weights' 12 binades: one e4m3 scale per row of h flushes its small
# columns (measured 0.082 on these weights, within 0.08 on weights within a factor of ~3).
LAYER_TOL = {"output": 0.12, "x_grad": 0.12, "wi_grad": 0.12, "wo_grad": 0.12}


@pytest.mark.parametrize("mesh", ["default", "expert2"])
def test_moe_layer_within_the_tolerance_table(mesh):
    over = {"default": (), "expert2": ("mesh.expert=2",)}[mesh]
    base = tiny_config()
    # Routed weights over 12 binades of output channels (fp8_reference.spread_channels).
    p = jax.tree.map(lambda a: a[0], spread_experts(tiny_params(base))["blocks"][0]["moe"])
    x = jax.random.normal(jax.random.key(1), (8, 16, base.model.d_model))
    (_, y_r), (gp_r, gx_r) = _layer_grads(base, p, x)  # float32, no mesh
    cfg = tiny_config(*GMM, *over)
    (_, y), (gp, gx) = _layer_grads(cfg, p, x, build(cfg))
    errs = {"output": rel_l2(y, y_r), "x_grad": rel_l2(gx, gx_r), "wi_grad": rel_l2(gp["wi"], gp_r["wi"]),
            "wo_grad": rel_l2(gp["wo"], gp_r["wo"])}
    for what, err in errs.items():
        assert FP8_FLOOR / 10 < err <= LAYER_TOL[what], f"{mesh} {what}: relative L2 {err:.3g}"


def test_validator_names_every_unmet_requirement():
    with pytest.raises(ConfigError) as e:
        tiny_config(*GMM, "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true", "kernels.gmm.backend=pallas_tpu",
                    "kernels.interpret=true")
    msg = dict(e.value.problems)["quant.fp8_gmm"]
    assert "moe.wi_fused_swiglu" in msg and "float32 accumulator" in msg and "pallas_tpu" in msg
    with pytest.raises(ConfigError) as e:
        tiny_config(*GMM, "moe.impl=dense")
    assert "moe.impl=sparse" in dict(e.value.problems)["quant.fp8_gmm"]
    with pytest.raises(ConfigError) as e:
        tiny_config(*GMM, "moe.routing_replay=true")
    assert "moe.routing_replay" in dict(e.value.problems)["quant.fp8_gmm"]
    tiny_config(*GMM, "quant.fp8_moe_fake_quant=true", "moe.capacity_factor=2.0")


@pytest.mark.slow  # the 60-step comparison with bf16 is benchmarks/fp8_gmm_train.py (record + plot)
def test_tiny_recipe_trains_with_fp8_gmm():
    from hybridmoe.train.loop import train

    cfg = tiny_config(*GMM, "model.compute_dtype=bfloat16", "train.steps=4", "train.seq_len=32",
                      "train.warmup_steps=0")
    losses = [h["loss"] for h in train(cfg, None, progress=False)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_token_chunks_sum_the_fp8_weight_gradients_over_the_chunks():
    """moe.token_chunks with quant.fp8_gmm, against fp8_gmm in one pass (the lever off). The fp8
    matmuls have no weight_out: the chunk backward passes each weight on unchanged and autodiff adds
    the chunk's gradient to the carried one. The output is the same bits (its scales are per row);
    the tokens' gradient is not (the gradient's e5m2 scales span the chunk's rows), nor are the
    weights' gradients (summed over the chunks)."""
    base = tiny_config()
    p = jax.tree.map(lambda a: a[0], spread_experts(tiny_params(base))["blocks"][0]["moe"])
    x = jax.random.normal(jax.random.key(1), (8, 16, base.model.d_model))
    off_cfg, on_cfg = tiny_config(*GMM, "mesh.expert=2"), tiny_config(*GMM, "mesh.expert=2", "moe.token_chunks=4")
    (_, y_off), (gp_off, gx_off) = _layer_grads(off_cfg, p, x, build(off_cfg))
    (_, y_on), (gp_on, gx_on) = _layer_grads(on_cfg, p, x, build(on_cfg))
    assert np.array_equal(y_on, y_off)
    errs = {"x": rel_l2(gx_on, gx_off), **{k: rel_l2(gp_on[k], gp_off[k]) for k in ("wi", "wo")}}
    print(f"fp8 gradients, chunks against one pass: {errs}")
    assert max(errs.values()) < 1e-3, errs  # clean 5e-8; the passed weight's cotangent dropped: 0.85
