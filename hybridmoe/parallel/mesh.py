"""The device mesh: five named axes whose sizes come from the config."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from hybridmoe.config.schema import MeshConfig

MESH_AXES = ("data", "fsdp", "context", "expert", "tensor")


def configure_cpu_devices(mesh_cfg: MeshConfig) -> None:
    """Ask for simulated CPU devices; must run before JAX initialises its backends.

    A config that simulates CPU devices runs on the CPU platform: unless the platforms were
    chosen already, no other backend (e.g. a TPU plugin installed for compile-only targets) is
    started."""
    if mesh_cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", mesh_cfg.cpu_devices)
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")


def make_mesh(sizes: Mapping[str, int], devices: list | None = None) -> Mesh:
    """The mesh of the axis sizes given (every axis resolved: `MeshConfig.resolve` of a config the
    validator passed for these devices) over `devices` (default: every device)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[a] for a in MESH_AXES)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)
