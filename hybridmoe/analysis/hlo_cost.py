"""What each instruction of a compiled program costs, hardware aside: FLOPs, bytes, Pallas grid
steps and collective wire bytes, loops' trip counts applied (analysis/step_estimate.py turns these
into seconds on a target).

- FLOPs: each dot, convolution and ragged dot from its HLO shapes (2 x result elements x the
  contracted size; TPU fusions hold dots as convolutions, whose window taps count only where they
  land on real input), wherever it sits (a fusion's body too); a float32 dot at HIGHEST precision
  costs 6 bfloat16 MXU passes, HIGH 3 (XLA's TPU lowering). Elementwise work counts no FLOPs.
- bytes: a top-level instruction's operands plus its result (a fusion: its boundary, not its
  body's intermediates, which stay on chip), except what touches part of a buffer: a slice reads
  what it returns, an in-place update moves its update, and a fusion reads of a parameter only the
  slices its body takes (through bitcasts, relayouts and nested fusions).
- loops: a while body runs its trip count times: the `known_trip_count` XLA annotates, else the
  induction variable's compare against a constant in the loop condition (start from the
  while's initial tuple); nested loops multiply. XLA's own cost analysis counts a body once.
- conditionals: the most expensive branch (an upper bound: a causal block skip is not seen).
- calls and async calls (the TPU7x compiler's SparseCore offloads: call-start) are walked into.
- Pallas calls (the Mosaic `tpu_custom_call`): the kernel's stated `pl.CostEstimate` (FLOPs,
  bytes accessed) and its grid (`iteration_bounds` of the serialised kernel). A dynamic grid
  dimension is bounded by the length of its scalar-prefetch tables.
- collectives: wire bytes per device (ring algorithms: an all-gather moves (n-1)/n of its result,
  a reduce-scatter (n-1) shards, an all-reduce 2 (n-1)/n of its buffer); n from the op's replica
  groups.

Categories: grouped matmuls, attention, GDN, dense matmuls, collectives, the rest. An op belongs
to a kernel's category by the Pallas kernel's name or by the name scope the model's kernel entry
points open (`grouped_matmul`, `attention_core`, `gdn_core`: jax keeps them in every op's
`op_name`, forward and backward); any other dot is a dense matmul.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import re
from collections import defaultdict

import numpy as np

from hybridmoe.analysis.program import _HLO_SHAPE, _OPNAME, dtype_bytes, hlo_computations

# ---------------------------------------------------------------------------------------------
# The HLO text as instructions


@dataclasses.dataclass
class Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str
    op_name: str
    args: str = ""               # the operands' text (a constant's literal)
    root: bool = False           # the computation's ROOT


def _split_call(rest: str) -> tuple[str, str]:
    """(operands text, attributes text) of `a, b), attr=...` (the opcode's paren already eaten)."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:]
    return rest, ""


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """({computation: [instructions]}, entry name) of an HLO module's text."""
    computations, entry = hlo_computations(text)
    comps: dict[str, list[Instr]] = {}
    for current, ops in computations:
        comps[current] = []
        for op in ops:
            name, type_text, opcode, rest = op.groups()
            operands, attrs = _split_call(rest)
            opname = _OPNAME.search(attrs)
            comps[current].append(Instr(name, type_text, opcode, re.findall(r"%([\w.\-]+)", operands), attrs,
                                        opname.group(1) if opname else "", operands,
                                        op.group(0).lstrip().startswith("ROOT ")))
    return comps, entry


def _shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _HLO_SHAPE.findall(type_text)]


def type_bytes(type_text: str) -> int:
    return sum(math.prod(dims) * dtype_bytes(dt) for dt, dims in _shapes(type_text))


_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def _fused_callee(i: Instr) -> str | None:
    """The computation a fusion calls; None for any other instruction."""
    m = _CALLS.search(i.attrs) if i.opcode == "fusion" else None
    return m.group(1) if m else None


def _dims_attr(attrs: str, key: str) -> tuple[int, ...]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


# ---------------------------------------------------------------------------------------------
# Trip counts

_KNOWN_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def constant_of(instr: Instr) -> int | None:
    """The value of a scalar integer `constant(N)`, else None."""
    if instr.opcode != "constant" or not re.match(r"[su]\d+\[\]", instr.type_text):
        return None
    m = re.fullmatch(r"\s*(-?\d+)\s*", instr.args)
    return int(m.group(1)) if m else None


