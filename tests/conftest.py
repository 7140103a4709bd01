"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends).

Compiled programs persist across test processes and test runs in one directory outside the checkout
(TEST_COMPILE_CACHE), which child processes inherit through JAX's own environment variables: a rerun,
another xdist worker, a kill/resume trial or a CI run on a machine that ran the tests before compiles
only what changed. JAX keys each entry by the program, the compile options (optimisation level
included), the backend and the versions, so a stale entry is never read.

No size cap is given to JAX: with one, every write first lists the whole directory and reads each
entry's access time to pick what to evict (0.66 s per write at the ~4,700 entries one run of the
suite leaves, most of them the small programs of eager operations), a quarter of a cold run's test
time. Without it JAX neither locks nor evicts: a reader that meets an entry another worker is still
writing fails to decompress it and compiles instead (JAX warns; the result is the same). The
directory is pruned once per session instead, as the CLI prunes its own (hybridmoe/run/compile_cache.py).

CPU programs compile with XLA's backend optimisations off (jax_disable_most_optimizations: LLVM at
-O0, its expensive passes skipped): at the tests' tiny shapes code generation is most of a compile
and the programs run briefly (measured here: tests/test_train.py 224 -> 187 s, two tests of
tests/test_rl_run.py 245 -> 201 s). HLO passes are untouched, so the program facts a CPU test reads
(the optimised HLO, its collectives and fusions) are a default compile's. Child processes
(kill/resume, multi-host) inherit it through the environment. The TPU compiles (marked
tpu_compile) run with the defaults, as `hybridmoe inspect` compiles, and outside JAX's cache.

CPU fusions are emitted by XLA's elemental IR emitters, not its newer MLIR fusion emitters
(--xla_cpu_use_fusion_emitters=false): they compile 2.3x faster (tests/test_model.py's four largest
model programs from an empty cache: 32.8 -> 14.1 s of backend compile; the whole suite cold 22.2 ->
17.0 min). The optimised HLO differs: the older emitters cannot emit a scatter or a sort as a fusion,
so XLA expands some into loops, and a reduction's order can differ between two programs that the
default compiler runs bit for bit alike. A test whose claim is about the default CPU program (a fact
read from its HLO, or two programs equal bit for bit) is marked `default_cpu_codegen`: its programs
compile with the default emitters (the fixture below passes the option to each compile). The TPU
compiles are untouched (the flag is the CPU backend's).
"""

import contextlib
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
})
os.environ.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
CPU_FUSIONS_BY_THE_ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if CPU_FUSIONS_BY_THE_ELEMENTAL_EMITTERS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_FUSIONS_BY_THE_ELEMENTAL_EMITTERS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from hybridmoe.analysis import compiled_facts  # noqa: E402
from hybridmoe.run.compile_cache import prune  # noqa: E402

if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run without xdist), before any worker
    prune(TEST_COMPILE_CACHE)

# What inspect and the program proofs read from a compile (TPU targets' included), as the CLI keeps it.
compiled_facts.use_folder(TEST_COMPILE_CACHE / compiled_facts.SUBFOLDER)


def pytest_addoption(parser):
    parser.addoption("--chip", action="store_true",
                     help="run the tests marked tpu, and only those, on this host's TPU chip (JAX sees the chip, "
                     "not 8 simulated CPU devices; one process: no -n). Without it they are skipped.")


def pytest_configure(config):
    """JAX's devices before any backend starts: the chip for `--chip`, else 8 simulated CPU devices
    compiled with XLA's backend optimisations off (the module docstring)."""
    if config.getoption("--chip"):
        jax.config.update("jax_disable_most_optimizations", False)
        os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        return
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True)
def _set_ups_kept_within_one_test():
    """run.setup keeps the last set-ups and their jitted programs for an equal config (a resume in
    the same process traces nothing again); a test that patches model or loop code must not meet a
    program another test traced, so what is kept ends with each test."""
    from hybridmoe.run.setup import forget_setups

    yield
    forget_setups()


@pytest.fixture(autouse=True, scope="module")
def _tpu_targets_compile_with_the_defaults(request):
    if request.node.get_closest_marker("tpu_compile") is None:
        yield
        return
    from hybridmoe.analysis.program import without_persistent_cache

    # A compile-only TPU client cannot load a cached executable: writing one would cost and never serve.
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        with without_persistent_cache():
            yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)


