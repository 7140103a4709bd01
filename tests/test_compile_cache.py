"""run.compile_cache_dir: a second run of the same program loads it from disk instead of compiling."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hybridmoe.run.compile_cache import DEFAULT_DIR, cache_dir, prune

ROOT = Path(__file__).resolve().parent.parent
# One attention layer: any program shows the cache, and the first run compiles everything it runs.
TRAIN = ["train", "recipe=tiny", "model.layer_pattern=[attention]", "model.num_layers=1", "train.steps=1",
         "train.batch_size=8", "train.seq_len=16"]


def _train(folder: Path, out: Path) -> str:
    """One training run into `folder`; its output, where JAX logs each program it read from the folder
    (JAX_LOG_COMPILES)."""
    # The suite's own cache (JAX_COMPILATION_CACHE_DIR, inherited) must not win over the key.
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    done = subprocess.run([sys.executable, "-m", "hybridmoe", *TRAIN, f"run.compile_cache_dir={folder}",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


HIT = re.compile(r"Persistent compilation cache hit for '([^']+)' with key '([^']+)'")


def _stored(folder: Path) -> set[str]:
    return {p.name.removesuffix("-cache") for p in folder.glob("*-cache")}


def test_a_second_run_reads_every_program_the_first_compiled(tmp_path):
    folder = tmp_path / "cache"
    first_log = _train(folder, tmp_path / "first")
    first = _stored(folder)
    assert len(first) >= 2 and not HIT.search(first_log), "the first run compiled and stored its programs"
    assert not list(folder.glob("*-atime")), "JAX was given a size cap (it stamps each read only under one)"
    second_log = _train(folder, tmp_path / "second")
    hits = {key: name for name, key in HIT.findall(second_log)}
    assert _stored(folder) == first, \
        "the second run compiled a program the first had not stored"
    # Every program it read is one the first run stored, among them the training step and the
    # state's initialisation.
    assert hits.keys() <= first and {"jit_step", "jit_init"} <= set(hits.values()), sorted(hits.values())


def test_prune_deletes_the_entries_written_longest_ago_past_the_limit(tmp_path):
    sizes = {"a": 400, "b": 300, "c": 200, "d": 100}  # a written first, d last
    for age, (name, size) in enumerate(sizes.items()):
        (tmp_path / name).write_bytes(b"x" * size)
        os.utime(tmp_path / name, (1000 + age, 1000 + age))
    assert prune(tmp_path, above=1000, to=0) == 0 and len(list(tmp_path.iterdir())) == 4  # 1000 bytes: not past
    assert prune(tmp_path, above=999, to=300) == 700  # a and b go; c and d (300 bytes) stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]


def test_the_setting_names_the_folder():
    assert cache_dir("off") is None
    assert cache_dir("~/x") == Path.home() / "x"
    # auto keeps a folder JAX was given (here the suite's own, tests/conftest.py); else the user cache.
    import jax
    assert cache_dir("auto") == Path(jax.config.jax_compilation_cache_dir or DEFAULT_DIR)


def test_an_unwritable_folder_is_refused_naming_the_key(tmp_path):
    from hybridmoe.run.compile_cache import configure_compile_cache
    from hybridmoe.run.run_dir import RunError
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunError, match="run.compile_cache_dir"):
        configure_compile_cache(str(blocker / "cache"))


# ---------------------------------------------------------------------------------------------
# What inspect reads from a compile, kept beside JAX's entries (analysis/compiled_facts.py)

ONE_LAYER = ["mesh.data=2", "mesh.fsdp=4", "model.layer_pattern=[attention]", "model.num_layers=1",
             "train.batch_size=8", "train.seq_len=16"]


@pytest.fixture
def facts_folder(tmp_path):
    from hybridmoe.analysis import compiled_facts

    kept = compiled_facts.folder()
    compiled_facts.use_folder(tmp_path / "program-facts")
    yield tmp_path / "program-facts"
    compiled_facts.use_folder(kept)


def _step(*overrides):
    from hybridmoe.recipe import load_config
    from hybridmoe.tools import train_program as tp

    cfg = load_config("tiny", [*ONE_LAYER, *overrides])
    return tp.compile_step(cfg, tp.host_target(), with_residuals=False)


def _no_compile(monkeypatch):
    from hybridmoe.analysis import program

    def refuse(*_, **__):
        raise AssertionError("compiled a program whose facts the folder holds")
    monkeypatch.setattr(program, "compile_with_buffers", refuse)
    monkeypatch.setattr(program, "read_buffer_assignment", refuse)


def test_a_second_inspect_reads_the_compiles_facts_and_compiles_nothing(facts_folder, monkeypatch):
    first = _step()
    assert not first.cached and len(list(facts_folder.glob("*.json.gz"))) == 1
    _no_compile(monkeypatch)
    second = _step()
    assert second.cached and second.compile_s == first.compile_s  # the compile's own time, kept
    assert second.program == first.program and second.peak_buffers == first.peak_buffers
    assert first.peak_buffers and first.program.memory["default_space"] > 0


def _lowered(fn=lambda x: x * 2, device=0):
    import jax

    arg = jax.ShapeDtypeStruct((8,), jax.numpy.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[device]))
    return jax.jit(fn).lower(arg)


def test_another_program_or_compiler_setting_is_another_entry(facts_folder, monkeypatch):
    _step()
    _no_compile(monkeypatch)
    with pytest.raises(AssertionError, match="compiled a program"):
        _step("mesh.data=4", "mesh.fsdp=2")  # the same shapes over another mesh: another program
    _each_ingredient_changes_the_key(monkeypatch)


def _each_ingredient_changes_the_key(monkeypatch):
    """The key's ingredients one at a time, on a program of one multiply."""
    import jax

    from hybridmoe.analysis import compiled_facts

    key = compiled_facts.key(_lowered(), False)
    assert key == compiled_facts.key(_lowered(), False)
    assert key != compiled_facts.key(_lowered(lambda x: x * 3), False)  # another program
    assert _lowered().as_text() == _lowered(device=1).as_text()
    assert key != compiled_facts.key(_lowered(device=1), False)  # the same text on another device
    assert key != compiled_facts.key(_lowered(), True)  # the buffer assignment only
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        assert key != compiled_facts.key(_lowered(), False)  # other compiler options
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    flagged = compiled_facts.key(_lowered(), False)
    assert key != flagged
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=false")
    assert flagged != compiled_facts.key(_lowered(), False)  # the TPU compiler's own flags
    # The code that parses the dumps, by its source (an edited parser must not read old entries).
    with tempfile.TemporaryDirectory() as folder:
        parser = Path(folder) / "parser.py"
        parser.write_text("A = 1\n")
        monkeypatch.setattr(compiled_facts, "_PARSERS", (parser,))
        before = compiled_facts.key(_lowered(), False)
        parser.write_text("A = 2\n")
        assert before != compiled_facts.key(_lowered(), False)