def trip_count(while_instr: Instr, comps: dict[str, list[Instr]], where: list[Instr]) -> int | None:
    """Iterations of a while: XLA's known_trip_count, else `i < N` (or <=, >, >=, !=) on a
    tuple element against a constant in the condition, counted from that element's initial
    value in the while's operand tuple (a constant), with step 1. None when neither is readable."""
    known = _KNOWN_TRIP.search(while_instr.attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", while_instr.attrs)
    if not cond or cond.group(1) not in comps:
        return None
    body = comps[cond.group(1)]
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None
    operands = root.operands if root is not None else []
    if root is not None and root.opcode == "fusion":  # the CPU wraps the compare in a fusion
        inner = comps.get(_fused_callee(root), [])
        params = {i.name: int(i.args) for i in inner if i.opcode == "parameter" and i.args.strip().isdigit()}
        compare = inner[-1] if inner and inner[-1].opcode == "compare" else None
        if compare is None or any(o not in params for o in compare.operands):
            return None
        root, operands = compare, [root.operands[params[o]] for o in compare.operands]
    if root is None or root.opcode != "compare" or len(operands) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root.attrs).group(1)
    a, b = (by_name.get(o) for o in operands)
    if a is None or b is None:
        return None
    if a.opcode == "constant" and b.opcode == "get-tuple-element":
        a, b = b, a
        direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    if a.opcode != "get-tuple-element" or b.opcode != "constant":
        return None
    limit = constant_of(b)
    index = re.search(r"index=(\d+)", a.attrs)
    start = _initial_value(while_instr, int(index.group(1)) if index else None, where)
    if limit is None or start is None:
        return None
    n = {"LT": limit - start, "LE": limit - start + 1, "NE": limit - start,
         "GT": start - limit, "GE": start - limit + 1}.get(direction)
    return max(n, 0) if n is not None else None


def _initial_value(while_instr: Instr, index: int | None, where: list[Instr]) -> int | None:
    if index is None or not while_instr.operands:
        return None
    by_name = {i.name: i for i in where}
    init = by_name.get(while_instr.operands[0])
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    element = by_name.get(init.operands[index])
    while element is not None and element.opcode in ("copy", "bitcast", "convert") and element.operands:
        element = by_name.get(element.operands[0])  # the compiler copies the start into the loop's buffer
    return constant_of(element) if element is not None else None


def while_trip_counts(text: str) -> dict[str, int | None]:
    """{while instruction name: trip count or None} of every while loop in an HLO module."""
    comps, _ = parse_module(text)
    return {i.name: trip_count(i, comps, body) for body in comps.values() for i in body if i.opcode == "while"}


# ---------------------------------------------------------------------------------------------
# Pallas kernels


@functools.lru_cache(maxsize=None)
def mosaic_kernel(body_b64: str) -> tuple[str, tuple[int, ...]] | None:
    """(kernel name, iteration bounds; -1 = dynamic) of a serialised Mosaic kernel, or None when
    this JAX cannot read it."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib import tpu
        from jax._src.lib.mlir import ir
    except ImportError:
        return None
    ctx = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    with ctx, ir.Location.unknown():
        module = ir.Module.parse(base64.b64decode(body_b64))
        for op in module.body.operations:
            if "iteration_bounds" in op.attributes:
                bounds = tuple(int(b) if b >= 0 else -1 for b in ir.DenseI64ArrayAttr(op.attributes["iteration_bounds"]))
                return ir.StringAttr(op.attributes["sym_name"]).value, bounds
    return None


@functools.cache
def kernel_mxu_passes() -> dict[str, int]:
    """MXU passes per stated FLOP of our kernels whose matmuls run float32 at HIGHEST precision
    (a cost estimate states the math's FLOPs; the MXU runs them as bfloat16 passes)."""
    from hybridmoe.kernels.gdn.pallas_chunk import KERNEL_NAMES, MXU_PASSES

    return {name: MXU_PASSES for name in KERNEL_NAMES.values()}


# A Mosaic call's backend config: compact at the top level, spaced inside a fused computation.
_BODY = re.compile(r'"body":\s*"([A-Za-z0-9+/=]*)"')
_COST = re.compile(r'"cost_estimate":\s*\{([^}]*)\}')


def pallas_call_cost(instr: Instr, types: dict[str, str]) -> dict:
    """What a Mosaic custom call states: name, flops, bytes (None without a cost estimate) and
    grid steps (a dynamic dimension: the longest 1-D int32 scalar-prefetch operand)."""
    name, steps = instr.name, None
    body = _BODY.search(instr.attrs)
    kernel = mosaic_kernel(body.group(1)) if body else None
    if kernel:
        name, bounds = kernel
        longest = max((dims[0] for o in instr.operands for dt, dims in _shapes(types.get(o, ""))
                       if dt == "s32" and len(dims) == 1), default=1)
        steps = math.prod(b if b >= 0 else longest for b in bounds)
    cost = _COST.search(instr.attrs)
    flops = nbytes = None
    if cost:
        fields = json.loads("{" + cost.group(1) + "}")
        flops, nbytes = float(fields.get("flops", 0)), float(fields.get("bytes_accessed", 0))
    return {"kernel": name, "flops": flops, "bytes": nbytes, "grid_steps": steps}


# ---------------------------------------------------------------------------------------------
# Costs per instruction

CATEGORIES = ("grouped matmuls", "attention", "GDN", "dense matmuls", "collectives", "the rest")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "iota"}
# Custom calls that move no data: the TPU compiler's concatenation of adjacent buffers as one (the
# pieces an asynchronous slice brought into the alternate memory), and an allocation.
_FREE_CUSTOM_CALLS = {"ConcatBitcast", "AllocateBuffer"}


