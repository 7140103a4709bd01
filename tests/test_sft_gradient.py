"""The supervised step's gradient is the mean over the trained tokens of the whole step.

The reference is written here from the model's plain log-probs (`token_logprobs`, the full-logits
path, not the step's chunked head): -sum of log p over the trained targets, divided by their
number, with the trained targets listed by a loop over the rows (same document, not padding, the
row's loss mask on). The batch has two micro-batches whose rows train very different numbers of
tokens (one row nearly all, one a handful), so a gradient summed instead of averaged, averaged
over every target instead of the trained ones, or averaged per micro-batch first, is off by O(1).
Adam and the clip would hide the gradient's scale from the loss curve, but not from grad_norm and
train.grad_clip; the step's gradient is captured here exactly, before any optimizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import tiny_config, tiny_params
from hybridmoe.data.packing import pack_documents
from hybridmoe.model.forward import token_logprobs
from hybridmoe.run import step as step_mod
from broken_variants import mutated

SEQ = 32
DENSITIES = ((0.95, 0.1), (0.5, 0.02))  # per micro-batch, per row: the fraction of tokens trained
TOL = 1e-4  # float32 sums in another order; measured ~1e-6


def _batch(vocab):
    rng = np.random.default_rng(5)
    micro = []
    for row_densities in DENSITIES:
        docs, masks = [], []
        for density in row_densities:  # two documents per row
            for n in (19, 13):
                docs.append(rng.integers(1, vocab, n))
                masks.append((rng.random(n) < density).astype(np.int32))
        micro.append(pack_documents(docs, len(row_densities), SEQ, masks=masks))
    return {k: np.stack([m[k] for m in micro]) for k in micro[0]}


def _trained_targets(batch):
    """[M, B, T-1] True where token t+1 is a trained target of token t, by a loop over the rows."""
    seg, lm = batch["segment_ids"], batch["loss_mask"]
    out = np.zeros(seg[..., 1:].shape, bool)
    for m, b, t in np.ndindex(out.shape):
        out[m, b, t] = seg[m, b, t + 1] == seg[m, b, t] and seg[m, b, t + 1] > 0 and lm[m, b, t + 1] == 1
    return out


def reference(params, cfg, batch):
    """(mean NLL over the step's trained targets, its gradient), all micro-batches as one batch."""
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    trained = jnp.asarray(_trained_targets(batch).reshape(-1, SEQ - 1))

    def loss(p):
        lp = token_logprobs(p, cfg, flat["tokens"], flat["segment_ids"], flat["positions"])[:, :SEQ - 1]
        return -jnp.sum(jnp.where(trained, lp, 0.0)) / jnp.sum(trained)

    return jax.jit(jax.value_and_grad(loss))(params)


# An optimizer that moves nothing and keeps the gradient it was given as its state.
CAPTURE = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                       lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))

BROKEN = {
    # the gradient summed over the trained tokens, not averaged
    "summed_gradient": ("train_step", "(g / denom).astype(p.dtype)", "(g * 1.0).astype(p.dtype)"),
    # averaged over every next-token target, trained or not
    "divided_by_all_targets": ("train_step", "denom = jnp.maximum(count, 1).astype(jnp.float32)",
                               "denom = jnp.maximum(jnp.sum(loss_mask(batch['segment_ids'].reshape(-1, "
                               "batch['segment_ids'].shape[-1]))), 1).astype(jnp.float32)"),
    # each micro-batch's mean, then their mean
    "mean_of_micro_batch_means": ("nll_sum", "out = (-jnp.sum(jnp.where(mask, tgt, 0.0)), jnp.sum(mask))",
                                  "out = (-jnp.sum(jnp.where(mask, tgt, 0.0)) / jnp.maximum(jnp.sum(mask), 1), "
                                  "jnp.int32(1))"),
}


@pytest.fixture(scope="module")
def case():
    cfg = tiny_config("model.layer_pattern=[attention]", "model.num_layers=1", "train.micro_batches=2",
                      "train.batch_size=8", f"train.seq_len={SEQ}", "moe.capacity_factor=0")
    params = tiny_params(cfg)
    batch = _batch(cfg.model.vocab_size)
    return cfg, params, batch, reference(params, cfg, batch)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("variant", [None, *BROKEN])
def test_the_step_gradient_is_the_mean_over_trained_tokens(variant, case, monkeypatch):
    cfg, params, batch, (want_loss, want_grads) = case
    if variant is not None:
        name, old, new = BROKEN[variant]
        monkeypatch.setattr(step_mod, name, mutated(step_mod, name, old, new))
    trained = _trained_targets(batch)
    per_row = trained.sum(-1)
    assert per_row.min() * 5 < per_row.max() and trained.sum() * 2 < (batch["segment_ids"][..., 1:] > 0).sum()
    state = {"params": params, "opt_state": CAPTURE.init(params), "step": jnp.int32(0)}
    new_state, metrics = jax.jit(step_mod.train_step(cfg, CAPTURE))(state, {k: jnp.asarray(v) for k, v in batch.items()})
    grads = new_state["opt_state"]
    err = max(_rel(g, w) for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    want_norm = float(np.sqrt(sum(np.sum(np.asarray(w, np.float64) ** 2) for w in jax.tree.leaves(want_grads))))
    norm_err = abs(float(metrics["grad_norm"]) - want_norm) / want_norm
    print(f"{variant or 'clean'}: worst leaf relative L2 {err:.2e}, grad_norm {float(metrics['grad_norm']):.5g} "
          f"against {want_norm:.5g} ({norm_err:.2e}); trained targets per row {per_row.tolist()} (tolerance {TOL:.0e})")
    if variant is None:
        assert err < TOL and norm_err < TOL
        assert int(metrics["loss_tokens"]) == int(trained.sum())
        assert abs(float(metrics["loss"]) - float(want_loss)) < TOL * abs(float(want_loss))
    else:
        assert max(err, norm_err) > 10 * TOL
