"""What a config is checked against besides itself: the caller's facts (platform, device count, the
checkpoint and tokenizer a run starts from) and the mesh and platform they resolve to. The validator's
rules (validate.py) read them through these helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridmoe.config.schema import Config
from hybridmoe.kernels.attention import limits as attention_limits


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a config is checked against that it does not hold itself, given by the caller.

    platform: the platform the program runs on or is compiled for ("cpu", "gpu", "tpu"; a
    compile-only TPU target is "tpu"); None: the config's own (cpu with simulated devices, else
    JAX's default backend).
    devices: how many devices the mesh spans; None: the simulated CPU count, or not known yet (the
    rules that need the -1 axis's size decide on the built mesh, which passes it).
    checkpoint_model: the model fields of the Hugging Face checkpoint the run starts from
    (`--init-hf`), whose shape fields the config must match; None: no checkpoint.
    tokenizer: the tokenizer the rl command encodes the config's own task's prompts with (its
    rules measure them); None: not known, or the task is the caller's."""
    platform: str | None = None
    devices: int | None = None
    checkpoint_model: Mapping | None = None
    tokenizer: Any = None


def _mesh_sizes(cfg: Config, f: Facts) -> dict[str, int]:
    """The mesh axis sizes known: all of them when the device count is (given, or simulated CPU
    devices), otherwise the fixed ones (the -1 axis absorbs a device count known only on the mesh)."""
    n = f.devices or cfg.mesh.simulated_devices
    if n:
        sizes, problem = cfg.mesh.resolve(n)
        if problem is None:
            return sizes
    return {k: v for k, v in cfg.mesh.axis_sizes.items() if v > 0}


def _full_mesh_sizes(cfg: Config, f: Facts) -> dict[str, int] | None:
    """Every axis size, or None while the -1 axis's is not known."""
    sizes = _mesh_sizes(cfg, f)
    return sizes if len(sizes) == len(cfg.mesh.axis_sizes) else None


def _context_size(cfg: Config, f: Facts) -> int | None:
    """mesh.context, or the size it absorbs when it is -1 and the device count is known."""
    return _mesh_sizes(cfg, f).get("context")


def _run_platform(cfg: Config, f: Facts) -> str:
    """The platform the program is for: the one given (a compile target's, or the built mesh's
    devices'), simulated CPU devices, or JAX's default backend."""
    if f.platform:
        return f.platform
    if cfg.mesh.cpu_devices:
        return "cpu"
    import jax  # only when asked: with simulated devices the backends must start later

    return jax.default_backend()


def _attention_backend(cfg: Config, f: Facts) -> str:
    """kernels.attention.backend with `auto` resolved for the platform the program is for."""
    choice = cfg.kernels.attention.backend
    return attention_limits.resolve(choice, _run_platform(cfg, f)) if choice == "auto" else choice
