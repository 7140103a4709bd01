"""The decoder's glue pinned to hand-worked numbers: the MoE rows dropped summed over every layer
of every block (model/forward.py), the decode cache's bounds (model/decode.py) and the blocked
core's checks (kernels/attention/blocked.py). The token mixers and the MoE block are stubbed where
only the glue is under test; tiny shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from hybridmoe.model import forward
from hybridmoe.model.params import declare_params, is_spec


def _stub_layers(monkeypatch):
    """Mixers that add nothing; an MoE block that adds nothing and drops router[0, 0] rows (so each
    layer's count is read from its own weights)."""
    monkeypatch.setattr(forward, "_mixer", lambda kind, p, x, *a, **kw: jnp.zeros_like(x))

    def moe_layer(p, h, m, moe, kernels, *, return_dropped=False, **kw):
        y = jnp.zeros_like(h)
        return (y, p["router"][0, 0].astype(jnp.int32)) if return_dropped else y

    monkeypatch.setattr(forward, "moe_layer", moe_layer)


def _params_with_drops(cfg, drops):
    """drops[position][block]: the rows the stubbed MoE block of that layer drops."""
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), declare_params(cfg.model), is_leaf=is_spec)
    for pos, per_block in enumerate(drops):
        router = params["blocks"][pos]["moe"]["router"]
        params["blocks"][pos]["moe"]["router"] = router.at[:, 0, 0].set(jnp.asarray(per_block, router.dtype))
    return params


def test_dropped_rows_are_summed_over_every_layer_of_every_block(monkeypatch):
    _stub_layers(monkeypatch)
    # the blocks unrolled (the scan's step is the same function): no compile
    cfg = tiny_config("model.num_layers=4", "model.layer_pattern=[gdn,attention]", "remat.scan_layers=false",
                      "remat.policy=none")
    # 2 blocks x 2 positions: 1 + 20 (block 0), 300 + 4000 (block 1)
    params = _params_with_drops(cfg, [[1, 300], [20, 4000]])
    tokens = jnp.zeros((1, 4), jnp.int32)
    _, dropped = forward.decoder_hidden(params, cfg, tokens, with_moe_dropped=True)
    assert int(dropped) == 1 + 20 + 300 + 4000


# ---------------------------------------------------------------------------------------------
# model/decode.py: growing the cache


def test_grow_cache_to_its_own_size_is_a_no_op_and_one_less_is_refused():
    from hybridmoe.model import decode

    cache = {"layers": [{"k": jnp.zeros((1, 2, 3, 1, 1)), "v": jnp.zeros((1, 2, 3, 1, 1))}],
             "kv_pos": jnp.zeros((2, 3), jnp.int32), "kv_seg": jnp.ones((2, 3), jnp.int32), "slot": jnp.int32(3)}
    same = decode.grow_cache(cache, 3)
    assert same["kv_pos"].shape == (2, 3) and same["layers"][0]["k"].shape == (1, 2, 3, 1, 1)
    assert np.asarray(same["kv_seg"]).tolist() == [[1, 1, 1]] * 2
    with pytest.raises(ValueError, match="cannot shrink a cache of 3 slots to 2"):
        decode.grow_cache(cache, 2)


# ---------------------------------------------------------------------------------------------
# kernels/attention/blocked.py: the checks


def _blocked(T, S, num_blocks=None):
    from hybridmoe.kernels.attention.blocked import causal_attention_blocked

    def run():  # traced only (the checks are at trace time)
        q, k = jnp.zeros((1, T, 2, 4)), jnp.zeros((1, S, 1, 4))
        ids_q, ids_k = jnp.ones((1, T), jnp.int32), jnp.ones((1, S), jnp.int32)
        return causal_attention_blocked(q, k, k, q_pos_BT=ids_q, kv_pos_BS=ids_k, q_seg_BT=ids_q, kv_seg_BS=ids_k,
                                        scale=0.5, num_blocks=num_blocks)

    return jax.eval_shape(run)


def test_blocked_core_is_self_attention_over_a_block_count_that_divides_the_tokens():
    with pytest.raises(ValueError, match="blocked causal attention is self-attention: 8 queries, 16 keys"):
        _blocked(8, 16)
    with pytest.raises(ValueError, match="self-attention: 16 queries, 8 keys"):
        _blocked(16, 8)
    with pytest.raises(ValueError, match="3 query blocks do not divide 8 tokens"):
        _blocked(8, 8, num_blocks=3)
    assert _blocked(8, 8, num_blocks=4).shape == (1, 8, 2, 4)   # 4 blocks of 2
    assert _blocked(8, 8, num_blocks=8).shape == (1, 8, 2, 4)   # one token a block


