"""What a jitted program does, read from its lowered (StableHLO) and compiled (HLO) text.

The program proofs of the performance levers use this module: which collectives a program runs
(kind, dtype, bytes), whether they sit inside a while loop (the layer scan) and how often per
iteration, the compiled memory figures and bytes accessed, and the residuals a remat policy saves.

Two texts, two truths:
- lowered: the program as JAX wrote it, before XLA. Explicit collectives (shard_map's psum,
  all_gather, ...) appear with the dtype JAX chose; collectives that the SPMD partitioner adds
  for jit shardings do not appear yet.
- compiled: the program the backend runs. Every collective, partitioner-made ones included, but
  the backend may rewrite dtypes (the CPU backend widens bf16 and f8 collectives to f32), so
  "what dtype moves on the wire" is a lowered-text question and "how many collectives run" is a
  compiled-text question.

Loop nesting: in HLO a while names its body computation; in StableHLO the body is a region
(`stablehlo.while ... cond { } do { }`) and may call private functions. Both are walked as a
call graph from the entry, so a collective reached through calls from a loop body counts as
inside that loop. `loop_depth` 0 = outside every loop.

`bytes` of a collective is the byte size of its result (all-gather: the gathered array;
reduce-scatter: the scattered shard; tuple results are summed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

import jax
import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute")

_DTYPE_BYTES = {
    "token": 0,  # HLO's ordering value (async-call starts and their dones pass one), no bytes
    "pred": 1, "i1": 1, "s8": 1, "u8": 1, "i8": 1, "ui8": 1, "s16": 2, "u16": 2, "i16": 2, "ui16": 2,
    "s32": 4, "u32": 4, "i32": 4, "ui32": 4, "s64": 8, "u64": 8, "i64": 8, "ui64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8E4M3FN": 1, "f8E5M2": 1, "f8E4M3": 1, "f8E4M3FNUZ": 1, "f8E5M2FNUZ": 1,
}


def dtype_bytes(dtype: str) -> int:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    raise ValueError(f"unknown element type {dtype!r} in program text")


def _normal_dtype(dtype: str) -> str:
    """One spelling for both texts: HLO s32/bf16/f8e4m3fn, StableHLO i32/bf16/f8E4M3FN."""
    d = dtype.lower()
    return {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64",
            "ui8": "u8", "ui16": "u16", "ui32": "u32", "ui64": "u64"}.get(d, d)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str            # one of KINDS
    dtype: str           # element type of the result, normalised (f32, bf16, s32, f8e4m3fn, ...)
    shape: tuple         # result shape (the first element's for a tuple result)
    bytes: int           # byte size of the whole result
    loop_depth: int      # 0 = outside every while loop
    loop: str | None     # the innermost enclosing loop (HLO: the while's name; StableHLO: "while#n")
    trip_count: int | None  # iterations of that loop when the compiler knows them
    computation: str     # where the op is written
    op_name: str         # HLO metadata op_name (jax's name stack) or ""
    shapes: tuple = ()   # every element's shape of a tuple result (the compiler combines collectives)

    @property
    def in_loop(self) -> bool:
        return self.loop_depth > 0


# ---------------------------------------------------------------------------------------------
# Compiled HLO text


_HLO_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_HLO_SHAPE = re.compile(r"([a-z]\w*?)\[([\d,]*)\]")
_HLO_CALLS = re.compile(r"\b(body|condition|to_apply|calls|branch_computations|"
                        r"true_computation|false_computation)=(\{[%\w.\-, ]+\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPNAME = re.compile(r'op_name="([^"]*)"')


def _hlo_result(type_text: str):
    """(dtype, first shape, total bytes) of an HLO result type such as `(f32[4]{0}, s32[])`."""
    shapes = _HLO_SHAPE.findall(type_text)
    if not shapes:
        return "?", (), 0
    total = 0
    for dt, dims in shapes:
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * dtype_bytes(dt)
    dt, dims = shapes[0]
    return _normal_dtype(dt), tuple(int(d) for d in dims.split(",") if d), total


def _hlo_kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def hlo_computations(text: str) -> tuple[list[tuple[str, list[re.Match]]], str]:
    """The computations of an HLO module's text in order, each (name, [its instructions' matches:
    name, result type, opcode, the rest]), and the entry's name.

    An instruction may span lines: inside a fused computation the TPU compiler prints a Mosaic
    call's backend config as indented JSON (its cost estimate over several lines, then a line
    starting "}," that closes it). While an instruction's braces are open, the lines after it
    continue it; a line starting with "}" after a whole instruction closes the computation (alone,
    or with the computation's attributes: `}, execution_thread="sparsecore"`)."""
    comps: list[tuple[str, list[re.Match]]] = []
    entry, ops, pending = None, None, None

    def flush():
        if ops is not None and pending is not None and (op := _HLO_OP.match(pending)):
            ops.append(op)

    for line in text.splitlines():
        m = _HLO_COMP.match(line)
        if m and not line.startswith(" "):
            flush()
            ops, pending = [], None
            comps.append((m.group(2), ops))
            entry = m.group(2) if m.group(1) else entry
        elif ops is None:
            continue
        elif pending is not None and pending.count("{") > pending.count("}"):
            pending += line.strip()  # inside the instruction's open braces
        elif line.startswith("}"):
            flush()
            ops, pending = None, None
        elif _HLO_OP.match(line):
            flush()
            pending = line
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _hlo_graph(text: str):
    """Every instruction of every computation, and the call edges: (comps, edges, entry).

    comps: name -> [(opcode, result type, instruction name, op_name)];
    edges: name -> [(callee, while name or "", trip count)] (a while's body/condition carry its name).
    """
    computations, entry = hlo_computations(text)
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    edges: dict[str, list[tuple[str, str, int | None]]] = defaultdict(list)
    for current, ops in computations:
        comps[current] = []
        for op in ops:
            name, type_text, opcode, rest = op.groups()
            for key, targets in _HLO_CALLS.findall(rest):
                for t in targets.strip("{}").replace("%", "").split(","):
                    t = t.strip()
                    if not t:
                        continue
                    if opcode == "while" and key == "body":
                        trip = _TRIP.search(rest)
                        edges[current].append((t, name, int(trip.group(1)) if trip else None))
                    elif opcode == "while" and key == "condition":
                        edges[current].append((t, name, None))
                    else:
                        edges[current].append((t, "", None))
            opname = _OPNAME.search(rest)
            comps[current].append((opcode, type_text, name, opname.group(1) if opname else ""))
    return comps, edges, entry


def _walk_hlo(text: str):
    """Yield (computation, depth, loop, trip, its instructions) for each computation reached from
    the entry, once per (computation, loop) it is reached in."""
    comps, edges, entry = _hlo_graph(text)
    seen: set[tuple[str, int, str | None]] = set()
    stack = [(entry, 0, None, None)]
    while stack:
        comp, depth, loop, trip = stack.pop()
        key = (comp, depth, loop)
        if key in seen or comp not in comps:
            continue
        seen.add(key)
        yield comp, depth, loop, trip, comps[comp]
        for target, while_name, while_trip in reversed(edges.get(comp, [])):
            if while_name:  # a while's body or condition: one level deeper
                stack.append((target, depth + 1, while_name, while_trip))
            else:
                stack.append((target, depth, loop, trip))


def parse_hlo(text: str) -> list[Collective]:
    """Every collective of a compiled HLO module, with its loop nesting."""
    out: list[Collective] = []
    for comp, depth, loop, trip, ops in _walk_hlo(text):
        for opcode, type_text, _, opname in ops:
            kind = _hlo_kind(opcode)
            if kind:
                dt, shape, nbytes = _hlo_result(type_text)
                shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in _HLO_SHAPE.findall(type_text))
                out.append(Collective(kind, dt, shape, nbytes, depth, loop, trip, comp, opname, shapes))
    return out


