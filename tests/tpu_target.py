"""What the tests that compile for a TPU target share (the tpu_compile files; their `device`
fixture is in conftest.py).

`jax.experimental.topologies.get_topology_desc(..., platform="tpu")` gives compile-only devices
(libtpu comes with the test extra, `jax[tpu]` at the pinned JAX version); `.lower(...).compile()`
then runs the real Mosaic compiler, so layout, tiling and VMEM errors surface on this CPU host.
libtpu lets one process per host hold it: conftest.py puts every tpu_compile test in one xdist
group, which `--dist loadgroup` runs on one worker.
"""

from __future__ import annotations

import jax

TOPOLOGY = "tpu7x:2x2x1"


def spec(shape, dtype, dev):
    """An abstract array on one compile-only device."""
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))


def compile_abstract(fn, *args):
    """What compiling `fn` for these arguments says (analysis/compiled_facts.py: its HLO `hlo_text`,
    its `memory` figures), read from the suite's compile cache when it was compiled before."""
    from hybridmoe.analysis import compiled_facts

    return compiled_facts.compile(jax.jit(fn).lower(*args))