# ---------------------------------------------------------------------------------------------
# model/decode.py: one cached layer


def _decode_cfg(chunk_size=4, backend="auto", precision="auto", layout="head_major"):
    from types import SimpleNamespace

    from hybridmoe.config.schema import ModelConfig

    return SimpleNamespace(model=ModelConfig(head_dim=16, num_heads=2, num_kv_heads=1), gdn=SimpleNamespace(chunk_size=chunk_size),
                           kernels=SimpleNamespace(gdn=SimpleNamespace(backend=backend, precision=precision, layout=layout),
                                                   interpret=True))


def test_a_cached_gdn_layer_runs_one_token_as_the_chunk_1_xla_recurrence(monkeypatch):
    from hybridmoe.model import decode

    seen = []

    def gdn_layer(p, h, seg, m, *, chunk_size, backend, interpret, state, precision, layout):
        seen.append((h.shape[1], chunk_size, backend, interpret, precision, layout))
        return h, {name: (a + 1).astype(jnp.float32) for name, a in state.items()}

    monkeypatch.setattr(decode, "gdn_layer", gdn_layer)
    cache = {"conv_q": jnp.zeros((1, 3, 1, 2), jnp.bfloat16), "ssm": jnp.zeros((1, 1, 2, 2), jnp.float32)}
    cfg = _decode_cfg(chunk_size=4, backend="pallas_tpu", precision="bfloat16", layout="token_major")
    ctx = (None, jnp.ones((1, 1), jnp.int32), None, None, jnp.int32(0))
    _, new = decode._cached_mixer("gdn", {}, jnp.zeros((1, 1, 8)), cache, ctx, cfg)
    decode._cached_mixer("gdn", {}, jnp.zeros((1, 5, 8)), cache, ctx, cfg)
    # kernels.gdn.precision and layout handed on; gdn_layer gives them to the Mosaic core only
    assert seen == [(1, 1, "xla", True, "bfloat16", "token_major"), (5, 4, "pallas_tpu", True, "bfloat16", "token_major")]
    # the new state keeps the cache's dtypes
    assert new["conv_q"].dtype == jnp.bfloat16 and new["ssm"].dtype == jnp.float32
    assert float(new["conv_q"][0, 0, 0, 0]) == 1.0


def test_a_cached_attention_layer_writes_its_keys_at_the_slot_and_scales_by_the_head_dim(monkeypatch):
    from hybridmoe.model import decode

    seen = {}
    k_new = jnp.full((1, 2, 1, 16), 5.0)
    monkeypatch.setattr(decode, "project_qkv", lambda p, h, pos, m: (jnp.zeros((1, 2, 2, 16)), None, k_new, 2 * k_new))
    monkeypatch.setattr(decode, "attention", lambda q, k, v, **kw: seen.update(kw, k=k, v=v) or q)
    monkeypatch.setattr(decode, "gated_output", lambda p, o, gate: o)
    cache = {"k": jnp.zeros((1, 6, 1, 16), jnp.bfloat16), "v": jnp.zeros((1, 6, 1, 16), jnp.bfloat16)}
    ctx = (jnp.array([[3, 4]]), jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6), jnp.int32),
           jnp.int32(3))
    _, new = decode._cached_mixer("attention", {}, jnp.zeros((1, 2, 8)), cache, ctx, _decode_cfg())
    # slots 3 and 4 of 6 written
    assert np.asarray(new["k"][0, :, 0, 0], np.float32).tolist() == [0, 0, 0, 5, 5, 0]
    assert np.asarray(new["v"][0, :, 0, 0], np.float32).tolist() == [0, 0, 0, 10, 10, 0]
    assert new["k"].dtype == jnp.bfloat16
    assert seen["scale"] == 0.25                     # 16 ** -0.5
    assert np.asarray(seen["q_pos_BT"]).tolist() == [[3, 4]] and seen["kv_seg_BS"].shape == (1, 6)
    assert np.asarray(seen["k"][0, :, 0, 0]).tolist() == [0, 0, 0, 5, 5, 0]
