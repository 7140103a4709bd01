"""The Mosaic TPU grouped-matmul kernels compile for a real TPU target from this CPU host.

`jax.experimental.topologies.get_topology_desc(..., platform="tpu")` gives compile-only devices
when libtpu is installed (`pip install "jax[tpu]"` at the installed JAX version, in a separate
venv); `.lower(...).compile()` then runs the real Mosaic compiler, so layout, tiling and VMEM
errors surface here. Skips cleanly without libtpu.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.kernels import gmm as K
from hybridmoe.kernels.gmm.tiling import Tiling

pytestmark = pytest.mark.tpu_compile

TOPOLOGY = "tpu7x:2x2x1"
M, D, F, E, TN = 512, 256, 256, 4, 128
TILING = Tiling(tm=128, tk=128, tn=128)


@pytest.fixture(scope="module")
def device():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jax[tpu]' in a separate venv)")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(TOPOLOGY, platform="tpu")
    except Exception as err:  # noqa: BLE001 - any failure to get the target means skip
        pytest.skip(f"no compile-only TPU topology: {err}")
    return topo.devices[0]


def _spec(shape, dtype, dev):
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


@pytest.mark.parametrize("transpose", [False, True])
def test_gmm_compiles(device, transpose):
    x = _spec((M, D), jnp.bfloat16, device)
    w = _spec((E, F, D) if transpose else (E, D, F), jnp.bfloat16, device)
    gs = _spec((E,), jnp.int32, device)

    def loss(x, w, gs):
        y = K.gmm(x, w, gs, transpose_rhs=transpose, backend="pallas_tpu", tiling=TILING)
        return jnp.sum(y.astype(jnp.float32))

    _compile(jax.grad(loss, (0, 1)), x, w, gs)  # gmm, gmm_t and tgmm


@pytest.mark.parametrize("depth", [0, 2])
def test_fused_pair_compiles(device, depth):
    x = _spec((M, D), jnp.bfloat16, device)
    wi = _spec((E, D, 2 * F), jnp.bfloat16, device)
    wo = _spec((E, F, D), jnp.bfloat16, device)
    s = _spec((M,), jnp.float32, device)
    gs = _spec((E,), jnp.int32, device)
    # One K tile (tk = D) so the weight depth applies.
    tiling = Tiling(tm=128, tk=D, tn=128, rhs_buffer_count=depth)

    def loss(x, wi, wo, s, gs):
        h, pre = K.gmm_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=TN,
                              backend="pallas_tpu", tiling=tiling,
                              rhs_buffer_count=depth)
        y = K.gmm_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=TN, row_scale=s,
                          backend="pallas_tpu", tiling=tiling)
        return jnp.sum(y.astype(jnp.float32))

    compiled = _compile(jax.grad(loss, (0, 1, 2, 3)), x, wi, wo, s, gs)
    text = compiled.as_text()
    assert "gmm_swiglu_fwd" in text and "gmm_dswiglu_dlhs" in text
    assert ("gmm_swiglu_fwd_rhsbuf2" in text) == (depth == 2)


def test_vmem_overflow_is_caught(device):
    """The upstream tile at the compiler's default scoped limit (32 MiB) overflows VMEM: the
    compile-only target does catch on-chip memory errors (figures: benchmarks/gmm_vmem.json)."""
    x = _spec((1024, 4096), jnp.bfloat16, device)
    wi = _spec((2, 4096, 4096), jnp.bfloat16, device)
    gs = _spec((2,), jnp.int32, device)
    tiling = Tiling(tm=512, tk=4096, tn=1024)

    def fwd(x, wi, gs):
        return K.gmm_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=1024,
                            backend="pallas_tpu", tiling=tiling)

    with pytest.raises(Exception, match="(?i)vmem"):
        _compile(fwd, x, wi, gs)
    roomy = Tiling(tm=512, tk=4096, tn=1024, vmem_limit_mib=57.6)
    _compile(lambda x, wi, gs: K.gmm_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=1024,
                                            backend="pallas_tpu", tiling=roomy), x, wi, gs)
