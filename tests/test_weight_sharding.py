"""Weights sharded over every mesh axis that does not already split them (parallel/rules.py).

8 simulated CPU devices as fsdp 2 x context 2 x expert 2: a dense weight is split 8 ways over its
FSDP dimension (the ranks that split a sequence or hold other experts are data-parallel for it), a
routed expert weight over its experts (expert) and its FSDP dimension (fsdp x context). Proofs:
the layout itself; the loss and every gradient against the layout that split weights over fsdp
alone (the previous default); the 1-byte fp8 expert gather, whose explicit all-gather now spans
two mesh axes, bit-identical to fake quantization without it; and the compiled step's per-device
argument bytes equal to the state's total over the devices, but for the small replicated leaves.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import TWO_LAYERS, packed_batch, tiny_config, tiny_params
from hybridmoe.model.params import is_spec
from hybridmoe.parallel import rules
from hybridmoe.parallel.rules import AxisRuleError, at_use_spec, logical_to_spec
from hybridmoe.run.setup import build
from hybridmoe.run.step import nll_sum

MESH = ("mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.expert=2", "gdn.chunk_size=32")
FSDP_ONLY = {**rules.DEFAULT_RULES, rules.FSDP_AXIS: "fsdp"}  # the layout before: weights over fsdp alone

# Claims of bit equality between two programs: the default CPU compiler's (tests/conftest.py).
pytestmark = pytest.mark.default_cpu_codegen


def test_the_layout_of_dense_expert_and_activation_arrays():
    with rules.use_rules(rules.DEFAULT_RULES):
        assert logical_to_spec(("embed", "heads", None)) == P(("fsdp", "context", "expert"), "tensor", None)
        assert logical_to_spec(("exp", "embed", "mlp")) == P("expert", ("fsdp", "context"), "tensor")
        assert logical_to_spec(("layers", "exp", "mlp", "embed")) == P(None, "expert", "tensor", ("fsdp", "context"))
        assert at_use_spec(("embed", "heads", None)) == P(None, "tensor", None)
        assert at_use_spec(("exp", "embed", "mlp")) == P("expert", None, "tensor")
        assert rules.gathered_at_use(("exp", "embed", "mlp")) == ((), ("fsdp", "context"), ())
        # Activations are placed as before: the FSDP dimension is a weight's.
        assert logical_to_spec(("batch", "seq", None)) == P(("data", "fsdp", "expert"), "context", None)
        with pytest.raises(AxisRuleError, match="'expert'"):
            logical_to_spec(("batch", "exp"))
        with pytest.raises(AxisRuleError, match="two dimensions"):
            logical_to_spec(("embed", "embed"))
    with rules.use_rules(rules.CP_AS_EP_RULES):  # experts over context x expert leave fsdp to the weight
        assert logical_to_spec(("exp", "embed", "mlp")) == P(("context", "expert"), "fsdp", "tensor")
        assert logical_to_spec(("vocab", "embed")) == P("tensor", ("fsdp", "context", "expert"))


def test_the_routed_experts_fsdp_split_on_their_expert_dimension():
    """mesh.expert_fsdp_dim=exp: wi and wo split E over expert, then the FSDP axes it leaves (minor,
    so the gather at use is over them); D stays whole; every other array is placed as before."""
    table = rules.rules_table("default", "exp")
    with rules.use_rules(table):
        assert logical_to_spec(("exp", "embed", "mlp")) == P(("expert", "fsdp", "context"), None, "tensor")
        assert logical_to_spec(("layers", "exp", "mlp", "embed")) == P(None, ("expert", "fsdp", "context"), "tensor", None)
        assert at_use_spec(("exp", "mlp", "embed")) == P("expert", "tensor", None)
        assert rules.gathered_at_use(("exp", "mlp", "embed")) == (("fsdp", "context"), (), ())
        assert logical_to_spec(("exp",)) == P("expert")  # the MoE layer's expert ranks
        assert logical_to_spec(("embed", "heads", None)) == P(("fsdp", "context", "expert"), "tensor", None)
        assert logical_to_spec(("embed", None)) == P(("fsdp", "context", "expert"), None)  # the router
        assert logical_to_spec(("batch", "seq", None)) == P(("data", "fsdp", "expert"), "context", None)
    with rules.use_rules(rules.rules_table("cp_as_ep", "exp")):
        assert logical_to_spec(("exp", "embed", "mlp")) == P(("context", "expert", "fsdp"), None, "tensor")
    assert rules.rules_table("default") is rules.DEFAULT_RULES
    # Each device's shard of a stacked wo [L, E, F, D] is whole experts with D whole (where the
    # default splits D, the TPU pads a narrow D shard to 128 lanes).
    cfg = tiny_config(*TWO_LAYERS, *MESH, "mesh.expert_fsdp_dim=exp")
    setup = build(cfg)
    wo_spec, wo_sharding = setup.specs["blocks"][0]["moe"]["wo"], setup.param_shardings["blocks"][0]["moe"]["wo"]
    L, E, F, D = wo_spec.shape
    assert wo_sharding.shard_shape(wo_spec.shape) == (L, E // 8, F, D)


@contextlib.contextmanager
def _default_rules(table):
    saved = rules.RULES_TABLES["default"]
    rules.RULES_TABLES["default"] = table
    try:
        yield
    finally:
        rules.RULES_TABLES["default"] = saved


def _loss_and_grads(cfg, params, batch, table=rules.DEFAULT_RULES):
    with _default_rules(table):
        setup = build(cfg)
    with setup.context():
        p = jax.device_put(params, setup.param_shardings)
        (loss, count), grads = jax.jit(jax.value_and_grad(lambda p, b: nll_sum(p, cfg, b), has_aux=True))(p, batch)
    return float(loss), int(count), jax.device_get(grads)


def _max_rel_err(a, b) -> float:
    errs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                  / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(errs)


@pytest.fixture(scope="module")
def batch():
    cfg = tiny_config(*TWO_LAYERS, *MESH)
    return packed_batch(3, cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size, doc_lengths=(32, 7, 25))


_ARMS: dict = {}  # one file runs on one worker: each arm is computed once and shared by the tests


def _arm(batch, extra=(), expert_fsdp_dim="embed", spread=False, table=None):
    """(loss, token count, gradients) of the tiny model on MESH with `extra` overrides; spread: the
    routed experts' channels and shards many binades apart (fp8_reference.spread_experts)."""
    from fp8_reference import spread_experts

    key = (extra, expert_fsdp_dim, spread, None if table is None else tuple(sorted(table.items())))
    if key not in _ARMS:
        cfg = tiny_config(*TWO_LAYERS, *MESH, *extra, f"mesh.expert_fsdp_dim={expert_fsdp_dim}")
        params = spread_experts(tiny_params(cfg), blocks=4) if spread else tiny_params(cfg)
        _ARMS[key] = _loss_and_grads(cfg, params, batch, rules.DEFAULT_RULES if table is None else table)
    return _ARMS[key]


