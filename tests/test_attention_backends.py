"""kernels.attention.backend and attention.cp_impl through the production model path on the 8-device CPU mesh: the
logits and every parameter gradient of the tiny model (attention layers only, helpers.ATTENTION_LAYERS:
a GDN layer has no attention core) with each attention core (xla and pallas_tpu flash attention,
pallas_tpu interpreted; the blocked core) against the same model on the masked XLA
core (kernels/attention/xla.py), without context parallelism and with all-gather or ring context
parallelism over 2 and 4 ranks, natural and load-balanced order, packed rows (documents, padding)
and unpacked ones. Blocks of 8 queries x 16 keys, so every rank walks several block pairs, skipped,
masked and unmasked. Broken variants of the flash block math patched in are caught through the
model with a 10x margin. And the validator: a backend the platform cannot run, blocks that do not
tile the rows, each in one error naming the key and a fitting value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ATTENTION_LAYERS, TWO_LAYERS, packed_batch, tiny_config, tiny_params
from hybridmoe.config.errors import ConfigError
from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import xla
from hybridmoe.model import attention as attn_model
from hybridmoe.model.forward import logits
from hybridmoe.run.setup import build

B, T = 8, 64
BLOCKS = ("kernels.attention.block_q=8", "kernels.attention.block_k=16")
TOLERANCE = 1e-4  # relative L2 per leaf; float32 sums in another order: ~1e-6


def mesh_overrides(P: int, lb: bool, impl: str = "all_gather"):
    if P == 1:  # rows over data x fsdp, heads over tensor: self_attention's shard_map splits both
        return ("mesh.data=2", "mesh.tensor=2")
    return (f"mesh.context={P}", "mesh.data=1", "gdn.chunk_size=8", f"attention.cp_load_balance={lb}",
            f"attention.cp_impl={impl}")


def logits_and_grads(cfg, packed: bool):
    """The tiny model's logits and the gradient of sum(logits * cotangent) for every parameter."""
    batch = packed_batch(0, B, T, cfg.model.vocab_size)
    seg, pos = (batch["segment_ids"], batch["positions"]) if packed else (None, None)
    cot = jax.random.normal(jax.random.key(7), (B, T, cfg.model.vocab_size))
    params = tiny_params(cfg)

    def f(p):
        lg = logits(p, cfg, batch["tokens"], seg, pos)
        return jnp.sum(lg * cot), lg

    setup = build(cfg)
    with setup.context():
        (_, lg), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return {"logits": lg, **{jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}}


def rel_errors(out, ref):
    errs = {}
    for k, r in ref.items():
        a, r = np.asarray(out[k], np.float64), np.asarray(r, np.float64)
        assert np.isfinite(a).all(), k
        errs[k] = float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30))
    return errs


def worst(errs):
    k = max(errs, key=errs.get)
    return errs[k], k


_REFERENCE = {}


def _masked_self_attention(q, k, v, positions, segment_ids, kernels, *, scale):
    return xla.attention(q, k, v, q_pos_BT=positions, kv_pos_BS=positions, q_seg_BT=segment_ids,
                         kv_seg_BS=segment_ids, scale=scale)


def reference(P, lb, packed):
    """The model on the masked XLA core (the core every backend replaces) without context
    parallelism, whatever P and lb the case under test has: one reference per packing, on the
    mesh of P = 1 (the same loss on any mesh; float32 sums in another order)."""
    key = packed
    if key not in _REFERENCE:
        cfg = tiny_config(*ATTENTION_LAYERS, *mesh_overrides(1, False))
        mp = pytest.MonkeyPatch()
        mp.setattr(attn_model, "attention_core", lambda kc, **_: xla.attention)
        mp.setattr(attn_model, "self_attention", _masked_self_attention)
        try:
            _REFERENCE[key] = logits_and_grads(cfg, packed)
        finally:
            mp.undo()
    return _REFERENCE[key]


def run_backend(backend, P, lb, packed, impl="all_gather"):
    more = ("kernels.interpret=true",) if backend.startswith("pallas") else ()
    blocks = BLOCKS if backend != "blocked" else ()
    cfg = tiny_config(*ATTENTION_LAYERS, *mesh_overrides(P, lb, impl), f"kernels.attention.backend={backend}", *blocks, *more)
    return logits_and_grads(cfg, packed)


