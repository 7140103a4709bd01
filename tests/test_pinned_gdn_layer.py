"""The GDN layer's glue: the decode conv tail's document, padding tokens, the norm's epsilon and the
context axis the layer reads."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.model import gdn


def test_decode_tail_without_ids_belongs_to_the_first_token_document():
    # W 2 (tap 0 reads t - 1, tap 1 reads t), taps 1; one channel; tail [5]; tokens [1, 2] in docs [1, 2].
    # token 0 (doc 1, the first token's) reads the tail: silu(5 + 1); token 1 (doc 2) does not read token 0: silu(2)
    x = jnp.array([1.0, 2.0]).reshape(1, 2, 1, 1)
    y, tail = gdn.causal_conv(x, jnp.ones((2, 1, 1)), jnp.array([[1, 2]]), jnp.full((1, 1, 1, 1), 5.0))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    np.testing.assert_allclose(np.asarray(y).ravel(), [silu(6.0), silu(2.0)], rtol=1e-6)
    assert np.asarray(tail).ravel().tolist() == [2.0]  # the last W - 1 = 1 pre-conv tokens


def _layer_params(D=4, K=1, U=2, k=4, v=4, W=2, seed=0):
    shapes = dict(wq=(D, K, k), wk=(D, K, k), wv=(D, U, v), wz=(D, U, v), wb=(D, U), wa=(D, U),
                  conv_q=(W, K, k), conv_k=(W, K, k), conv_v=(W, U, v), wo=(U, v, D))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    p = {n: 0.5 * jax.random.normal(key, s) for key, (n, s) in zip(keys, shapes.items())}
    p.update(A_log=jnp.zeros((U,)), dt_bias=jnp.zeros((U,)), norm=jnp.ones((v,)))
    return p


def _layer(p, x, seg, eps=1e-6):
    run = jax.jit(lambda p, x, seg: gdn.gdn_layer(p, x, seg, types.SimpleNamespace(rms_norm_eps=eps), chunk_size=4,
                                                  backend="xla"))
    return run(p, x, seg)


def test_padding_tokens_give_exactly_zero_output_and_real_tokens_do_not():
    p = _layer_params()
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 6, 4))
    seg = jnp.array([[1, 1, 1, 1, 0, 0]])  # two padding tokens (id 0) at the row's end
    out = np.asarray(_layer(p, x, seg))
    assert np.all(out[0, 4:] == 0.0)
    assert np.all(np.abs(out[0, :4]).max(axis=-1) > 1e-4)


def test_layer_norm_uses_the_model_epsilon():
    # y = o * silu(z) / sqrt(mean(o^2) + eps): an eps of 1e12 scales y by ~1e-6 against eps 1e-6
    p = _layer_params()
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 4, 4))
    seg = jnp.ones((1, 4), jnp.int32)
    small, huge = (np.abs(np.asarray(_layer(p, x, seg, eps))).max() for eps in (1e-6, 1e12))
    assert small > 1e-3 and huge < 1e-3 * small


def test_context_ranks_reads_the_context_axis_of_the_mesh_in_force():
    assert gdn.context_ranks() == 1
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 3), ("data", "context"))):
        assert gdn.context_ranks() == 3
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("data",))):
        assert gdn.context_ranks() == 1
