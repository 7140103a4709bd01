"""What a compile says, kept on disk so that the same program is not compiled twice to read it.

`inspect`, the step estimate and the program proofs read facts from a compile: the optimised HLO,
the memory figures and cost analysis, the buffers live at the peak (XLA's dumps) and the default
memory space's bytes, or the compiler's refusal of a program too large for the device. JAX's
persistent cache cannot give them back: its key leaves the dump options out, so an executable read
from it comes without the dumps, and a compile-only TPU client cannot load an executable at all.
So a repeated `inspect` of a 397B cell compiled again for 15 minutes to print the same table.

`compile` keeps the facts (not the executable) in one file per program, under a key of:
the lowered program's text (kernels included: a Mosaic kernel's body is an attribute of its custom
call), the devices it is assigned to (platform, kind, id, coordinates), the backend's version
(libtpu's build on a TPU target), the JAX and jaxlib versions, the compiler settings JAX passes
(optimisation levels and efforts, XLA_FLAGS and LIBTPU_INIT_ARGS), what was read (the whole
compile, or the buffer assignment only) and the source of the code that parses the dumps
(analysis/program.py and this module). A change to any of them is a new key, so a stale entry is
never read. A refusal for memory (the device's or a kernel's on-chip memory) is kept as its message and
peak, and raised again as the compiler raised it; any other compile error is not kept.

The folder is run.compile_cache_dir's, in its `program-facts` subfolder (run/compile_cache.py sets
it, and prunes it with JAX's entries); with the setting off nothing is read or written. An entry is
written to a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import time
from pathlib import Path

import jax
import jaxlib

from hybridmoe.analysis import program
from hybridmoe.analysis.device_refusal import device_refusal

SUBFOLDER = "program-facts"
FORMAT = 1
# The jax options that change what the compiler does with a given program (the rest shape the
# lowering, which the program's text already holds).
_COMPILER_OPTIONS = ("jax_disable_most_optimizations", "jax_optimization_level", "jax_memory_fitting_effort",
                     "jax_exec_time_optimization_effort")
_PARSERS = (Path(program.__file__), Path(__file__))

_folder: Path | None = None


def use_folder(folder: Path | None) -> None:
    """Keep and read facts in `folder` (created on the first write); None: neither."""
    global _folder
    _folder = None if folder is None else Path(folder)


def folder() -> Path | None:
    return _folder


@dataclasses.dataclass
class Facts:
    """One compile's facts. `memory`: the compiler's memory figures (program.memory_figures) with
    `default_space` where XLA's report gives it; read at the buffer assignment only (memory_only),
    `argument`, `default_space` and `memory_only` alone, and no cost. `compile_s`: how long the
    compile (or the read) took when it ran; `cached`: whether these came from the folder."""
    hlo_text: str
    memory: dict
    cost: dict
    buffers: list[program.LiveBuffer]
    compile_s: float
    cached: bool = False


def memory_refusal(error: BaseException) -> bool:
    """A compiler's refusal of the program for memory (the device's, or a kernel's on-chip): the
    same program is refused the same way."""
    return device_refusal(error) is not None


def _rows(buffers: list[program.LiveBuffer]) -> list[dict]:
    return [dataclasses.asdict(b) for b in buffers]


def ingredients(lowered, memory_only: bool, lowered_text: str | None = None) -> dict | None:
    """What the key is made of (module docstring; `lowered_text`: lowered.as_text() where the caller
    has it); None where this JAX does not say which devices a lowered program is assigned to (then
    nothing is cached)."""
    devices = getattr(getattr(lowered, "_lowering", None), "_device_list", None)
    if devices is None:
        return None
    devices = list(devices)
    return {
        "format": FORMAT,
        "program": lowered.as_text() if lowered_text is None else lowered_text,
        "memory_only": memory_only,
        "devices": [(d.platform, d.device_kind, d.id, list(getattr(d, "coords", None) or [])) for d in devices],
        "backend": devices[0].client.platform_version,
        "versions": [jax.__version__, jaxlib.__version__],
        "options": {name: jax.config.values.get(name) for name in _COMPILER_OPTIONS},
        "environment": {name: os.environ.get(name, "") for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "parsers": [hashlib.sha256(p.read_bytes()).hexdigest() for p in _PARSERS],
    }


def key(lowered, memory_only: bool, lowered_text: str | None = None) -> str | None:
    """The entry's key: a digest of its `ingredients`, or None without them."""
    made_of = ingredients(lowered, memory_only, lowered_text)
    return None if made_of is None else hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()


def _path(entry: str) -> Path:
    return _folder / f"{entry}.json.gz"


def _load(entry: str) -> Facts | None:
    """The entry's facts (raising the kept refusal), or None when there is none or it is unreadable."""
    try:
        with gzip.open(_path(entry), "rt") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError):
        return None
    buffers = [program.LiveBuffer(**b) for b in data["buffers"]]
    if "refusal" in data:
        error = jax.errors.JaxRuntimeError(data["refusal"])
        error.peak_buffers = buffers
        error.compile_s, error.cached = data["compile_s"], True
        raise error
    return Facts(data["hlo_text"], data["memory"], data["cost"], buffers, data["compile_s"], cached=True)


def _store(entry: str, data: dict) -> None:
    """Write the entry whole or not at all (a full disk or a read-only folder only loses the entry)."""
    try:
        _folder.mkdir(parents=True, exist_ok=True)
        partial = _path(entry).with_suffix(f".{os.getpid()}.partial")
        with gzip.open(partial, "wt", compresslevel=1) as f:
            json.dump(data, f)
        os.replace(partial, _path(entry))
    except OSError:
        pass


def compile(lowered, module_name: str | None = None, *, memory_only: bool = False,  # noqa: A001
            lowered_text: str | None = None) -> Facts:
    """The facts of compiling `lowered`: from the folder when an entry has them, else compiled with
    XLA's dumps (program.compile_with_buffers; memory_only: program.read_buffer_assignment, whose
    compile may go on in a thread) and kept. A refusal for memory raises as the compiler's error, with
    `peak_buffers`, `compile_s` and `cached` set, from the compile or from the entry."""
    entry = key(lowered, memory_only, lowered_text) if _folder is not None else None
    if entry is not None:
        cached = _load(entry)
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    try:
        if memory_only:
            read = program.read_buffer_assignment(lowered, module_name=module_name)
            compiled, buffers, default_space = read.compiled, read.buffers, read.default_space
        else:
            compiled, buffers, default_space = program.compile_with_buffers(lowered, module_name=module_name)
    except jax.errors.JaxRuntimeError as e:  # the compiler's error; any other passes through untouched
        e.compile_s, e.cached = time.perf_counter() - t0, False
        if entry is not None and memory_refusal(e):
            _store(entry, {"refusal": str(e), "buffers": _rows(getattr(e, "peak_buffers", [])), "compile_s": e.compile_s})
        raise
    compile_s = time.perf_counter() - t0
    if compiled is None:  # read before code generation: the report's figures only
        facts = Facts(read.hlo_text, {"argument": read.argument, "default_space": default_space, "memory_only": True},
                      {}, buffers, compile_s)
    else:
        memory = program.memory_figures(compiled) | ({} if default_space is None else {"default_space": default_space})
        facts = Facts(compiled.as_text(), memory, program.cost_figures(compiled), buffers, compile_s)
    if entry is not None:
        _store(entry, {"hlo_text": facts.hlo_text, "memory": facts.memory, "cost": facts.cost,
                       "buffers": _rows(facts.buffers), "compile_s": compile_s})
    return facts