def loop_instructions(text: str) -> dict[str, Counter]:
    """{loop: Counter((opcode, result dtype) -> instructions)} of a compiled HLO module, for the
    instructions reached from each while loop's body (innermost loop; each written op once)."""
    out: dict[str, Counter] = defaultdict(Counter)
    for _, depth, loop, _, ops in _walk_hlo(text):
        if depth:
            for opcode, type_text, _, _ in ops:
                out[loop][(opcode, _hlo_result(type_text)[0])] += 1
    return dict(out)


# ---------------------------------------------------------------------------------------------
# Lowered StableHLO text


_MLIR_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.\-$]+)\(")
_MLIR_COLL = re.compile(r'"?stablehlo\.(all_gather|all_reduce|reduce_scatter|all_to_all|'
                        r'collective_permute|ragged_all_to_all)"?\(')
_MLIR_CALL = re.compile(r"\bcall\s+@([\w.\-$]+)\(")
_MLIR_TENSOR = re.compile(r"tensor<([^<>]*)>")


def _mlir_result(text: str):
    """(dtype, shape, bytes) of the result types after the op's `->` (or its only type)."""
    tail = text.rsplit("->", 1)[-1] if "->" in text else text.rsplit(":", 1)[-1]
    tensors = _MLIR_TENSOR.findall(tail)
    if not tensors:
        return "?", (), 0
    total, first = 0, None
    for t in tensors:
        parts = t.split("x")
        dims, dt = parts[:-1], parts[-1]
        n = int(np.prod([int(d) for d in dims])) if dims else 1
        total += n * dtype_bytes(dt)
        if first is None:
            first = (_normal_dtype(dt), tuple(int(d) for d in dims))
    return first[0], first[1], total


def parse_stablehlo(text: str) -> list[Collective]:
    """Every explicit collective of a lowered module, with its loop nesting through calls."""
    funcs: dict[str, list] = {}                  # name -> [(kind, dtype, shape, bytes, depth, loop)]
    calls: dict[str, list] = defaultdict(list)   # name -> [(callee, depth, loop)]
    entry = None
    current = None
    braces = 0
    loops: list[tuple[int, str]] = []            # open whiles: (brace depth at the op, loop id)
    pending: tuple[str, int, str | None] | None = None  # a collective whose type closes later
    n_while = 0
    for line in text.splitlines():
        f = _MLIR_FUNC.match(line)
        if f:
            current, braces, loops, pending = f.group(1), 0, [], None
            funcs[current] = []
            if entry is None or current == "main":
                entry = current
        if current is None:
            continue
        here = (len(loops), loops[-1][1] if loops else None)
        c = _MLIR_COLL.search(line)
        if c:
            pending = (c.group(1).replace("_", "-"), *here)
        for callee in _MLIR_CALL.findall(line):
            calls[current].append((callee, *here))
        # The op's result types end it: on its own line, or on the `}) : (...) -> ...` line
        # that closes its reduction region.
        if pending and re.search(r":\s*\(.*\)\s*->", line) and (c or line.lstrip().startswith("})")):
            kind, depth, loop = pending
            dt, shape, nbytes = _mlir_result(line)
            funcs[current].append((kind, dt, shape, nbytes, depth, loop))
            pending = None
        if "stablehlo.while" in line:
            n_while += 1
            loops.append((braces, f"{current}/while#{n_while}"))
        braces += line.count("{") - line.count("}")
        while loops and "}" in line and braces <= loops[-1][0]:
            loops.pop()
    if entry is None:
        raise ValueError("no func.func in the lowered text")
    out: list[Collective] = []

    def walk(fn: str, base_depth: int, base_loop: str | None, stack: tuple[str, ...]):
        if fn in stack or fn not in funcs:
            return
        for kind, dt, shape, nbytes, d, lp in funcs[fn]:
            out.append(Collective(kind, dt, shape, nbytes, base_depth + d, lp or base_loop, None,
                                  fn, "", (shape,)))
        for callee, d, lp in calls.get(fn, []):
            walk(callee, base_depth + d, lp or base_loop, stack + (fn,))

    walk(entry, 0, None, ())
    return out


# ---------------------------------------------------------------------------------------------
# Summaries


def count(colls: Iterable[Collective], *, kind: str | None = None, dtype: str | None = None,
          in_loop: bool | None = None) -> int:
    """How many collectives match (each written op once, not times its trip count)."""
    return sum(1 for c in colls if (kind is None or c.kind == kind)
               and (dtype is None or c.dtype == dtype)
               and (in_loop is None or c.in_loop == in_loop))


def table(colls: Iterable[Collective]) -> dict[tuple[str, str, bool], dict[str, int]]:
    """{(kind, dtype, in_loop): {"ops": n, "bytes": per-execution bytes summed}}."""
    acc: dict = defaultdict(lambda: {"ops": 0, "bytes": 0})
    for c in colls:
        row = acc[(c.kind, c.dtype, c.in_loop)]
        row["ops"] += 1
        row["bytes"] += c.bytes
    return dict(acc)


def per_iteration(colls: Iterable[Collective]) -> dict[str, Counter]:
    """{loop: Counter(kind -> ops run per iteration)} for the collectives inside loops."""
    out: dict[str, Counter] = defaultdict(Counter)
    for c in colls:
        if c.in_loop:
            out[c.loop][c.kind] += 1
    return dict(out)


def executed_bytes(colls: Iterable[Collective]) -> int:
    """Bytes moved by one run of the program: loop collectives times their known trip count."""
    return sum(c.bytes * (c.trip_count or 1 if c.in_loop else 1) for c in colls)


# ---------------------------------------------------------------------------------------------
# From a jitted function


@dataclasses.dataclass
class Program:
    """A jitted function's lowered and compiled forms and what they say."""
    lowered_text: str
    compiled_text: str
    memory: dict[str, int]
    cost: dict[str, float]

    @property
    def lowered_collectives(self) -> list[Collective]:
        return parse_stablehlo(self.lowered_text)

    @property
    def compiled_collectives(self) -> list[Collective]:
        return parse_hlo(self.compiled_text)

    @property
    def bytes_accessed(self) -> float:
        return float(self.cost.get("bytes accessed", 0.0))

    @property
    def temp_bytes(self) -> int:
        return int(self.memory.get("temp", 0))


def memory_figures(compiled) -> dict[str, int]:
    """The compiled memory figures in bytes: temp, argument, output, alias, generated code."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {"temp": int(m.temp_size_in_bytes), "argument": int(m.argument_size_in_bytes),
            "output": int(m.output_size_in_bytes), "alias": int(m.alias_size_in_bytes),
            "generated_code": int(m.generated_code_size_in_bytes)}


def cost_figures(compiled) -> dict[str, float]:
    """XLA's cost analysis (flops, "bytes accessed", ...); the per-operand breakdown dropped."""
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    return {k: float(v) for k, v in (c or {}).items() if "{" not in k}


def analyze(fn: Callable, *args, **kwargs) -> Program:
    """Lower and compile `fn` (jitted if it is not already) for these arguments."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile()
    return Program(lowered.as_text(), compiled.as_text(), memory_figures(compiled),
                   cost_figures(compiled))


# ---------------------------------------------------------------------------------------------
# What fills memory at the peak (XLA's buffer assignment)


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One buffer live at the program's peak of memory, per device."""
    value: str           # the HLO value: instruction name, and tuple index when not the whole result
    bytes: int           # what it takes in its allocation (its layout's size, tile padding included)
    shape: str           # dtype[dims] (a tuple result: "tuple")
    op_name: str         # jax's name stack of the op that makes it ("" for an argument)
    computation: str     # the HLO computation that makes it
    loop: str | None     # the innermost while loop (the layer scan, ...) it is made in; None outside
    storage: str = "temp"  # its allocation: "temp", "argument", "output", "constant", "thread-local" or
    #                        "on-chip" (another memory space than the device's main one: TPU VMEM, ...)

    @property
    def in_loop(self) -> bool:
        return self.loop is not None


_PEAK_SECTION = re.compile(r"Live ranges at \d+ \(peak\):\n((?:[ \t]+\S.*\n?)+)")
_PEAK_LINE = re.compile(r"^\s+(\S+?)(\{[\d,]*\})?: (\d+) bytes")
_VALUE_LINE = re.compile(r"value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=\d+,offset=\d+\): (\S+)")


_ALLOCATION_LINE = re.compile(r"^allocation \d+: size \d+,(.*)$")
_VALUE_IN_ALLOCATION = re.compile(r"^ value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),")


def _storage(allocation_tags: str) -> str:
    """What an allocation of the buffer assignment holds, from its tags: an entry parameter
    (arguments; those the output reuses too), the output, constants, a CPU thread's scratch, or
    temporaries (everything else: `memory_analysis().temp_size_in_bytes` counts these)."""
    color = re.search(r"\bcolor (\d+)", allocation_tags)
    if color and color.group(1) != "0":
        return "on-chip"
    if "parameter" in allocation_tags:
        return "argument"
    if "constant" in allocation_tags:
        return "constant"
    if "thread-local" in allocation_tags:
        return "thread-local"
    if "output shape" in allocation_tags or "maybe-live-out" in allocation_tags:
        return "output"
    return "temp"


def value_storage(buffer_assignment_text: str) -> dict[tuple[str, str], tuple[str, int]]:
    """{(HLO value name, tuple index): (the kind of allocation it lives in (see `_storage`), the
    bytes it takes there: its layout's, tile padding included)}."""
    out: dict[tuple[str, str], tuple[str, int]] = {}
    kind = None
    for line in buffer_assignment_text.splitlines():
        a = _ALLOCATION_LINE.match(line)
        if a:
            kind = _storage(a.group(1))
            continue
        v = _VALUE_IN_ALLOCATION.match(line)
        if v and kind:
            out.setdefault((v.group(1), v.group(2) or "{}"), (kind, int(v.group(3))))
    return out


_ALLOCATION_SIZE = re.compile(r"^allocation \d+: size (\d+),(.*)$", re.M)


def argument_bytes(buffer_assignment_text: str) -> int:
    """The bytes of the allocations that hold the entry computation's parameters: what
    `memory_analysis().argument_size_in_bytes` reports, read from the buffer assignment."""
    return sum(int(size) for size, tags in _ALLOCATION_SIZE.findall(buffer_assignment_text)
               if _storage(tags) == "argument")


def _shape_text(hlo_type: str) -> str:
    """`f32[4,512]{1,0:T(8,128)}` -> `f32[4,512]`; a tuple type -> `tuple`."""
    return "tuple" if hlo_type.startswith("(") else hlo_type.split("{", 1)[0]


def peak_buffers(live_range_text: str, buffer_assignment_text: str, hlo_text: str) -> list[LiveBuffer]:
    """The buffers live at the peak, largest first, from the dumps XLA writes with `xla_dump_to`:
    the live-range report (its "Live ranges at N (peak)" section), the buffer assignment (each
    value's shape) and the optimized HLO module (each instruction's computation, loop, op_name)."""
    section = _PEAK_SECTION.search(live_range_text)
    if not section:
        return []
    shapes = {}
    for name, index, hlo_type in _VALUE_LINE.findall(buffer_assignment_text):
        shapes.setdefault((name, index or "{}"), _shape_text(hlo_type))
    storage = value_storage(buffer_assignment_text)
    where = {}
    for comp, _, loop, _, ops in _walk_hlo(hlo_text):
        for _, _, name, opname in ops:
            where.setdefault(name, (comp, loop, opname))
    out = []
    for line in section.group(1).splitlines():
        m = _PEAK_LINE.match(line)
        if not m:
            continue
        name, index, nbytes = m.group(1), m.group(2) or "{}", int(m.group(3))
        comp, loop, opname = where.get(name, ("?", None, ""))
        if not opname and loop:  # a loop body's parameter: state the loop carries (the scan's stacks, ...)
            opname = f"{where.get(loop, ('', None, ''))[2] or loop} [carried by the loop]"
        value = name if index == "{}" else f"{name}{index}"
        kind, padded = storage.get((name, index), ("temp", nbytes))
        out.append(LiveBuffer(value, padded, shapes.get((name, index), "?"), opname, comp, loop, kind))
    return sorted(out, key=lambda b: -b.bytes)


@contextlib.contextmanager
def without_persistent_cache():
    """The persistent compilation cache leaves the dump options out of its key, so an executable
    read from it comes without the dumps: compile past it. JAX decides whether to use the cache once
    per process; resetting it before and after makes it decide again (off inside, as configured
    after)."""
    from jax._src import config as jax_config
    from jax.experimental.compilation_cache import compilation_cache

    with jax_config.enable_compilation_cache(False):
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            compilation_cache.reset_cache()


_DEFAULT_SPACE = re.compile(r"^Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", re.M)


def default_space_bytes(memory_usage_report: str) -> int | None:
    """The bytes XLA's memory-usage report places in the default memory space (HBM on a TPU: the
    arguments and the temporaries' heap as buffer assignment packed them), or None without one."""
    m = _DEFAULT_SPACE.search(memory_usage_report)
    return int(m.group(1)) if m else None


class _Dumps:
    """XLA's text dumps of one compile, in a temporary folder: the compiler options that write them
    and readers of the main module's files."""

    REPORT = "after_optimizations-memory-usage-report.txt"
    # What reading the buffer assignment needs; XLA writes them together, before code generation.
    BUFFER_ASSIGNMENT = ("after_optimizations.txt", "after_optimizations-buffer-assignment.txt",
                         "after_optimizations-live-range.txt", REPORT)

    def __init__(self, module_name: str | None):
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="hybridmoe-xla-dump-")
        self.options = {"xla_dump_to": self.folder, "xla_dump_hlo_as_text": True}
        if module_name:
            self.options["xla_dump_hlo_module_re"] = module_name

    def path(self, suffix: str) -> str | None:
        """The main module's file (Pallas kernel modules are dumped beside it: the largest)."""
        import glob
        import os

        found = sorted(glob.glob(os.path.join(self.folder, f"*{suffix}")), key=os.path.getsize)
        return found[-1] if found else None

    def read(self, suffix: str) -> str:
        found = self.path(suffix)
        return open(found).read() if found else ""

    def sizes(self) -> tuple | None:
        """The buffer-assignment files' sizes, or None while one is missing or empty."""
        import os

        paths = [self.path(s) for s in self.BUFFER_ASSIGNMENT]
        if not all(paths):
            return None
        sizes = tuple(os.path.getsize(p) for p in paths)
        return sizes if all(sizes) else None

    def buffers(self, hlo_text: str) -> list[LiveBuffer]:
        return peak_buffers(self.read("after_optimizations-live-range.txt"),
                            self.read("after_optimizations-buffer-assignment.txt"), hlo_text)

    def default_space(self) -> int | None:
        return default_space_bytes(self.read(self.REPORT))

    def arguments(self) -> int:
        return argument_bytes(self.read("after_optimizations-buffer-assignment.txt"))

    def remove(self):
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def _compile(lowered, dumps: _Dumps):
    """The compile itself, past the persistent cache (which would skip the dumps). A compile that
    fails re-raises with the error's `peak_buffers` set: the compiler writes the buffer assignment
    before it refuses a program for memory, so a refusal says what filled memory too."""
    try:
        with without_persistent_cache():
            return lowered.compile(compiler_options=dumps.options)
    except Exception as e:
        e.peak_buffers = dumps.buffers(dumps.read("after_optimizations.txt"))
        raise


