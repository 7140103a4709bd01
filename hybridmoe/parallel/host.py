"""Moving data between the hosts' numpy arrays and global (possibly multi-host) device arrays.

Every host builds the same global batch (the data is a pure function of seed and step), so a
global array is assembled from the shards each host addresses; results come back to every host
with an all-gather. On one host these are device_put / device_get.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize_distributed(mesh_cfg) -> None:
    """Join the multi-controller runtime: the coordinator from mesh.coordinator_address, or found from
    the cluster (TPU pod, SLURM, ...). Simulated CPU devices talk over gloo (JAX's CPU collectives)."""
    if mesh_cfg.cpu_devices:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = {}
    if mesh_cfg.coordinator_address:
        where = {"coordinator_address": mesh_cfg.coordinator_address, "num_processes": mesh_cfg.num_processes,
                 "process_id": mesh_cfg.process_id}
    jax.distributed.initialize(**where)


def is_lead_host() -> bool:
    """The host that writes metrics and exports (checkpoints are written by every host via orbax)."""
    return jax.process_index() == 0


def sync_hosts(name: str) -> None:
    """Every host waits here until all have arrived (a no-op on one host)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def put_global(tree, shardings):
    """Host numpy arrays (the same global values on every host) -> global arrays with `shardings`.

    `shardings` is one sharding for every leaf or a tree matching `tree`.
    """
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def put(a, sharding):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return jax.tree.map(put, tree, shardings)


def put_process_local(tree, sharding):
    """Host numpy arrays holding only this host's rows (axis 1 of [micro_batches, rows, ...], split
    evenly over the hosts) -> global arrays with `sharding`; nothing crosses hosts."""
    def put(a):
        a = np.asarray(a)
        global_shape = (a.shape[0], a.shape[1] * jax.process_count(), *a.shape[2:])
        return jax.make_array_from_process_local_data(sharding, a, global_shape)

    return jax.tree.map(put, tree)


def fetch_global(tree):
    """Global arrays -> numpy on every host."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
