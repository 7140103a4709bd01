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