def compile_with_buffers(lowered, module_name: str | None = None, *, buffers: bool = True):
    """(compiled, the buffers live at its peak, the default memory space's bytes from XLA's
    memory-usage report or None): compiles with XLA's dumps into a temporary folder (removed after)
    and reads them. `module_name`: a regex of the module to dump (default all); `buffers=False`:
    the buffers are not read (an empty list; a run's memory plan needs the figure alone). A compile
    refused re-raises with the error's `peak_buffers` set (`_compile`)."""
    dumps = _Dumps(module_name)
    try:
        compiled = _compile(lowered, dumps)
        return compiled, dumps.buffers(compiled.as_text()) if buffers else [], dumps.default_space()
    finally:
        dumps.remove()


COMPILE_THREAD = "xla-compile"  # the name of the thread a compile read early goes on in


@dataclasses.dataclass
class BufferAssignment:
    """A compile read at its buffer assignment, before code generation: the optimised HLO module,
    the buffers live at its peak, the default memory space's bytes and the arguments' (as the
    compiler's memory analysis counts them). `compiled` is the
    executable when the compile finished before the dumps were read (small programs), else None:
    the compile goes on in the thread named COMPILE_THREAD (see `read_buffer_assignment`)."""
    hlo_text: str
    buffers: list[LiveBuffer]
    default_space: int | None
    argument: int
    compiled: object | None