# (backend, context ranks, load-balanced, packed, context parallelism's impl). blocked under context
# parallelism is the masked core itself (not a case). Each case compiles the model twice (~15 s
# each on 2 cores): the default suite runs one per order and packing for xla, the ring once, one
# case for blocked and pallas_tpu; the rest are slow.
SLOW = pytest.mark.slow
AG, RING = "all_gather", "ring"
CASES = [("xla", 1, False, True, AG), ("xla", 2, False, False, AG), ("xla", 2, True, True, AG),
         ("xla", 2, True, True, RING), ("blocked", 1, False, True, AG), ("pallas_tpu", 2, True, True, AG),
         pytest.param("xla", 1, False, False, AG, marks=SLOW), pytest.param("xla", 4, True, False, AG, marks=SLOW),
         pytest.param("xla", 4, False, False, RING, marks=SLOW),
         pytest.param("pallas_tpu", 1, False, True, AG, marks=SLOW),
         pytest.param("pallas_tpu", 2, True, True, RING, marks=SLOW)]
_CLEAN = {}


def clean(backend, P, lb, packed, impl=AG):
    key = (backend, P, lb, packed, impl)
    if key not in _CLEAN:
        _CLEAN[key] = rel_errors(run_backend(*key), reference(P, lb, packed))
    return _CLEAN[key]


def _case_id(c):
    b, P, lb, pk, impl = c.values if hasattr(c, "values") else c
    return f"{b}-cp{P}{'-ring' if impl == RING else ''}-{'lb' if lb else 'natural'}-{'packed' if pk else 'unpacked'}"


@pytest.mark.parametrize("backend, P, lb, packed, impl", CASES, ids=[_case_id(c) for c in CASES])
def test_model_with_each_core_equals_the_masked_core(backend, P, lb, packed, impl):
    err, leaf = worst(clean(backend, P, lb, packed, impl))
    assert err < TOLERANCE, (leaf, err)


def test_auto_on_cpu_is_flash_xla(monkeypatch):
    """The default (auto) traces flash attention in XLA ops on CPU, under context parallelism too."""
    seen = []
    original = attn_model.flash_attention
    monkeypatch.setattr(attn_model, "flash_attention", lambda *a, **kw: seen.append(kw["backend"]) or original(*a, **kw))
    for P in (1, 2):
        cfg = tiny_config(*TWO_LAYERS, *mesh_overrides(P, False))
        assert cfg.kernels.attention.backend == "auto"
        setup = build(cfg)
        params = tiny_params(cfg)
        tokens = jnp.zeros((B, T), jnp.int32)
        with setup.context():
            jax.eval_shape(lambda p: logits(p, cfg, tokens), params)
    assert seen == ["xla", "xla"], seen


_ORIGINAL_SCORES = fb.scores
MODEL_BROKEN = {
    "causal_mask_off_by_one": ("visible", lambda q_pos, q_seg, kv_pos, kv_seg: (kv_pos < q_pos) & (kv_seg == q_seg)),
    "online_softmax_rescale_dropped": ("rescale_factor", lambda m_old, m_new: jnp.ones_like(m_old)),
    "scale_applied_twice": ("scores", lambda q, k, scale: _ORIGINAL_SCORES(q, k, scale) * scale),
}


@pytest.mark.parametrize("variant", [v if v == "causal_mask_off_by_one" else pytest.param(v, marks=SLOW)
                                     for v in sorted(MODEL_BROKEN)])
def test_broken_block_math_is_caught_through_the_model(variant, monkeypatch):
    """Load-balanced context parallelism on 2 ranks, packed rows, the xla flash backend."""
    case = ("xla", 2, True, True, AG)
    clean_err, _ = worst(clean(*case))
    ref = reference(*case[1:4])
    attribute, broken = MODEL_BROKEN[variant]
    monkeypatch.setattr(fb, attribute, broken)
    broken_err, leaf = worst(rel_errors(run_backend(*case), ref))
    print(f"{variant}: clean {clean_err:.2e}, broken {broken_err:.2e} ({leaf})")
    assert broken_err >= 10 * TOLERANCE and broken_err >= 10 * clean_err, (variant, clean_err, broken_err, leaf)


