"""The fp8 grouped matmul's bookkeeping pinned to hand-worked numbers (quant/gmm_fp8.py): each row's
local group, and a forward and both gradients at values whose fp8 codes are exact, so a scale
applied twice, left out or taken from the wrong operand changes the answer; plus the hoisted
absmax's spec (quant/expert_fp8.py). Tiny eager arrays."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from hybridmoe.quant import expert_fp8, gmm_fp8


def test_local_group_of_rows_clips_foreign_rows():
    # sizes (2, 3, 1): rows 0-1 group 0, 2-4 group 1, 5 group 2, 6-7 padding; local groups 1, 2
    g = gmm_fp8.local_group_of_rows(8, jnp.array([2, 3, 1]), 1, 2)
    assert np.asarray(g).tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    g = gmm_fp8.local_group_of_rows(8, jnp.array([2, 3, 1]), 0, 3)
    assert np.asarray(g).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_weight_scale_of_rows_reads_each_rows_group():
    s_w = jnp.array([[[1.0, 2.0]], [[4.0, 8.0]]])  # [G 2, 1, N 2]
    assert np.asarray(gmm_fp8.weight_scale_of_rows(s_w, jnp.array([1, 0, 1]))).tolist() == [[4, 8], [1, 2], [4, 8]]


@jax.jit
def _fwd_bwd(x, w, sizes, d):
    """(out, dx, dw) of the fp8 grouped matmul (one compiled program: op by op is slower)."""
    out, vjp = jax.vjp(lambda a, b: gmm_fp8.gmm_fp8(a, b, sizes), x, w)
    return (out, *vjp(d))


def test_fp8_gmm_forward_and_gradients_with_exact_codes():
    # x (1, 2): absmax 2 -> scale 2**-7, codes 128, 256. w (3, 5): absmax 5 -> scale 2**-6, codes 192, 320.
    # out = 1 * 3 + 2 * 5 = 13. With d = 1: dx = d * w = (3, 5) (the weight scale moved onto d: 2**-6
    # -> e5m2 scale 2**-21, code 2**15); dw = x * d = (1, 2) (the row scale onto d: 2**-7 -> scale 2**-22).
    x = jnp.array([[1.0, 2.0]])
    w = jnp.array([[[3.0], [5.0]]])
    sizes = jnp.array([1], jnp.int32)
    out, dx, dw = _fwd_bwd(x, w, sizes, jnp.ones((1, 1)))
    assert np.asarray(out).tolist() == [[13.0]]
    assert np.asarray(dx).tolist() == [[3.0, 5.0]]
    assert np.asarray(dw).tolist() == [[[1.0], [2.0]]]


def test_fp8_gmm_rows_of_two_groups_take_their_own_weight_scales():
    # group 0 w (1, 1) (scale 2**-8), group 1 w (4, 4) (scale 2**-6); rows x = (1, 1) and (2, 2)
    x = jnp.array([[1.0, 1.0], [2.0, 2.0]])
    w = jnp.array([[[1.0], [1.0]], [[4.0], [4.0]]])
    sizes = jnp.array([1, 1], jnp.int32)
    out, dx, dw = _fwd_bwd(x, w, sizes, jnp.array([[1.0], [0.5]]))
    assert np.asarray(out).tolist() == [[2.0], [16.0]]
    assert np.asarray(dx).tolist() == [[1.0, 1.0], [2.0, 2.0]]            # d * w of each row's group
    assert np.asarray(dw).tolist() == [[[1.0], [1.0]], [[1.0], [1.0]]]    # x * d: 1 * 1 and 2 * 0.5


def test_hoisted_absmax_spec_and_switch():
    assert expert_fp8._amax_spec(PS("expert", ("fsdp", "context"), "tensor")) == PS("expert", None, "tensor")
    assert expert_fp8._amax_spec(PS("expert", None, ("fsdp", "context")), leading=(None,)) == PS(
        None, "expert", None, ("fsdp", "context"))
    assert expert_fp8._amax_spec(PS("expert")) == PS("expert", None, None)

    def cfg(fake, hoist):
        return SimpleNamespace(quant=SimpleNamespace(fp8_moe_fake_quant=fake, fp8_fake_quant_hoist=hoist))

    assert expert_fp8.hoisted(cfg(True, "gather8"))
    assert not expert_fp8.hoisted(cfg(True, "off"))
    assert not expert_fp8.hoisted(cfg(False, "gather8"))