def read_buffer_assignment(lowered, module_name: str, poll_s: float = 0.25) -> BufferAssignment:
    """What `compile_with_buffers` reads, as soon as XLA has written it: after the HLO passes and
    buffer assignment, before code generation (at the 397B cell 86 s into a 930 s compile on 2
    cores). The compile runs in a daemon thread (XLA releases the GIL) while this thread waits for
    the main module's buffer-assignment dumps to appear and stop growing; the compile is not
    stopped (XLA cannot be interrupted), so a process that read a large program this way ends with
    `os._exit` once its results are written (cli.entry). A compile that finishes or fails first
    returns or raises as `compile_with_buffers` does. Code generation's own checks (the Pallas
    kernels' on-chip memory) are not reached: the validator's VMEM model refuses those at load."""
    import threading
    import time

    dumps = _Dumps(module_name)
    outcome: dict = {}

    def run():
        try:
            outcome["compiled"] = _compile(lowered, dumps)
        except BaseException as e:  # handed to the reading thread
            outcome["error"] = e
        finally:
            outcome["done"] = True
            if outcome.get("read"):
                dumps.remove()

    thread = threading.Thread(target=run, name=COMPILE_THREAD, daemon=True)
    thread.start()
    last = None
    while not outcome.get("done"):
        sizes = dumps.sizes()
        if sizes is not None and sizes == last:
            hlo = dumps.read("after_optimizations.txt")
            read = BufferAssignment(hlo, dumps.buffers(hlo), dumps.default_space(), dumps.arguments(), None)
            outcome["read"] = True
            if outcome.get("done"):  # finished while being read: the folder is this thread's to remove
                dumps.remove()
            return read
        last = sizes
        time.sleep(poll_s)
    thread.join()
    try:
        if "error" in outcome:
            raise outcome["error"]
        compiled = outcome["compiled"]
        return BufferAssignment(compiled.as_text(), dumps.buffers(compiled.as_text()), dumps.default_space(),
                                dumps.arguments(), compiled)
    finally:
        dumps.remove()


