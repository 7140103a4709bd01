"""GDN glue arithmetic: chunks per Mosaic grid step, the Mosaic kernels' buffer list, the backend
choice, the context-parallel shard refusal and the pairwise fold over an odd chunk count."""

import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels.gdn import context_parallel as cp
from hybridmoe.kernels.gdn import limits


@pytest.mark.parametrize("chunk_size, group, chunks, expected", [
    (64, 1, None, 8),   # 8 chunk-heads // 1 head = 8 chunks; 512 tokens, a multiple of 16
    (64, 4, None, 2),   # 8 // 4 = 2
    (64, 16, None, 1),  # 8 // 16 = 0 -> at least 1
    (64, 1, 3, 3),      # capped at the sequence's 3 chunks
    (64, 1, 0, 1),      # never below 1
    (2, 2, None, 8),    # 4 chunks = 8 tokens -> grown to 8 chunks = 16 tokens
    (4, 4, 1, 4),       # capped to 1 chunk = 4 tokens -> grown to 4 chunks = 16 tokens
    (24, 8, None, 2),   # 1 chunk = 24 tokens -> 2 chunks = 48 tokens
    (12, 8, None, 4),   # 12, 24, 36 are not multiples of 16; 48 is
])
def test_chunks_per_step_is_eight_chunk_heads_capped_then_grown_to_whole_sublane_tiles(chunk_size, group, chunks,
                                                                                       expected):
    assert limits.default_chunks_per_step(chunk_size, group, chunks) == expected


def _by_name(buffers):
    return {b.what: b for b in buffers}


def test_forward_buffers_count_values_per_further_chunk_head():
    # C 64, K 32, V 16, group 2, 3 chunks per step: 192 tokens; 2 * 3 - 1 = 5 further chunk-heads
    b = _by_name(limits.tpu_buffers("gdn_chunk_forward", chunk_size=64, key_dim=32, value_dim=16, group=2,
                                    chunks_per_step=3, itemsize=2))
    assert (b["q"].shape, b["q"].itemsize, b["q"].count) == ((192, 32), 2, 2)  # the input's rows
    assert (b["q_scale"].shape, b["q_scale"].itemsize) == ((3, 1, 64), 4)
    assert (b["v"].shape, b["v"].itemsize) == ((2, 192, 16), 2)
    assert (b["o"].shape, b["o"].itemsize) == ((2, 192, 16), 2)
    assert b["log_gates"].shape == b["beta"].shape == (3, 2, 64)
    assert b["chunk_starts"].shape == (6, 32, 16) and b["inverses"].shape == (6, 64, 64)
    assert (b["state"].shape, b["state"].count, b["state"].kind) == ((2, 32, 16), 1, "scratch")
    # forward counts: base (17, 0, 0) + 5 * (0, 0, 5)
    assert [b[n].count for n in ("c_by_c", "c_by_k", "k_by_v")] == [17, 0, 25]
    assert b["c_by_k"].shape == (64, 32)  # [C, max(K, V)]
    assert b["k_by_v"].shape == (32, 16)


def test_backward_buffers_count_values_per_further_chunk_head_and_default_step():
    # C 64, K 16, V 48, group 4, default chunks per step 8 // 4 = 2: 2 * 4 - 1 = 7 further chunk-heads
    b = _by_name(limits.tpu_buffers("gdn_chunk_backward", chunk_size=64, key_dim=16, value_dim=48, group=4))
    assert b["q"].shape == (128, 16) and b["dv"].shape == b["do"].shape == (4, 128, 48)
    assert b["dlog_gates"].shape == (2, 4, 64)
    # backward counts: base (0, 20, 9) + 7 * (5, 11, 5)
    assert [b[n].count for n in ("c_by_c", "c_by_k", "k_by_v")] == [35, 97, 44]
    assert b["c_by_k"].shape == (64, 48)  # max(K 16, V 48)
    assert "d_initial" in b and "initial" not in b
    with pytest.raises(ValueError, match="unknown GDN kernel 'gdn_chunk'"):
        limits.tpu_buffers("gdn_chunk", chunk_size=64, key_dim=16, value_dim=16)


def test_resolve_keeps_an_explicit_choice_and_auto_is_xla_off_tpu():
    assert limits.resolve("pallas_gpu", "tpu", 1) == "pallas_gpu"
    assert limits.resolve("xla", "tpu", 64) == "xla"
    assert limits.resolve("auto", "gpu", 64) == "xla"
    assert limits.resolve("auto", "cpu", 64) == "xla"
    assert limits.resolve("auto", "tpu", 2) == "pallas_tpu"
    assert limits.resolve("auto", "tpu", 1) == "xla"


def test_context_parallel_refuses_a_shard_that_is_not_whole_chunks():
    # a shard of 6 tokens at chunk 4: refused before any collective (so no shard_map needed)
    q = jnp.zeros((1, 6, 1, 4))
    v = jnp.zeros((1, 6, 2, 4))
    g = jnp.zeros((1, 6, 2))
    with pytest.raises(ValueError, match="a shard of 6 tokens is not a whole number of chunks of 4"):
        cp.gated_delta_rule_context_parallel(q, q, v, g, g, segment_ids=jnp.ones((1, 6), jnp.int32),
                                             axis_name="context", chunk_size=4)


@pytest.mark.parametrize("n, expected", [
    # M0 = [[1, 1], [0, 1]], M1 = [[1, 0], [1, 1]], M2 = [[2, 0], [0, 1]], M3 = [[1, 0], [0, 3]]
    (1, [[1, 1], [0, 1]]),
    (2, [[1, 1], [1, 2]]),    # M1 M0
    (3, [[2, 2], [1, 2]]),    # M2 M1 M0: rows of M1 M0, the first doubled
    (4, [[2, 2], [3, 6]]),    # M3 M2 M1 M0: the second row tripled
])
def test_tree_fold_is_the_ordered_product_at_odd_and_even_counts(n, expected):
    m = jnp.array([[[1, 1], [0, 1]], [[1, 0], [1, 1]], [[2, 0], [0, 1]], [[1, 0], [0, 3]]], jnp.float32)[:n]
    (out,) = cp._fold_pairs((m,), lambda early, late: (late[0] @ early[0],), (jnp.eye(2),))
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_decode_step_and_sequence_return_v_dtype_outputs_and_float32_states():
    from hybridmoe.kernels.gdn import ops

    # q, k float32 and v bfloat16: the output follows v, the state is float32 (B 1, Hk 1, Hv 2, dk 2, dv 2)
    q = jnp.ones((1, 1, 2), jnp.float32)
    v = jnp.ones((1, 2, 2), jnp.bfloat16)
    g, beta, state = jnp.zeros((1, 2)), jnp.full((1, 2), 0.5), jnp.zeros((1, 2, 2, 2), jnp.bfloat16)
    o, new_state = ops.gated_delta_step(q, q, v, g, beta, state)
    assert (o.dtype, o.shape, new_state.dtype, new_state.shape) == (jnp.bfloat16, (1, 2, 2), jnp.float32, (1, 2, 2, 2))
    o, final = ops.gated_delta_rule(q[:, None], q[:, None], v[:, None], g[:, None], beta[:, None], chunk_size=2)
    assert (o.dtype, o.shape, final.dtype, final.shape) == (jnp.bfloat16, (1, 1, 2, 2), jnp.float32, (1, 2, 2, 2))
