"""The flash kernels' block bookkeeping pinned to hand-worked answers: block classes (skip, masked,
unmasked), the block schedules, the head and row layouts (kernels/attention/flash_block.py), the
ring's source rank and partial merge (ring.py) and the entry checks (ops.py). A class or a
schedule slip that only costs time (a fully visible pair masked, a visible pair's order) leaves the
numbers right, so the numeric tests cannot see it: these can. Eager arrays of a few elements."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels.attention import flash_block as fb
from hybridmoe.kernels.attention import ops, ring

SKIP, PARTIAL, FULL = fb.SKIP, fb.PARTIAL, fb.FULL


def _l(x):
    return np.asarray(x).tolist()


def test_block_class_constants():
    assert (SKIP, PARTIAL, FULL) == (0, 1, 2)


def test_causal_blocks_are_full_below_masked_on_and_skipped_above_the_diagonal():
    # 8 tokens of one document, blocks of 2: key block j before query block i is fully visible
    pos = jnp.arange(8)[None]
    seg = jnp.zeros((1, 8), jnp.int32)
    r = fb.block_ranges(pos, seg, 2)
    assert _l(r.pos_lo) == [[0, 2, 4, 6]] and _l(r.pos_hi) == [[1, 3, 5, 7]]
    assert _l(fb.block_classes(r, r)) == [[[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]]


# Two packed documents: tokens 0..2 (positions 0, 1, 2; segment 0) and 3..7 (0..4; segment 1), blocks
# of 2. Ranges per block: b0 positions 0-1, segment 0; b1 0-2, segments 0-1; b2 1-2, segment 1;
# b3 3-4, segment 1.
PACKED_POS = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
PACKED_SEG = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
# (i, j): q0 sees k0, k1 masked, k2 other document, k3 later; q1 mixes documents: masked with
# k0..k2, k3 later; q2 (segment 1) skips k0 (segment 0), k1 mixed, k2 masked (key 2 after query 1),
# k3 later; q3: k2 all at or before its earliest query and one document: FULL.
PACKED_CLASSES = [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 0], [0, 1, 2, 1]]


def test_packed_block_classes_respect_segments_and_positions():
    r = fb.block_ranges(PACKED_POS, PACKED_SEG, 2)
    assert _l(r.seg_lo) == [[0, 0, 1, 1]] and _l(r.seg_hi) == [[0, 1, 1, 1]]
    assert _l(r.pos_lo) == [[0, 0, 1, 3]] and _l(r.pos_hi) == [[1, 2, 2, 4]]
    assert _l(fb.block_classes(r, r)) == [PACKED_CLASSES]


def test_block_predicates_at_their_edges():
    def ranges(pos_lo, pos_hi, seg_lo, seg_hi):
        return fb.Ranges(*(jnp.array([[v]]) for v in (pos_lo, pos_hi, seg_lo, seg_hi)))

    q = ranges(4, 7, 1, 1)
    assert bool(fb.block_may_be_visible(q, ranges(7, 9, 1, 1))[0, 0])       # first key at the last query
    assert not bool(fb.block_may_be_visible(q, ranges(8, 9, 1, 1))[0, 0])   # every key after it
    assert not bool(fb.block_may_be_visible(q, ranges(0, 3, 2, 2))[0, 0])   # a later document only
    assert not bool(fb.block_may_be_visible(q, ranges(0, 3, 0, 0))[0, 0])   # an earlier document only
    assert bool(fb.block_fully_visible(q, ranges(0, 4, 1, 1))[0, 0])        # last key at the first query
    assert not bool(fb.block_fully_visible(q, ranges(0, 5, 1, 1))[0, 0])
    assert not bool(fb.block_fully_visible(q, ranges(0, 3, 0, 1))[0, 0])    # keys of two documents
    assert not bool(fb.block_fully_visible(ranges(4, 7, 1, 2), ranges(0, 3, 1, 1))[0, 0])  # queries of two
    assert not bool(fb.block_fully_visible(q, ranges(0, 3, 2, 2))[0, 0])    # another document


def test_schedules_visit_visible_blocks_in_order_then_repeat_the_last():
    by_q, by_k = fb.schedules(PACKED_POS, PACKED_SEG, PACKED_POS, PACKED_SEG, 2, 2)
    assert _l(by_q.count) == [[2, 3, 2, 3]]
    assert _l(by_q.order) == [[[0, 1, 1, 1], [0, 1, 2, 2], [1, 2, 2, 2], [1, 2, 3, 3]]]
    assert _l(by_q.cls) == [[[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 2, 1, 1]]]
    # by key block: the transposed classes' columns
    assert _l(by_k.count) == [[2, 4, 3, 1]]
    assert _l(by_k.order) == [[[0, 1, 1, 1], [0, 1, 2, 3], [1, 2, 3, 3], [3, 3, 3, 3]]]
    assert _l(by_k.cls) == [[[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 2, 2], [1, 1, 1, 1]]]
    order, count, cls = fb.flat_schedule(by_q)
    assert _l(count) == [2, 3, 2, 3] and _l(order)[:8] == [0, 1, 1, 1, 0, 1, 2, 2]


def test_schedule_of_a_block_that_sees_nothing_is_block_zero():
    s = fb.schedule(jnp.array([[[SKIP, SKIP, SKIP], [SKIP, SKIP, FULL]]]))
    assert _l(s.count) == [[0, 1]]
    assert _l(s.order) == [[[0, 0, 0], [2, 2, 2]]]
    assert _l(s.cls) == [[[SKIP, SKIP, SKIP], [FULL, FULL, FULL]]]


def test_schedules_with_different_query_and_key_blocks():
    # 4 queries at positions 4..7 (blocks of 2) against 8 keys 0..7 (blocks of 4), one document:
    # q0 (4-5): k0 (0-3) full, k1 (4-7) masked; q1 (6-7): k0 full, k1 masked
    by_q, by_k = fb.schedules(jnp.array([[4, 5, 6, 7]]), jnp.zeros((1, 4), int), jnp.arange(8)[None],
                              jnp.zeros((1, 8), int), 2, 4)
    assert _l(by_q.cls) == [[[2, 1], [2, 1]]] and _l(by_q.count) == [[2, 2]]
    assert _l(by_k.cls) == [[[2, 2], [1, 1]]] and _l(by_k.count) == [[2, 2]]


# ---------------------------------------------------------------------------------------------
# Layouts


def test_query_heads_of_a_kv_head_are_consecutive():
    assert _l(fb.query_heads_of(2, 3)) == [[0, 1, 2], [3, 4, 5]]


def test_group_heads_puts_query_head_g_r_under_kv_head_g():
    # x[b, t, n] = 10 * t + n; B 1, T 2, N 4 over G 2
    x = (10 * jnp.arange(2)[:, None] + jnp.arange(4)[None, :])[None]
    g = fb.group_heads(x, 2)
    assert g.shape == (1, 2, 2, 2)  # [B, G, R, T]
    assert _l(g[0]) == [[[0, 10], [1, 11]], [[2, 12], [3, 13]]]
    assert _l(fb.ungroup_heads(g)) == _l(x)


def test_rows_to_blocks_folds_each_heads_block_in_turn():
    # [B 1, G 1, R 2, T 4], blocks of 2: block i's rows are head 0's tokens then head 1's
    x = jnp.array([[[[0, 1, 2, 3], [10, 11, 12, 13]]]])
    b = fb.rows_to_blocks(x, 2)
    assert _l(b) == [[[[0, 1, 10, 11], [2, 3, 12, 13]]]]
    assert _l(fb.blocks_to_rows(b, 2)) == _l(x)


def test_id_blocks_stack_positions_over_segments_per_block():
    ids = fb.id_blocks(jnp.array([[5, 6, 7, 8]]), jnp.array([[0, 0, 1, 1]]), 2)
    assert _l(ids) == [[[[5, 6], [0, 0]], [[7, 8], [1, 1]]]]
    rep = fb.id_blocks(jnp.array([[5, 6, 7, 8]]), jnp.array([[0, 0, 1, 1]]), 2, repeat=2)
    assert _l(rep[0, 1]) == [[7, 8, 7, 8], [1, 1, 1, 1]]


def test_visible_is_at_or_before_in_the_same_segment():
    q_pos, q_seg = jnp.array([[2], [2]]), jnp.array([[0], [1]])
    kv_pos, kv_seg = jnp.array([[1, 2, 3]]), jnp.array([[0, 0, 0]])
    assert _l(fb.visible(q_pos, q_seg, kv_pos, kv_seg)) == [[True, True, False], [False, False, False]]


def test_forward_finish_normalises_and_gives_an_empty_row_zeros_and_minus_inf():
    m = jnp.array([[1.0], [-jnp.inf]])
    total = jnp.array([[4.0], [0.0]])
    acc = jnp.array([[2.0, 8.0], [0.0, 0.0]])
    o, lse = fb.forward_finish((m, total, acc))
    assert _l(o) == [[0.5, 2.0], [0.0, 0.0]]
    np.testing.assert_allclose(_l(lse), [[1.0 + math.log(4.0)], [-math.inf]])


def test_forward_block_online_softmax_over_two_key_blocks():
    # one query row q = (1, 0), scale 1; keys k = (1, 0), (0, 0) in two blocks; values 3 and 5:
    # scores 1 and 0: o = (e * 3 + 1 * 5) / (e + 1), lse = log(e + 1)
    q = jnp.array([[1.0, 0.0]])
    carry = fb.forward_init(1, 1)
    carry = fb.forward_block(q, jnp.array([[1.0, 0.0]]), jnp.array([[3.0]]), None, carry, 1.0)
    carry = fb.forward_block(q, jnp.array([[0.0, 0.0]]), jnp.array([[5.0]]), None, carry, 1.0)
    o, lse = fb.forward_finish(carry)
    np.testing.assert_allclose(float(o[0, 0]), (math.e * 3 + 5) / (math.e + 1), rtol=1e-6)
    np.testing.assert_allclose(float(lse[0, 0]), math.log(math.e + 1), rtol=1e-6)
    # a masked block first leaves the row empty, then the visible one counts alone
    carry = fb.forward_block(q, jnp.array([[1.0, 0.0]]), jnp.array([[3.0]]), jnp.array([[False]]), fb.forward_init(1, 1), 1.0)
    carry = fb.forward_block(q, jnp.array([[0.0, 0.0]]), jnp.array([[5.0]]), None, carry, 2.0)
    o, lse = fb.forward_finish(carry)
    assert float(o[0, 0]) == 5.0 and float(lse[0, 0]) == 0.0


# ---------------------------------------------------------------------------------------------
# ring.py and ops.py


def test_ring_source_is_the_rank_step_places_before():
    assert [ring.ring_source(r, 1, 4) for r in range(4)] == [3, 0, 1, 2]
    assert [ring.ring_source(2, s, 4) for s in range(4)] == [2, 1, 0, 3]


def test_merge_partials_weights_each_by_its_share_of_the_sum():
    # [B 1, T 1, N 1, A 1]; partial sums e^0 = 1 and e^(ln 3) = 3: weights 1/4 and 3/4
    o, lse = ring.merge_partials(jnp.full((1, 1, 1, 1), 2.0), jnp.zeros((1, 1, 1)),
                                 jnp.full((1, 1, 1, 1), 5.0), jnp.full((1, 1, 1), math.log(3.0)))
    np.testing.assert_allclose(float(o[0, 0, 0, 0]), 2.0 / 4 + 5.0 * 3 / 4, rtol=1e-6)
    np.testing.assert_allclose(float(lse[0, 0, 0]), math.log(4.0), rtol=1e-6)
    # nothing seen yet on one side: the other passes through; on both: zeros, -inf
    o, lse = ring.merge_partials(jnp.zeros((1, 1, 1, 1)), jnp.full((1, 1, 1), -jnp.inf),
                                 jnp.full((1, 1, 1, 1), 7.0), jnp.full((1, 1, 1), math.log(2.0)))
    np.testing.assert_allclose(float(o[0, 0, 0, 0]), 7.0, rtol=1e-6)
    o, lse = ring.merge_partials(jnp.zeros((1, 1, 1, 1)), jnp.full((1, 1, 1), -jnp.inf),
                                 jnp.zeros((1, 1, 1, 1)), jnp.full((1, 1, 1), -jnp.inf))
    assert float(o[0, 0, 0, 0]) == 0.0 and float(lse[0, 0, 0]) == -math.inf


def test_merge_partials_moves_lse_heads_to_the_outputs_heads():
    # [B 1, T 2, N 2, A 1]; lse [B, N, T]: head 0 has lse_s = -inf at both tokens, head 1 has it equal
    o_acc = jnp.ones((1, 2, 2, 1))
    o_s = jnp.full((1, 2, 2, 1), 3.0)
    lse_acc = jnp.zeros((1, 2, 2))
    lse_s = jnp.array([[[-jnp.inf, -jnp.inf], [0.0, 0.0]]])
    o, _ = ring.merge_partials(o_acc, lse_acc, o_s, lse_s)
    assert _l(o[0, :, :, 0]) == [[1.0, 2.0], [1.0, 2.0]]  # [T, N]: head 0 keeps 1, head 1 averages 1 and 3


def _qkv(T=8, S=8, N=4, G=2, A=4):
    return jnp.zeros((1, T, N, A)), jnp.zeros((1, S, G, A)), jnp.zeros((1, S, G, A))


def test_flash_entry_checks_name_the_bad_argument():
    q, k, v = _qkv()
    ok = dict(q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, backend="xla", block_q=4, block_k=8)
    ops._check(q, k, v, **ok)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        ops._check(q, k, v, **{**ok, "backend": "cuda"})
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of kv heads 3"):
        ops._check(q, *_qkv(G=3)[1:], **ok)
    with pytest.raises(ValueError, match=r"kv_pos must be \[B, 8\] = \(1, 8\); got \(1, 4\)"):
        ops._check(q, k, v, **{**ok, "kv_pos": jnp.zeros((1, 4))})
    with pytest.raises(ValueError, match="block_q=3 must divide the query length 8"):
        ops._check(q, k, v, **{**ok, "block_q": 3})
    # keys longer than queries (a ring step, a decode cache): block_k against S
    q2, k2, v2 = _qkv(T=4, S=12)
    ops._check(q2, k2, v2, **{**ok, "block_q": 4, "block_k": 6})
    with pytest.raises(ValueError, match="block_k=8 must divide the key length 12"):
        ops._check(q2, k2, v2, **{**ok, "block_q": 4, "block_k": 8})
    with pytest.raises(ValueError, match="q must be"):
        ops._check(q, k, v[:, :, :1], **ok)


def test_only_mosaic_takes_a_vmem_limit_and_query_runs():
    assert ops._limit("pallas_tpu", 24.0, ((0, 4),)) == {"vmem_limit_mib": 24.0, "query_runs": ((0, 4),)}
    assert ops._limit("pallas_gpu", 24.0) == {}
    assert ops.platform_default("tpu") == "pallas_tpu" and ops.platform_default("cpu") == "xla"


@pytest.mark.parametrize("t, blocks", [(256, 4), (512, 4), (128, 2), (254, 2), (255, 1), (126, 1), (127, 1)])
def test_blocked_core_splits_into_the_most_blocks_of_at_least_64_tokens(t, blocks):
    # 256: 4 x 64 (exactly the least); 128: 4 x 32 too small -> 2 x 64; 254: 4 does not divide -> 2 x 127;
    # 126: 2 x 63 too small -> 1
    from hybridmoe.kernels.attention import blocked

    assert blocked.num_query_blocks(t) == blocks


# ---------------------------------------------------------------------------------------------
# model/attention.py: the core the config names, with the blocks and query runs it hands the kernel


def _core_call(monkeypatch, attention_keys, *, interpret=False, T=200, S=400, load_balanced=None):
    from hybridmoe.config.schema import KernelsConfig
    from hybridmoe.model import attention as layer

    seen = {}
    monkeypatch.setattr(layer, "flash_attention", lambda *a, **kw: seen.update(kw))
    kc = KernelsConfig.model_validate({"attention": attention_keys, "interpret": interpret})
    core = layer.attention_core(kc, self_attention=False, load_balanced=load_balanced)
    q, k = jnp.zeros((1, T, 4, 8)), jnp.zeros((1, S, 2, 8))
    ids_q, ids_k = jnp.zeros((1, T), jnp.int32), jnp.zeros((1, S), jnp.int32)
    core(q, k, k, q_pos_BT=ids_q, kv_pos_BS=ids_k, q_seg_BT=ids_q, kv_seg_BS=ids_k, scale=0.5)
    return seen


def test_attention_core_fits_mosaic_blocks_and_states_load_balanced_query_runs(monkeypatch):
    # 200 local queries against 400 gathered keys, 2 ranks: Mosaic blocks 40 (8, 40, 200 divide 200)
    # and 400; balanced runs: half-chunks 0 and 3 of 100 tokens
    seen = _core_call(monkeypatch, {"backend": "pallas_tpu", "vmem_limit_mib": 24.0}, load_balanced=True)
    assert (seen["backend"], seen["block_q"], seen["block_k"], seen["scale"]) == ("pallas_tpu", 40, 400, 0.5)
    assert seen["query_runs"] == ((0, 100), (300, 100)) and seen["vmem_limit_mib"] == 24.0
    assert seen["interpret"] is False
    assert _core_call(monkeypatch, {"backend": "pallas_tpu"}, load_balanced=False)["query_runs"] == ((200, 200),)
    assert _core_call(monkeypatch, {"backend": "pallas_tpu"})["query_runs"] is None
    assert _core_call(monkeypatch, {"backend": "pallas_tpu"}, S=300, load_balanced=True)["query_runs"] is None


def test_attention_core_interpreted_or_xla_takes_any_divisor(monkeypatch):
    # no Mosaic rule: 128 -> 100 for 200 queries; 512 -> 400 keys
    seen = _core_call(monkeypatch, {"backend": "pallas_tpu"}, interpret=True)
    assert (seen["block_q"], seen["block_k"], seen["interpret"]) == (100, 400, True)
    seen = _core_call(monkeypatch, {"backend": "xla"})
    assert (seen["backend"], seen["block_q"], seen["block_k"]) == ("xla", 200, 200)  # xla's 256 defaults
    seen = _core_call(monkeypatch, {"backend": "xla", "block_q": 50, "block_k": 80})
    assert (seen["block_q"], seen["block_k"]) == (50, 80)


def test_blocked_core_takes_its_block_count_from_block_q(monkeypatch):
    from hybridmoe.config.schema import KernelsConfig
    from hybridmoe.model import attention as layer

    seen = {}
    monkeypatch.setattr(layer, "causal_attention_blocked", lambda q, *a, **kw: seen.update(kw))
    q = jnp.zeros((1, 200, 4, 8))
    layer.attention_core(KernelsConfig.model_validate({"attention": {"backend": "blocked", "block_q": 50}}),
                         self_attention=True)(q)
    assert seen["num_blocks"] == 4  # 200 / 50
    layer.attention_core(KernelsConfig.model_validate({"attention": {"backend": "blocked"}}), self_attention=True)(q)
    assert seen["num_blocks"] is None  # the core's own count
    # not self-attention (the gathered keys of context parallelism): the masked core over every key
    core = layer.attention_core(KernelsConfig.model_validate({"attention": {"backend": "blocked"}}), self_attention=False)
    assert core is layer.attention
