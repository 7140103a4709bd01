"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends).

Tests that build the same program (a run and its resumed twin, the same tiny step in several
tests) share compiled executables through JAX's persistent cache, in a fresh directory per test
process, so a run never reads a cache it did not write.
"""

import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="hybridmoe-test-xla-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