GATHER8 = ("quant.fp8_moe_fake_quant=true", "quant.fp8_fake_quant_hoist=gather8")


def test_loss_and_gradients_equal_the_fsdp_only_layout(batch):
    """The same model on the same mesh with weights over fsdp x context x expert and over fsdp
    alone. Only where partial gradients are summed differs (one reduce-scatter over the 8 ranks
    instead of an all-reduce over context x expert and a reduce-scatter over fsdp): float32 sums in
    another order, so within 1e-5 of each leaf's largest entry, not bit for bit."""
    loss, count, grads = _arm(batch)
    loss_old, count_old, grads_old = _arm(batch, table=FSDP_ONLY)
    assert count == count_old > 0
    assert abs(loss - loss_old) <= 1e-6 * abs(loss_old), (loss, loss_old)
    err = _max_rel_err(grads, grads_old)
    assert err < 1e-5, f"gradients differ from the fsdp-only layout's by {err:.2e} of the leaf max"


def test_fp8_gather8_over_fsdp_and_context_is_bit_identical(batch):
    """gather8 all-gathers the 1-byte codes over both mesh axes of the expert weights' FSDP
    dimension (fsdp x context); against fake quantization without the hoist: the same bits (a
    gather in the wrong axis order, tests/broken_variants-style, permutes rows of wi/wo). The
    routed weights' output channels span 12 binades and their FSDP shards sit 12 binades apart
    (fp8_reference.spread_experts, one block per shard of the 4): a scale not reduced over both
    axes gives other bits."""
    loss_off, _, grads_off = _arm(batch, GATHER8[:1], spread=True)
    loss_g8, _, grads_g8 = _arm(batch, GATHER8, spread=True)
    assert loss_g8 == loss_off
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads_g8)[0], jax.tree.leaves(grads_off)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_experts_split_on_their_expert_dimension_give_the_same_loss_and_gradients(batch):
    """mesh.expert_fsdp_dim=exp against the lever off (embed), plain and with the 1-byte fp8 gather
    (whose all-gather then runs over the expert dimension): the same loss and the same gradient bits
    (the expert weights' partial gradients are reduce-scattered over E instead of D, and on this mesh
    the sums keep their order). A gather of the experts in the wrong mesh-axis order (context before
    fsdp: each rank's experts in another rank's slots) changes the gradients by 3.9 of a leaf's max."""
    from hybridmoe.quant import expert_fp8

    for extra, spread in [((), False), (GATHER8, True)]:
        loss_off, count_off, grads_off = _arm(batch, extra, spread=spread)
        loss_on, count_on, grads_on = _arm(batch, extra, "exp", spread=spread)
        assert count_on == count_off > 0 and loss_on == loss_off, (extra, loss_on, loss_off)
        err = _max_rel_err(grads_on, grads_off)
        assert err == 0.0, f"{extra}: gradients differ from the lever off's by {err:.2e} of the leaf max"

    def reversed_axes(x, stored, gathered):
        for dim, axes in enumerate(gathered):
            if axes:
                x = jax.lax.all_gather(x, axes[::-1], axis=dim, tiled=True, to="invarying")
        return x

    real_gather, expert_fp8._gather = expert_fp8._gather, reversed_axes
    try:
        cfg = tiny_config(*TWO_LAYERS, *MESH, *GATHER8, "mesh.expert_fsdp_dim=exp")
        from fp8_reference import spread_experts

        _, _, grads_bad = _loss_and_grads(cfg, spread_experts(tiny_params(cfg), blocks=4), batch)
    finally:
        expert_fp8._gather = real_gather
    bad = _max_rel_err(grads_bad, grads_off)
    assert bad > 1e-3, f"a gather in the wrong axis order is not caught: {bad:.2e} of the leaf max"


