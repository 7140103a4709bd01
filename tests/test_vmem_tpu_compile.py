"""The on-chip memory model (kernels/vmem.py) against the Mosaic compiler for a real TPU target
from this CPU host: every Mosaic kernel alone (grouped matmuls, flash attention, GDN), at tiles on
both sides of a small scoped limit (tests/vmem_sweep.py), compiles exactly where the model says it
fits; each broken variant of the model disagrees (tests/tpu_target.py).
"""

from __future__ import annotations

import collections
import functools

import pytest

from tests.tpu_target import TOPOLOGY
from tests import vmem_sweep
from tests.broken_variants import BROKEN_VMEM_MODEL

pytestmark = pytest.mark.tpu_compile  # about a minute of compile in all


@functools.cache
def _compiler_verdict(kernel, tiles):
    from hybridmoe.tools.train_program import tpu_target

    return vmem_sweep.compile_verdict(kernel, tiles, vmem_sweep.LIMIT_MIB, tpu_target(TOPOLOGY).devices[0])


@pytest.mark.parametrize("kernel, tiles", vmem_sweep.POINTS, ids=[f"{k}-{t}" for k, t in vmem_sweep.POINTS])
def test_vmem_model_verdict_equals_the_compilers(device, kernel, tiles):
    ok, error = _compiler_verdict(kernel, tiles)
    need = vmem_sweep.model_bytes(kernel, tiles) / 2**20
    assert ok == vmem_sweep.model_verdict(kernel, tiles, vmem_sweep.LIMIT_MIB), (
        f"{kernel} at {tiles}: model {need:.3f} MiB against {vmem_sweep.LIMIT_MIB} MiB; compiler: {error or 'fits'}")


def test_vmem_sweep_covers_both_sides_for_every_kernel():
    verdicts = collections.defaultdict(set)
    for kernel, tiles in vmem_sweep.POINTS:
        verdicts[kernel].add(vmem_sweep.model_verdict(kernel, tiles, vmem_sweep.LIMIT_MIB))
    assert set(verdicts) == {*vmem_sweep.tiling.PALLAS_NAMES, *vmem_sweep.attention_limits.KERNELS,
                             *vmem_sweep.gdn_limits.KERNELS}
    assert all(v == {True, False} for v in verdicts.values()), dict(verdicts)


@pytest.mark.parametrize("variant", sorted(BROKEN_VMEM_MODEL))
def test_broken_vmem_model_disagrees_with_the_compiler(device, monkeypatch, variant):
    for target, name, broken in BROKEN_VMEM_MODEL[variant]():
        monkeypatch.setattr(target, name, broken)
    wrong = [(k, t) for k, t in vmem_sweep.POINTS
             if _compiler_verdict(k, t)[0] != vmem_sweep.model_verdict(k, t, vmem_sweep.LIMIT_MIB)]
    assert wrong, variant


# The 397B cell's case (the margin alone asks past the default) in the default suite; the 35B one at
# 512 x 512 blocks (the need itself about twice the default) repeats the rule at a larger need: slow.
@pytest.mark.parametrize("heads, block_q, block_k", [pytest.param(16, 512, 512, marks=pytest.mark.slow),
                                                     (32, 128, 512)],
                         ids=["35b-blocks-512x512", "397b-cell-blocks"])
def test_auto_limit_raises_v5e_default_for_large_flash_blocks(heads, block_q, block_k):
    """A v5e's compiler gives a kernel 16 MiB of scoped VMEM unless it asks for more. Qwen3.5's attention
    (2 kv heads, head dim 256) needs more: at 512 x 512 blocks with 16 query heads about twice that (the
    forward's 29.5 MiB by the model), at the 397B cell's default 128 x 512 with 32 query heads the dk-dv
    kernel 16.6 MiB (13.3 by the model, under the default: only the margin asks). Under `auto`
    (vmem_limit_mib 0) forward and backward compile for a v5e. At 512 x 512 a limit of 16 set by hand is
    refused by the compiler, and by the validator first, at load, naming the key."""
    import jax
    import jax.numpy as jnp

    from hybridmoe.config import ConfigError
    from hybridmoe.kernels.attention import ops
    from hybridmoe.recipe import load_config
    from hybridmoe.tools.train_program import tpu_target
    from tests.tpu_target import compile_abstract, spec

    dev = tpu_target("v5e:2x2").devices[0]
    T = 1024
    q, kv = spec((1, T, heads, 256), jnp.bfloat16, dev), spec((1, T, 2, 256), jnp.bfloat16, dev)
    pos = spec((1, T), jnp.int32, dev)

    def grads(limit_mib):
        def loss(q, k, v, p):
            o = ops.flash_attention(q, k, v, q_pos_BT=p, kv_pos_BS=p, scale=0.0625, backend="pallas_tpu",
                                    block_q=block_q, block_k=block_k, vmem_limit_mib=limit_mib)
            return o.astype(jnp.float32).sum()
        return compile_abstract(jax.grad(loss, (0, 1, 2)), q, kv, kv, pos)

    assert "flash_attention_dkv" in grads(0.0).hlo_text
    if block_q != 512:
        return
    with pytest.raises(Exception, match="(?i)vmem"):
        grads(16.0)
    blocks = ["kernels.attention.block_q=512", "kernels.attention.block_k=512"]
    load_config("qwen3.5-35b-a3b-v5e-1", blocks, platform="tpu")
    with pytest.raises(ConfigError, match="kernels.attention.vmem_limit_mib") as err:
        load_config("qwen3.5-35b-a3b-v5e-1", [*blocks, "kernels.attention.vmem_limit_mib=16"], platform="tpu")
    assert "flash_attention_forward needs 29.53 MiB" in str(err.value), str(err.value)
