"""Entry checks of the kernels' public functions: each checked dimension, when wrong, is refused
with an error that names it (GDN core, flash attention, grouped matmuls).

All sizes are distinct where a check could compare the wrong dimension, so such a slip is seen.
Only shapes are read: the arrays are zeros and nothing is compiled.
"""

import jax.numpy as jnp
import pytest

from hybridmoe.kernels.attention import ops as attention_ops
from hybridmoe.kernels.gdn import ops as gdn_ops
from hybridmoe.kernels.gmm import ops as gmm_ops

Z = jnp.zeros

# GDN: B 2, T 6, Hk 2, dk 3, Hv 4, dv 5.
B, T, HK, DK, HV, DV = 2, 6, 2, 3, 4, 5


def _gdn(**over):
    args = dict(q=Z((B, T, HK, DK)), k=Z((B, T, HK, DK)), v=Z((B, T, HV, DV)), g=Z((B, T, HV)),
                beta=Z((B, T, HV)), segment_ids=Z((B, T), jnp.int32), initial_state=Z((B, HV, DK, DV)))
    args.update(over)
    return args


def test_gdn_accepts_well_formed_shapes():
    gdn_ops._check_shapes(**_gdn())
    gdn_ops._check_shapes(**_gdn(segment_ids=None, initial_state=None))


@pytest.mark.parametrize("over, message", [
    # q and k: rank 4 and equal shapes (rank 3 for both: only the rank check sees it)
    (dict(q=Z((B, T, HK)), k=Z((B, T, HK))), r"q and k must both be \[B, T, Hk, dk\]"),
    (dict(k=Z((B, T, HK, DK + 1))), r"q and k must both be .* k \(2, 6, 2, 4\)"),
    (dict(k=Z((B, T, HK + 1, DK))), r"q and k must both be"),
    # v: rank 4 with q's batch and tokens
    (dict(v=Z((B, T, HV))), r"v must be \[B, T, Hv, dv\] with B, T of q \(2, 6, 2, 3\); got \(2, 6, 4\)"),
    (dict(v=Z((1, T, HV, DV))), r"v must be \[B, T, Hv, dv\].*got \(1, 6, 4, 5\)"),
    (dict(v=Z((B, T - 1, HV, DV))), r"v must be \[B, T, Hv, dv\].*got \(2, 5, 4, 5\)"),
    # g and beta: [B, T, Hv] (not Hk)
    (dict(g=Z((B, T, HK))), r"g must be \[B, T, Hv\] = \(2, 6, 4\); got \(2, 6, 2\)"),
    (dict(g=Z((B, T - 1, HV))), r"g must be \[B, T, Hv\]"),
    (dict(beta=Z((B, T, HK))), r"beta must be \[B, T, Hv\] = \(2, 6, 4\); got \(2, 6, 2\)"),
    (dict(beta=Z((1, T, HV))), r"beta must be \[B, T, Hv\]"),
    # segment ids: [B, T]
    (dict(segment_ids=Z((B, T - 1), jnp.int32)), r"segment_ids must be \[B, T\] = \(2, 6\); got \(2, 5\)"),
    (dict(segment_ids=Z((1, T), jnp.int32)), r"segment_ids must be \[B, T\] = \(2, 6\); got \(1, 6\)"),
    # initial state: [B, Hv, dk, dv], each dimension
    (dict(initial_state=Z((1, HV, DK, DV))), r"initial_state must be \[B, Hv, dk, dv\] = \(2, 4, 3, 5\)"),
    (dict(initial_state=Z((B, HK, DK, DV))), r"initial_state must be .*got \(2, 2, 3, 5\)"),
    (dict(initial_state=Z((B, HV, DV, DK))), r"initial_state must be .*got \(2, 4, 5, 3\)"),
    (dict(initial_state=Z((B, HV, DK, DV + 1))), r"initial_state must be .*got \(2, 4, 3, 6\)"),
])
def test_gdn_refuses_each_wrong_dimension_by_name(over, message):
    with pytest.raises(ValueError, match=message):
        gdn_ops._check_shapes(**_gdn(**over))


def test_gdn_value_heads_must_be_a_multiple_of_key_heads():
    # Hk 2 into Hv 4 is fine (above); Hv 5 is not (v, g, beta all at 5 heads so only this check sees it)
    with pytest.raises(ValueError, match="value heads 5 must be a multiple of key heads 2"):
        gdn_ops._check_shapes(**_gdn(v=Z((B, T, 5, DV)), g=Z((B, T, 5)), beta=Z((B, T, 5)), initial_state=None))