# ---------------------------------------------------------------------------------------------
# Remat residuals


@dataclasses.dataclass(frozen=True)
class Residual:
    shape: tuple
    dtype: str
    source: str          # jax's description: "from the argument ...", "named 'x' from ...", ...
    name: str | None     # the checkpoint name when the residual was saved by name


_NAMED = re.compile(r"named '([^']+)'")


def saved_residuals(fn: Callable, *args) -> list[Residual]:
    """What the forward of `fn` keeps for its backward under the remat policies inside it.

    Call it on the checkpointed function itself (one block); under a scan the residuals are
    the scan's stacked outputs and lose their names. Uses the implementation behind
    `jax.ad_checkpoint.print_saved_residuals`.
    """
    from jax._src.ad_checkpoint import saved_residuals as _saved

    out = []
    for aval, src in _saved(fn, *args):
        named = _NAMED.search(src)
        out.append(Residual(tuple(aval.shape), str(np.dtype(aval.dtype)), src,
                            named.group(1) if named else None))
    return out


def saved_names(fn: Callable, *args) -> Counter:
    """Counter of the checkpoint names among the saved residuals."""
    return Counter(r.name for r in saved_residuals(fn, *args) if r.name)


# ---------------------------------------------------------------------------------------------
# Jaxpr walking


