"""Which platforms run each Pallas backend (the validation pass checks a config's backends here)."""

PALLAS_PLATFORMS: dict[str, tuple[str, ...]] = {"pallas_tpu": ("tpu",), "pallas_gpu": ("gpu", "cuda", "rocm")}
