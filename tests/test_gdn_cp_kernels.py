"""gdn.cp_terms_in_kernel: sequence-sharded GDN whose pass 1 and local state cotangent are Mosaic kernels
on the core's own layout (kernels/gdn/pallas_tpu_cp.py), run interpreted on 4 simulated context ranks.

- The layer equals the single-device XLA layer (forward and every gradient):
  test_gdn_pallas.test_sequence_sharded_layer_with_pallas_core_equals_one_device["terms in kernel"].
- Broken variants of the two kernels, each caught against the same reference with a margin of 10x.
- Program facts: the kernels read each key head once and the step forms no chunk terms in XLA (no
  pass-1 loop, no CP scan kernel, no per-value-head copy of the keys); the remat names keep the
  cross-rank prefix out of the backward's replay.
- kernels.gdn.precision reaches the kernels; the validator names every unmet requirement.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from helpers import tiny_config
from hybridmoe.analysis import program
from hybridmoe.analysis.program import iter_eqns
from hybridmoe.config.errors import ConfigError
from hybridmoe.kernels.gdn import pallas_tpu_cp, tpu_chunk
from hybridmoe.model.gdn import gdn_layer
from tests.test_gdn_context_parallel import (_layer_loss, _on_context_mesh, _rel_max, layer_case,  # noqa: F401
                                             shard_inputs, single_device)
from tests.test_gdn_pallas import _sharded_pallas_errors

KEYS = dict(backend="pallas_tpu", interpret=True, cp_terms_in_kernel=True)

_ORIGINAL = {"chain": tpu_chunk._state_chain_step, "specs": pallas_tpu_cp.block_specs,
             "cotangent_step": tpu_chunk.state_cotangent_step}


def _walked_front_to_back(chunks, inverses, d_outs, d_states, precision):
    """The local cotangent's chunks of a grid step walked first to last (its chain is a reverse one)."""
    return _ORIGINAL["cotangent_step"](chunks[::-1], inverses[::-1], d_outs[::-1], d_states, precision)


def _transition_sign_flipped(t, items, k_CK, states, precision, *, values=True):
    """The transition chain adds K_bwd^T W M instead of subtracting it (M_c = c I + K_bwd^T W)."""
    v_new, ends = _ORIGINAL["chain"](t, items, k_CK, states, precision, values=values)
    if values:
        return v_new, ends
    return v_new, [2.0 * t.decays[i].chunk * s - e for i, s, e in zip(items, states, ends)]


BROKEN = {  # name: [(module, attribute, the broken function)]
    "transition product started from zero": [(pallas_tpu_cp, "_identity", lambda size: jnp.zeros((size, size)))],
    "transition chain sign flipped": [(tpu_chunk, "_state_chain_step", _transition_sign_flipped)],
    "local cotangent walked front to back within a step": [(tpu_chunk, "state_cotangent_step", _walked_front_to_back)],
    "local cotangent dropped": [(pallas_tpu_cp, "local_state_cotangent",
                                 lambda q, k, g, beta, inverses, do, settings: jnp.zeros(
                                     (*do.shape[:3], q.rows.shape[-1], do.shape[-1]), jnp.float32))],
}


@pytest.fixture(scope="module")
def clean_errors(layer_case, single_device):
    return _sharded_pallas_errors(layer_case, single_device, cp_terms_in_kernel=True)


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_cp_kernels_are_caught(variant, layer_case, single_device, clean_errors, monkeypatch):
    for module, attribute, broken in BROKEN[variant]:
        monkeypatch.setattr(module, attribute, broken)
    jax.clear_caches()  # nothing traced with the clean kernels is reused
    try:
        broken_errors = _sharded_pallas_errors(layer_case, single_device, cp_terms_in_kernel=True)
    finally:
        jax.clear_caches()
    clean, worst = max(clean_errors.values()), max(broken_errors.values())
    print(f"{variant}: clean {clean:.2e}, broken {worst:.2e}")
    assert worst > 10 * clean and worst > 1e-3, (variant, clean, broken_errors)


def _grad_jaxpr(layer_case, saved=None, chunk_size=16, **keys):
    cfg, params, x, seg = layer_case

    def loss(p, x):
        layer = lambda p, x: gdn_layer(p, x, seg, cfg.model, chunk_size=chunk_size, **keys)  # noqa: E731
        if saved is not None:
            layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names(*saved))
        return jnp.sum(layer(p, x) ** 2)

    return _on_context_mesh(4, lambda: jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x))


