"""run.compile_cache_dir: a second run of the same program loads it from disk instead of compiling."""

import os
import re
import subprocess
import sys
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
