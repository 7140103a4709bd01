"""Which platforms run each Pallas backend (the validation pass checks a config's backends here)."""

PALLAS_PLATFORMS: dict[str, tuple[str, ...]] = {"pallas_tpu": ("tpu",), "pallas_gpu": ("gpu", "cuda", "rocm")}


def trace_platform() -> str:
    """The platform of the program being traced: the current mesh's devices' (a compile-only TPU
    target's mesh says tpu on a CPU host), else JAX's default backend."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()
