"""JAX's persistent compilation cache, set from `run.compile_cache_dir` before the first compile.

A compiled program is stored under a key of its HLO, the compile options, the backend and the
versions, so a changed program or another JAX never reads a stale entry; a later run of the same
program (a second demo, a --resume, inspect of the same recipe) loads it instead of compiling.
"""

from __future__ import annotations

from pathlib import Path

import jax

from hybridmoe.run.run_dir import RunError

DEFAULT_DIR = Path.home() / ".cache" / "hybridmoe" / "xla"
# Least recently used entries are evicted past this size (JAX then also locks the folder, so
# processes sharing it read and write whole entries).
MAX_BYTES = 8 * 2**30


def cache_dir(setting: str) -> Path | None:
    """The folder `run.compile_cache_dir` names (None: off). auto keeps a folder JAX was already
    given (its jax_compilation_cache_dir option), else DEFAULT_DIR."""
    if setting == "off":
        return None
    if setting == "auto":
        return Path(jax.config.jax_compilation_cache_dir or DEFAULT_DIR)
    return Path(setting).expanduser()


def configure_compile_cache(setting: str) -> Path | None:
    """Point JAX's persistent cache at `setting`'s folder (created here); the folder, or None when off."""
    folder = cache_dir(setting)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"run.compile_cache_dir: cannot create {folder} ({e.strerror}); give a writable folder, "
                       "or off") from None
    if str(folder) != jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_enable_compilation_cache", True)
    # Every program, however quick to compile: a step is many small programs besides the big one.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return folder
