"""The GDN layer's own pieces around the core: the causal conv's hand-written backward.

Shape legend as in hybridmoe/model/gdn.py: B batch, T tokens, S tail tokens (W - 1), H heads, C channels.
"""

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe.model import gdn


def conv_by_autodiff(x_BTHC, taps_WHC, segment_ids_BT, tail_BSHC, tail_segment_ids_BS):
    """The same conv + SiLU with gradients by autodiff through the masked tap loop (no custom VJP)."""
    W, T = taps_WHC.shape[0], x_BTHC.shape[1]
    xp = jnp.concatenate([tail_BSHC, x_BTHC], axis=1)
    segp = jnp.concatenate([tail_segment_ids_BS, segment_ids_BT], axis=1)
    acc = sum(jnp.where((segp[:, j:j + T] == segment_ids_BT)[..., None, None], xp[:, j:j + T], 0.0) * taps_WHC[j]
              for j in range(W))
    return jax.nn.silu(acc)


def test_conv_backward_equals_autodiff_across_documents_and_a_halo():
    rng = np.random.default_rng(0)
    B, T, H, C, W = 2, 11, 3, 5, 4
    x, tail = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, T, H, C), (B, W - 1, H, C)))
    taps = jnp.asarray(rng.normal(size=(W, H, C)), jnp.float32)
    # Row 0: the halo continues the first document; row 1: it belongs to another one. Documents of
    # length 1 and 2 make every tap cross a boundary somewhere.
    seg = jnp.asarray([[5, 5, 5, 6, 7, 7, 8, 8, 8, 8, 8], [1, 2, 2, 3, 3, 3, 3, 4, 5, 5, 5]], jnp.int32)
    tail_seg = jnp.asarray([[4, 5, 5], [9, 9, 9]], jnp.int32)
    weight = jnp.asarray(rng.normal(size=(B, T, H, C)), jnp.float32)

    def loss(conv):
        return lambda x, taps, tail: jnp.sum(conv(x, taps, seg, tail, tail_seg) * weight)

    ours = jax.jit(jax.value_and_grad(loss(lambda *a: gdn.causal_conv(*a)[0]), argnums=(0, 1, 2)))(x, taps, tail)
    reference = jax.jit(jax.value_and_grad(loss(conv_by_autodiff), argnums=(0, 1, 2)))(x, taps, tail)
    for name, a, b in zip(("loss", "dx", "dtaps", "dtail"), jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
