"""model.tie_word_embeddings: one tensor used as the embedding and as the LM head.

The reference is the untied model whose lm_head is set to the embedding's transpose: the tied model
computes the same logits, and the tied tensor's gradient is the sum of the untied model's two
gradients (the embedding's and the head's, transposed).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import packed_batch, tiny_config, tiny_params
from hybridmoe.model import forward
from hybridmoe.model.params import count_params, declare_params
from hybridmoe.run.step import nll_sum
from broken_variants import mutated

ONE_LAYER = ("model.layer_pattern=[attention]", "model.num_layers=1")


@pytest.fixture(scope="module")
def case():
    # One attention layer: what is under test is outside the layers, and one layer compiles fast.
    tied_cfg, untied_cfg = tiny_config(*ONE_LAYER, "model.tie_word_embeddings=true"), tiny_config(*ONE_LAYER)
    tied = tiny_params(tied_cfg, seed=3)
    untied = {**tied, "lm_head": tied["embed"].T}  # the independent reference: an untied model
    batch = packed_batch(0, 2, 64, tied_cfg.model.vocab_size, doc_lengths=(5, 40, 19))
    reference = _loss_grads(untied_cfg, untied, batch)
    return tied_cfg, tied, batch, reference


def _loss_grads(cfg, params, batch):
    return jax.jit(jax.value_and_grad(lambda p: nll_sum(p, cfg, batch)[0]))(params)


def _embed_grad_error(g_tied, g_untied) -> float:
    """Relative error of the tied tensor's gradient against the sum of the untied model's two."""
    want = np.asarray(g_untied["embed"], np.float64) + np.asarray(g_untied["lm_head"], np.float64).T
    return float(np.linalg.norm(np.asarray(g_tied["embed"], np.float64) - want) / np.linalg.norm(want))


def test_tied_tree_has_no_head_and_one_tensor_fewer():
    tied, untied = declare_params(tiny_config("model.tie_word_embeddings=true").model), declare_params(tiny_config().model)
    assert "lm_head" not in tied and "lm_head" in untied
    m = tiny_config().model
    assert count_params(untied) - count_params(tied) == m.d_model * m.vocab_size


def test_tied_loss_and_gradient_are_the_untied_models_with_the_head_set_to_the_embedding(case):
    tied_cfg, tied, batch, (loss_u, g_u) = case
    loss_t, g_t = _loss_grads(tied_cfg, tied, batch)
    np.testing.assert_allclose(float(loss_t), float(loss_u), rtol=1e-6)
    err = _embed_grad_error(g_t, g_u)
    # The head's share of the summed gradient: what a variant that drops one use would miss.
    head_share = np.linalg.norm(np.asarray(g_u["lm_head"])) / np.linalg.norm(
        np.asarray(g_u["embed"]) + np.asarray(g_u["lm_head"]).T)
    assert err < 1e-6 and head_share > 10 * 1e-3, (err, head_share)
    np.testing.assert_allclose(np.asarray(g_t["final_norm"]), np.asarray(g_u["final_norm"]), rtol=1e-4, atol=1e-7)


def test_broken_variant_head_without_gradient_is_caught(case, monkeypatch):
    """Broken: the head use of the tied tensor is cut from the gradient (only the embedding's counts)."""
    tied_cfg, tied, batch, (_, g_u) = case
    monkeypatch.setattr(forward, "lm_head_at_use", mutated(
        forward, "lm_head_at_use", 'constrain_at_use(params["embed"], ("vocab", "embed")).T',
        'jax.lax.stop_gradient(constrain_at_use(params["embed"], ("vocab", "embed")).T)'))
    _, g_t = _loss_grads(tied_cfg, tied, batch)
    err = _embed_grad_error(g_t, g_u)
    assert err > 1e-3, err  # the clean error is < 1e-6