def _custom_call_target(i: Instr) -> str | None:
    m = re.search(r'custom_call_target="([^"]+)"', i.attrs) if i.opcode == "custom-call" else None
    return m.group(1) if m else None


# Ops that touch part of a buffer: a slice reads what it returns; an in-place update reads and
# writes its update (Estimator._accessed_bytes).
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


def _update_bytes(i: Instr, types: dict[str, str]) -> int:
    """Bytes an in-place update writes: a dynamic-update-slice's update, a scatter's updates
    (scatter(operands..., indices, updates...): as many updates as operands)."""
    if i.opcode == "dynamic-update-slice":
        return type_bytes(types.get(i.operands[1], ""))
    n = (len(i.operands) - 1) // 2
    return sum(type_bytes(types.get(o, "")) for o in i.operands[n + 1:])


_SCOPES = (("grouped matmuls", re.compile(r"grouped_matmul|\bgmm|tgmm|swiglu|ragged")),
           ("attention", re.compile(r"attention")),
           ("GDN", re.compile(r"gdn")))
_PASSES = {"highest": 6, "high": 3}


def category_of(text: str, has_flops: bool) -> str:
    for cat, pattern in _SCOPES:
        if pattern.search(text):
            return cat
    return "dense matmuls" if has_flops else "the rest"


