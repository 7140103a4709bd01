"""Single checks of the peak-memory attribution (analysis/peak_memory.py), the depth table
(tools/depth.py) and the gates (tools/gates.py), by hand on small fixtures; nothing compiles."""

from __future__ import annotations

import types

import numpy as np
import pytest

from hybridmoe.analysis import peak_memory as pm
from hybridmoe.analysis.program import LiveBuffer
from hybridmoe.tools import depth, gates

GIB = 2**30


def _buf(shape, op_name):
    return LiveBuffer("v", 64, shape, op_name, "c", None)


class _Leaf:
    """A parameter as the abstract state holds it: a shape and a sharding that says its shard."""

    def __init__(self, shape, shard):
        self.shape = shape
        self.sharding = types.SimpleNamespace(shard_shape=lambda full: shard)


def test_model_shapes_hold_each_parameters_global_shard_and_one_block_shapes():
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(d_model=16, moe_intermediate_size=4, num_experts=3,
                                                            num_blocks=5, num_layers=20))
    # A stacked expert weight [5 blocks, 3 experts, 16, 8] sharded 4 ways on its last dim; a norm scale
    # stacked [5, 16] unsharded; the embedding [50, 16] sharded 2 ways on rows.
    params = {"wi": _Leaf((5, 3, 16, 8), (5, 3, 16, 2)), "norm": _Leaf((5, 16), (5, 16)),
              "embed": _Leaf((50, 16), (25, 16))}
    shapes = pm.model_shapes(cfg, {"params": params})
    assert (shapes.d_model, shapes.moe_intermediate, shapes.num_experts, shapes.num_blocks) == (16, 4, 3, 5)
    # Whole and shard, each also without its leading (block) dim; dims of 1 dropped, () discarded.
    assert shapes.param_shapes == {(5, 3, 16, 8), (3, 16, 8), (5, 3, 16, 2), (3, 16, 2), (5, 16), (16,),
                                   (50, 16), (25, 16)}
    one = pm.model_shapes(cfg, {"params": {"bias": _Leaf((1, 7), (1, 7)), "scalar": _Leaf((4,), (4,)),
                                                   "one": _Leaf((1,), (1,))}})
    assert one.param_shapes == {(7,), (4,)}


def test_a_rank_two_per_block_stack_outside_the_scopes_is_a_residual():
    shapes = pm.ModelShapes(16, 4, 3, frozenset({(16, 16)}), num_blocks=5)
    # [5 blocks, 9]: the layer loop's stack of a per-block vector, named after the call around the loop.
    assert pm.category(_buf("f32[5,9]", "jit(s)/while"), shapes) == pm.RESIDUALS
    assert pm.category(_buf("f32[4,9]", "jit(s)/while"), shapes) == pm.OTHER
    assert pm.category(_buf("f32[5,16,16]", "jit(s)/while"), pm.ModelShapes(
        16, 4, 3, frozenset({(5, 16, 16)}), num_blocks=5)) == pm.GRADIENTS


def test_no_heap_share_when_the_arguments_fill_the_default_space():
    peak = {"itemised": 50}
    assert pm.heap_share(peak, {"default_space": 300, "argument": 100}) == 0.25  # 50 / (300 - 100)
    assert pm.heap_share(peak, {"default_space": 100, "argument": 100}) is None
    assert pm.heap_share(peak, {"default_space": 100, "argument": 150}) is None  # never negative
    assert pm.heap_share(peak, {"default_space": 200}) == 0.25  # no argument figure: the whole space


def test_the_depth_table_is_in_gib_from_exactly_one_gib():
    row = {"argument": 0, "temp": 0, "total": 2**20, "default_space": None}
    d = {"block_layers": 1, "hbm": None, "fits": None, "compiled": [{**row, "layers": 2, "blocks": 2},
                                                                  {**row, "layers": 3, "blocks": 3}],
         "per_block": row, "extrapolated": {**row, "total": GIB, "layers": 4, "blocks": 4}}
    text = depth.format_depth(d)
    assert "(per device, GiB)" in text
    assert text.splitlines()[5].split()[-2:] == ["1.00", "-"]
    below = {**d, "extrapolated": {**d["extrapolated"], "total": GIB - 2**20}}
    assert "(per device, MiB)" in depth.format_depth(below)
    assert depth.format_depth(below).splitlines()[5].split()[-2:] == ["1023.00", "-"]


def test_the_depths_refuse_fewer_than_two_blocks_and_take_exactly_two():
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(layer_pattern=("gdn", "attention"), num_layers=8))
    assert depth.depths(cfg, 4) == (4, 6)  # two blocks of 2, and three
    assert depth.depths(cfg, 6) == (6, 8)  # the deeper compile is the whole model
    for n in (2, 0):
        with pytest.raises(ValueError, match="at least two blocks"):
            depth.depths(cfg, n)
    with pytest.raises(ValueError, match="the model has 8 layers"):
        depth.depths(cfg, 8)
    with pytest.raises(ValueError, match="not a whole number"):
        depth.depths(cfg, 5)


def test_the_gates_run_with_one_step(monkeypatch):
    monkeypatch.setattr(gates, "run_arm", lambda cfg, steps, with_sampler_gap=True: {
        "steps": [{"kept_frac": 1.0, "loss": 2.0, "logp_mean": -1.0, "logp_mean_last": -1.0, "entropy": 3.0,
                   "grad_norm": 1.0}] * steps, "logp_tokens": np.zeros((1, 1)), "sampler_gap": None})
    out = gates.run_gates("ref", "cand", steps=1)
    assert out["passed"] and len(out["candidate"]) == 1


def test_kept_frac_is_kept_tokens_over_the_batches_completion_tokens():
    cfg = types.SimpleNamespace(rl=types.SimpleNamespace(rollouts_per_step=6, max_new_tokens=4, sequence_len=10))
    m = gates.step_metrics(cfg, {"kept_tokens": np.float32(12), "loss": np.float32(0.5)}, -2.5)
    # 12 of 6 rows x 4 completion tokens.
    assert m == {"kept_tokens": 12.0, "loss": 0.5, "kept_frac": 0.5, "logp_mean_last": -2.5}
