"""JAX's persistent compilation cache, set from `run.compile_cache_dir` before the first compile.

A compiled program is stored under a key of its HLO, the compile options, the backend and the
versions, so a changed program or another JAX never reads a stale entry; a later run of the same
program (a second demo, a --resume) loads it instead of compiling. What `inspect` reads from a
compile (its HLO, memory figures and peak, or the compiler's refusal) is kept beside them, in the
folder's `program-facts` subfolder (analysis/compiled_facts.py), so inspecting the same program again
compiles nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from hybridmoe.run.run_dir import RunError

DEFAULT_DIR = Path.home() / ".cache" / "hybridmoe" / "xla"
# JAX is given no size cap: under one, every write lists the whole folder and reads each entry's
# access stamp to choose what to evict (0.66 s a write at 4,700 entries; a demo writes ~180). The
# folder is pruned when a command starts instead: past PRUNE_ABOVE bytes, the entries written
# longest ago go until PRUNE_TO remain (one read often but written long ago goes too; a compile
# brings it back). Without a cap JAX does not lock the folder either: a process that reads an
# entry another is still writing fails to decompress it, warns and compiles (the same program).
PRUNE_ABOVE, PRUNE_TO = 8 * 2**30, 4 * 2**30


def prune(folder: Path, above: int = PRUNE_ABOVE, to: int = PRUNE_TO) -> int:
    """While `folder` (its subfolders included) holds more than `above` bytes, delete the files
    written longest ago until at most `to` remain; the bytes deleted."""
    files = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # another process pruning the same folder
                continue
            files.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in files)
    if total <= above:
        return 0
    deleted = 0
    for _, size, path in sorted(files):
        if total - deleted <= to:
            break
        Path(path).unlink(missing_ok=True)
        deleted += size
    return deleted


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
    from hybridmoe.analysis import compiled_facts

    folder = cache_dir(setting)
    compiled_facts.use_folder(None if folder is None else folder / compiled_facts.SUBFOLDER)
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
    prune(folder)
    jax.config.update("jax_enable_compilation_cache", True)
    # Every program, however quick to compile: a step is many small programs besides the big one.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return folder
