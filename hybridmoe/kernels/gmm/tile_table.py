"""Measured tiles of the Pallas grouped matmuls, by chip generation and shape (`kernels.gmm.tiling=auto`).

The right tiles of a grouped matmul depend on the chip and on the shape: the 128 x 128 x 128 the
kernels fall back to is slow at large widths (a v5e chip measured 131 TFLOP/s at 512 x 2048 x 512
where the heuristic tiles leave most of the matrix unit idle). `hybridmoe tune-gmm` (tools/tune_gmm.py)
times candidate tiles on the chip it runs on for every grouped matmul a config's step calls and
writes the fastest into tile_table.json beside this module, one section per generation. With
`tiling=auto` each Pallas kernel, when it is traced, looks its own call up here:

- the generation is the traced program's devices' (a compile-only target's on any host);
- an entry matches a call of the same kernel kind (gmm, gmm_t, tgmm), contraction K, output width N
  and operand size, with rows per group within a factor MAX_ROWS_RATIO of the call's (the nearest
  wins): K and N equal keep the entry's tk / tn dividing the call's dimensions and its VMEM need
  unchanged (tm is capped to the rows as for any tile);
- anything else (no table, no section for the generation, no entry near the shape) runs the
  heuristic tiles, which is what `tiling=heuristic` always runs: on a TPU the chip's rule
  (TPU_RULE: 512 x 2048 x 512, each clipped to a lane-aligned divisor of its dimension), never the
  128 x 128 x 128 of tiling.DEFAULT, which a v5e chip ran at 8.4 TFLOP/s forward + backward at the
  seed cell's grouped matmul against the rule's 79 (docs/tpu.md); elsewhere tiling.DEFAULT.

The fused SwiGLU kernels (moe.wi_fused_swiglu, moe.wo_fused_dswiglu) keep their heuristic or explicit
tiles: their per-half tile fixes the stored pre-activation's layout for the whole layer.

This module reads the table only (kernels import nothing above them); the tuner writes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

from hybridmoe.kernels.gmm.tiling import DEFAULT, Tiling

TABLE_FILE = Path(__file__).with_name("tile_table.json")
ABOUT = "measured tiles of the Pallas grouped matmuls; `hybridmoe tune-gmm` refills a generation (kernels/gmm/tile_table.py)"
KINDS = ("gmm", "gmm_t", "tgmm")
# An entry serves calls whose rows per group are within this factor of its own.
MAX_ROWS_RATIO = 4.0


@dataclasses.dataclass(frozen=True)
class Call:
    """One grouped matmul as a kernel is called: its kind, rows M (all groups), contraction K,
    output width N, local groups, operand bytes per element, and the chip generation."""

    kind: str
    m: int
    k: int
    n: int
    groups: int
    itemsize: int
    generation: str | None

    @property
    def rows_per_group(self) -> float:
        return self.m / max(self.groups, 1)

    def key(self) -> dict:
        return {"kind": self.kind, "m": self.m, "k": self.k, "n": self.n, "groups": self.groups,
                "itemsize": self.itemsize}


_recorded: list[list[Call]] = []


@contextlib.contextmanager
def recording():
    """Collect every call the kernels look up while tracing inside the block (the tuner's shapes)."""
    calls: list[Call] = []
    _recorded.append(calls)
    try:
        yield calls
    finally:
        _recorded.remove(calls)


def read_table(path: Path = TABLE_FILE) -> dict:
    """{generation: {"entries": [...], ...}} (empty when no chip has filled the table)."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return table.get("generations", {})


_cache: dict[Path, tuple[float, dict]] = {}


def _table(path: Path) -> dict:
    """The table, read again only when the file changed (kernels look it up at every trace)."""
    try:
        stamp = path.stat().st_mtime
    except FileNotFoundError:
        return {}
    if path not in _cache or _cache[path][0] != stamp:
        _cache[path] = (stamp, read_table(path))
    return _cache[path][1]


def nearest_entry(call: Call, table: dict) -> dict | None:
    """The entry of `table` (read_table's form) that serves `call`, or None."""
    section = table.get(call.generation or "", {})
    best, best_distance = None, math.log(MAX_ROWS_RATIO) + 1e-9
    for e in section.get("entries", []):
        if (e["kind"], e["k"], e["n"], e["itemsize"]) != (call.kind, call.k, call.n, call.itemsize):
            continue
        distance = abs(math.log((e["m"] / max(e["groups"], 1)) / max(call.rows_per_group, 1e-9)))
        if distance <= best_distance:
            best, best_distance = e, distance
    return best


def lookup(call: Call, path: Path | None = None) -> Tiling | None:
    """The measured tiles for `call` (from the table at `path`, default TABLE_FILE), or None (the
    caller runs the heuristic ones)."""
    entry = nearest_entry(call, _table(path or TABLE_FILE))
    return None if entry is None else Tiling(tm=entry["tm"], tk=entry["tk"], tn=entry["tn"])


# The heuristic tiles of a plain grouped matmul on a TPU, measured on a v5e chip at the seed cell's
# uneven-group grouped matmul (65,536 x 4,096 -> 2,048, 128 groups): 79 TFLOP/s forward + backward,
# against 8.4 at 128^3 and 72 for XLA's ragged_dot. A 512-row tile over 2,048-deep contraction blocks
# keeps the matrix unit fed; its blocks (2 x (2 + 2) MiB bf16 operands, 1 MiB float32 accumulator,
# 2 x 0.5 MiB output) sit under v5e's 16 MiB scoped-VMEM default.
TPU_RULE = Tiling(tm=512, tk=2048, tn=512)


def lane_divisor(dim: int, preferred: int, lane: int = 128) -> int:
    """The largest multiple of `lane` no larger than `preferred` that divides `dim`; `dim` itself when
    none does (one tile spanning the dimension, which Mosaic accepts at any width)."""
    for tile in range(min(preferred, dim) // lane * lane, 0, -lane):
        if dim % tile == 0:
            return tile
    return dim


def tpu_rule(k: int, n: int) -> Tiling:
    """TPU_RULE at contraction k and output width n (tm is capped to the rows by the kernel)."""
    return Tiling(tm=TPU_RULE.tm, tk=lane_divisor(k, TPU_RULE.tk), tn=lane_divisor(n, TPU_RULE.tn))


def resolve(tiling: Tiling | None, kind: str, *, m: int, k: int, n: int, groups: int, itemsize: int) -> Tiling | None:
    """A kernel's tiles: explicit tiles as they are; for the table (Tiling.from_table) its entry for
    this call, else the heuristic tiles; for the heuristic (None), on a TPU the chip's rule, elsewhere
    None (the kernels' DEFAULT). The table's scoped-VMEM limit and buffer count are the tiling's."""
    if tiling is not None and not tiling.from_table:
        return tiling
    from hybridmoe.kernels.platform import trace_generation, trace_platform

    heuristic = tpu_rule(k, n) if trace_platform() == "tpu" else None
    if tiling is None:
        return heuristic
    call = Call(kind, m, k, n, groups, itemsize, trace_generation())
    for calls in _recorded:
        calls.append(call)
    found = lookup(call) or heuristic or DEFAULT
    return dataclasses.replace(found, vmem_limit_mib=tiling.vmem_limit_mib, rhs_buffer_count=tiling.rhs_buffer_count)