@contextlib.contextmanager
def _default_cpu_emitters():
    """Every compile inside asks for XLA's default CPU fusion emitters (the module docstring). JAX's
    in-memory programs are dropped before and after, so no program compiled the other way is reused
    (the persistent cache keys by the compile options)."""
    from jax._src import compiler  # JAX has no public switch for one compile option of every compile

    plain = compiler.get_compile_options

    def with_default_emitters(*args, env_options_overrides=None, **kwargs):
        options = {**(env_options_overrides or {}), "xla_cpu_use_fusion_emitters": True}
        return plain(*args, env_options_overrides=options, **kwargs)

    jax.clear_caches()
    compiler.get_compile_options = with_default_emitters
    try:
        yield
    finally:
        compiler.get_compile_options = plain
        jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _default_cpu_codegen_in_marked_modules(request):
    """A module marked default_cpu_codegen (pytestmark): its module fixtures compile that way too."""
    if request.node.get_closest_marker("default_cpu_codegen") is None:
        yield
        return
    with _default_cpu_emitters():
        yield


@pytest.fixture(autouse=True)
def _default_cpu_codegen_in_marked_tests(request):
    """A test marked default_cpu_codegen itself (its own compiles; a marked module's are above)."""
    if not any(mark.name == "default_cpu_codegen" for mark in request.node.own_markers):
        yield
        return
    with _default_cpu_emitters():
        yield


# Named here (conftest imports no project code at load: JAX's devices are set up first).
BROKEN_FIT_NAMES = ("count_off_by_one", "budget_ignored", "smallest_count_not_chosen")


@pytest.fixture(params=BROKEN_FIT_NAMES)
def broken_fit(request, monkeypatch):
    """Each broken variant of the micro-batch count search (tests/broken_variants.py: BROKEN_FIT) patched in."""
    from broken_variants import BROKEN_FIT

    assert set(BROKEN_FIT) == set(BROKEN_FIT_NAMES)  # every variant is run
    for module, attr, fn in BROKEN_FIT[request.param]:
        monkeypatch.setattr(module, attr, fn)
    return request.param


@pytest.fixture(scope="module")
def device():
    """A compile-only device of the TPU topology the tpu_compile tests compile for (tests/tpu_target.py)."""
    import importlib.util

    from tests.tpu_target import TOPOLOGY

    if importlib.util.find_spec("libtpu") is None:
        pytest.fail(f"libtpu is not installed: pip install -e '.[test]' (jax[tpu]=={jax.__version__})")
    from hybridmoe.tools.train_program import tpu_target

    return tpu_target(TOPOLOGY).devices[0]


SUITE_TIME_RECORD = Path(__file__).resolve().parent.parent / "benchmarks" / "records" / "suite_time.json"


def _group_seconds() -> dict[str, float]:
    """Seconds per xdist group in the last recorded `make test`, the longer of its cold and warm
    runs (every test phase of a second or more: make test lists them): a cold cache makes some groups several times longer (the TPU
    compiles, the kernels' interpreted programs), and one of them handed out late would run alone.
    Empty without the record."""
    import json

    try:
        runs = json.loads(SUITE_TIME_RECORD.read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return {}
    seconds: dict[str, float] = {}
    for run in runs:
        per_run: dict[str, float] = {}
        for row in run.get("slowest", []):
            nodeid, _, group = row["test"].partition("@")  # pytest-xdist prints "nodeid@group"
            group = group or nodeid.split("::")[0]
            per_run[group] = per_run.get(group, 0.0) + row["s"]
        for group, s in per_run.items():
            seconds[group] = max(seconds.get(group, 0.0), s)
    return seconds


def _select_for_the_chip(config, items):
    """--chip: the tests marked tpu, the others deselected; without it the tpu tests skip."""
    chip = config.getoption("--chip")
    if chip:
        if jax.default_backend() != "tpu":
            raise pytest.UsageError(f"--chip runs the tpu tests on a TPU chip; this host's JAX sees {jax.default_backend()}")
        kept = [i for i in items if i.get_closest_marker("tpu")]
        config.hook.pytest_deselected(items=[i for i in items if not i.get_closest_marker("tpu")])
        items[:] = kept
        return
    skip = pytest.mark.skip(reason="needs a TPU chip: `python3 -m pytest --chip` on a TPU host (docs/tpu.md)")
    for item in items:
        if item.get_closest_marker("tpu"):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (make test) a file runs on one worker, as under loadfile, except that
    every tpu_compile test joins one group: libtpu lets one process per host hold it.

    The groups are handed out longest first (by the last record of the suite's time; the Makefile
    turns off xdist's own order, which is by test count): a long group of few tests (the kill
    trials, 2 tests and 2 minutes) handed out last ran alone while the other worker idled."""
    _select_for_the_chip(config, items)
    group_of, first_seen = {}, {}
    for item in items:
        group = "tpu_compile" if item.get_closest_marker("tpu_compile") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        group_of[item.nodeid] = group
        first_seen.setdefault(group, len(first_seen))
    seconds = _group_seconds()
    items.sort(key=lambda item: (-seconds.get(group_of[item.nodeid], 0.0), first_seen[group_of[item.nodeid]]))
