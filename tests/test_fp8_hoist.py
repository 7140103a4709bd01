"""quant.fp8_moe_fake_quant and quant.fp8_fake_quant_hoist (docs/levers.md, "fp8 experts"): validators,
exactness on the 8-device mesh, program proofs, and the six broken variants.

The model is the tiny recipe shrunk to two attention layers (a layer scan of two iterations, so
a neighbouring layer exists), bfloat16 weights and compute, full remat, experts sharded over the
expert axis (mesh data 2 x fsdp 2 x expert 2): scan, remat, expert parallelism and FSDP at once.

Bit-for-bit comparisons view floats as unsigned integers: -0.0 and +0.0 differ. The routed
weights of every test here span 12 binades across output channels, and in every channel one FSDP
shard of the contracting axis sits 12 binades below the other (fp8_reference.spread_experts): a
per-tensor absmax gives other bits there (a broken variant below). The sampler test keeps the
plain weights: on the spread ones it failed (not yet diagnosed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_reference import bits, ref_fake_quant, spread_experts
from helpers import packed_batch, tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.config import ConfigError
from hybridmoe.quant import expert_fp8
from hybridmoe.model.params import layer_axes
from hybridmoe.quant import fp8
from hybridmoe.run.setup import build
from hybridmoe.run.step import nll_sum

MODEL = ("model.compute_dtype=bfloat16", "model.param_dtype=bfloat16", "model.num_layers=2",
         "model.layer_pattern=[attention]", "mesh.expert=2")
FQ = ("quant.fp8_moe_fake_quant=true",)
MODES = ("off", "absmax", "gather8")


def _problems(*overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        tiny_config(*overrides)
    return dict(e.value.problems)


# ---------------------------------------------------------------------------------------------
# Validators


def test_accepted_where_it_can_work():
    for mode in MODES:
        cfg = tiny_config(*FQ, f"quant.fp8_fake_quant_hoist={mode}")
        assert cfg.quant.fp8_fake_quant_hoist == mode
    # A bare `off` is YAML's False; it still means off.
    assert tiny_config("quant.fp8_fake_quant_hoist=off").quant.fp8_fake_quant_hoist == "off"
    # Fake quantization rounds the weights before any matmul: the fused levers take it.
    tiny_config(*FQ, "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true")


def test_hoist_names_every_unmet_requirement():
    msg = _problems("quant.fp8_fake_quant_hoist=gather8", "moe.impl=dense", "mesh.fsdp=1",
                    "mesh.data=8")["quant.fp8_fake_quant_hoist"]
    for need in ("fp8_moe_fake_quant=true", "moe.impl=sparse", "split over mesh.fsdp=1 x mesh.context=1, 1 shard"):
        assert need in msg, (need, msg)
    assert "fp8_moe_fake_quant" in _problems("quant.fp8_fake_quant_hoist=absmax")["quant.fp8_fake_quant_hoist"]


def test_unknown_mode_is_named():
    probs = _problems(*FQ, "quant.fp8_fake_quant_hoist=gather16")
    assert "gather16" in probs["quant.fp8_fake_quant_hoist"]


def test_gather8_without_a_mesh_raises_at_trace():
    """Model code raises a plain error (the validation pass owns ConfigError and refuses the config
    before any trace); traced without a mesh, gather8 names the key rather than gathering nothing."""
    cfg = tiny_config(*FQ, "quant.fp8_fake_quant_hoist=gather8")
    w = jnp.ones((8, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match="quant.fp8_fake_quant_hoist=gather8 needs a device mesh"):
        expert_fp8.weight_at_use(w, ("exp", "embed", "mlp"), cfg.quant.fp8_fake_quant_hoist, None)


# ---------------------------------------------------------------------------------------------
# The weights where the MoE block uses them: production functions, through a layer scan


def _layer_weights_fn(cfg):
    """(stacked routed weights as used, per pattern position) through the scan's xs, exactly as
    forward.block_fn hands them to the MoE block."""
    weights = expert_fp8.LayerWeights(cfg, layer_axes(cfg.model))

    def used(params):
        xs = weights.scan_xs(params)

        def body(carry, block_xs):
            block_params, block_amax = weights.split(block_xs)
            outs = [{k: weights.at_use(lp, i, a)["moe"][k] for k in expert_fp8.ROUTED}
                    for i, (lp, a) in enumerate(zip(block_params, block_amax))]
            return carry, outs

        return jax.lax.scan(body, 0, xs)[1]

    return used


def _with_tiny_negatives(params):
    """Every 97th routed-weight element made a tiny negative number, which rounds to -0.0 on the
    fp8 grid (a normal initialisation rarely has one)."""
    def tiny(w):
        flat = w.reshape(-1)
        flat = flat.at[::97].set(-1e-30)
        return flat.reshape(w.shape)

    blocks = [{**b, "moe": {**b["moe"], **{k: tiny(b["moe"][k]) for k in expert_fp8.ROUTED}}}
              for b in params["blocks"]]
    return {**params, "blocks": blocks}


@functools.cache
def weights_run(mode: str):
    """(weights as used, their VJP for a fixed cotangent: the params' gradient) on the mesh."""
    cfg = tiny_config(*MODEL, *FQ, f"quant.fp8_fake_quant_hoist={mode}")
    params = _with_tiny_negatives(spread_experts(tiny_params(cfg)))
    setup = build(cfg)
    fn = _layer_weights_fn(cfg)
    with setup.context():
        p = jax.device_put(params, setup.param_shardings)
        out, vjp = jax.vjp(jax.jit(fn), p)
        ct = jax.tree.map(lambda a: jax.random.normal(jax.random.key(7), a.shape, a.dtype), out)
        (grads,) = vjp(ct)
    routed = [{k: np.asarray(b["moe"][k]) for k in expert_fp8.ROUTED} for b in params["blocks"]]
    cts = [{k: np.asarray(c[k]) for k in expert_fp8.ROUTED} for c in ct]
    g = [{k: np.asarray(b["moe"][k]) for k in expert_fp8.ROUTED} for b in grads["blocks"]]
    return routed, [{k: np.asarray(o[k]) for k in expert_fp8.ROUTED} for o in out], cts, g


def weight_checks(mode: str):
    """Every weight as used is the reference fake quantization of its layer's weight (bits), and
    the cotangent reaches the stored weight untouched (the straight-through estimator)."""
    routed, used, cts, grads = weights_run(mode)
    assert any(np.any(bits(ref_fake_quant(w[k], 2)[1]) == 0x80) for w in routed for k in w), \
        "the weights must have elements that round to -0.0"
    for pos, (w, u, c, g) in enumerate(zip(routed, used, cts, grads)):
        for k in expert_fp8.ROUTED:
            for layer in range(w[k].shape[0]):
                ref, _, _ = ref_fake_quant(w[k][layer], 1)
                assert np.array_equal(bits(u[k][layer]), bits(ref)), f"{mode}: {k} of layer {layer} (pos {pos})"
            assert np.array_equal(bits(g[k]), bits(c[k])), f"{mode}: the cotangent of {k} (pos {pos})"


@pytest.mark.parametrize("mode", MODES)
def test_weights_as_used_are_the_reference_fake_quantization(mode):
    weight_checks(mode)


# ---------------------------------------------------------------------------------------------
# Exactness and program proofs through the whole model (one compile per mode, shared)


def _loss_and_logits(cfg):
    from hybridmoe.model.forward import logits

    def f(p, b):
        lg = logits(p, cfg, b["tokens"], b["segment_ids"], b["positions"])
        return nll_sum(p, cfg, b)[0], lg

    return jax.value_and_grad(f, has_aux=True)


@functools.cache
def model_run(*overrides, params_fn=None):
    """(Program, ((loss, logits), grads)) of the loss on the 8-device mesh."""
    cfg = tiny_config(*MODEL, *overrides)
    params = spread_experts(tiny_params(cfg))
    if params_fn is not None:
        params = params_fn(params)
    batch = packed_batch(0, 8, 64, cfg.model.vocab_size)
    setup = build(cfg)
    with setup.context():
        p = jax.device_put(params, setup.param_shardings)
        b = jax.device_put(batch, jax.tree.map(lambda _: setup.batch_sharding(0), batch))
        lowered = jax.jit(_loss_and_logits(cfg)).lower(p, b)
        compiled = lowered.compile()
        out = compiled(p, b)
    prog = program.Program(lowered.as_text(), compiled.as_text(), program.memory_figures(compiled), {})
    return prog, out


def mode_run(mode):
    return model_run(*FQ, f"quant.fp8_fake_quant_hoist={mode}")


def _bit_leaves(tree):
    return [(jax.tree_util.keystr(k), bits(np.asarray(v))) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_bits(a, b, what=""):
    for (name, x), (_, y) in zip(_bit_leaves(a), _bit_leaves(b)):
        assert np.array_equal(x, y), f"{what}{name}: not bit-identical ({np.sum(x != y)} of {x.size} differ)"


@pytest.mark.parametrize("mode", ["absmax", "gather8"])
def test_modes_bit_identical_through_the_model(mode):
    """Loss, logits and every gradient: the hoisted modes give off's bits."""
    assert_bits(mode_run(mode)[1], mode_run("off")[1], f"{mode}: ")


def _reference_quantized(params):
    blocks = [{**b, "moe": {**b["moe"], **{k: jnp.asarray(np.stack([ref_fake_quant(w, 1)[0] for w in np.asarray(b["moe"][k])]))
                                          for k in expert_fp8.ROUTED}}} for b in params["blocks"]]
    return {**params, "blocks": blocks}


def test_fake_quant_is_the_model_on_quantized_weights():
    """With fake quantization the forward is the plain model's on reference-quantized weights
    (every layer, forward and remat replay), and the straight-through gradient of a routed
    weight is the plain model's gradient of its quantized weight."""
    (_, fq), (_, plain) = mode_run("off"), model_run(params_fn=_reference_quantized)
    (loss, logits_), grads = fq
    (loss_p, logits_p), grads_p = plain
    assert_bits((loss, logits_), (loss_p, logits_p))
    for b, bp in zip(grads["blocks"], grads_p["blocks"]):
        for k in expert_fp8.ROUTED:
            x, y = np.asarray(b["moe"][k], np.float32), np.asarray(bp["moe"][k], np.float32)
            err = np.linalg.norm(x - y) / np.linalg.norm(y)
            assert err < 1e-2, f"{k}: relative L2 {err:.3g}"


PATHS = {"default": (), "levers": ("moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true"),
         "buffer": ("moe.capacity_factor=2.0",)}
# The transform runs before the MoE block, so every path sees the same weights; the kernel paths
# are the slow group's (budget of the default group).
SLOW_PATHS = ("levers", "buffer")


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PATHS else p for p in PATHS])
def test_every_moe_path_runs_on_quantized_weights(path):
    """The forward loss with fake quantization is the plain model's on reference-quantized weights
    on the default grouped path, the fused-lever kernels and the buffered kernel path (one expert
    rank; expert parallelism is the test above)."""
    base = tuple(o for o in MODEL if o != "mesh.expert=2") + PATHS[path]

    def loss(*overrides, params_fn=lambda p: p):
        cfg = tiny_config(*base, *overrides)
        params = params_fn(spread_experts(tiny_params(cfg)))
        batch, setup = packed_batch(0, 8, 64, cfg.model.vocab_size), build(cfg)
        with setup.context():
            return jax.jit(lambda p, b: nll_sum(p, cfg, b)[0])(params, batch)

    fq, plain = loss(*FQ), loss(params_fn=_reference_quantized)
    assert bits(fq) == bits(plain), (float(fq), float(plain))
    assert float(fq) != float(loss()), "fake quantization changed nothing"


