"""Which platforms run each Pallas backend (the validation pass checks a config's backends here), and
which chip generation a device belongs to (the tables keyed by generation: the step-time model's
hardware rows, the grouped matmuls' measured tiles)."""

PALLAS_PLATFORMS: dict[str, tuple[str, ...]] = {"pallas_tpu": ("tpu",), "pallas_gpu": ("gpu", "cuda", "rocm")}


def trace_platform() -> str:
    """The platform of the program being traced: the current mesh's devices' (a compile-only TPU
    target's mesh says tpu on a CPU host), else JAX's default backend."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


# jax.devices()[0].device_kind on each generation's host -> its generation.
DEVICE_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "tpu7x",
                "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}


def generation_of_device(device) -> str | None:
    """The generation of a (real, compile-only or abstract) device by its device kind; None for a
    CPU or an accelerator the table lacks."""
    return DEVICE_KINDS.get(getattr(device, "device_kind", ""))


def trace_generation() -> str | None:
    """The chip generation of the program being traced: the current mesh's devices' (a compile-only
    target's on any host), else the default backend's first device's."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return generation_of_device(device if device is not None else jax.devices()[0])