def _group_size(attrs: str) -> int:
    """Devices per replica group of a collective (the three spellings XLA prints)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'(\w+)'", m.group(2))) or 1
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d]) or 1
    m = re.search(r"source_target_pairs=", attrs)
    return 2 if m else 1


def wire_bytes(kind: str, result_bytes: int, n: int) -> float:
    """Bytes one device sends for a collective of `result_bytes` over a group of n (ring)."""
    if n <= 1:
        return 0.0 if kind != "collective-permute" else float(result_bytes)
    return {"all-gather": result_bytes * (n - 1) / n, "reduce-scatter": result_bytes * (n - 1),
            "all-reduce": 2 * result_bytes * (n - 1) / n, "all-to-all": result_bytes * (n - 1) / n,
            "ragged-all-to-all": result_bytes * (n - 1) / n}.get(kind, float(result_bytes))


def dot_flops(instr: Instr, types: dict[str, str]) -> float:
    """2 x result elements x contracted size of a dot / ragged dot; a convolution's from its
    kernel (result elements x kernel elements / output features); MXU passes of f32 precision."""
    result = sum(math.prod(d) for _, d in _shapes(instr.type_text)[:1])
    lhs = _shapes(types.get(instr.operands[0], "")) if instr.operands else []
    if instr.opcode in ("dot", "ragged-dot"):
        if not lhs:
            return 0.0
        contracted = math.prod(lhs[0][1][d] for d in _dims_attr(instr.attrs, "lhs_contracting_dims"))
        flops = 2.0 * result * contracted
    elif instr.opcode == "convolution":
        # Each output sums over the kernel's input features and the window taps that land on real
        # input, not on padding or between the points of a dilated lhs: XLA's TPU forms of a batched
        # dot (the batch as a spatial dim with window = lhs_dilate) and of a dot with a unit spatial
        # dim padded to the window (window W, pad W-1 on each side) each take one real tap of W.
        rhs = _shapes(types.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
        if not rhs or not lhs or not labels or "i" not in labels.group(2):
            return 0.0
        lhs_labels, kernel_labels, out_labels = labels.groups()
        out_shape = _shapes(instr.type_text)[0][1]
        window = re.search(r"window=\{([^}]*)\}", instr.attrs)
        window = window.group(1) if window else ""
        pads = re.search(r"\bpad=([\d_x-]+)", window)
        pairs = out_positions = 1
        for d in range(sum(ch.isdigit() for ch in lhs_labels)):
            out = out_shape[out_labels.index(str(d))]
            field = lambda key: (_window_field(window, key) or (1,) * (d + 1))[d]  # noqa: E731
            pad_lo = int(pads.group(1).split("x")[d].split("_")[0]) if pads else 0
            pairs *= real_taps(lhs[0][1][lhs_labels.index(str(d))], out, field("size"), field("stride"), pad_lo,
                               field("lhs_dilate"), field("rhs_dilate"))
            out_positions *= out
        flops = 2.0 * result / max(out_positions, 1) * pairs * rhs[0][1][kernel_labels.index("i")]
    else:
        return 0.0
    return flops * mxu_passes(instr, types)


def real_taps(n: int, out: int, size: int, stride: int, pad_lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one spatial dim of a convolution whose tap lands on one
    of the n real input points (at pad_lo + x * lhs_dilate of the padded, dilated input)."""
    x = np.arange(n)
    p = pad_lo + x * lhs_dilate
    if stride == 1 and rhs_dilate == 1:  # output o takes tap t = p - o for 0 <= o < out, 0 <= t < size
        return int(np.clip(np.minimum(p, size - 1) - np.maximum(0, p - out + 1) + 1, 0, None).sum())
    if n * size > 1 << 24:  # too many pairs to list: the window's taps over the lhs dilation
        return out * -(-size // lhs_dilate)
    t = np.arange(size)[None, :]
    q = p[:, None] - t * rhs_dilate  # the output position's window start, times the stride
    return int(((q >= 0) & (q % stride == 0) & (q // stride < out)).sum())


def _window_field(window: str, key: str) -> tuple[int, ...]:
    m = re.search(rf"\b{key}=([\dx]+)", window)
    return tuple(int(v) for v in m.group(1).split("x")) if m else ()


def mxu_passes(instr: Instr, types: dict[str, str]) -> int:
    """MXU passes of a float32 dot at its precision (HIGHEST 6, HIGH 3; bf16 and fp8: 1)."""
    lhs = _shapes(types.get(instr.operands[0], "")) if instr.operands else []
    precision = re.search(r"operand_precision=\{(\w+)", instr.attrs)
    return _PASSES.get(precision.group(1), 1) if precision and lhs and lhs[0][0] == "f32" else 1


@dataclasses.dataclass
class OpCost:
    category: str
    flops: float = 0.0           # MXU work (f32 passes included)
    useful_flops: float = 0.0    # the same without the f32 pass factor
    bytes: float = 0.0
    fp8: bool = False
    grid_steps: float = 0.0
    collective: str | None = None
    wire_bytes: float = 0.0
    kernel: str | None = None
    no_cost_estimate: bool = False


class Estimator:
    """Walks an HLO module once; `ops()` lists (OpCost, times executed) over the whole step."""

    def __init__(self, text: str, *, apply_trip_counts: bool = True):
        self.comps, self.entry = parse_module(text)
        self.types = {c: {i.name: i.type_text for i in body} for c, body in self.comps.items()}
        self.names = {c: {i.name: i.op_name for i in body} for c, body in self.comps.items()}
        self.apply_trip_counts = apply_trip_counts
        self.unknown_trips: list[str] = []
        self._fused: dict[str, tuple[float, float, str, bool]] = {}
        self._users: dict[str, dict[str, list[Instr]]] = {}
        self._sliced: dict[tuple[str, str], int | None] = {}

    def _fusion(self, comp: str) -> tuple[float, float, str, bool]:
        """(MXU flops, useful flops, op_name of its first dot, fp8 operands) of a fused computation."""
        memo = self._fused
        if comp in memo:
            return memo[comp]
        flops = useful = 0.0
        name, fp8 = "", False
        for i in self.comps.get(comp, []):
            if i.opcode in ("dot", "convolution", "ragged-dot"):
                f = dot_flops(i, self.types[comp]) / self._masked_groups(comp, i)
                flops += f
                useful += f / mxu_passes(i, self.types[comp])
                lhs = _shapes(self.types[comp].get(i.operands[0], ""))
                name = name or i.op_name
                fp8 = fp8 or bool(lhs and lhs[0][0].startswith("f8"))
            for callee in _CALLS.findall(i.attrs):
                sub = self._fusion(callee)
                flops, useful = flops + sub[0], useful + sub[1]
                name, fp8 = name or sub[2], fp8 or sub[3]
        if not name:  # a dot without metadata: any named op of the fusion says where it comes from
            name = next((i.op_name for i in self.comps.get(comp, []) if i.op_name), "")
        memo[comp] = (flops, useful, name, fp8)
        return memo[comp]

    def _masked_groups(self, comp: str, i: Instr) -> int:
        """G where `i` is XLA's TPU form of a ragged dot's weight gradient, else 1: a batched dot (or
        its convolution form) with a [G, ...] result whose operands are each selected row by row
        by a pred[G, rows] mask, a parameter of the fused computation (each group's rows kept, the
        rest zeroed). Every row lies in one group, and the chip does the work of the rows kept,
        not the dense count over all G (a v5e step's such dots: 26.4 TFLOP dense, 0.10 s measured
        for every grouped matmul of the step, 0.16 s the dense count alone would take)."""
        body = {x.name: x for x in self.comps.get(comp, [])}
        result = _shapes(i.type_text)
        if not result or not result[0][1]:
            return 1
        groups = result[0][1][0]
        masks = {x.name for x in body.values() if x.opcode == "parameter" and x.type_text.startswith("pred[")
                 and list((_shapes(x.type_text) or [(None, ())])[0][1][:1]) == [groups]}
        selected = all(o in body and masks & set(body[o].operands) for o in i.operands[:2])
        return groups if masks and len(i.operands) >= 2 and selected else 1

    def _instr_cost(self, i: Instr, comp: str, context: str = "") -> OpCost | None:
        """One instruction's cost; `context`: the op_name of the loop or branch it runs in, for an
        instruction the compiler left without one."""
        types = self.types[comp]
        if (i.opcode in _FREE or i.opcode.endswith("-done") or i.opcode == "copy-start"
                or _custom_call_target(i) in _FREE_CUSTOM_CALLS):
            return None
        kind = i.opcode[:-len("-start")] if i.opcode.endswith("-start") else i.opcode
        result_bytes = type_bytes(i.type_text)
        if kind in COLLECTIVES:
            if i.opcode.endswith("-start") and i.type_text.startswith("("):
                # (operand, result[, context scalars]): the result is the largest element
                result_bytes = max((math.prod(d) * dtype_bytes(dt) for dt, d in _shapes(i.type_text)), default=0)
            return OpCost("collectives", collective=kind,
                          wire_bytes=wire_bytes(kind, result_bytes, _group_size(i.attrs)))
        operand_bytes = sum(type_bytes(types.get(o, "")) for o in i.operands)
        accessed = self._accessed_bytes(i, comp)
        kernel = self._mosaic_call(i, comp)
        if kernel is not None:
            k, ktypes = kernel
            p = pallas_call_cost(k, ktypes)
            flops = p["flops"] or 0.0
            cat = category_of(f"{p['kernel']} {k.op_name or i.op_name or context}", flops > 0)
            return OpCost(cat, flops * kernel_mxu_passes().get(p["kernel"], 1), flops,
                          p["bytes"] if p["bytes"] is not None else operand_bytes + result_bytes,
                          grid_steps=p["grid_steps"] or 0, kernel=p["kernel"], no_cost_estimate=p["flops"] is None)
        flops = useful = 0.0
        name, fp8 = i.op_name, False
        if i.opcode in ("dot", "convolution", "ragged-dot"):
            flops = dot_flops(i, types)
            useful = flops / mxu_passes(i, types)
            lhs = _shapes(types.get(i.operands[0], "")) if i.operands else []
            fp8 = bool(lhs and lhs[0][0].startswith("f8"))
        elif i.opcode == "fusion":
            for callee in _CALLS.findall(i.attrs):
                f, u, n, e = self._fusion(callee)
                flops, useful, fp8 = flops + f, useful + u, fp8 or e
                name = n or name
        if not name:  # a compiler-made op (a fusion of its own): named by what feeds it, else its loop
            name = next((self.names[comp].get(o) for o in i.operands if self.names[comp].get(o)), "")
        return OpCost(category_of(name or context, flops > 0), flops, useful, accessed, fp8)

    def _mosaic_call(self, i: Instr, comp: str) -> tuple[Instr, dict] | None:
        """(the Mosaic custom call, the types of its computation) where `i` is one, or a fusion the
        compiler made around one (a Pallas call whose operands' producers it fused into the kernel's
        reads: allow_input_fusion); else None. Such a fusion is the kernel:
        its cost is what the kernel states (its bytes count the operands as the kernel reads them), and
        the fused elementwise work runs in the kernel's reads."""
        if _custom_call_target(i) == "tpu_custom_call":
            return i, self.types[comp]
        callee = _fused_callee(i)
        if callee is None or "kind=kCustom" not in i.attrs or callee not in self.comps:
            return None
        calls = [j for j in self.comps[callee] if _custom_call_target(j) == "tpu_custom_call"]
        return (calls[0], self.types[callee]) if len(calls) == 1 else None

    def _accessed_bytes(self, i: Instr, comp: str) -> float:
        """HBM bytes one instruction reads and writes: its operands and result, except that a slice
        reads only what it returns, an in-place update (a dynamic-update-slice or scatter, alone or
        as a fusion's output into a buffer the fusion is given) moves its update and not the buffer
        around it, and a fusion reads of each parameter only the slices its body takes. A loop that
        fills a stack one row per iteration moves a row per iteration, not the stack."""
        types = self.types[comp]
        if i.opcode in _SLICES:
            return 2.0 * type_bytes(i.type_text)
        if i.opcode == "slice-start":
            # An asynchronous slice (the TPU compiler's memory-space assignment bringing part of a
            # buffer into the alternate memory): its type is ((operand), slice, context scalar); it
            # reads and writes the slice, never the whole operand.
            shapes = _shapes(i.type_text)
            return 2.0 * math.prod(shapes[1][1]) * dtype_bytes(shapes[1][0]) if len(shapes) > 1 else 0.0
        if i.opcode in _IN_PLACE:
            return 2.0 * _update_bytes(i, types)
        callee = _fused_callee(i)
        if callee not in self.comps:
            return sum(type_bytes(types.get(o, "")) for o in i.operands) + type_bytes(i.type_text)
        body, inner = self.comps[callee], self.types[callee]
        by_name = {j.name: j for j in body}

        def source(name: str) -> Instr | None:  # through bitcasts
            j = by_name.get(name)
            while j is not None and j.opcode == "bitcast":
                j = by_name.get(j.operands[0])
            return j

        read = 0
        for index, j in self._parameters(callee).items():
            if index < len(i.operands):
                sliced = self._sliced_read(callee, j.name)
                read += type_bytes(types.get(i.operands[index], "")) if sliced is None else sliced
        root = next((j for j in body if j.root), body[-1] if body else None)
        outputs = root.operands if root is not None and root.opcode == "tuple" else [root.name] if root else []
        written = 0
        for name in outputs:
            j = source(name)
            buffer = source(j.operands[0]) if j is not None and j.opcode in _IN_PLACE else None
            if buffer is not None and buffer.opcode == "parameter":
                written += _update_bytes(j, inner)  # computed in the fusion, written once
            else:
                written += type_bytes(inner.get(name, ""))
        return float(read + written)

    def _parameters(self, comp: str) -> dict[int, Instr]:
        return {int(j.args): j for j in self.comps[comp] if j.opcode == "parameter" and j.args.strip().isdigit()}

    def _relayout(self, u: Instr) -> bool:
        """A copy or convert of one operand (a layout or dtype change), alone or as a nested fusion."""
        if u.opcode in ("copy", "convert"):
            return True
        nested = _fused_callee(u)
        return (nested in self.comps and len(set(u.operands)) == 1 and
                all(j.opcode in ("parameter", "copy", "convert", "bitcast") for j in self.comps[nested]))

    def _sliced_read(self, comp: str, name: str) -> int | None:
        """Bytes a fused computation reads of its value `name` when it only slices it or updates it in
        place (through bitcasts and nested fusions); None when some use reads it whole."""
        key = (comp, name)
        if key in self._sliced:
            return self._sliced[key]
        if comp not in self._users:
            users: dict[str, list[Instr]] = defaultdict(list)
            for j in self.comps[comp]:
                for o in set(j.operands):
                    users[o].append(j)
            self._users[comp] = users
        total: int | None = 0
        for u in self._users[comp].get(name, []):
            nested = _fused_callee(u)
            if u.opcode == "bitcast" or self._relayout(u):
                # a relayout fused into its slices converts only what they take
                sub = self._sliced_read(comp, u.name)
            elif u.opcode in _SLICES and u.operands[0] == name and name not in u.operands[1:]:
                sub = type_bytes(u.type_text)
            elif u.opcode in _IN_PLACE and u.operands[0] == name and name not in u.operands[1:]:
                sub = 0
            elif nested in self.comps:
                params = self._parameters(nested)
                subs = [self._sliced_read(nested, params[k].name) if k in params else None
                        for k, o in enumerate(u.operands) if o == name]
                sub = None if None in subs else sum(subs)
            else:
                sub = None
            if sub is None:
                total = None
                break
            total += sub
        self._sliced[key] = total
        return total

    def _trips(self, i: Instr, body: list, note_unknown: bool = True) -> int:
        """How many times a while instruction runs its body (1 where unreadable, or trip counts off)."""
        n = trip_count(i, self.comps, body) if self.apply_trip_counts else 1
        if n is None:
            if note_unknown:
                self.unknown_trips.append(i.name)
            n = 1
        return n

    @staticmethod
    def _branch_names(i: Instr) -> list[str]:
        branches = re.search(r"branch_computations=\{([^}]*)\}", i.attrs)
        return ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else
                re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", i.attrs))

    @staticmethod
    def _calls_into(i: Instr) -> list[str] | None:
        """The computations a call, an async call or a custom call with called computations runs
        (None: the instruction is none of these)."""
        if i.opcode in ("call", "call-start", "async-start") or (i.opcode == "custom-call" and "called_computations" in i.attrs):
            return re.findall(r"\b(?:to_apply|calls|called_computations)=\{?%?([\w.\-]+)", i.attrs)
        return None

    def _heaviest_branch(self, i: Instr, comp: str, stack: tuple, context: str) -> tuple[str, list] | None:
        """(name, ops) of a conditional's most expensive branch: an upper bound of what it runs."""
        walked = [(b, self._walk(b, stack + (comp,), i.op_name or context)) for b in self._branch_names(i)]
        return max(walked, key=lambda bw: sum(_flat_time(c) * k for _, c, k in bw[1])) if walked else None

    def _walk(self, comp: str, stack: tuple = (), context: str = "") -> list[tuple[str, OpCost, float]]:
        """The ops one execution of `comp` runs (instruction name, cost), each with how many times
        (loops applied)."""
        if comp in stack or comp not in self.comps:
            return []
        out: list[tuple[str, OpCost, float]] = []
        body = self.comps[comp]
        for i in body:
            callees = self._calls_into(i)
            if i.opcode == "while":
                loop_body = re.search(r"\bbody=%?([\w.\-]+)", i.attrs).group(1)
                n = self._trips(i, body)
                out += [(name, c, k * n) for name, c, k in self._walk(loop_body, stack + (comp,), i.op_name or context)]
            elif i.opcode == "conditional":
                heaviest = self._heaviest_branch(i, comp, stack, context)
                if heaviest:
                    out += heaviest[1]
            elif callees is not None:
                for callee in callees:
                    out += self._walk(callee, stack + (comp,), i.op_name or context)
            else:
                c = self._instr_cost(i, comp, context)
                if c is not None:
                    out.append((i.name, c, 1.0))
        return out

    def timeline(self, seconds, exposures: dict | None = None) -> tuple[float, float]:
        """(busy, exposed) seconds of one run of the program in its schedule's order, `seconds(OpCost)`
        an op's time: busy is the compute stream's work; exposed the time it waits on asynchronous
        work (collectives, and what an async call runs: the TPU compiler's SparseCore offloads)
        still unfinished when it reaches the done, loops' trips applied. A started piece of async
        work progresses while the compute stream runs, one piece at a time in start order (they
        share the links); a synchronous collective is exposed whole. busy + exposed lies between
        the step with every collective hidden and with none hidden. `exposures`, where given,
        collects each async start's (or synchronous collective's) exposed seconds over the step by
        instruction name."""
        noted = len(self.unknown_trips)
        try:
            return self._timeline(self.entry, (), "", seconds, 1.0, exposures)
        finally:  # the walk's loops were noted by ops() already: note none twice
            del self.unknown_trips[noted:]

    def _timeline(self, comp: str, stack: tuple, context: str, seconds, scale: float,
                  exposures: dict | None) -> tuple[float, float]:
        """timeline() of one run of `comp`; `scale`: how many times it runs in the step (for `exposures`)."""
        if comp in stack or comp not in self.comps:
            return 0.0, 0.0
        busy = exposed = 0.0
        pending: dict[str, float] = {}  # async start -> its seconds still to run, in start order
        inner = stack + (comp,)

        def expose(name: str, t: float) -> None:
            nonlocal exposed
            exposed += t
            if exposures is not None and t > 0:
                exposures[name] = exposures.get(name, 0.0) + t * scale

        def run(t: float, waited: float = 0.0) -> None:
            """t seconds on the compute stream's clock, `waited` of them a nested walk's exposed waits."""
            nonlocal busy, exposed
            busy += t - waited
            exposed += waited
            for start in pending:
                done = min(pending[start], t)
                pending[start] -= done
                t -= done
                if t <= 0:
                    break

        body = self.comps[comp]
        for i in body:
            callees = self._calls_into(i)
            where = i.op_name or context
            if i.opcode == "while":
                loop_body = re.search(r"\bbody=%?([\w.\-]+)", i.attrs).group(1)
                n = self._trips(i, body, note_unknown=False)
                b, e = self._timeline(loop_body, inner, where, seconds, scale * n, exposures)
                run(n * (b + e), n * e)
            elif i.opcode == "conditional":
                heaviest = self._heaviest_branch(i, comp, stack, context)
                if heaviest:
                    b, e = self._timeline(heaviest[0], inner, where, seconds, scale, exposures)
                    run(b + e, e)
            elif i.opcode in ("call-start", "async-start") or (i.opcode.endswith("-start") and
                                                                i.opcode[:-len("-start")] in COLLECTIVES):
                ops = ([(c, k) for callee in callees for _, c, k in self._walk(callee, inner, where)]
                       if callees is not None else [(c, 1.0) for c in [self._instr_cost(i, comp, context)] if c])
                pending[i.name] = sum(seconds(c) * k for c, k in ops)
            elif i.opcode.endswith("-done"):
                if i.operands and i.operands[0] in pending:
                    expose(i.operands[0], pending.pop(i.operands[0]))
            elif callees is not None:
                for callee in callees:
                    b, e = self._timeline(callee, inner, where, seconds, scale, exposures)
                    run(b + e, e)
            else:
                c = self._instr_cost(i, comp, context)
                if c is None:
                    continue
                if c.collective:
                    expose(i.name, seconds(c))
                else:
                    run(seconds(c))
        for start, left in pending.items():  # started, never waited for here: the program's end waits
            expose(start, left)
        return busy, exposed

    def ops(self) -> list[tuple[OpCost, float]]:
        return [(c, k) for _, c, k in self._walk(self.entry)]

    def op_names(self) -> dict[str, str]:
        """{instruction name: the op_name in its metadata} over the module (names are unique in it)."""
        return {name: op for names in self.names.values() for name, op in names.items() if op}

    def named_ops(self) -> list[tuple[str, OpCost, float]]:
        """ops() with each op's instruction name (what a profiler's trace names it by)."""
        return self._walk(self.entry)

    def instruction_categories(self) -> dict[str, str]:
        """{instruction name: category} of every instruction a device can run (names are unique in a
        module): the walk's ops as it costs them; the others (a conditional's lighter branch, a loop
        itself, an async op's other half) by the same classifier over their op_name. Instructions
        inside a fusion are left out: a device runs the fusion."""
        out = {name: c.category for name, c, _ in self._walk(self.entry)}
        fused = {callee for body in self.comps.values() for i in body if i.opcode == "fusion"
                 for callee in _CALLS.findall(i.attrs)}
        for comp, body in self.comps.items():
            if comp in fused:
                continue
            for i in body:
                if i.name in out:
                    continue
                if i.opcode.removesuffix("-done").removesuffix("-start") in COLLECTIVES:
                    out[i.name] = "collectives"
                    continue
                c = self._instr_cost(i, comp)
                out[i.name] = c.category if c is not None else category_of(i.op_name, False)
        return out


def _flat_time(c: OpCost) -> float:
    """A hardware-free weight to pick a conditional's heaviest branch: FLOPs + 300 x bytes."""
    return c.flops + 300.0 * c.bytes + 300.0 * c.wire_bytes


def hlo_flops(text: str, *, apply_trip_counts: bool = True) -> float:
    """MXU FLOPs of one run of the program without the f32 pass factor (dots, convolutions, ragged
    dots and Pallas calls' stated FLOPs, loops applied): the count to check against the model's."""
    return sum(c.useful_flops * k for c, k in Estimator(text, apply_trip_counts=apply_trip_counts).ops())