def test_gdn_public_function_refuses_a_zero_chunk_and_bad_shapes_before_computing():
    a = _gdn()
    q, k, v, g, beta = (a[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match="chunk_size must be positive; got 0"):
        gdn_ops.gated_delta_rule(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="beta must be"):
        gdn_ops.gated_delta_rule(q, k, v, g, beta[:, :, :HK])
    with pytest.raises(ValueError, match="initial_state must be"):
        gdn_ops.gated_delta_rule(q, k, v, g, beta, initial_state=Z((B, HK, DK, DV)))
    with pytest.raises(ValueError, match="precision 'bfloat16' is the pallas_tpu core's; backend 'xla' takes none"):
        gdn_ops.gated_delta_rule(q, k, v, g, beta, precision="bfloat16")


# Flash attention: B 1, T 4 queries, S 12 keys, N 4 query heads, G 2 kv heads, A 6.
def _attn(T_=4, S=12, N=4, G=2, A=6, Bq=1):
    return Z((Bq, T_, N, A)), Z((1, S, G, A)), Z((1, S, G, A))


_OK = dict(q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, backend="xla", block_q=4, block_k=6)


def test_flash_accepts_ids_of_query_and_key_lengths():
    q, k, v = _attn()
    attention_ops._check(q, k, v, **{**_OK, "q_pos": Z((1, 4)), "kv_pos": Z((1, 12)), "q_seg": Z((1, 4)),
                                     "kv_seg": Z((1, 12))})


@pytest.mark.parametrize("name, shape, message", [
    ("q_pos", (1, 12), r"q_pos must be \[B, 4\] = \(1, 4\); got \(1, 12\)"),
    ("q_pos", (2, 4), r"q_pos must be \[B, 4\] = \(1, 4\); got \(2, 4\)"),
    ("kv_pos", (1, 4), r"kv_pos must be \[B, 12\] = \(1, 12\); got \(1, 4\)"),
    ("q_seg", (1, 12), r"q_seg must be \[B, 4\] = \(1, 4\); got \(1, 12\)"),
    ("kv_seg", (1, 4), r"kv_seg must be \[B, 12\] = \(1, 12\); got \(1, 4\)"),
    ("kv_seg", (2, 12), r"kv_seg must be \[B, 12\] = \(1, 12\); got \(2, 12\)"),
])
def test_flash_refuses_ids_of_the_wrong_length_or_batch(name, shape, message):
    q, k, v = _attn()
    with pytest.raises(ValueError, match=message):
        attention_ops._check(q, k, v, **{**_OK, name: Z(shape)})


@pytest.mark.parametrize("qkv", [
    (Z((1, 4, 4)), Z((1, 12, 2, 6)), Z((1, 12, 2, 6))),          # q rank 3
    (Z((1, 4, 4, 6)), Z((1, 12, 2)), Z((1, 12, 2))),              # k, v rank 3
    (Z((1, 4, 4, 6)), Z((1, 12, 2, 6)), Z((1, 12, 2, 7))),        # v's head dim differs from k's
    (Z((1, 4, 4, 6)), Z((1, 12, 2, 6)), Z((1, 11, 2, 6))),        # v's length differs from k's
    (Z((2, 4, 4, 6)), Z((1, 12, 2, 6)), Z((1, 12, 2, 6))),        # q's batch differs from k's
    (Z((1, 4, 4, 8)), Z((1, 12, 2, 6)), Z((1, 12, 2, 6))),        # q's head dim differs from k's
])
def test_flash_refuses_q_k_v_of_mismatched_shapes(qkv):
    with pytest.raises(ValueError, match=r"q must be \[B, T, N, A\] and k, v \[B, S, G, A\]"):
        attention_ops._check(*qkv, **_OK)


def test_flash_refuses_zero_blocks_with_a_message_not_a_division_error():
    q, k, v = _attn()
    with pytest.raises(ValueError, match="block_q=0 must divide the query length 4"):
        attention_ops._check(q, k, v, **{**_OK, "block_q": 0})
    with pytest.raises(ValueError, match="block_k=0 must divide the key length 12"):
        attention_ops._check(q, k, v, **{**_OK, "block_k": 0})
    # block_q may equal T and block_k S; block_q 12 would not divide the 4 queries
    attention_ops._check(q, k, v, **{**_OK, "block_q": 4, "block_k": 12})
    with pytest.raises(ValueError, match="block_q=12 must divide the query length 4"):
        attention_ops._check(q, k, v, **{**_OK, "block_q": 12, "block_k": 12})


# Grouped matmul: M 6, K 4, G 2 groups, N 3.
def test_gmm_refuses_ranks_and_group_sizes_rank():
    sizes = jnp.array([3, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"gmm wants lhs \[M, K\] and rhs \[G, K, N\]; got \(1, 6, 4\)"):
        gmm_ops._check(Z((1, 6, 4)), Z((2, 4, 3)), sizes, 1)
    with pytest.raises(ValueError, match=r"gmm wants lhs \[M, K\] and rhs \[G, K, N\]; got \(6, 4\), \(4, 3\)"):
        gmm_ops._check(Z((6, 4)), Z((4, 3)), sizes, 1)
    with pytest.raises(ValueError, match=r"group_sizes must be int32 \[E\]; got int32\(1, 2\)"):
        gmm_ops._check(Z((6, 4)), Z((2, 4, 3)), sizes[None], 1)
    # transposed rhs [G, N, K]: K is axis 2
    gmm_ops._check(Z((6, 4)), Z((2, 3, 4)), sizes, 2)
    with pytest.raises(ValueError, match="contraction mismatch"):
        gmm_ops._check(Z((6, 4)), Z((2, 3, 4)), sizes, 1)
    # more group sizes than local groups is allowed (expert sharding: the rhs holds a slice)
    gmm_ops._check(Z((6, 4)), Z((2, 4, 3)), jnp.array([2, 2, 2], jnp.int32), 1)


def test_fused_swiglu_refuses_an_odd_width_and_a_tile_that_does_not_divide_f():
    sizes = jnp.array([3, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"wi's last dim must be 2F; got \(2, 4, 7\)"):
        gmm_ops.wi_fused_swiglu(Z((6, 4)), Z((2, 4, 7)), sizes)
    # F = 6: tile 4 does not divide it, tile 0 is refused too (not a division error)
    with pytest.raises(ValueError, match="tile_n_per_half=4 must divide F=6"):
        gmm_ops.wi_fused_swiglu(Z((6, 4)), Z((2, 4, 12)), sizes, tile_n_per_half=4)
    with pytest.raises(ValueError, match="tile_n_per_half=0 must divide F=6"):
        gmm_ops._tile(6, 0)
    assert gmm_ops._tile(6, None) == 6 and gmm_ops._tile(6, 3) == 3


def test_fused_dswiglu_refuses_a_wrong_preact_and_a_row_dot_without_scale():
    # h [M 6, F 5], wo [G 2, F 5, D 4]: preact must be [6, 10]
    h, wo, sizes = Z((6, 5)), Z((2, 5, 4)), jnp.array([3, 3], jnp.int32)
    with pytest.raises(ValueError, match=r"preact must be \[M, 2F\] = \(6, 10\); got \(6, 5\)"):
        gmm_ops.wo_fused_dswiglu(h, wo, sizes, preact=Z((6, 5)), preact_tile_n_per_half=None)
    with pytest.raises(ValueError, match=r"preact must be \[M, 2F\] = \(6, 10\); got \(5, 10\)"):
        gmm_ops.wo_fused_dswiglu(h, wo, sizes, preact=Z((5, 10)), preact_tile_n_per_half=None)
    with pytest.raises(ValueError, match="with_row_dot needs row_scale"):
        gmm_ops.wo_fused_dswiglu(h, wo, sizes, preact=Z((6, 10)), preact_tile_n_per_half=None, with_row_dot=True)
    with pytest.raises(ValueError, match="tile_n_per_half=2 must divide F=5"):
        gmm_ops.wo_fused_dswiglu(h, wo, sizes, preact=Z((6, 10)), preact_tile_n_per_half=2)


# Chunked token logprobs: chunk sizes, the model width, and the chunk grid.
def test_chunked_logprobs_refuse_a_zero_vocab_chunk():
    from hybridmoe.kernels import logprobs

    with pytest.raises(ValueError, match="chunk sizes must be >= 1, got chunk_tokens=2, chunk_vocab=0"):
        logprobs.chunked_token_logprobs(Z((1, 1, 2)), Z((2, 3)), Z((1, 1), jnp.int32), chunk_tokens=2, chunk_vocab=0)


@pytest.mark.parametrize("chunk_tokens, chunk_vocab, chunks, tokens, vocab_cols, vocab_chunk", [
    (8, 3, 1, 4, 9, 3),  # 4 tokens: a chunk of 8 is capped to 4; V 7 padded by 2 to 9 for chunks of 3
    (3, 8, 2, 3, 7, 7),  # 4 tokens padded by 2 to 6 = 2 chunks of 3; a vocab chunk of 8 is capped to V 7
])
def test_chunked_logprobs_cap_chunks_at_the_sizes_and_pad_the_rest(monkeypatch, chunk_tokens, chunk_vocab, chunks,
                                                                   tokens, vocab_cols, vocab_chunk):
    from hybridmoe.kernels import logprobs

    seen = {}

    def fake(h_KCD, lm_head_DV, targets_KC, chunk_vocab_, vocab_size, temperature, save_logits):
        seen.update(h=h_KCD.shape, head=lm_head_DV.shape, targets=targets_KC.shape, chunk_vocab=chunk_vocab_,
                    vocab=vocab_size)
        return Z(targets_KC.shape), Z(targets_KC.shape)

    monkeypatch.setattr(logprobs, "_chunked", fake)
    logp, _ = logprobs.chunked_token_logprobs(Z((1, 4, 2)), Z((2, 7)), Z((1, 4), jnp.int32),
                                              chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    assert seen == dict(h=(chunks, tokens, 2), head=(2, vocab_cols), targets=(chunks, tokens),
                        chunk_vocab=vocab_chunk, vocab=7)
    assert logp.shape == (1, 4)