def _absmax_all_reduces(prog, in_loop: bool) -> int:
    return sum(1 for c in prog.compiled_collectives
               if c.kind == "all-reduce" and expert_fp8.ABSMAX_SCOPE in c.op_name and c.in_loop == in_loop)


def test_program_absmax_all_reduces_leave_the_loop():
    n = {mode: (_absmax_all_reduces(mode_run(mode)[0], True), _absmax_all_reduces(mode_run(mode)[0], False))
         for mode in MODES}
    assert n["off"][0] > 0 and n["off"][1] == 0, n
    assert n["absmax"][0] == n["gather8"][0] == 0, n
    assert n["absmax"][1] > 0 and n["gather8"][1] > 0, n


def _expert_gathers(prog, cfg):
    """In-loop lowered all-gathers whose result is a whole layer's routed weight."""
    m = cfg.model
    e_local = m.num_experts // cfg.mesh.expert
    shapes = {(e_local, m.d_model, 2 * m.moe_intermediate_size), (e_local, m.moe_intermediate_size, m.d_model)}
    colls = [c for c in prog.lowered_collectives if c.kind == "all-gather" and c.in_loop]
    return [c for c in colls if c.shape in shapes], [c for c in colls if c.shape not in shapes]


def test_program_gathers_one_byte_codes_at_half_the_bytes():
    cfg = tiny_config(*MODEL)
    off, off_other = _expert_gathers(mode_run("off")[0], cfg)
    g8, g8_other = _expert_gathers(mode_run("gather8")[0], cfg)
    assert off and len(off) == len(g8), (off, g8)
    assert {c.dtype for c in off} == {"bf16"} and {c.dtype for c in g8} == {"f8e4m3fn"}
    assert 2 * sum(c.bytes for c in g8) == sum(c.bytes for c in off)
    # Nothing else gathered inside the loop changes (no scale moves there).
    key = lambda c: (c.dtype, c.shape)  # noqa: E731
    assert sorted(map(key, g8_other)) == sorted(map(key, off_other))


