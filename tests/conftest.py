"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends).

Tests that build the same program (a run and its resumed twin, the same tiny step in several
tests) share compiled executables through JAX's persistent cache, in a fresh directory per test
process, so a run never reads a cache it did not write.

CPU programs compile with XLA's backend optimisations off (jax_disable_most_optimizations: LLVM at
-O0, its expensive passes skipped): at the tests' tiny shapes code generation is most of a compile
and the programs run briefly (measured here: tests/test_train.py 224 -> 187 s, two tests of
tests/test_rl_run.py 245 -> 201 s). HLO passes are untouched, so the program facts a CPU test reads
(the optimised HLO, its collectives and fusions) are a default compile's. Child processes
(kill/resume, multi-host) inherit it through the environment. The TPU compiles (marked
tpu_compile) run with the defaults, as `hybridmoe inspect` compiles.
"""

import os
import tempfile

os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # read by jax at import, and by child processes

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="hybridmoe-test-xla-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _tpu_targets_compile_with_the_defaults(request):
    if request.node.get_closest_marker("tpu_compile") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