@pytest.mark.parametrize("dropped", ["program", "devices", "memory_only", "options", "environment", "parsers"])
def test_a_key_without_one_of_its_ingredients_is_caught(dropped, monkeypatch):
    """Broken variants of the key, each made of all but one ingredient: the test above finds two
    programs (or settings) that must not share an entry sharing one."""
    from hybridmoe.analysis import compiled_facts

    whole = compiled_facts.ingredients
    monkeypatch.setattr(compiled_facts, "ingredients",
                        lambda *a, **k: {n: v for n, v in whole(*a, **k).items() if n != dropped})
    with pytest.raises(AssertionError):
        _each_ingredient_changes_the_key(monkeypatch)


def test_a_refusal_for_memory_is_kept_and_raised_again(facts_folder, monkeypatch):
    import jax

    from hybridmoe.analysis import compiled_facts, program

    peak = [program.LiveBuffer("fusion.1", 2**30, "f32[16384,16384]", "jit(step)/dot", "main", None)]
    refusal = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(132.47G) exceeds available HBM (94.75G).")

    def refuse(*_, **__):
        error = jax.errors.JaxRuntimeError(refusal)
        error.peak_buffers = peak
        raise error
    monkeypatch.setattr(program, "compile_with_buffers", refuse)
    with pytest.raises(jax.errors.JaxRuntimeError) as first:
        compiled_facts.compile(_lowered())
    assert not first.value.cached
    _no_compile(monkeypatch)
    with pytest.raises(jax.errors.JaxRuntimeError) as second:
        compiled_facts.compile(_lowered())
    assert second.value.cached and str(second.value) == refusal and second.value.peak_buffers == peak
    # Another compile error is not kept: the next compile runs.
    def fail(*_, **__):
        raise jax.errors.JaxRuntimeError("INTERNAL: the compiler crashed")
    monkeypatch.setattr(program, "compile_with_buffers", fail)
    with pytest.raises(jax.errors.JaxRuntimeError, match="crashed"):
        compiled_facts.compile(_lowered(lambda x: x + 1))
    assert compiled_facts._load(compiled_facts.key(_lowered(lambda x: x + 1), False)) is None


def test_an_unreadable_entry_is_compiled_again_and_off_keeps_nothing(facts_folder, tmp_path):
    from hybridmoe.analysis import compiled_facts
    from hybridmoe.run.compile_cache import configure_compile_cache

    first = compiled_facts.compile(_lowered())
    (entry,) = facts_folder.glob("*.json.gz")
    entry.write_bytes(entry.read_bytes()[:100])  # cut short, as a full disk would leave it
    again = compiled_facts.compile(_lowered())
    assert not again.cached and (again.memory, again.cost) == (first.memory, first.cost)
    assert compiled_facts.compile(_lowered()).cached  # written whole again
    try:
        configure_compile_cache("off")
        assert compiled_facts.folder() is None and not compiled_facts.compile(_lowered()).cached
        assert configure_compile_cache(str(tmp_path / "mine")) == tmp_path / "mine"
        assert compiled_facts.folder() == tmp_path / "mine" / compiled_facts.SUBFOLDER
    finally:
        configure_compile_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])
