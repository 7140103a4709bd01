"""run.compile_cache_dir: a second run of the same program loads it from disk instead of compiling."""

import subprocess
import sys
from pathlib import Path

import pytest

from hybridmoe.run.compile_cache import DEFAULT_DIR, cache_dir

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train", "recipe=tiny", "train.steps=1", "train.batch_size=8", "train.seq_len=16", "gdn.chunk_size=8"]


def _train(folder: Path, out: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "hybridmoe", *TRAIN, f"run.compile_cache_dir={folder}",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _entries(folder: Path) -> dict[str, bytes]:
    """Each entry's last-read stamp (JAX rewrites it on every read of the entry)."""
    return {p.name: (folder / p.name.replace("-cache", "-atime")).read_bytes() for p in folder.glob("*-cache")}


def test_a_second_run_reads_every_program_the_first_compiled(tmp_path):
    # The suite's own cache (JAX_COMPILATION_CACHE_DIR, inherited) must not win over the key.
    folder = tmp_path / "cache"
    _train(folder, tmp_path / "first")
    first = _entries(folder)
    assert len(first) >= 2, "the first run stored its programs (the train step at least)"
    _train(folder, tmp_path / "second")
    second = _entries(folder)
    assert second.keys() == first.keys(), "the second run compiled a program the first had stored"
    # The training step and the state's initialisation were read back from the folder.
    reread = {name.split("-")[0] for name in first if second[name] != first[name]}
    assert {"jit_step", "jit_init"} <= reread, sorted(reread)


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
