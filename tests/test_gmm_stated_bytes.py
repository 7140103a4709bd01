"""The Pallas TPU grouped matmuls' stated bytes (their pl.CostEstimate, which the step model reads):
a weight slab counted once per step where the contraction runs in several K tiles, once per local
group where it runs in one (the grid pipeline does not fetch a block whose index is unchanged).
Traced only (make_jaxpr), worked by hand from the shapes."""

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.kernels.gmm import pallas_tpu as gp
from hybridmoe.kernels.gmm.tiling import Tiling

M, K, N, G = 256, 256, 256, 4


def _stated_bytes(fn, *args) -> dict[str, int]:
    out = {}
    for eqn in jax.make_jaxpr(fn)(*args).eqns:
        if eqn.primitive.name == "pallas_call":
            name = eqn.params.get("name") or eqn.params["name_and_src_info"].name
            out[name] = eqn.params["cost_estimate"].bytes_accessed
    return out


def _gmm_bytes(tk: int) -> int:
    x = jnp.ones((M, K), jnp.bfloat16)
    w = jnp.ones((G, K, N), jnp.bfloat16)
    sizes = jnp.full((G,), M // G, jnp.int32)
    fn = lambda x, w, s: gp.gmm(x, w, s, transpose_rhs=False, group_offset=0, sharded=False,  # noqa: E731
                                out_dtype=jnp.bfloat16, tiling=Tiling(tm=64, tk=tk, tn=128), interpret=True)
    return _stated_bytes(fn, x, w, sizes)["gmm"]


@pytest.mark.parametrize("tk, weight_bytes", [
    # one K tile: each of the 4 groups' [256, 256] bf16 slabs once: 4 x 131,072
    (256, 4 * 256 * 256 * 2),
    # two K tiles: the slab once per step; steps = 256 / 64 tiles + 4 groups - 1 = 7 (`_steps` at
    # the balanced share): 7 x 131,072
    (128, 7 * 256 * 256 * 2),
])
def test_gmm_counts_a_weight_slab_per_group_with_one_k_tile_and_per_step_with_more(tk, weight_bytes):
    """lhs: its row tile per N tile per step, 2 N tiles x 7 steps x 64 x 256 x 2 B = 458,752; output:
    7 steps x 64 x 256 x 2 B = 229,376; the weight as the parameter says."""
    assert _gmm_bytes(tk) == 2 * 7 * 64 * 256 * 2 + weight_bytes + 7 * 64 * 256 * 2


def test_fused_up_projection_counts_its_slab_pair_once_per_group_with_one_k_tile():
    """wi [G, D, 2F] with D 256 in one K tile, F 128 per half in one N tile: the gate and up slabs
    ([256, 256] bf16 together) once per group: 4 x 131,072; x once per step (7 x 64 x 256 x 2); h and
    the pre-activations written per step (7 x 64 x 3 x 128 x 2)."""
    x = jnp.ones((M, K), jnp.bfloat16)
    wi = jnp.ones((G, K, 2 * 128), jnp.bfloat16)
    sizes = jnp.full((G,), M // G, jnp.int32)
    fn = lambda x, w, s: gp.wi_fused_swiglu(x, w, s, group_offset=0, sharded=False, tile_n_per_half=128,  # noqa: E731
                                            mode="float32", tiling=Tiling(tm=64, tk=256, tn=128), interpret=True)
    got = _stated_bytes(fn, x, wi, sizes)["wi_fused_swiglu_fwd"]
    assert got == 7 * 64 * 256 * 2 + 4 * 256 * 256 * 2 + 7 * 64 * 3 * 128 * 2