# ---------------------------------------------------------------------------------------------
# Broken variants (docs/levers.md, "fp8 experts"): each patched into the production functions, each caught.


def _unrounded_scale(amax, dtype=fp8.E4M3):
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.where(amax > 0, amax / fp8.fp8_max(dtype), 1.0)


def _per_tensor_absmax(x, axis: int):
    """Broken: one absmax for the whole (local) tensor, broadcast to the per-channel shape."""
    per_channel = jnp.max(jnp.abs(jax.lax.stop_gradient(x)).astype(jnp.float32), axis=axis, keepdims=True)
    return jnp.broadcast_to(jnp.max(per_channel), per_channel.shape)


_stacked = expert_fp8.stacked_absmax
_dequantize = expert_fp8.dequantize_gathered
_to_shard = expert_fp8.cotangent_to_shard

BROKEN = {
    "scale_without_rounding": (fp8, "scale_from_absmax", _unrounded_scale),
    "neighbouring_layer_absmax": (expert_fp8, "stacked_absmax",
                                  lambda *a: jnp.roll(_stacked(*a), 1, axis=0)),
    "scaled_straight_through": (fp8, "straight_through",
                                lambda x, x_q: x_q + 0.5 * (x - jax.lax.stop_gradient(x))),
    "neighbouring_channel_scale_after_gather": (expert_fp8, "dequantize_gathered",
                                                lambda c, s, d: _dequantize(c, jnp.roll(s, 1, axis=-1), d)),
    "scaled_custom_vjp_cotangent": (expert_fp8, "cotangent_to_shard", lambda ct, spec: _to_shard(ct * 2, spec)),
    "codes_keep_negative_zero": (fp8, "positive_zero", lambda codes: codes),
    # Scales that per-channel weights within a factor of ~3 cannot tell apart.
    "per_tensor_absmax": (fp8, "absmax", _per_tensor_absmax),
}