def test_the_kernels_read_each_key_head_once_and_xla_forms_no_chunk_terms(layer_case):
    """The step's Mosaic calls are the two CP kernels and the chunk kernels, each reading q and k as
    [B, G, T, K]; the traced program holds no loop over chunks, no CP scan kernel and no array in
    the chunk-terms layout [B, N, H, C, K] (chunks of 8: 4 per rank, so no kernel layout shares the
    shape), which the chunk-terms path of the same layer does form (the check can fail)."""
    cfg, params, x, seg = layer_case
    m = cfg.model
    chunk, per_rank = 8, x.shape[1] // 4 // 8
    jaxpr = _grad_jaxpr(layer_case, chunk_size=chunk, **KEYS)
    calls = [e for e in iter_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert sorted(e.params["name"] for e in calls) == [
        "gdn_chunk_backward", "gdn_chunk_forward", "gdn_cp_local_cotangent", "gdn_cp_transition"]
    for e in calls:
        if e.params["name"] != "gdn_cp_transition":  # the transition reads no q: k first
            assert e.invars[0].aval.shape[1:] == (m.gdn_num_key_heads, x.shape[1] // 4, m.gdn_key_dim), e.params["name"]
    assert not [e for e in iter_eqns(jaxpr) if e.primitive.name in ("while", "scan")]

    def chunk_layout(jaxpr):
        return [v.aval.shape for e in iter_eqns(jaxpr) for v in e.outvars
                if getattr(v.aval, "shape", ())[1:] == (per_rank, m.gdn_num_value_heads, chunk, m.gdn_key_dim)]

    assert not chunk_layout(jaxpr), chunk_layout(jaxpr)
    xla_terms = _grad_jaxpr(layer_case, chunk_size=chunk, backend="pallas_tpu", interpret=True)
    assert chunk_layout(xla_terms) and any(e.primitive.name in ("while", "scan") for e in iter_eqns(xla_terms))


@pytest.mark.parametrize("saved, replayed", [((), 1), (("gdn_cp_transition", "gdn_cp_state_in"), 0)])
def test_remat_names_keep_pass_1_out_of_the_replay(layer_case, saved, replayed):
    """As on the chunk-terms path: saving M_r and S_in_r by name removes pass 1 from the backward's
    replay: its all-gathers (two) and its transition kernel, counted in the lowered program."""
    cfg, params, x, seg = layer_case
    policy = jax.checkpoint_policies.save_only_these_names(*saved)

    def loss(p, x):
        layer = jax.checkpoint(lambda p, x: gdn_layer(p, x, seg, cfg.model, chunk_size=16, **KEYS), policy=policy)
        return jnp.sum(layer(p, x) ** 2)

    text = _on_context_mesh(4, lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text())
    gathers = program.count(program.parse_stablehlo(text), kind="all-gather")
    # Forward: M and S_ext gathered (2); backward: the reverse prefix's M and dS_loc (2); a replay: 2 more.
    assert gathers == 4 + 2 * replayed, gathers
    assert text.count("gdn_cp_transition") == text.count("gdn_cp_local_cotangent") * (1 + replayed), (
        text.count("gdn_cp_transition"), text.count("gdn_cp_local_cotangent"))


def test_precision_reaches_the_cp_kernels(layer_case, monkeypatch):
    """kernels.gdn.precision under gdn.cp_terms_in_kernel: every kernel of the layer runs at the one
    asked for (None: the default for the inputs' dtype, float32 here)."""
    seen = []
    for name in ("transition", "local_state_cotangent"):
        original = getattr(pallas_tpu_cp, name)
        monkeypatch.setattr(pallas_tpu_cp, name,
                            lambda *a, _f=original: (seen.append(a[-1].precision), _f(*a))[1])
    for precision, want in (("bfloat16", "bfloat16"), (None, "float32")):
        seen.clear()
        _grad_jaxpr(layer_case, precision=precision or "auto", **KEYS)
        assert len(seen) == 2 and set(seen) == {want}, (precision, seen)


VALIDATOR_CASES = {  # overrides: the words the refusal must hold
    ("mesh.context=1",): ["mesh.context > 1"],
    ("mesh.context=2", "kernels.gdn.backend=xla"): ["kernels.gdn.backend is xla"],
    ("mesh.context=2", "kernels.gdn.backend=pallas_tpu", "kernels.interpret=true", "gdn.cp_m_scan=true"):
        ["gdn.cp_m_scan nothing to do"],
}


@pytest.mark.parametrize("overrides", list(VALIDATOR_CASES))
def test_validator_names_each_unmet_requirement(overrides):
    with pytest.raises(ConfigError) as e:
        tiny_config("gdn.cp_terms_in_kernel=true", "mesh.fsdp=1", "mesh.data=-1", "train.seq_len=128",
                    "gdn.chunk_size=16", *overrides)
    text = str(e.value)
    assert "gdn.cp_terms_in_kernel" in text and all(w in text for w in VALIDATOR_CASES[overrides]), text


def test_validator_accepts_the_key_where_it_applies():
    cfg = tiny_config("gdn.cp_terms_in_kernel=true", "mesh.context=2", "mesh.fsdp=1", "mesh.data=-1",
                      "train.seq_len=128", "gdn.chunk_size=16", "kernels.gdn.backend=pallas_tpu", "kernels.interpret=true")
    assert cfg.gdn.cp_terms_in_kernel


# ---------------------------------------------------------------------------------------------
# The kernels alone, over several grid steps, against the XLA path's float32 HIGHEST trees.

C, CHUNKS = 16, 4


@pytest.fixture(scope="module")
def shard_case():
    """One shard of 4 chunks of 16 (dims 16, 1 key head, 2 value heads), long-memory gates; row 1
    holds a document start inside its second chunk: the kernels' results (one chunk per grid step,
    so every carry crosses a step) and the XLA trees' over the same chunk terms."""
    import numpy as np

    from hybridmoe.kernels.gdn import context_parallel as cp, pallas_tpu
    from hybridmoe.kernels.gdn.xla import chunk_start_states, chunk_terms, from_chunks, prepare_chunks

    rng = np.random.default_rng(5)
    (q, k, v, g, beta), starts = shard_inputs(rng, CHUNKS, C, gate_low=0.97, beta=(0.05, 0.3))
    B, G, H, K, V = q.shape[0], q.shape[2], v.shape[2], q.shape[3], v.shape[3]
    x, starts_BNC = prepare_chunks(q, k, v, g, beta, starts, C, True)
    t = chunk_terms(x, starts_BNC)
    do_BNHCV = jnp.asarray(rng.normal(size=x.v.shape), jnp.float32)
    trees = {"end state": chunk_start_states(t, jnp.zeros((B, H, K, V)))[1], "transition": cp.cp_m_tree_product(t),
             "local cotangent": cp.cp_dh_tree_cotangent(t, do_BNHCV)}

    def kernels(token_major=False):
        settings, inputs = pallas_tpu.prepared(q, k, v, g, beta, starts, jnp.zeros((B, H, K, V)), chunk_size=C,
                                               normalize_qk=True, interpret=True, chunks_per_step=1,
                                               token_major=token_major)
        end, transition = pallas_tpu_cp.transition(*inputs[1:5], settings)
        _, _, _, inverses = pallas_tpu.forward(*inputs, settings, save=True)
        do_BTHV = from_chunks(do_BNHCV)
        do = (do_BTHV.reshape(B, -1, H * V) if token_major
              else jnp.moveaxis(pallas_tpu.split_value_heads(do_BTHV, 2, G), 1, 3))
        local = pallas_tpu_cp.local_state_cotangent(inputs[0], inputs[1], inputs[3], inputs[4], inverses, do, settings)
        merge = lambda a: pallas_tpu.merge_value_heads(a, 1)  # noqa: E731
        return {"end state": merge(end), "transition": merge(transition), "local cotangent": merge(local)}

    return trees, kernels


@pytest.mark.parametrize("token_major", [False, True], ids=["transposed layout", "token-major blocks"])
@pytest.mark.parametrize("which", ["end state", "transition", "local cotangent"])
def test_cp_kernels_over_several_grid_steps_equal_the_highest_trees(which, token_major, shard_case):
    trees, kernels = shard_case
    got = jax.jit(functools.partial(kernels, token_major))()[which]
    assert float(jnp.abs(trees[which]).max()) > 1e-2  # long-memory gates: nothing is ~0
    assert _rel_max(got, trees[which]) < 1e-5, _rel_max(got, trees[which])


STEP_BROKEN = {  # name: (result checked, [(module, attribute, the broken function)])
    "local cotangent's grid steps walked front to back": (
        "local cotangent", [(pallas_tpu_cp, "block_specs", lambda d, reverse: _ORIGINAL["specs"](d, False))]),
    "transition product not carried across grid steps": (
        "transition", [(tpu_chunk, "transition_step",
                        lambda chunks, states, products, p: _ORIGINAL["transition"](
                            chunks, states, [jnp.eye(products[0].shape[0]) for _ in products], p))]),
}
_ORIGINAL["transition"] = tpu_chunk.transition_step


@pytest.mark.parametrize("variant", list(STEP_BROKEN))
def test_broken_carries_across_grid_steps_are_caught(variant, shard_case, monkeypatch):
    trees, kernels = shard_case
    which, patches = STEP_BROKEN[variant]
    clean = _rel_max(jax.jit(lambda: kernels())()[which], trees[which])
    for module, attribute, broken in patches:
        monkeypatch.setattr(module, attribute, broken)
    broken = _rel_max(jax.jit(lambda: kernels())()[which], trees[which])  # a new function: traced again
    assert broken > 10 * max(clean, 1e-6), f"clean {clean:.2e}, broken {broken:.2e}"


@pytest.mark.parametrize("arm", ["pallas_tpu", "pallas_tpu_token_major"])
def test_the_chip_case_runs_two_ranks_against_the_whole_sequences_reference(arm):
    """tools/chip_cases.py's gdn_cp at `tiny` (interpreted): the two ranks mapped by vmap, each taking its
    gradients inside the map, give the whole sequence's output and gradients of the float32 recurrence
    over it within the bf16 inputs' error (3.1e-3 measured; a rank given the other's shard, or a
    prefix that passes nothing across, is off by more than 1e-1); the kernels on the transposed
    layouts and on blocks of the token-major arrays."""
    from hybridmoe.tools import chip_cases as cc

    (case,) = cc.cases("tiny", interpret=True, families=["gdn_cp"]).values()
    reference = case.reference()
    built = case.backends[arm]()
    fn, args = built.fwd_bwd
    error = cc.relative_error(case.view(built.restore(fn(*args), True), backward=True), reference.fwd_bwd)
    assert case.shape["ranks"] == 2 and error < 1e-2, error
