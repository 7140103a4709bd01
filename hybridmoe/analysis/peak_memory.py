"""What fills memory at a compiled step's peak, itemised by what made each buffer.

XLA's buffer assignment lists every buffer live at the peak (tools/program.peak_buffers); each
carries the op_name of the op that made it: jax's name stack, which holds the named scopes the
model's parts run under (model/scopes.py) through remat, scans and autodiff (a transposed op
keeps its primal op's scopes). A buffer counts to the innermost such scope, refined by its shape
where a scope makes two kinds of buffer:

- MoE rows: the routed block's token-side buffers (router, gathered rows, grouped-matmul
  activations and their gradients, combine);
- expert weights: the routed experts' weights at use (gathered, fp8 codes, dequantised, gathered
  per row tile) and their per-layer gradients, in the MoE block or its weight preparation: a
  buffer of rank >= 3 ending in (d_model, moe_intermediate or twice it) in either order, or in the
  MoE block shaped like a parameter shard (a reduce-scattered gradient). Shape is all that tells
  a weight from a row buffer there, so a row tile of exactly d_model or moe_intermediate rows by
  the other dim would count as a weight;
- attention, GDN, LM head: everything made in that part, its weights' gradients included;
- saved residuals: what the layer loop carries and stacks (the forward's saved block inputs and
  residuals, read back by the backward), but for the backward loop's parameter-shaped gradient
  stacks; outside the model's parts, any buffer whose leading dim is the number of blocks (the
  TPU compiler allocates the loop's stacks itself, under the name of the call around the loop);
- gradients and optimizer state: buffers shaped like a parameter made outside the model's parts
  (the micro-batch loop's float32 accumulators, the layer loop's per-block gradient stacks, the
  normalised gradients) and everything the optimizer's update makes;
- other: the rest (embedding, norms, residual adds, dense layers' weights at use, unnamed copies).

Only temporaries in the device's main memory are itemised (the arguments and the output have their
own figures), each at its size in its allocation (tile padding included). Their sum is what was
live at the peak; the compiler's temporary figure is larger: the heap it packed them into holds
gaps (buffers freed at different times), and on TPU the figure also counts the kernels' on-chip
VMEM and scratch outside the buffer assignment. The listing closes with that difference as its
own row and says which share of the figure the categories explain (on CPU over 95%; on a TPU
target about half at a small model, where the padded heap and 64 MiB of VMEM weigh most).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from hybridmoe.model import scopes
from hybridmoe.analysis.program import LiveBuffer

MOE_ROWS = "MoE rows"
EXPERT_WEIGHTS = "expert weights"
ATTENTION = "attention"
GDN = "GDN"
LM_HEAD = "LM head"
RESIDUALS = "saved residuals (layer loop)"
GRADIENTS = "gradients and optimizer state"
OTHER = "other"
CATEGORIES = (MOE_ROWS, EXPERT_WEIGHTS, ATTENTION, GDN, LM_HEAD, RESIDUALS, GRADIENTS, OTHER)

_SCOPES = {scopes.EMBEDDING, scopes.LAYERS, scopes.LAYER_WEIGHTS, scopes.ATTENTION, scopes.GDN, scopes.MOE,
           scopes.LM_HEAD, scopes.MICRO_BATCHES, scopes.OPTIMIZER}
_WORD = re.compile(r"[A-Za-z_]\w*")
_DIMS = re.compile(r"^[a-z]\w*\[([\d,]*)\]$")


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the attribution needs of the model: the expert weights' dims and the shapes of the
    parameters (global, per device, and one block of a stacked leaf; dims of 1 dropped)."""
    d_model: int
    moe_intermediate: int
    num_experts: int
    param_shapes: frozenset
    num_blocks: int = 1

    def expert_weight_like(self, dims: tuple, *, shards: bool = False) -> bool:
        """Rank >= 3 ending in (d_model, moe_intermediate or twice it) in either order: the experts'
        wi / wo at use, a slice or per-row-tile gather of them, their gradients; with `shards`,
        also any rank >= 3 parameter shape (a gradient reduce-scattered to its shard)."""
        if len(dims) < 3:
            return False
        D, F = self.d_model, self.moe_intermediate
        if tuple(dims[-2:]) in {(D, F), (D, 2 * F), (F, D), (2 * F, D)}:
            return True
        return shards and self.param_like(dims)

    def param_like(self, dims: tuple) -> bool:
        return dims in self.param_shapes


def _squeezed(shape) -> tuple:
    return tuple(int(d) for d in shape if int(d) != 1)


def model_shapes(cfg, state) -> ModelShapes:
    """From the config and the abstract train state (ShapeDtypeStructs with shardings)."""
    import jax

    shapes = set()
    for leaf in jax.tree.leaves(state["params"]):
        full = tuple(leaf.shape)
        shard = leaf.sharding.shard_shape(full) if getattr(leaf, "sharding", None) is not None else full
        for s in (full, shard):
            shapes.add(_squeezed(s))
            if len(s) > 1:
                shapes.add(_squeezed(s[1:]))  # one block of a stacked leaf
    shapes.discard(())
    m = cfg.model
    return ModelShapes(m.d_model, m.moe_intermediate_size, m.num_experts, frozenset(shapes), m.num_blocks)


def dims_of(shape_text: str) -> tuple | None:
    """`bf16[15,1,16384,4096]` -> (15, 16384, 4096) (dims of 1 dropped); None for a tuple or unknown."""
    m = _DIMS.match(shape_text)
    if not m:
        return None
    return _squeezed(d for d in m.group(1).split(",") if d)