@pytest.fixture(params=list(BROKEN))
def broken(request, monkeypatch):
    module, name, fn = BROKEN[request.param]
    monkeypatch.setattr(module, name, fn)
    weights_run.cache_clear()
    yield request.param
    weights_run.cache_clear()


def test_broken_variant_is_caught(broken):
    """The weight checks above, in every mode: at least one fails for every broken variant."""
    failures = []
    for mode in MODES:
        try:
            weight_checks(mode)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    assert failures, f"{broken} was not caught"


# ---------------------------------------------------------------------------------------------
# The sampler samples the policy the trainer trains: fake-quantized experts in the cached forward


def test_sampler_uses_the_fake_quantized_experts():
    from hybridmoe.model.forward import decoder_hidden
    from hybridmoe.kernels.logprobs import chunked_token_logprobs
    from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate

    cfg = tiny_config("model.num_layers=2", "model.layer_pattern=[attention]", *FQ)
    plain = tiny_config("model.num_layers=2", "model.layer_pattern=[attention]")
    setup, params = build(cfg), tiny_params(cfg)
    rng = np.random.default_rng(0)
    tokens, seg, pos = left_pad_prompts([rng.integers(3, 200, size=n).tolist() for n in (3, 7, 1, 5, 2, 7, 4, 6)],
                                        7, pad_id=0)
    opts = SamplingOptions(max_new_tokens=4, temperature=1.0, eos_id=-1)

    def trainer_logp(c, out):
        h = jax.jit(lambda p, t, s, q: decoder_hidden(p, c, t, s, q))(
            params, out["tokens"], out["segment_ids"], out["positions"])
        lp, _ = chunked_token_logprobs(h[:, :-1], params["lm_head"], out["tokens"][:, 1:], chunk_tokens=16,
                                       chunk_vocab=64)
        return np.asarray(lp)[:, 6:]

    with setup.context():
        out = make_generate(cfg, opts)(params, tokens, seg, pos, jax.random.key(1))
        quantized, unquantized = trainer_logp(cfg, out), trainer_logp(plain, out)
    sampled = np.asarray(out["logprobs"])
    np.testing.assert_allclose(sampled, quantized, rtol=0, atol=1e-5)
    assert np.max(np.abs(sampled - unquantized)) > 100 * 1e-5
