"""Context-parallel attention equals the unsharded layer; load balancing evens the causal work.

8 simulated CPU devices. The attention layer runs on meshes whose context axis splits the
sequence 2, 4 and 8 ways (queries sharded, keys and values all-gathered), in natural and in
load-balanced order, packed (segment ids) and unpacked, against the same layer without a mesh:
output and every gradient (weights and input).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TWO_LAYERS, assert_rel_l2, packed_batch, tiny_config, tiny_params
from hybridmoe.analysis import program
from hybridmoe.model.attention import attention_layer
from hybridmoe.parallel import context
from hybridmoe.run.setup import build
from hybridmoe.run.step import nll_sum

B, T = 8, 64


def _attention_params(cfg):
    kinds = cfg.model.layer_pattern
    return jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][kinds.index("attention")]["mixer"])


def cp_overrides(P, *more):
    # GDN layers (sequence-sharded too) need whole chunks on every context rank.
    return (f"mesh.context={P}", "mesh.data=1", "gdn.chunk_size=8", *more)


def layer_value_and_grads(cfg, batch, packed):
    seg = batch["segment_ids"] if packed else jnp.ones((B, T), jnp.int32)
    pos = batch["positions"] if packed else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def f(p, x):
        y = attention_layer(p, x, pos, seg, cfg.model, cfg.attention, packed=packed)
        return jnp.sum(jnp.sin(y)), y

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


@pytest.fixture(scope="module")
def layer_inputs():
    cfg = tiny_config()
    return (_attention_params(cfg), jax.random.normal(jax.random.key(1), (B, T, cfg.model.d_model)),
            packed_batch(0, B, T, cfg.model.vocab_size))


@pytest.fixture(scope="module")
def unsharded(layer_inputs):
    p, x, batch = layer_inputs
    cfg = tiny_config()
    return {packed: layer_value_and_grads(cfg, batch, packed)(p, x) for packed in (True, False)}


def run_on_mesh(cfg, fn, *args):
    setup = build(cfg)
    with setup.context():
        return fn(*args)


# Each mesh packed and unpacked, load balancing alternating; the other half of the grid is slow.
LAYER_CASES = [pytest.param(P, packed, lb, marks=() if (P // 2 + packed + lb) % 2 else pytest.mark.slow,
                            id=f"{P}-{'packed' if packed else 'unpacked'}-{'load_balanced' if lb else 'natural'}")
               for P in (2, 4, 8) for packed in (True, False) for lb in (False, True)]


@pytest.mark.parametrize("P, packed, lb", LAYER_CASES)
def test_cp_layer_equals_unsharded(P, packed, lb, layer_inputs, unsharded):
    p, x, batch = layer_inputs
    cfg = tiny_config(*cp_overrides(P, f"attention.cp_load_balance={lb}"))
    out = run_on_mesh(cfg, layer_value_and_grads(cfg, batch, packed), p, x)
    # float32 sums in another order: ~1e-6; a wrong mask, order or gather: O(1).
    assert_rel_l2(out, unsharded[packed], 1e-4)


def test_cp_layer_under_cp_as_ep_rules(layer_inputs, unsharded):
    """The cp_as_ep table (experts over context x expert, batch over data x fsdp) splits the
    sequence the same way."""
    p, x, batch = layer_inputs
    cfg = tiny_config(*cp_overrides(2, "mesh.rules=cp_as_ep", "mesh.expert=2", "attention.cp_load_balance=true"))
    assert_rel_l2(run_on_mesh(cfg, layer_value_and_grads(cfg, batch, True), p, x), unsharded[True], 1e-4)


def test_cp_program_gathers_keys_and_values_only():
    """Sequence-sharded for real: the forward all-gathers keys, values, key positions and key
    segment ids over the context axis (the queries never), and the score block each rank
    computes is [t local queries, T keys] (flash attention's blocks set to t and T here: the
    block pair's scores, [G, R * t, T], R query heads per kv head folded into rows)."""
    cfg = tiny_config(*cp_overrides(4), "kernels.attention.block_q=16", "kernels.attention.block_k=64")
    p, x = _attention_params(cfg), jnp.ones((B, T, cfg.model.d_model))
    batch = packed_batch(0, B, T, cfg.model.vocab_size)
    fwd = jax.jit(lambda p, x, pos, seg: attention_layer(p, x, pos, seg, cfg.model, cfg.attention))
    prog = run_on_mesh(cfg, program.analyze, fwd, p, x, batch["positions"], batch["segment_ids"])
    gathers = [c for c in prog.lowered_collectives if c.kind == "all-gather"]
    G, A = cfg.model.num_kv_heads, cfg.model.head_dim
    b = B // (8 // 4)  # the batch is split over the other 2 devices (fsdp)
    assert sorted(c.shape for c in gathers) == sorted([(b, T, G, A)] * 2 + [(b, T)] * 2)
    N, t = cfg.model.num_heads, T // 4
    assert f"tensor<{G}x{N // G * t}x{T}xf32>" in prog.lowered_text


@pytest.mark.slow
def test_cp_model_equals_unsharded_model():
    """The whole tiny model (GDN layers, whose sequence the partitioner gathers, attention and
    MoE) with context 2 and load balancing equals the model without context parallelism."""
    def run(*overrides):
        cfg = tiny_config("mesh.data=1", *overrides)
        batch = packed_batch(0, B, T, cfg.model.vocab_size)
        params = tiny_params(cfg)
        f = jax.jit(jax.value_and_grad(lambda p, b: nll_sum(p, cfg, b)[0]))
        return run_on_mesh(cfg, f, params, batch)

    assert_rel_l2(run("mesh.context=2", "attention.cp_load_balance=true", "gdn.chunk_size=8"), run("gdn.chunk_size=8"), 1e-4)


# ---------------------------------------------------------------------------------------------
# Load balancing


@pytest.mark.parametrize("P", [2, 4, 8])
def test_load_balanced_order_and_back(P):
    cfg = tiny_config(*cp_overrides(P))
    iota_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def there_and_back(a):
        lb = context.reorder(a, ("batch", "seq"))
        return lb, context.reorder(lb, ("batch", "seq"), inverse=True)

    lb, back = run_on_mesh(cfg, jax.jit(there_and_back), iota_BT)
    np.testing.assert_array_equal(np.asarray(lb[0]), context.load_balanced_token_index(T, P))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(iota_BT))
    # Rank r holds half-chunks r and 2P-1-r.
    h = T // (2 * P)
    shards = np.asarray(lb[0]).reshape(P, 2 * h)
    assert [(s[0] // h, s[h] // h) for s in shards] == [(r, 2 * P - 1 - r) for r in range(P)]


def balance_figures(P, seq_len=T, packed=True):
    """Per-rank unmasked score entries in natural and in load-balanced order (the order taken
    from the reorder run on the mesh)."""
    cfg = tiny_config(*cp_overrides(P), f"train.seq_len={seq_len}")
    batch = packed_batch(0, B, seq_len, cfg.model.vocab_size, doc_lengths=(5, 70, 9, 30) if packed else (seq_len,))
    natural = context.unmasked_scores_per_rank(batch["positions"], batch["segment_ids"], P)
    reordered = run_on_mesh(cfg, jax.jit(lambda p, s: (context.reorder(p, ("batch", "seq")),
                                                        context.reorder(s, ("batch", "seq")))),
                            batch["positions"], batch["segment_ids"])
    balanced = context.unmasked_scores_per_rank(*reordered, P)
    return natural, balanced


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("P", [2, 4])
def test_load_balancing_evens_the_causal_work(P, packed):
    natural, balanced = balance_figures(P, packed=packed)
    assert natural.sum() == balanced.sum()  # the same work, shared differently
    spread = lambda c: (c.max() - c.min()) / c.mean()  # noqa: E731
    assert spread(balanced) < 0.5 * spread(natural), (natural, balanced)
    if not packed:  # one document per row: exactly even
        assert len(set(balanced.tolist())) == 1, balanced


# ---------------------------------------------------------------------------------------------
# Bad input


def _problems(*overrides):
    from hybridmoe.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(*overrides)
    return dict(e.value.problems)


def test_validator_names_every_unmet_requirement():
    probs = _problems("mesh.context=4", "mesh.data=1", "train.seq_len=38", "attention.cp_load_balance_hoist_ids=true",
                      "remat.policy=full", "remat.scan_layers=false")
    assert "multiple of 4" in probs["train.seq_len"]
    msg = probs["attention.cp_load_balance_hoist_ids"]
    for need in ("attention.cp_load_balance=true", "remat.policy=custom", "remat.scan_layers=true"):
        assert need in msg, need
    probs = _problems("mesh.context=1", "mesh.data=1", "attention.cp_load_balance=true",
                      "attention.cp_load_balance_hoist_ids=true", "remat.policy=custom")
    assert "even mesh.context >= 2" in probs["attention.cp_load_balance"]
    assert "even mesh.context >= 2" in probs["attention.cp_load_balance_hoist_ids"]
    probs = _problems("mesh.context=2", "mesh.data=1", "train.seq_len=34", "attention.cp_load_balance=true")
    assert "4 half-chunks" in probs["train.seq_len"]


def test_validator_odd_context():
    probs = _problems("mesh.cpu_devices=3", "mesh.context=3", "mesh.data=1", "train.seq_len=64",
                      "attention.cp_load_balance=true", "rl.prompts_per_step=3")
    assert "even mesh.context" in probs["attention.cp_load_balance"]
    assert "multiple of 6" in probs["train.seq_len"]


def test_validator_accepts_the_supported_setting():
    cfg = tiny_config("mesh.context=4", "mesh.data=1", "gdn.chunk_size=8", "attention.cp_load_balance=true",
                      "attention.cp_load_balance_hoist_ids=true", "remat.policy=custom")
    assert cfg.attention.cp_load_balance_hoist_ids


# ---------------------------------------------------------------------------------------------
# The sampler under a context-parallel mesh: decoding runs with the sequence unsharded.


def test_sampler_under_context_parallelism_matches_the_cp_trainer():
    from hybridmoe.model.forward import token_logprobs
    from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate

    # One layer of each mixer (helpers.TWO_LAYERS): the decode carries a GDN state and a KV cache,
    # at about half of tiny's four layers' compile.
    cfg = tiny_config(*TWO_LAYERS, *cp_overrides(2, "attention.cp_load_balance=true", "gdn.chunk_size=4"))
    params = tiny_params(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.model.vocab_size, size=n).tolist() for n in (3, 8, 1, 5, 2, 8, 4, 6)]
    tokens, seg, pos = left_pad_prompts(prompts, 8, pad_id=0)
    opts = SamplingOptions(max_new_tokens=8, temperature=1.0, eos_id=-1)
    setup = build(cfg)
    with setup.context():
        out = make_generate(cfg, opts)(params, tokens, seg, pos, jax.random.key(1))
        # The trainer's forward on the sampled rows, sequence-sharded (16 tokens over 2 ranks).
        trainer = jax.jit(lambda p, t, s, q: token_logprobs(p, cfg, t, s, q))(
            params, out["tokens"], out["segment_ids"], out["positions"])
    np.testing.assert_allclose(np.asarray(out["logprobs"]), np.asarray(trainer)[:, 7:], rtol=0, atol=1e-5)
