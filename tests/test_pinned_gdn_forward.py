"""model/forward.py glue with the model stubbed: default batch fields, the routing layout of the
layer scan, the LM head in use, the next-token targets and the logprob chunk settings."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.model import forward


def test_default_batch_fields_are_one_document_and_positions_from_zero():
    seg, pos = forward.default_batch_fields(jnp.zeros((2, 3), jnp.int32))
    assert np.asarray(seg).tolist() == [[1, 1, 1], [1, 1, 1]]
    assert np.asarray(pos).tolist() == [[0, 1, 2], [0, 1, 2]]


def test_batch_fields_fill_only_what_is_missing_and_packed_means_ids_were_given():
    tokens = jnp.zeros((1, 3), jnp.int32)
    given_seg, given_pos = jnp.array([[1, 1, 2]]), jnp.array([[0, 1, 0]])
    seg, pos, packed = forward._batch_fields(tokens, given_seg, None)
    assert (np.asarray(seg).tolist(), np.asarray(pos).tolist(), packed) == ([[1, 1, 2]], [[0, 1, 2]], True)
    seg, pos, packed = forward._batch_fields(tokens, None, given_pos)
    assert (np.asarray(seg).tolist(), np.asarray(pos).tolist(), packed) == ([[1, 1, 1]], [[0, 1, 0]], False)


def test_routing_layout_is_layer_block_times_pattern_plus_position():
    # B 1, T 2, 2 blocks of pattern length 3 = 6 layers, k 1; id = 10 * token + layer
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(num_blocks=2, layer_pattern=("gdn", "gdn", "attention")))
    ids = jnp.array([[[[10 * t + layer] for layer in range(6)] for t in range(2)]])  # [1, 2, 6, 1]
    blocks = forward.routing_to_blocks(ids, cfg)
    assert blocks.shape == (2, 3, 1, 2, 1)
    assert int(blocks[1, 2, 0, 1, 0]) == 15  # block 1, position 2 -> layer 1 * 3 + 2 = 5, token 1
    assert int(blocks[0, 1, 0, 0, 0]) == 1
    np.testing.assert_array_equal(np.asarray(forward.routing_from_blocks(blocks)), np.asarray(ids))


def test_lm_head_is_the_declared_head_or_the_embedding_transpose():
    embed = jnp.arange(6.0).reshape(3, 2)  # [V 3, D 2]
    head = jnp.ones((2, 3))
    assert np.asarray(forward.lm_head_at_use({"embed": embed})).tolist() == [[0, 2, 4], [1, 3, 5]]
    assert np.asarray(forward.lm_head_at_use({"embed": embed, "lm_head": head})).tolist() == [[1, 1, 1]] * 2


def test_unknown_layer_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown layer kind 'mamba'"):
        forward._mixer("mamba", {}, None, None, None, None)


def _logprob_cfg():
    chunks = types.SimpleNamespace(chunk_tokens=3, chunk_vocab=5, save_logits=True)
    return types.SimpleNamespace(kernels=types.SimpleNamespace(logprobs=chunks))


def test_next_token_targets_shift_by_one_and_the_last_position_is_cut(monkeypatch):
    seen = {}

    def fake_logprobs(h, w, targets, cfg, *, temperature):
        seen.update(targets=np.asarray(targets).tolist(), temperature=temperature)
        return targets.astype(jnp.float32), -targets.astype(jnp.float32)

    monkeypatch.setattr(forward, "decoder_hidden", lambda *a, **k: jnp.zeros((1, 4, 2)))
    monkeypatch.setattr(forward, "per_shard_token_logprobs", fake_logprobs)
    logp, ent = forward.next_token_logprobs({"lm_head": jnp.zeros((2, 9))}, None, jnp.array([[7, 8, 9, 6]]),
                                            temperature=0.5)
    # targets: tokens 1.. then token 0 as the stand-in; its result is cut off
    assert seen == {"targets": [[8, 9, 6, 7]], "temperature": 0.5}
    assert np.asarray(logp).tolist() == [[8, 9, 6]] and np.asarray(ent).tolist() == [[-8, -9, -6]]


def test_per_shard_logprobs_pass_the_configured_chunks_outside_a_mesh(monkeypatch):
    seen = {}

    def fake(h, w, t, **kw):
        seen.update(kw)
        return t, t

    monkeypatch.setattr(forward, "chunked_token_logprobs", fake)
    forward.per_shard_token_logprobs(jnp.zeros((1, 2, 2)), jnp.zeros((2, 4)), jnp.zeros((1, 2), jnp.int32),
                                     _logprob_cfg(), temperature=0.7)
    assert seen == dict(chunk_tokens=3, chunk_vocab=5, temperature=0.7, save_logits=True)
