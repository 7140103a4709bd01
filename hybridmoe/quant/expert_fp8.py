"""fp8 fake quantization of the routed-expert weights where they are used, and its hoist.

The model reads its layer weights through one hook, `LayerWeights` (at the end): what the layer
scan iterates over and each layer's weights where they are used. Unquantized, that is the FSDP
gather at use; quant.fp8_moe_fake_quant adds the transform below.

quant.fp8_moe_fake_quant rounds wi [E, D, 2F] and wo [E, F, D] to their per-output-channel
float8_e4m3fn grid (quant/fp8.py; one scale per expert and output column, from the
absmax over the contracting axis 1) with the straight-through gradient, in every layer, in the
forward and again in the remat replay. It is a transform of the weights before the MoE block, so
every MoE path (default grouped matmul, the kernel family with its levers, expert parallelism,
the dense reference) sees the quantized weights.

The weight is quantized on its FSDP shard and then all-gathered, both written explicitly in one
shard_map (the FSDP gather at use, made by `constrain_at_use` for every other weight; the FSDP
dimension is split over every data-parallel mesh axis the rules give it, parallel/rules.py): the
absmax reduces over the contracting axis, which is FSDP-sharded for wi, so each layer pays a max
all-reduce per pass (forward and replay). quant.fp8_fake_quant_hoist:
- off: as above.
- absmax: the absmax of the whole scanned stack is computed once before the layer scan (one
  all-reduce per weight) and rides in the scan's xs; each layer quantizes with its slice.
- gather8: absmax, and each layer quantizes its shard to e4m3 codes (-0.0 stored as +0.0),
  all-gathers the 1-byte codes instead of the weight and dequantizes after the gather, under a
  custom VJP whose backward hands the cotangent to the shard (the straight-through estimator).
  The absmax stack of a weight whose output channels are FSDP-sharded (wo) is gathered once,
  before the scan, so no scale moves inside the loop.
Exactness: a max is exact in any order, so every layer gets the absmax, scale and codes it
computed before; dequantization is exact (power-of-two scale), so it commutes with the gather.

Collectives of the absmax run under the name scope "fp8_absmax" (the program proofs count them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import PartitionSpec

from hybridmoe.config.schema import Config, QuantConfig
from hybridmoe.parallel.rules import at_use_spec, constrain_at_use, gathered_at_use, logical_to_spec, mesh_axes_of
from hybridmoe.quant import fp8

ROUTED = ("wi", "wo")
CONTRACT = 1          # wi [E, D, 2F] contracts D, wo [E, F, D] contracts F
ABSMAX_SCOPE = "fp8_absmax"


def hoisted(cfg: Config) -> bool:
    return cfg.quant.fp8_moe_fake_quant and cfg.quant.fp8_fake_quant_hoist != "off"


def _amax_spec(spec: PartitionSpec, leading=()) -> PartitionSpec:
    """The absmax [.., E, 1, N] of a weight with this spec: the contracting axis is size 1."""
    s = tuple(spec) + (None,) * (3 - len(tuple(spec)))
    return PartitionSpec(*leading, s[0], None, s[2])


def _local_absmax(w_blk, contract_axes, axis: int):
    with jax.named_scope(ABSMAX_SCOPE):
        amax = fp8.absmax(w_blk, axis)
        return jax.lax.pmax(amax, contract_axes) if contract_axes else amax


def _gather(x_blk, stored: PartitionSpec, gathered):
    """All-gather the FSDP-sharded dims of a weight block (the result is invariant over them).

    gathered: per dim, the mesh axes gathered there (rules.gathered_at_use), or () for none."""
    for dim, (entry, axes) in enumerate(zip(stored, gathered)):
        if not axes:
            continue
        if mesh_axes_of(entry)[-len(axes):] != axes:
            raise ValueError(f"the gathered mesh axes {axes} must be the minor ones of the weight dim {entry}")
        x_blk = jax.lax.all_gather(x_blk, axes, axis=dim, tiled=True, to="invarying")
    return x_blk


def dequantize_gathered(codes, scale, dtype):
    """The gathered codes back to the weight (the gather8 path's dequantization)."""
    return fp8.dequantize(codes, scale, dtype)


def cotangent_to_shard(ct, stored: PartitionSpec):
    """gather8's backward: the gathered weight's cotangent as the shard's (the gather's transpose,
    as the straight-through estimator of the fake-quant expression passes it)."""
    return jax.lax.with_sharding_constraint(ct, stored)


def _gather8(w, amax_local, amax_full, mesh, stored, used, gathered):
    def body(w_blk, amax_blk, amax_full_blk):
        scale = fp8.scale_from_absmax(amax_blk)
        codes = fp8.positive_zero(fp8.quantize(w_blk, scale))
        codes = _gather(codes, stored, gathered)
        return dequantize_gathered(codes, fp8.scale_from_absmax(amax_full_blk), w_blk.dtype)

    run = jax.shard_map(body, mesh=mesh, in_specs=(stored, _amax_spec(stored), _amax_spec(used)),
                        out_specs=used)

    @jax.custom_vjp
    def f(w, amax_local, amax_full):
        return run(w, amax_local, amax_full)

    def fwd(w, amax_local, amax_full):
        return run(w, amax_local, amax_full), None

    def bwd(_, ct):
        return cotangent_to_shard(ct, stored), None, None

    f.defvjp(fwd, bwd)
    return f(w, jax.lax.stop_gradient(amax_local), jax.lax.stop_gradient(amax_full))


def weight_at_use(w, axes, mode: str, amax=None):
    """One routed-expert weight fake-quantized and gathered to its layout at use.

    amax: this layer's absmax (hoisted modes; for gather8 in the gathered layout), else None.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        if mode == "gather8":
            raise ValueError("quant.fp8_fake_quant_hoist=gather8 needs a device mesh with an FSDP-sharded "
                             "expert weight; there is no mesh here")
        return fp8.fake_quant(w, CONTRACT, amax)
    stored, used, gathered = logical_to_spec(axes), at_use_spec(axes), gathered_at_use(axes)
    # Collectives over size-1 axes too: shard_map types every manual axis, and XLA drops them.
    contract_axes = mesh_axes_of(tuple(stored)[CONTRACT])
    if mode == "gather8":
        if math.prod(mesh.shape[a] for dim in gathered for a in dim) == 1:
            # The validation pass refuses this at load or, with a -1 axis, at set-up on the real mesh.
            raise ValueError(f"quant.fp8_fake_quant_hoist=gather8 needs an FSDP-sharded expert weight; "
                             f"the weight is {stored} on a mesh of {dict(mesh.shape)}: nothing to gather")
        return _gather8(w, amax, amax, mesh, stored, used, gathered)
    if amax is None:
        def body(w_blk):
            return _gather(fp8.fake_quant(w_blk, CONTRACT, _local_absmax(w_blk, contract_axes, CONTRACT)),
                           stored, gathered)

        return jax.shard_map(body, mesh=mesh, in_specs=stored, out_specs=used)(w)

    def body(w_blk, amax_blk):
        return _gather(fp8.fake_quant(w_blk, CONTRACT, amax_blk), stored, gathered)

    return jax.shard_map(body, mesh=mesh, in_specs=(stored, _amax_spec(stored)), out_specs=used)(w, amax)


def stacked_absmax(w_LEKN, axes, mode: str):
    """The absmax [L, E, 1, N] of a scanned stack of one routed weight, for every layer at once
    (gather8: in the gathered layout, so layers never move a scale)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fp8.absmax(w_LEKN, CONTRACT + 1)
    stored, used = logical_to_spec(axes), at_use_spec(axes)
    contract_axes = mesh_axes_of(tuple(stored)[CONTRACT])
    stack = PartitionSpec(None, *stored)
    amax_stored = _amax_spec(stored, leading=(None,))
    # gather8: the stack in the gathered layout (the contracting dim is size 1, nothing to gather there).
    gathered = ((),) + tuple(() if d == CONTRACT else g for d, g in enumerate(gathered_at_use(axes))) \
        if mode == "gather8" else ()

    def body(w_blk):
        amax = _local_absmax(w_blk, contract_axes, CONTRACT + 1)
        return _gather(amax, amax_stored, gathered)

    out = _amax_spec(used if mode == "gather8" else stored, leading=(None,))
    return jax.shard_map(body, mesh=mesh, in_specs=stack, out_specs=out)(w_LEKN)


def hoisted_absmax(blocks, block_axes, q: QuantConfig):
    """Per position of the layer pattern, {"wi": [L, E, 1, 2F], "wo": [L, E, 1, D]}."""
    return [{k: stacked_absmax(lp["moe"][k], la["moe"][k], q.fp8_fake_quant_hoist) for k in ROUTED}
            for lp, la in zip(blocks, block_axes)]


def scan_xs(params, cfg: Config, block_axes):
    """What the layer scan iterates over: the stacked blocks (and the hoisted absmax)."""
    if not hoisted(cfg):
        return params["blocks"]
    return params["blocks"], hoisted_absmax(params["blocks"], block_axes, cfg.quant)


def layer_weights_at_use(lp, lp_axes, cfg: Config, amax=None):
    """A layer's weights where they are used: gathered over FSDP; the routed experts fake-quantized
    (with the hoisted absmax `amax` when given, else computed here: the same bits)."""
    is_arr = lambda a: isinstance(a, jax.Array)  # noqa: E731
    lp_axes = {k: lp_axes[k] for k in lp}  # lp may be one sublayer's part of the layer (remat.unit=sublayer)
    if not cfg.quant.fp8_moe_fake_quant or "moe" not in lp:
        return jax.tree.map(constrain_at_use, lp, lp_axes, is_leaf=is_arr)
    moe_axes = lp_axes["moe"]
    rest = {k: v for k, v in lp.items() if k != "moe"}
    out = jax.tree.map(constrain_at_use, rest, {k: lp_axes[k] for k in rest}, is_leaf=is_arr)
    mode = cfg.quant.fp8_fake_quant_hoist if amax is not None else "off"
    moe = {k: (weight_at_use(v, moe_axes[k], mode, None if amax is None else amax[k]) if k in ROUTED
               else constrain_at_use(v, moe_axes[k])) for k, v in lp["moe"].items()}
    return {**out, "moe": moe}


def sampling_weights(lp, lp_axes, cfg: Config):
    """The layer's weights for the sampler's cached forward: the routed experts fake-quantized as
    the trainer sees them (unchanged when fake quantization is off)."""
    return layer_weights_at_use(lp, lp_axes, cfg) if cfg.quant.fp8_moe_fake_quant else lp


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """The one hook through which quantization reaches the model: what the layer scan iterates
    over (`scan_xs`), one scan step's xs taken apart (`split`), and each layer's weights where
    they are used (`at_use`, the sampler's `for_sampling`).

    block_axes: per position of the layer pattern, that layer's logical axes (model.params.layer_axes)."""
    cfg: Config
    block_axes: list

    def scan_xs(self, params):
        return scan_xs(params, self.cfg, self.block_axes)

    def split(self, block_xs):
        """(the block's params, per position its hoisted absmax or None) of one step's xs."""
        return block_xs if hoisted(self.cfg) else (block_xs, [None] * len(self.block_axes))

    def at_use(self, lp, position: int, amax=None):
        return layer_weights_at_use(lp, self.block_axes[position], self.cfg, amax)

    def for_sampling(self, lp, position: int):
        return sampling_weights(lp, self.block_axes[position], self.cfg)
