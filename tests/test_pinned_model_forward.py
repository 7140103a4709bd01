"""The decoder's glue pinned to hand-worked numbers: the MoE rows dropped summed over every layer
of every block (model/forward.py), the decode cache's bounds (model/decode.py) and the blocked
core's checks (kernels/attention/blocked.py). The token mixers and the MoE block are stubbed where
only the glue is under test; tiny shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import tiny_config

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