@pytest.fixture(scope="module")
def compiled_step():
    from hybridmoe.tools import train_program as tp

    cfg = tiny_config(*TWO_LAYERS, *MESH, "kernels.logprobs.chunk_tokens=16")  # 4 chunks of each device's 64 tokens
    return cfg, tp.compile_step(cfg, tp.host_target(), with_residuals=False)


def test_compiled_arguments_are_the_state_over_the_devices(compiled_step):
    """The compiled training step's per-device argument bytes are exactly the shardings' (state
    and batch); every weight with an FSDP dimension (and its optimizer moments) is split over all
    8 devices, the rest (norm scales, gates' biases, conv taps: no FSDP dimension) is replicated,
    so the state per device is its total over the devices but for those small leaves."""
    from hybridmoe.tools import train_program as tp

    cfg, step = compiled_step
    setup = build(cfg)
    state = setup.abstract_state()
    assert step.program.memory["argument"] == tp.shard_bytes(state) + tp.shard_bytes(tp.abstract_batch(cfg, setup))

    devices = setup.mesh.size
    nbytes = lambda a: math.prod(a.shape) * jnp.dtype(a.dtype).itemsize  # noqa: E731
    for spec, sharding in zip(jax.tree.leaves(setup.specs, is_leaf=is_spec), jax.tree.leaves(setup.param_shardings)):
        shard = math.prod(sharding.shard_shape(spec.shape))
        if rules.FSDP_AXIS in spec.axes:
            assert shard * devices == math.prod(spec.shape), (spec.shape, spec.axes, sharding.spec)
        else:
            assert sharding.is_fully_replicated, (spec.shape, spec.axes, sharding.spec)
    leaves = jax.tree.leaves(state)
    total = sum(nbytes(a) for a in leaves)
    replicated = sum(nbytes(a) for a in leaves if a.sharding.is_fully_replicated)
    assert tp.shard_bytes(state) == (total - replicated) // devices + replicated
    assert replicated < 0.05 * total, (replicated, total)


def test_the_lm_heads_chunk_loop_runs_on_each_devices_tokens(compiled_step):
    """The chunked LM head (model/forward.per_shard_token_logprobs) loops over the token chunks of
    each device's own rows and sequence shard: no array of the compiled step holds the global batch's
    tokens in one dimension (traced over the global batch, GSPMD gathered every token's hidden state
    onto every device before the chunk loop: 2 x 32 GiB per device at the 397B cell)."""
    from hybridmoe.analysis.program import _HLO_SHAPE, _TRIP

    cfg, step = compiled_step
    B, T, chunk = cfg.train.batch_size, cfg.train.seq_len, cfg.kernels.logprobs.chunk_tokens
    text = step.program.compiled_text
    global_tokens = {B * T, B * (T - 1)}
    dims = {int(d) for _, ds in _HLO_SHAPE.findall(text) for d in ds.split(",") if d}
    assert not dims & global_tokens, sorted(dims & global_tokens)
    # The chunk loops (forward, backward) run over one device's chunks, not the global batch's.
    trips = [int(n) for n in _TRIP.findall(text)]
    assert B * T // chunk not in trips, trips
    assert trips.count(B * T // 8 // chunk) >= 2, trips