def iter_eqns(jaxpr):
    """Every equation of a (closed) jaxpr and of the jaxprs nested in its equations' params."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in inner.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from iter_eqns(sub)


def iter_eqns_outside_kernels(jaxpr):
    """Like iter_eqns, but not into the bodies of pallas_call kernels (the ops XLA runs)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in inner.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from iter_eqns_outside_kernels(sub)


def ops_by_shape(jaxpr) -> Counter:
    """Counter of (primitive, output shape, output dtype) over the ops outside Pallas kernels."""
    out = Counter()
    for eqn in iter_eqns_outside_kernels(jaxpr):
        for v in eqn.outvars:
            aval = getattr(v, "aval", None)
            if hasattr(aval, "shape"):
                out[(eqn.primitive.name, tuple(aval.shape), str(aval.dtype))] += 1
    return out


def pallas_operand_shapes(jaxpr) -> list[tuple[str, tuple]]:
    """(kernel name, operand shapes) of every pallas_call, in program order."""
    return [(eqn.params.get("name") or str(eqn.params.get("name_and_src_info", "")),
             tuple(tuple(v.aval.shape) for v in eqn.invars))
            for eqn in iter_eqns(jaxpr) if eqn.primitive.name == "pallas_call"]


def primitive_counts(jaxpr) -> Counter:
    """Counter of primitive names over the whole nested jaxpr."""
    return Counter(eqn.primitive.name for eqn in iter_eqns(jaxpr))


def pallas_kernels(jaxpr) -> list[tuple[str, tuple]]:
    """(kernel name, per-operand pipeline modes) of every pallas_call, in program order."""
    out = []
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name == "pallas_call":
            modes = tuple(getattr(bm, "pipeline_mode", None)
                          for bm in eqn.params["grid_mapping"].block_mappings)
            out.append((eqn.params.get("name") or str(eqn.params.get("name_and_src_info", "")), modes))
    return out
