"""How many micro-batches the GRPO update and the pi_old pass run in (rl.micro_batches), and how
many passes the sampler makes over a round's prompts (rl.rollout_batches): chosen (auto) or checked
(a set count) against the device's memory before the first step (run/memory_fit.py).

The update's rows (a rollout's, or one mini-batch's with several updates per rollout) split into M
equal micro-batches, each over the batch shards of the mesh. The update's program holds the
reference policy's forward too (rl.beta > 0), so its count covers that pass. The pi_old pass
(several updates per rollout) runs once over the whole rollout, without gradients: under auto it
takes the fewest count that fits its own program; under a set count it runs at that count, checked
the same way. The sampler holds one pass's rows in flight: their KV cache and GDN states, beside
the optimizer state (and the reference policy) that stay on the device while it runs. Each chosen
program is the compiled one the loop then calls, kept on the set-up.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.rl.grpo import jit_grpo_step, jit_old_logprobs, update_batch_shardings
from hybridmoe.rl.sampler import SamplingOptions, make_generate
from hybridmoe.run.memory_fit import Fit, batch_shards, choose_count, divisor_counts, kept_measured, per_device_bytes


def abstract_update_batch(cfg: Config, setup, micro_batches: int, rows: int, with_old_logprobs: bool) -> dict:
    """One update's batch as ShapeDtypeStructs [M, b, ...] (rl/grpo.py's fields and shardings):
    `rows` rows of rl.sequence_len tokens in `micro_batches` micro-batches, with pi_old's log-probs
    when a rollout takes several updates."""
    r, m = cfg.rl, cfg.model
    M, b, T = micro_batches, rows // micro_batches, r.sequence_len
    shardings = update_batch_shardings(setup, with_old_logprobs=with_old_logprobs)
    shapes = {"tokens": ((M, b, T), jnp.int32), "segment_ids": ((M, b, T), jnp.int32),
              "positions": ((M, b, T), jnp.int32), "logp_sampler": ((M, b, T - 1), jnp.float32),
              "mask": ((M, b, T - 1), jnp.float32), "advantages": ((M, b), jnp.float32), "keep": ((M, b), jnp.bool_),
              "normalizer": ((M,), jnp.float32), "logp_old": ((M, b, T - 1), jnp.float32),
              "on_policy": ((M,), jnp.bool_),
              "routing": ((M, b, T, m.num_layers, m.num_experts_per_tok), jnp.int32)}
    return {k: jax.ShapeDtypeStruct(*shapes[k], sharding=sh) for k, sh in shardings.items()}


def update_rows_per_step(cfg: Config) -> int:
    """Rows of one update: the rollout's, or one mini-batch's with several updates per rollout."""
    return cfg.rl.rollouts_per_step // cfg.rl.mini_batches


def update_measured(setup, with_reference: bool, micro_batches: int) -> tuple[object, int]:
    """The GRPO update compiled for `micro_batches` micro-batches and its need per device
    (memory_fit.compile_measured; kept on the set-up)."""
    cfg = setup.cfg
    with_old = cfg.rl.updates_per_rollout > 1

    def lower():
        state = setup.abstract_state()
        ref = state["params"] if with_reference else None
        batch = abstract_update_batch(cfg, setup, micro_batches, update_rows_per_step(cfg), with_old)
        return jit_grpo_step(setup, with_reference).lower(state, ref, batch)

    return kept_measured(setup, ("grpo_update_program", with_reference, micro_batches), lower)


def update_program(setup, with_reference: bool, micro_batches: int):
    """The compiled program of update_measured."""
    return update_measured(setup, with_reference, micro_batches)[0]


def old_logprobs_measured(setup, micro_batches: int) -> tuple[object, int]:
    """The pi_old pass over a whole rollout compiled for `micro_batches` micro-batches, and its need
    per device (kept on the set-up)."""
    cfg = setup.cfg

    def lower():
        params = setup.abstract_state()["params"]
        batch = abstract_update_batch(cfg, setup, micro_batches, cfg.rl.rollouts_per_step, False)
        return jit_old_logprobs(setup).lower(params, batch)

    return kept_measured(setup, ("old_logprobs_program", micro_batches), lower)


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """The counts chosen and their compiled programs (old_logprobs None with one update per rollout)."""
    update: Fit
    old_logprobs: Fit | None

    @property
    def micro_batches(self) -> int:
        return self.update.count

    @property
    def old_logprobs_micro_batches(self) -> int:
        return self.update.count if self.old_logprobs is None else self.old_logprobs.count


def sampler_measured(setup, opts: SamplingOptions, prompts: int) -> tuple[object, int]:
    """The sampler compiled for one pass of `prompts` prompts (their rl.group_size rows each), and
    its need per device (kept on the set-up)."""
    cfg = setup.cfg
    replicated = NamedSharding(setup.mesh, PartitionSpec())

    def lower():
        generate = make_generate(cfg, opts, group_size=cfg.rl.group_size,
                                 in_shardings=(setup.param_shardings, replicated, replicated, replicated, replicated))
        rows = jax.ShapeDtypeStruct((prompts, cfg.rl.max_prompt_len), jnp.int32, sharding=replicated)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
        return generate.lower(setup.abstract_state()["params"], rows, rows, rows, key)

    return kept_measured(setup, ("sampler_program", opts, prompts), lower)


def sampler_program(setup, opts: SamplingOptions, prompts: int):
    """The compiled program of sampler_measured."""
    return sampler_measured(setup, opts, prompts)[0]


def plan_rollout(setup, opts: SamplingOptions, with_reference: bool, budget: int | None, setting=None) -> Fit:
    """rl.rollout_batches (or `setting`) chosen or checked: the sampler's passes per round whose
    program fits `budget` less what stays on the device beside its arguments while it runs (the
    optimizer state, the reference policy); refused with a RunError naming the count that fits."""
    r = setup.cfg.rl
    setting = r.rollout_batches if setting is None else setting
    state = setup.abstract_state()
    beside = per_device_bytes(state["opt_state"]) + (per_device_bytes(state["params"]) if with_reference else 0)
    shards = batch_shards(setup)
    counts = [n for n in divisor_counts(r.prompts_per_step) if (r.prompts_per_step // n * r.group_size) % shards == 0]
    return choose_count("rl.rollout_batches", setting, counts or [1],
                        lambda n: sampler_measured(setup, opts, r.prompts_per_step // n),
                        None if budget is None else budget - beside, "the sampler",
                        fixed_bytes=per_device_bytes(state["params"]))


def update_counts(setup) -> list[int]:
    """Counts that split an update's rows into equal micro-batches, each over the batch shards."""
    return divisor_counts(update_rows_per_step(setup.cfg), batch_shards(setup))


def update_held_bytes(setup, with_reference: bool) -> int:
    """What the GRPO update holds at every count: the training state and the reference policy."""
    state = setup.abstract_state()
    return per_device_bytes(state) + (per_device_bytes(state["params"]) if with_reference else 0)


def plan_updates(setup, with_reference: bool, budget: int | None, setting=None) -> UpdatePlan:
    """rl.micro_batches (or `setting`) chosen or checked for the update and the pi_old pass against
    `budget` bytes per device (None: unchecked); refused with a RunError naming the count that fits."""
    r = setup.cfg.rl
    setting = r.micro_batches if setting is None else setting
    update = choose_count("rl.micro_batches", setting, update_counts(setup),
                          lambda M: update_measured(setup, with_reference, M), budget, "the GRPO update",
                          fixed_bytes=update_held_bytes(setup, with_reference))
    old = None
    if r.updates_per_rollout > 1:
        state = setup.abstract_state()
        old = choose_count("rl.micro_batches", setting, divisor_counts(r.rollouts_per_step, batch_shards(setup)),
                           lambda M: old_logprobs_measured(setup, M), budget, "the pi_old pass",
                           fixed_bytes=per_device_bytes(state["params"]))
    return UpdatePlan(update, old)
