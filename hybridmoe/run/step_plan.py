"""How many micro-batches the training step accumulates (train.micro_batches): chosen (auto) or
checked against the device's memory before the first step (run/memory_fit.py).

train.batch_size sequences make one optimizer step; the step runs them as M equal micro-batches of
batch_size / M rows, each split over the batch shards of the mesh, accumulating the gradient. The
data a step trains on is packed for the whole step and split after (data/packing.py), so the count
changes the memory a step needs, not what it computes. The program of the count chosen is the
compiled one the loop then calls, kept on the set-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe.data.packing import BATCH_FIELDS
from hybridmoe.run.memory_fit import Fit, batch_shards, choose_count, divisor_counts, kept_measured, per_device_bytes


def abstract_train_batch(setup, micro_batches: int, fields=BATCH_FIELDS) -> dict:
    """The step's batch as ShapeDtypeStructs [micro_batches, batch_size / micro_batches, seq_len] int32."""
    t = setup.cfg.train
    shape = (micro_batches, t.batch_size // micro_batches, t.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.batch_sharding(1)) for k in fields}


def train_measured(setup, micro_batches: int, fields=BATCH_FIELDS) -> tuple[object, int]:
    """The training step compiled for `micro_batches` micro-batches of batches with `fields`, and
    its need per device (memory_fit.compile_measured; kept on the set-up)."""
    from hybridmoe.run.setup import jit_train_step

    fields = tuple(fields)
    return kept_measured(setup, ("train_step_program", micro_batches, fields), lambda: jit_train_step(setup).lower(
        setup.abstract_state(), abstract_train_batch(setup, micro_batches, fields)))


def train_program(setup, micro_batches: int, fields=BATCH_FIELDS):
    """The compiled program of train_measured."""
    return train_measured(setup, micro_batches, fields)[0]


def train_counts(setup) -> list[int]:
    """Counts that split train.batch_size into equal micro-batches, each over the batch shards."""
    return divisor_counts(setup.cfg.train.batch_size, batch_shards(setup))


def plan_train(setup, budget: int | None, fields=BATCH_FIELDS, setting=None) -> Fit:
    """train.micro_batches (or `setting`) chosen or checked against `budget` bytes per device (None:
    unchecked, auto the fewest count); refused with a RunError naming the smallest count that fits."""
    setting = setup.cfg.train.micro_batches if setting is None else setting
    return choose_count("train.micro_batches", setting, train_counts(setup),
                        lambda M: train_measured(setup, M, fields), budget, "the training step",
                        fixed_bytes=per_device_bytes(setup.abstract_state()))
