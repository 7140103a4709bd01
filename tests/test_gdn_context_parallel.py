"""Sequence-sharded GDN (docs/gdn.md section 3) and its scan keys gdn.cp_m_scan / gdn.cp_dh_scan.

- The GDN layer with the sequence split over 2, 4 and 8 context ranks equals the single-device
  layer (forward and every gradient), on rows that are one document and rows packed with
  documents that start inside a shard, on a shard edge and on a chunk edge.
- The scans equal a float32 HIGHEST tree (transition product and local state cotangent) within
  1e-5 relative to max; the broken variants (chunks in the wrong order, a document start that
  does not cut the chain) are caught with a margin of 10x.
- Program facts: the scan drops the tree's [chunks, heads, dk, dk] stack from the compiled
  temporaries; the remat names keep the backward from replaying the cross-rank prefix; keys off
  trace the program of a call without them.
- The validator names each key and every unmet requirement.
"""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TWO_LAYERS, tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.config.errors import ConfigError
from hybridmoe.kernels.gdn import context_parallel as cp
from hybridmoe.kernels.gdn.reference import document_starts
from hybridmoe.kernels.gdn.xla import ChunkInputs, chunk_terms, prepare_chunks
from hybridmoe.model.gdn import gdn_layer
from hybridmoe.run.setup import build

FAST_COMPILE = {"xla_backend_optimization_level": 0}
jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def _rel_max(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


# ---------------------------------------------------------------------------------------------
# The layer on 2, 4, 8 context ranks against one device.

TOKENS = 128  # 8 ranks x 16 tokens: one chunk of 16 per rank at 8 ranks


def _segment_ids(rows: int, tokens: int):
    """Row 0 one document; row 1 starts at 5 (inside a shard), 64 (every mesh's shard edge), 96 (a
    chunk edge at 2 ranks, a shard edge at 4 and 8) and 100; rows repeat the pair."""
    one = np.ones(tokens, np.int32)
    packed = np.ones(tokens, np.int32)
    for i, start in enumerate((5, 64, 96, 100)):
        packed[start:] = (3, 1, 2, 4)[i]
    return jnp.asarray(np.stack([one, packed] * (rows // 2)), jnp.int32)


def _layer_loss(cfg, chunk_size, cp_m_scan=False, cp_dh_scan=False, cp_prefix="all_gather", **core_options):
    rng = np.random.default_rng(7)

    def loss(p, x, seg):
        y = gdn_layer(p, x, seg, cfg.model, chunk_size=chunk_size, cp_m_scan=cp_m_scan, cp_dh_scan=cp_dh_scan,
                      cp_prefix=cp_prefix, **core_options)
        weight = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
        return jnp.sum(y * weight)

    return loss


@pytest.fixture(scope="module")
def layer_case():
    cfg = tiny_config()
    params = jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["mixer"])
    x = jax.random.normal(jax.random.key(2), (8, TOKENS, cfg.model.d_model), jnp.float32)
    seg = _segment_ids(8, TOKENS)
    return cfg, params, x, seg


def _on_context_mesh(ranks, fn, *args, overrides=()):
    cfg = tiny_config(f"mesh.context={ranks}", "mesh.fsdp=1", "mesh.data=-1", f"train.seq_len={TOKENS}",
                      "gdn.chunk_size=16", *overrides)
    setup = build(cfg)
    with setup.context():
        return fn(*args)


@pytest.fixture(scope="module")
def single_device(layer_case):
    cfg, params, x, seg = layer_case
    return {chunk: jit(jax.value_and_grad(_layer_loss(cfg, chunk), argnums=(0, 1)))(params, x, seg)
            for chunk in (16,)}


LAYER_CASES = {  # name: (ranks, chunk size, cp_m_scan, cp_dh_scan, cross-rank prefix)
    "2 ranks": (2, 16, False, False, "all_gather"),
    "4 ranks": (4, 16, False, False, "all_gather"),
    "8 ranks": (8, 16, False, False, "all_gather"),
    "4 ranks, both scans": (4, 16, True, True, "all_gather"),
    "8 ranks, ppermute prefix": (8, 16, False, False, "ppermute"),
}
SLOW_LAYER_CASES = ("2 ranks", "8 ranks")  # 4 and 8 cross more shard edges; 2 adds no path of its own


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_LAYER_CASES else c
                                  for c in LAYER_CASES])
def test_sequence_sharded_layer_equals_one_device(case, layer_case, single_device):
    ranks, chunk, cp_m_scan, cp_dh_scan, prefix = LAYER_CASES[case]
    cfg, params, x, seg = layer_case
    loss = _layer_loss(cfg, chunk, cp_m_scan, cp_dh_scan, prefix)
    value, grads = _on_context_mesh(ranks, jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, seg)
    value_1, grads_1 = single_device[chunk]
    errors = {"loss": _rel_max(value, value_1)}
    for (path, g), g_1 in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_1)):
        errors[jax.tree_util.keystr(path)] = _rel_max(g, g_1)
    # docs/gdn.md section 5: context-parallel vs not, 3e-3 in the field; float32 here lands near 1e-6.
    assert max(errors.values()) < 1e-4, errors


