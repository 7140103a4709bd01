"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends)."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
