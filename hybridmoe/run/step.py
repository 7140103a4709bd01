"""The jitted training step: gradients accumulated over micro-batches, clipping, AdamW.

The loss is the mean next-token negative log-likelihood over every valid target of every
micro-batch of the step: per micro-batch we accumulate the summed NLL and the token count, so N
micro-batches give exactly the gradient of one batch N times larger.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax

from hybridmoe.config.schema import Config, TrainConfig
from hybridmoe.model import scopes
from hybridmoe.model.forward import next_token_logprobs
from hybridmoe.run.loss_mask import batch_loss_mask, loss_mask


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    # No warm-up means the full rate from the first step (a one-step ramp would make step 0 a no-op).
    schedule = (optax.warmup_constant_schedule(0.0, t.learning_rate, t.warmup_steps) if t.warmup_steps
                else optax.constant_schedule(t.learning_rate))
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))
    return optax.chain(*parts)


def nll_sum(params, cfg: Config, batch, *, with_moe_dropped: bool = False):
    """(summed NLL over valid targets, number of valid targets) of one micro-batch
    (with_moe_dropped: and the MoE rows its expert buffers dropped, int32). The log-probs come
    from the chunked LM head: the [tokens, vocab] logits are never built."""
    out = next_token_logprobs(params, cfg, batch["tokens"], batch["segment_ids"], batch["positions"],
                              with_moe_dropped=with_moe_dropped)
    tgt, dropped = out[0], (out[2] if with_moe_dropped else None)
    mask = batch_loss_mask(batch)
    out = (-jnp.sum(jnp.where(mask, tgt, 0.0)), jnp.sum(mask))
    return (*out, dropped) if with_moe_dropped else out


def accumulate_grads(loss_sum_fn, params, micro_batches, reducers=None):
    """Sum (loss, count, grads) over the leading micro-batch axis with a scan (float32 sums).

    `loss_sum_fn(params, micro_batch) -> (loss, count)`; `count` may be any tree of scalars (the
    RL step sums its metric numerators there), each summed in its own dtype. `reducers` maps a key
    of a dict `count` to (combine, initial value) for metrics that do not add up (a max is the max
    of the micro-batches' maxima, not their sum).

    The counts leave the scan as its per-micro-batch outputs and are folded after it, in micro-batch
    order from zero (or the reducer's initial value): the sums a carried count would make, without a
    carry whose structure must be known before the body is traced (finding it by tracing the loss
    and its gradient once more doubled the step's tracing time).
    """
    grad_fn = jax.value_and_grad(loss_sum_fn, has_aux=True)
    reducers = reducers or {}

    def body(acc, mb):
        (loss, count), g = grad_fn(params, mb)
        acc_loss, acc_g = acc
        return (acc_loss + loss, jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc_g, g)), count

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    with jax.named_scope(scopes.MICRO_BATCHES):
        (loss, grads), counts = jax.lax.scan(body, (jnp.float32(0), zeros), micro_batches)
        count = _fold_counts(counts, reducers)
    return loss, count, grads


def _fold_counts(counts, reducers):
    """The per-micro-batch counts [M, ...] folded in micro-batch order: added from zero, or a
    reducer's combine from its initial value."""
    def fold(stacked, combine, init):
        acc = jnp.full(stacked.shape[1:], init, stacked.dtype)
        for i in range(stacked.shape[0]):
            acc = combine(acc, stacked[i])
        return acc

    summed = lambda tree: jax.tree.map(lambda c: fold(c, jnp.add, 0), tree)  # noqa: E731
    if not reducers:
        return summed(counts)
    return {k: fold(v, *reducers[k]) if k in reducers else summed(v) for k, v in counts.items()}


def guarded(t: TrainConfig) -> bool:
    """Whether the step keeps the old state on a NaN/inf loss or gradient (train.on_nonfinite != off)."""
    return t.on_nonfinite != "off"


def keep_if_not(ok, new, old):
    """`new` where the scalar `ok` holds, else `old` (leaf by leaf, on the device)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def skip_if_nonfinite(loss, grad_norm, new, old):
    """(`new`, or `old` when the loss or gradient norm is NaN/inf; update_skipped as int32): the
    guard of train.on_nonfinite, called only when it is on (the supervised and the GRPO step)."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return keep_if_not(finite, new, old), (~finite).astype(jnp.int32)


def train_step(cfg: Config, optimizer: optax.GradientTransformation):
    # Expert buffers that can overflow report what they dropped, summed over layers, micro-batches
    # and the mesh, as the metric moe_dropped (rows = (token, expert) assignments).
    report_dropped = cfg.moe.capacity_factor > 0

    def loss_sum_fn(p, mb):
        if not report_dropped:
            return nll_sum(p, cfg, mb)
        loss, count, dropped = nll_sum(p, cfg, mb, with_moe_dropped=True)
        return loss, {"tokens": count, "moe_dropped": dropped}

    def step(state, batch):
        params = state["params"]
        loss_sum, counts, grads = accumulate_grads(loss_sum_fn, params, batch)
        count = counts["tokens"] if report_dropped else counts
        denom = jnp.maximum(count, 1).astype(jnp.float32)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        loss = loss_sum / denom
        with jax.named_scope(scopes.OPTIMIZER):
            updates, opt_state = optimizer.update(grads, state["opt_state"], params)
            new_state = (optax.apply_updates(params, updates), opt_state)
        # A NaN/inf loss or gradient would poison the weights and Adam's moments for good: such a
        # step keeps the old ones, selected here on the device (no host round trip).
        if guarded(cfg.train):
            (params, opt_state), skipped = skip_if_nonfinite(loss, grad_norm, new_state, (params, state["opt_state"]))
        else:
            (params, opt_state), skipped = new_state, jnp.int32(0)
        # tokens: the next-token targets the step computed; loss_tokens: those the loss trains
        # (fewer under data.loss_on=assistant), its denominator.
        seg = batch["segment_ids"]
        targets = jnp.sum(loss_mask(seg.reshape(-1, seg.shape[-1])))
        metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": targets, "loss_tokens": count,
                   "update_skipped": skipped}
        if report_dropped:
            metrics["moe_dropped"] = counts["moe_dropped"]
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return step