def test_cross_rank_document_start_is_needed(layer_case, single_device, monkeypatch):
    """Broken variant: a document that starts on a shard edge does not cut the chain across ranks."""
    cfg, params, x, seg = layer_case
    monkeypatch.setattr(cp, "cross_rank_starts", lambda starts, seg, axis: starts)
    value, _ = _on_context_mesh(4, jit(jax.value_and_grad(_layer_loss(cfg, 16), argnums=(0, 1))), params, x, seg)
    assert _rel_max(value, single_device[16][0]) > 1e-3


# ---------------------------------------------------------------------------------------------
# The scans against the float32 HIGHEST tree, and the broken variants.

SCAN_CHUNK = 64


@pytest.fixture(scope="module")
def scan_terms():
    """Terms of 4 chunks of 64 (dims 16) with long-memory gates; row 1 packed (starts at 70 and 192)."""
    rng = np.random.default_rng(11)
    B, T, G, H, K, V = 2, 4 * SCAN_CHUNK, 1, 2, 16, 16
    q, k = (jnp.asarray(rng.normal(size=(B, T, G, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    g = jnp.asarray(np.log(rng.uniform(0.995, 1.0, size=(B, T, H))), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.01, 0.1, size=(B, T, H)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[1, 70:], seg[1, 192:] = 2, 3
    starts = document_starts(jnp.asarray(seg))
    x, starts_BNC = prepare_chunks(q, k, v, g, beta, starts, SCAN_CHUNK, True)
    do = jnp.asarray(rng.normal(size=x.v.shape), jnp.float32)
    return jit(chunk_terms)(x, starts_BNC), do


# The scans' two implementations: the XLA loop (CPU's) and the Mosaic kernels (a TPU's), interpreted.
SCAN_IMPLS = {"xla": dict(pallas=False), "pallas": dict(pallas=True, interpret=True)}


def _scan(which, impl):
    opts = SCAN_IMPLS[impl]
    if which == "m":
        return lambda t, do: cp.cp_m_scan_product(t, **opts)
    return lambda t, do: cp.cp_dh_scan_cotangent(t, do, **opts)


def _chunks_in_wrong_order(t, do):
    """Broken: the chunks walked in the wrong order (M: composed earliest-on-the-left, M_0 M_1 ...
    instead of ... M_1 M_0; dh: the reverse recurrence run front to back)."""
    flip = lambda a: a[:, ::-1]  # noqa: E731
    return jax.tree.map(flip, t), flip(do)


def _ignoring_starts(t, do):
    """Broken: the chunk decay of a chunk holding a document start is not zeroed (the chain is not cut)."""
    return t._replace(decay=jnp.where(t.decay == 0.0, 1.0, t.decay)), do


BROKEN_SCANS = {"chunks in the wrong order": _chunks_in_wrong_order,
                "a document start not cutting the chain": _ignoring_starts}


def _tree(terms, do, which):
    return jit(cp.cp_m_tree_product)(terms) if which == "m" else jit(cp.cp_dh_tree_cotangent)(terms, do)


@pytest.fixture(scope="module")
def trees_and_scans(scan_terms):
    terms, do = scan_terms
    return {(which, impl): (_tree(terms, do, which), jit(_scan(which, impl))(terms, do))
            for which in ("m", "dh") for impl in SCAN_IMPLS}


@pytest.mark.parametrize("impl", list(SCAN_IMPLS))
@pytest.mark.parametrize("which", ["m", "dh"])
def test_cp_m_scan_and_cp_dh_scan_equal_the_highest_tree(which, impl, trees_and_scans):
    tree, scan = trees_and_scans[which, impl]
    assert np.abs(np.asarray(tree)).max() > 1e-2  # long-memory gates: the product is not ~0
    assert _rel_max(scan, tree) < 1e-5, _rel_max(scan, tree)


@pytest.mark.parametrize("impl", list(SCAN_IMPLS))
@pytest.mark.parametrize("which", ["m", "dh"])
@pytest.mark.parametrize("variant", list(BROKEN_SCANS))
def test_cp_m_scan_and_cp_dh_scan_broken_variants_are_caught(variant, which, impl, scan_terms, trees_and_scans):
    terms, do = scan_terms
    tree, scan = trees_and_scans[which, impl]
    clean = _rel_max(scan, tree)
    broken = _rel_max(jit(lambda t, d: _scan(which, impl)(*BROKEN_SCANS[variant](t, d)))(terms, do), tree)
    assert broken > 10 * max(clean, 1e-5), f"clean {clean:.2e}, broken {broken:.2e}"


def shard_inputs(rng, chunks: int, chunk: int, *, gate_low: float, beta: tuple[float, float]):
    """float32 (q, k, v, g, beta) of one shard of 2 rows (dims 16, 1 key head, 2 value heads) with
    gates in [log gate_low, 0], and its document starts: row 1 holds a start 5 tokens into its second
    chunk."""
    B, T, G, H, K, V = 2, chunks * chunk, 1, 2, 16, 16
    q, k = (jnp.asarray(rng.normal(size=(B, T, G, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    g = jnp.asarray(np.log(rng.uniform(gate_low, 1.0, size=(B, T, H))), jnp.float32)
    b = jnp.asarray(rng.uniform(*beta, size=(B, T, H)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[1, chunk + 5:] = 2
    return (q, k, v, g, b), document_starts(jnp.asarray(seg))


def _odd_terms(chunks: int):
    """Terms of an odd number of chunks of 64 (dims 16), long-memory gates; row 1 holds a document
    start in its second chunk (its transition product is then the chunks' after it alone)."""
    rng = np.random.default_rng(20 + chunks)
    inputs, starts = shard_inputs(rng, chunks, SCAN_CHUNK, gate_low=0.995, beta=(0.01, 0.1))
    x, starts_BNC = prepare_chunks(*inputs, starts, SCAN_CHUNK, True)
    return jit(chunk_terms)(x, starts_BNC), jnp.asarray(rng.normal(size=x.v.shape), jnp.float32)


def _check_odd_chunk_counts():
    """At 3 and 5 chunks a shard (the tree pads its odd leftover with the identity), the tree and
    both scans agree; returns the largest disagreement."""
    worst = 0.0
    for chunks in (3, 5):
        terms, do = _odd_terms(chunks)
        for which in ("m", "dh"):
            tree = _tree(terms, do, which)
            assert np.abs(np.asarray(tree)).max() > 1e-2
            for impl in SCAN_IMPLS:
                err = _rel_max(jit(_scan(which, impl))(terms, do), tree)
                assert err < 1e-5, (chunks, which, impl, err)
                worst = max(worst, err)
    return worst


def test_cp_scans_and_trees_agree_at_odd_chunk_counts():
    _check_odd_chunk_counts()


def test_a_tree_that_drops_the_odd_chunk_is_caught(monkeypatch):
    """Broken: the pairwise fold drops the odd leftover instead of pairing it with the identity."""
    def dropping(items_N, combine, identity):
        while items_N[0].shape[0] > 1:
            n = items_N[0].shape[0] // 2 * 2
            items_N = combine(tuple(a[0:n:2] for a in items_N), tuple(a[1:n:2] for a in items_N))
        return tuple(a[0] for a in items_N)

    monkeypatch.setattr(cp, "_fold_pairs", dropping)
    jax.clear_caches()  # the trees traced with the clean fold are not reused
    try:
        with pytest.raises(AssertionError):
            _check_odd_chunk_counts()
    finally:
        jax.clear_caches()


def test_cp_scans_are_mosaic_kernels_on_a_tpu_and_loops_elsewhere(scan_terms):
    """The scans' implementation follows the traced program's platform (kernels/platform.py): the
    Mosaic kernels where it is a TPU, the XLA loop on this CPU host."""
    from hybridmoe.analysis.program import iter_eqns

    terms, do = scan_terms

    def calls(fn, *args):  # a new function each time: no trace cached from the other platform
        jaxpr = jax.make_jaxpr(lambda *a: fn(*a))(*args)
        return sorted(e.params["name"] for e in iter_eqns(jaxpr) if e.primitive.name == "pallas_call")

    assert calls(cp.cp_m_scan_product, terms) == [] and calls(cp.cp_dh_scan_cotangent, terms, do) == []
    with mock.patch.object(cp, "trace_platform", lambda: "tpu"):
        assert calls(cp.cp_m_scan_product, terms) == ["gdn_cp_m_scan"]
        assert calls(cp.cp_dh_scan_cotangent, terms, do) == ["gdn_cp_dh_scan"]


def test_cp_m_scan_drops_the_transition_stack_from_compiled_temporaries():
    """Program fact: the tree materialises [N, B, H, K, K] float32; the scan keeps one [B, H, K, K].

    Compiled only (abstract inputs), at dk 128 where the stack outweighs the chunk inputs.
    """
    batch, chunks, heads, chunk, key_dim = 1, 16, 4, 64, 128
    shapes = [(batch, chunks, heads, chunk, key_dim)] * 2 + [(batch, chunks, heads, chunk, chunk)] + [
        (batch, chunks, heads, chunk, key_dim)] * 2 + [(batch, chunks, heads)]
    terms = cp.ChunkTerms(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    stack_bytes = chunks * batch * heads * key_dim * key_dim * 4
    tree_temp = program.analyze(jax.jit(cp.cp_m_tree_product), terms).temp_bytes
    scan_temp = program.analyze(jax.jit(cp.cp_m_scan_product), terms).temp_bytes
    assert tree_temp >= stack_bytes, (tree_temp, stack_bytes)
    assert scan_temp < stack_bytes // 4, (scan_temp, stack_bytes)


# ---------------------------------------------------------------------------------------------
# Program facts of the layer: remat names, keys off.


def _cp_layer_jaxpr(cfg, params, x, seg, **keys):
    loss = lambda p, x: _layer_loss(cfg, 16, **keys)(p, x, seg)  # noqa: E731
    return _on_context_mesh(4, lambda: str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)))


def test_cp_m_scan_and_cp_dh_scan_off_trace_the_program_without_them(layer_case):
    cfg, params, x, seg = layer_case
    without = _on_context_mesh(4, lambda: str(jax.make_jaxpr(jax.grad(
        lambda p, x: jnp.sum(gdn_layer(p, x, seg, cfg.model, chunk_size=16)), argnums=(0, 1)))(params, x)))
    off = _on_context_mesh(4, lambda: str(jax.make_jaxpr(jax.grad(
        lambda p, x: jnp.sum(gdn_layer(p, x, seg, cfg.model, chunk_size=16, cp_m_scan=False, cp_dh_scan=False)),
        argnums=(0, 1)))(params, x)))
    on = _on_context_mesh(4, lambda: str(jax.make_jaxpr(jax.grad(
        lambda p, x: jnp.sum(gdn_layer(p, x, seg, cfg.model, chunk_size=16, cp_m_scan=True, cp_dh_scan=True)),
        argnums=(0, 1)))(params, x)))
    assert off == without
    assert on != off


@pytest.mark.parametrize("saved, replayed_gathers", [((), 2), (("gdn_cp_transition", "gdn_cp_state_in"), 0)])
def test_remat_names_keep_the_prefix_out_of_the_replay(layer_case, saved, replayed_gathers):
    """Under remat, saving M_r and S_in_r by name removes pass 1's all-gathers from the backward."""
    cfg, params, x, seg = layer_case
    policy = jax.checkpoint_policies.save_only_these_names(*saved)

    def loss(p, x):
        layer = jax.checkpoint(lambda p, x: gdn_layer(p, x, seg, cfg.model, chunk_size=16), policy=policy)
        return jnp.sum(layer(p, x) ** 2)

    text = _on_context_mesh(4, lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text())
    gathers = program.count(program.parse_stablehlo(text), kind="all-gather")
    # Forward: M and S_ext gathered (2); backward: the reverse prefix's M and dS_loc (2); the replay
    # of an unsaved forward: pass 1's two again.
    assert gathers == 4 + replayed_gathers, gathers


# ---------------------------------------------------------------------------------------------
# Long sequences in bfloat16: the state chain across ranks stays float32 (docs/gdn.md section 3:
# every cross-chunk and cross-rank product stays in float32; a bfloat16 chain is the drift another
# project found inflating its RL trainer/sampler KL). Measured: benchmarks/bf16_gaps.py.


def chain_collectives(layer_case) -> list:
    """The collectives of a bfloat16 GDN layer's value and gradient on 4 ranks that carry the state
    chain ([.., dk, dk] transitions, [.., dk, dv] states and their cotangents), from the lowered program."""
    cfg, params, x, seg = layer_case
    m = tiny_config("model.compute_dtype=bfloat16").model
    loss = lambda p, x: jnp.sum(gdn_layer(p, x, seg, m, chunk_size=16).astype(jnp.float32))  # noqa: E731
    text = _on_context_mesh(4, lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x.astype(jnp.bfloat16))
                            .as_text())
    k, v = m.gdn_key_dim, m.gdn_value_dim
    return [c for c in program.parse_stablehlo(text) if len(c.shape) >= 4 and tuple(c.shape[-2:]) in ((k, k), (k, v))]


def test_cross_rank_state_chain_is_float32_in_a_bfloat16_layer(layer_case):
    chain = chain_collectives(layer_case)
    # Forward: M_r and S_ext_r gathered; backward: M_r and dS_loc (the replay of pass 1: two more).
    assert len(chain) >= 4, chain
    assert {c.dtype for c in chain} == {"f32"}, [(c.dtype, c.shape) for c in chain]


def test_a_bfloat16_chain_is_caught(layer_case, monkeypatch):
    """Broken variant: the prefix's payload gathered in bfloat16 (what the program test must see)."""
    from broken_variants import mutated
    monkeypatch.setattr(cp, "exclusive_prefix_all_gather", mutated(
        cp, "exclusive_prefix_all_gather", "a_PBHKK = lax.all_gather(a_BHKK, axis_name)\n    b_PBHKV = lax.all_gather(b_BHKV, axis_name)",
        "a_PBHKK = lax.all_gather(a_BHKK.astype(jnp.bfloat16), axis_name).astype(a_BHKK.dtype)\n"
        "    b_PBHKV = lax.all_gather(b_BHKV.astype(jnp.bfloat16), axis_name).astype(b_BHKV.dtype)"))
    assert "bf16" in {c.dtype for c in chain_collectives(layer_case)}


# ---------------------------------------------------------------------------------------------
# The validator.


def test_validator_names_each_scan_key_and_every_requirement():
    with pytest.raises(ConfigError) as err:
        tiny_config("gdn.cp_m_scan=true", "gdn.cp_dh_scan=true", "gdn.chunk_size=32",
                    "model.layer_pattern=[attention]", "model.num_layers=2")
    problems = dict(err.value.problems)
    for key in ("gdn.cp_m_scan", "gdn.cp_dh_scan"):
        assert "needs GDN layers" in problems[key]
        assert "mesh.context > 1" in problems[key]
        assert "gdn.chunk_size=64" in problems[key]


def test_validator_accepts_the_scans_with_sequence_sharding_and_refuses_partial_chunks():
    tiny_config("mesh.context=2", "mesh.fsdp=1", "mesh.data=-1", "mesh.cpu_devices=8", "train.seq_len=128",
                "gdn.cp_m_scan=true", "gdn.cp_dh_scan=true")
    with pytest.raises(ConfigError) as err:
        tiny_config("mesh.context=4", "mesh.fsdp=1", "mesh.data=-1", "train.seq_len=128")
    assert "gdn.chunk_size" in dict(err.value.problems)


# ---------------------------------------------------------------------------------------------
# The whole model: sequence-sharded GDN next to context-parallel attention.


@pytest.fixture(scope="module")
def model_case():
    from helpers import packed_batch

    # One layer of each mixer (helpers.TWO_LAYERS): the GDN layer's sequence split is what the
    # whole model adds to the layer tests above; tiny's three GDN layers only added to each compile.
    overrides = ("gdn.chunk_size=16", "train.seq_len=128", *TWO_LAYERS)
    cfg = tiny_config(*overrides)
    params = tiny_params(cfg)
    # Documents of 32, 64, 9 and 23 tokens, packed first fit: rows of four 32s and of two 64s start
    # documents exactly on the 4-rank shard edges (32, 64, 96) and carry the 64s' state across
    # edges 32 and 96; the 9s and 23s start inside shards.
    batch = packed_batch(3, 8, TOKENS, cfg.model.vocab_size, doc_lengths=(32, 64, 9, 23))
    starts = {int(t) for t in np.argwhere(np.diff(np.asarray(batch["segment_ids"]), axis=1) != 0)[:, 1] + 1}
    assert {32, 64, 96} <= starts and starts - {32, 64, 96}, starts
    return overrides, params, batch, _model_loss_and_grads(cfg, params, batch)


def _model_loss_and_grads(cfg, params, batch):
    from hybridmoe.run.step import nll_sum

    return jit(jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0]))(params)


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_whole_model_with_context_parallelism_equals_one_device(ranks, model_case):
    overrides, params, batch, (loss_1, grads_1) = model_case
    cfg = tiny_config(f"mesh.context={ranks}", "mesh.fsdp=1", "mesh.data=-1", *overrides)
    setup = build(cfg)
    with setup.context():
        sharded_batch = jax.device_put(batch, jax.tree.map(lambda _: setup.batch_sharding(0), batch))
        loss, grads = _model_loss_and_grads(cfg, jax.device_put(params, setup.param_shardings), sharded_batch)
    errors = {"loss": _rel_max(loss, loss_1)}
    for (path, g), g_1 in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_1)):
        errors[jax.tree_util.keystr(path)] = _rel_max(g, g_1)
    assert max(errors.values()) < 1e-4, {k: f"{v:.1e}" for k, v in errors.items() if v >= 1e-4}
