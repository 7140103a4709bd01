"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends).

Compiled programs persist across test processes and test runs in one directory outside the checkout
(TEST_COMPILE_CACHE), which child processes inherit through JAX's own environment variables: a rerun,
another xdist worker, a kill/resume trial or a CI run on a machine that ran the tests before compiles
only what changed. JAX keys each entry by the program, the compile options (optimisation level
included), the backend and the versions, so a stale entry is never read; a size cap turns on JAX's
file lock, so parallel workers read and write the directory safely.

CPU programs compile with XLA's backend optimisations off (jax_disable_most_optimizations: LLVM at
-O0, its expensive passes skipped): at the tests' tiny shapes code generation is most of a compile
and the programs run briefly (measured here: tests/test_train.py 224 -> 187 s, two tests of
tests/test_rl_run.py 245 -> 201 s). HLO passes are untouched, so the program facts a CPU test reads
(the optimised HLO, its collectives and fusions) are a default compile's. Child processes
(kill/resume, multi-host) inherit it through the environment. The TPU compiles (marked
tpu_compile) run with the defaults, as `hybridmoe inspect` compiles.
"""

import os
from pathlib import Path

TEST_COMPILE_CACHE = Path.home() / ".cache" / "hybridmoe" / "xla-tests"
TEST_COMPILE_CACHE.mkdir(parents=True, exist_ok=True)
# Read by jax at import, in this process and in every child process the tests start.
os.environ.update({
    "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
    "JAX_COMPILATION_CACHE_DIR": str(TEST_COMPILE_CACHE),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(8 * 2**30),  # LRU eviction past 8 GiB; turns on the file lock
})

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_disable_most_optimizations", True)


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


@pytest.fixture(scope="module")
def device():
    """A compile-only device of the TPU topology the tpu_compile tests compile for (tests/tpu_target.py)."""
    import importlib.util

    from tests.tpu_target import TOPOLOGY

    if importlib.util.find_spec("libtpu") is None:
        pytest.fail(f"libtpu is not installed: pip install -e '.[test]' (jax[tpu]=={jax.__version__})")
    from hybridmoe.tools.train_program import tpu_target

    return tpu_target(TOPOLOGY).devices[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    """Under `--dist loadgroup` (make test) a file runs on one worker, as under loadfile, except that
    every tpu_compile test joins one group: libtpu lets one process per host hold it."""
    for item in items:
        group = "tpu_compile" if item.get_closest_marker("tpu_compile") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