# ---------------------------------------------------------------------------------------------
# Bad input: one error naming the key and a value that fits


def problems(*overrides, target=None):
    with pytest.raises(ConfigError) as e:
        tiny_config(*TWO_LAYERS, *overrides, platform=target)
    return dict(e.value.problems)


def test_a_backend_the_platform_cannot_run_is_refused():
    msg = problems("kernels.attention.backend=pallas_tpu")["kernels.attention.backend"]
    assert "cannot run on this platform (cpu)" in msg and "kernels.interpret=true" in msg, msg
    msg = problems("kernels.attention.backend=pallas_gpu")["kernels.attention.backend"]
    assert "pallas_gpu cannot run on this platform (cpu)" in msg, msg
    # Validated for a GPU, Triton's rules: power-of-two blocks >= 16 and head dim.
    probs = problems("kernels.attention.backend=pallas_gpu", "kernels.attention.block_q=24", "model.head_dim=24",
                     "model.partial_rotary_factor=0.5", target="gpu")
    assert "model.head_dim=24 must be a power of two >= 16" in probs["kernels.attention.backend"], probs
    assert "block_q=24 does not divide the 64 queries" in probs["kernels.attention.block_q"], probs
    probs = problems("kernels.attention.backend=pallas_gpu", "kernels.attention.block_q=8", target="gpu")
    assert "must be a power of two >= 16 (Triton)" in probs["kernels.attention.block_q"], probs
    assert "kernels.attention.block_q=16" in probs["kernels.attention.block_q"], probs
    # auto on a GPU is xla (the Triton kernels have not run on one yet): no Triton rule applies.
    tiny_config(*TWO_LAYERS, "kernels.attention.block_q=8", "model.head_dim=24", "model.partial_rotary_factor=0.5", platform="gpu")


def test_blocks_that_do_not_tile_the_rows_are_refused():
    probs = problems("mesh.context=2", "mesh.data=1", "gdn.chunk_size=8", "kernels.attention.block_q=24",
                     "kernels.attention.block_k=48")
    assert "24 does not divide the 32 local queries (train.seq_len=64 / mesh.context=2)" in probs[
        "kernels.attention.block_q"]
    assert "kernels.attention.block_q=16" in probs["kernels.attention.block_q"]
    assert "48 does not divide the 64 keys" in probs["kernels.attention.block_k"]
    assert "kernels.attention.block_k=32" in probs["kernels.attention.block_k"]
    probs = problems("kernels.attention.backend=blocked", "kernels.attention.block_k=16")
    assert "no key blocks" in probs["kernels.attention.block_k"]
    # The GRPO rows (rl.max_prompt_len + rl.max_new_tokens) are checked by the rl command.
    from hybridmoe.recipe.validate import rl_sequence_problems

    cfg = tiny_config(*TWO_LAYERS, "kernels.attention.block_q=32", "rl.max_prompt_len=16", "rl.max_new_tokens=32")
    probs = dict(rl_sequence_problems(cfg))
    assert "32 does not divide the 48 queries (rl.max_prompt_len + rl.max_new_tokens = 48)" in probs[
        "kernels.attention.block_q"], probs


def test_a_compile_only_tpu_target_validates_as_tpu():
    """`inspect --target tpu7x:...` validates for TPU: pallas_tpu accepted, its blocks in multiples of 8."""
    cfg = tiny_config(*TWO_LAYERS, "mesh.cpu_devices=0", "kernels.attention.backend=pallas_tpu", "kernels.attention.block_q=16",
                      platform="tpu")
    assert cfg.kernels.attention.backend == "pallas_tpu"
    msg = problems("mesh.cpu_devices=0", "kernels.attention.block_q=4", target="tpu")["kernels.attention.block_q"]
    assert "must be a multiple of 8" in msg and "kernels.attention.block_q=8" in msg, msg
    msg = problems("mesh.cpu_devices=0", "kernels.attention.block_q=12", target="tpu")["kernels.attention.block_q"]
    assert "does not divide the 64 queries" in msg and "kernels.attention.block_q=8" in msg, msg
