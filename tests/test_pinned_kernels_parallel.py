"""Sharding specs and context-parallel sizes pinned to hand-worked answers: the logical-axis rules
(parallel/rules.py) on every weight kind, and the load-balanced order's permutations, query runs,
token index and per-rank work (parallel/context.py). Pure Python and numpy."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

from hybridmoe.parallel import context, rules
from hybridmoe.parallel.rules import CP_AS_EP_RULES, DEFAULT_RULES, AxisRuleError

DENSE_FSDP = ("fsdp", "context", "expert")
EXP_FSDP = rules.rules_table("default", "exp")


def test_rules_tables():
    assert DEFAULT_RULES["batch"] == ("data", "fsdp", "expert") and DEFAULT_RULES["seq"] == "context"
    assert DEFAULT_RULES["embed"] == DENSE_FSDP and DEFAULT_RULES["exp"] == "expert"
    assert {DEFAULT_RULES[a] for a in ("vocab", "heads", "kv_heads", "mlp")} == {"tensor"}
    assert DEFAULT_RULES["layers"] is None
    assert CP_AS_EP_RULES["exp"] == ("context", "expert") and CP_AS_EP_RULES["batch"] == ("data", "fsdp")
    assert rules.rules_table("default") is DEFAULT_RULES
    assert EXP_FSDP == {**DEFAULT_RULES, "fsdp_to": "exp"}
    assert rules.rules_table("cp_as_ep", "exp")["fsdp_to"] == "exp"


@pytest.mark.parametrize("axes, table, spec", [
    # a dense weight: FSDP over every data-parallel axis for weights
    (("embed", "mlp"), DEFAULT_RULES, PS(DENSE_FSDP, "tensor")),
    (("vocab", "embed"), DEFAULT_RULES, PS("tensor", DENSE_FSDP)),
    # a routed expert weight: experts on expert, FSDP over what is left (fsdp, context)
    (("exp", "embed", "mlp"), DEFAULT_RULES, PS("expert", ("fsdp", "context"), "tensor")),
    (("exp", "mlp", "embed"), DEFAULT_RULES, PS("expert", "tensor", ("fsdp", "context"))),
    # expert_fsdp_dim=exp: the split moves onto the experts, after their own axis; D whole
    (("exp", "embed", "mlp"), EXP_FSDP, PS(("expert", "fsdp", "context"), None, "tensor")),
    # no exp dimension: fsdp_to changes nothing
    (("embed", "mlp"), EXP_FSDP, PS(DENSE_FSDP, "tensor")),
    # cp_as_ep: experts over context x expert, FSDP over fsdp alone (one axis: a plain name)
    (("exp", "embed", "mlp"), CP_AS_EP_RULES, PS(("context", "expert"), "fsdp", "tensor")),
    # activations
    (("batch", "seq", None), DEFAULT_RULES, PS(("data", "fsdp", "expert"), "context", None)),
    (("batch", "seq", None), CP_AS_EP_RULES, PS(("data", "fsdp"), "context", None)),
    # the stacked layer axis is never split
    (("layers", "embed", "heads", None), DEFAULT_RULES, PS(None, DENSE_FSDP, "tensor", None)),
    ((None,), DEFAULT_RULES, PS(None)),
])
def test_logical_to_spec(axes, table, spec):
    assert rules.logical_to_spec(axes, table) == spec


def test_logical_to_spec_refusals_name_the_axes():
    with pytest.raises(AxisRuleError, match=r"mesh axis 'expert' is used by both logical axes 'batch' and 'exp' "
                                             r"in \('batch', 'exp'\)"):
        rules.logical_to_spec(("batch", "exp"), DEFAULT_RULES)
    with pytest.raises(AxisRuleError, match="logical axis 'foo' has no rule"):
        rules.logical_to_spec(("foo",), DEFAULT_RULES)
    with pytest.raises(AxisRuleError, match="'embed' names two dimensions"):
        rules.logical_to_spec(("embed", "embed"), DEFAULT_RULES)
    # under cp_as_ep a batch over (data, fsdp) leaves expert free: no collision with the experts
    assert rules.logical_to_spec(("batch", "exp"), CP_AS_EP_RULES) == PS(("data", "fsdp"), ("context", "expert"))


def test_active_rules_are_the_default_until_replaced():
    assert rules.active_rules() is DEFAULT_RULES
    with rules.use_rules(CP_AS_EP_RULES):
        assert rules.logical_to_spec(("exp",)) == PS(("context", "expert"))
    assert rules.logical_to_spec(("exp",)) == PS("expert")


def test_at_use_spec_and_gathered_axes():
    assert rules.at_use_spec(("exp", "embed", "mlp"), DEFAULT_RULES) == PS("expert", None, "tensor")
    assert rules.gathered_at_use(("exp", "embed", "mlp"), DEFAULT_RULES) == ((), ("fsdp", "context"), ())
    assert rules.gathered_at_use(("embed", "mlp"), DEFAULT_RULES) == (DENSE_FSDP, ())
    # expert_fsdp_dim=exp: the experts' dimension gathers fsdp and context, keeps expert
    assert rules.gathered_at_use(("exp", "embed", "mlp"), EXP_FSDP) == (("fsdp", "context"), (), ())
    assert rules.at_use_spec(("exp", "embed", "mlp"), EXP_FSDP) == PS("expert", None, "tensor")


def test_mesh_axes_of_each_entry_kind():
    assert rules.mesh_axes_of(None) == ()
    assert rules.mesh_axes_of("tensor") == ("tensor",)
    assert rules.mesh_axes_of(("fsdp", "context")) == ("fsdp", "context")


def test_sequence_unsharded_drops_only_the_sequence_split():
    out = context.sequence_unsharded(DEFAULT_RULES)
    assert out["seq"] is None and {k: v for k, v in out.items() if k != "seq"} == {
        k: v for k, v in DEFAULT_RULES.items() if k != "seq"}
    assert DEFAULT_RULES["seq"] == "context"


# ---------------------------------------------------------------------------------------------
# parallel/context.py


def test_load_balance_permutations_at_three_ranks():
    # half-chunk j of rank j // 2 goes to rank j if j < 3, else to 5 - j
    first, second = context.load_balance_permutations(3)
    assert first == [(0, 0), (1, 2), (2, 1)]     # half-chunks 0, 2, 4
    assert second == [(0, 1), (1, 2), (2, 0)]    # half-chunks 1, 3, 5


def test_load_balance_permutations_at_two_and_one_rank():
    assert context.load_balance_permutations(2) == ([(0, 0), (1, 1)], [(0, 1), (1, 0)])
    assert context.load_balance_permutations(1) == ([(0, 0)], [(0, 0)])


def test_load_balanced_token_index_gives_rank_r_half_chunks_r_and_2p_minus_1_minus_r():
    # 12 tokens over 3 ranks: half-chunks of 2; rank 0: chunks 0, 5; rank 1: 1, 4; rank 2: 2, 3
    assert context.load_balanced_token_index(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert context.load_balanced_token_index(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_rank_query_runs():
    # 8 queries a rank of 32: balanced, half-chunks 0 and 2 * 4 - 1 = 7 of 4 tokens each
    assert context.rank_query_runs(8, 32, True) == ((0, 4), (28, 4))
    # natural order: the last rank's shard
    assert context.rank_query_runs(8, 32, False) == ((24, 8),)
    assert context.rank_query_runs(8, 8, True) == ((0, 4), (4, 4))


def test_unmasked_scores_per_rank_count_causal_same_segment_pairs():
    # one row of 4 tokens, one document: queries see 1, 2, 3, 4 keys -> ranks (1 + 2, 3 + 4)
    assert context.unmasked_scores_per_rank([[0, 1, 2, 3]], [[0, 0, 0, 0]], 2).tolist() == [3, 7]
    # two documents of 2 tokens: 1, 2, 1, 2 -> (3, 3); a second row adds (3, 7)
    pos = [[0, 1, 0, 1], [0, 1, 2, 3]]
    seg = [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert context.unmasked_scores_per_rank(pos, seg, 2).tolist() == [6, 10]
    # four ranks of one query each
    assert context.unmasked_scores_per_rank([[0, 1, 2, 3]], [[0, 0, 0, 0]], 4).tolist() == [1, 2, 3, 4]


def test_load_balanced_order_evens_the_work():
    # 8 tokens, 2 ranks: natural (1+2+3+4, 5+6+7+8) = (10, 26); balanced order 0, 1, 6, 7 | 2, 3, 4, 5:
    # (1 + 2 + 7 + 8, 3 + 4 + 5 + 6) = (18, 18)
    idx = context.load_balanced_token_index(8, 2)
    pos = np.arange(8)[None]
    seg = np.zeros((1, 8), int)
    assert context.unmasked_scores_per_rank(pos, seg, 2).tolist() == [10, 26]
    assert context.unmasked_scores_per_rank(pos[:, idx], seg, 2).tolist() == [18, 18]


# ---------------------------------------------------------------------------------------------
# Sizes under a mesh (an abstract one: no devices needed)


def _mesh(data=1, fsdp=1, context_=1, expert=1, tensor=1):
    import jax

    from hybridmoe.parallel.mesh import MESH_AXES

    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((data, fsdp, context_, expert, tensor), MESH_AXES))


def test_context_axes_and_size_under_a_mesh():
    assert context.context_axes() == ()  # no mesh
    with _mesh(fsdp=2, context_=3):
        assert context.context_axes() == ("context",) and context.context_size(("context",)) == 3
    with _mesh(fsdp=2, context_=1):
        assert context.context_axes() == ()  # a split of 1 is none


def test_tokens_per_device_divide_over_the_batch_and_sequence_shards():
    from hybridmoe.model.remat import tokens_per_device

    assert tokens_per_device(100) == 100  # no mesh
    with _mesh(data=2, fsdp=2, context_=3, tensor=4):
        # batch over data x fsdp x expert = 4, sequence over context 3: 12 shards (tensor holds copies)
        assert tokens_per_device(96) == 8
        assert tokens_per_device(97) == 9  # rounded up
    with _mesh(expert=2, context_=2), rules.use_rules(CP_AS_EP_RULES):
        assert tokens_per_device(96) == 48  # cp_as_ep: the batch is not split over expert


def test_splits_evenly_over_the_axes_a_spec_names():
    with _mesh(fsdp=2, context_=3):
        assert rules.splits_evenly(PS(("fsdp", "context")), (12,))
        assert not rules.splits_evenly(PS(("fsdp", "context")), (8,))
        assert not rules.splits_evenly(PS(("fsdp", "context")), (3,))  # 3 splits over context alone, not both
        assert rules.splits_evenly(PS("fsdp", None), (8, 7))
        assert not rules.splits_evenly(PS(None, "context"), (8, 7))


def test_make_mesh_orders_the_five_axes():
    import jax

    from hybridmoe.parallel.mesh import MESH_AXES, make_mesh

    assert MESH_AXES == ("data", "fsdp", "context", "expert", "tensor")
    n = len(jax.devices())
    mesh = make_mesh({"data": 1, "fsdp": n, "context": 1, "expert": 1, "tensor": 1})
    assert mesh.axis_names == MESH_AXES and dict(mesh.shape) == {"data": 1, "fsdp": n, "context": 1, "expert": 1,
                                                                 "tensor": 1}
    one = make_mesh({a: 1 for a in MESH_AXES}, devices=jax.devices()[:1])
    assert dict(one.shape) == {a: 1 for a in MESH_AXES}