def innermost_scope(op_name: str) -> str | None:
    """The last of the model's named scopes in an op's name stack (None outside them, or for an
    argument's name such as state['params']['blocks'][0]['moe']['wi'])."""
    if not op_name.startswith("jit("):
        return None
    found = None
    for word in _WORD.findall(op_name):
        if word in _SCOPES:
            found = word
    return found


def category(buf: LiveBuffer, shapes: ModelShapes) -> str:
    """What made a buffer live at the peak: one of CATEGORIES (see the module docstring)."""
    scope = innermost_scope(buf.op_name)
    dims = dims_of(buf.shape)
    param_like = dims is not None and shapes.param_like(dims)
    if scope in (scopes.MOE, scopes.LAYER_WEIGHTS):
        if dims is not None and shapes.expert_weight_like(dims, shards=scope == scopes.MOE):
            return EXPERT_WEIGHTS
        return MOE_ROWS if scope == scopes.MOE else OTHER
    if scope == scopes.ATTENTION:
        return ATTENTION
    if scope == scopes.GDN:
        return GDN
    if scope == scopes.LM_HEAD:
        return LM_HEAD
    if scope == scopes.OPTIMIZER:
        return GRADIENTS
    if scope == scopes.LAYERS:
        # The forward loop stacks what the backward reads (the gathered weights too, when the
        # remat policy saves them); the backward loop (transposed) stacks the blocks' gradients.
        backward = "transpose(" in buf.op_name
        return GRADIENTS if param_like and backward else RESIDUALS
    if dims is not None and shapes.num_blocks > 1 and len(dims) > 1 and dims[0] == shapes.num_blocks:
        # A per-block stack whose op carries only the enclosing name (the TPU compiler allocates
        # the layer loop's stacks itself, named after the call around the loop).
        return GRADIENTS if param_like else RESIDUALS
    return GRADIENTS if param_like else OTHER


LARGEST_PER_CATEGORY = 3


def itemise(buffers: list[LiveBuffer], shapes: ModelShapes, temp_bytes: int | None) -> dict:
    """The temporaries live at the peak by category: {"categories": [{category, bytes, buffers,
    largest: [(bytes, shape, count)]}], "itemised": their sum, "temp": the compiler's figure,
    "share": itemised / temp}. Categories in CATEGORIES order; empty ones left out."""
    acc: dict[str, dict] = {}
    shapes_by: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for b in buffers:
        if b.storage != "temp":
            continue
        c = category(b, shapes)
        row = acc.setdefault(c, {"category": c, "bytes": 0, "buffers": 0})
        row["bytes"] += b.bytes
        row["buffers"] += 1
        slot = shapes_by[c][b.shape]
        slot[0] += b.bytes
        slot[1] += 1
    rows = []
    for c in CATEGORIES:
        if c in acc:
            top = sorted(shapes_by[c].items(), key=lambda kv: -kv[1][0])[:LARGEST_PER_CATEGORY]
            rows.append({**acc[c], "largest": [{"shape": s, "bytes": n, "count": k} for s, (n, k) in top]})
    itemised = sum(r["bytes"] for r in rows)
    share = itemised / temp_bytes if temp_bytes else None
    return {"categories": rows, "itemised": itemised, "temp": temp_bytes,
            "heap_gaps": None if temp_bytes is None else temp_bytes - itemised,
            "share": None if share is None else round(share, 4)}


def heap_share(peak: dict | None, memory: dict) -> float | None:
    """The itemised temporaries' share of the default memory space's heap: XLA's memory-usage report
    of the default space (`memory["default_space"]`) less the arguments, the temporaries as buffer
    assignment packed them and what the TPU compiler checks against HBM. None without the report.
    On a TPU target the compiler's temporaries figure also counts what no allocation of the
    default space holds (on-chip scratch, reserves), so this share is the one that says how much of
    the device's memory the categories explain."""
    if not peak or memory.get("default_space") is None:
        return None
    heap = memory["default_space"] - memory.get("argument", 0)
    return round(peak["itemised"] / heap, 4) if heap > 0 else None


def format_itemised(name: str, peak: dict, unit: int, unit_name: str) -> list[str]:
    """Lines of text: one per category, with its largest shapes."""
    if not peak or not peak["categories"]:
        return []
    share = "" if peak["share"] is None else f", {100 * peak['share']:.1f}% of the temporaries' figure"
    if peak.get("heap_share") is not None:
        share += f", {100 * peak['heap_share']:.1f}% of the default memory space's heap"
    lines = [f"{name}: the temporaries live at the peak by what made them (per device; "
             f"{peak['itemised'] / unit:.2f} {unit_name} itemised{share})"]
    for r in peak["categories"]:
        frac = r["bytes"] / peak["itemised"] if peak["itemised"] else math.nan
        big = ", ".join(f"{s['count']}x {s['shape']}" for s in r["largest"])
        lines.append(f"  {r['category']:<30} {r['bytes'] / unit:>9.2f} {unit_name} {100 * frac:5.1f}%  "
                     f"{r['buffers']:>5} buffers  largest: {big}")
    if peak.get("heap_gaps") is not None:
        lines.append(f"  {'(not itemised: figure - sum)':<30} {peak['heap_gaps'] / unit:>9.2f} {unit_name}  "
                     "heap gaps, on-chip scratch (TPU VMEM), compiler reserve")
    return lines
