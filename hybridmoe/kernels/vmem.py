"""On-chip memory of a Pallas kernel, the pieces every kernel family's model is built from (pure
Python, no JAX: the config validator reads these at load, before anything is traced).

Mosaic TPU (VMEM): a kernel's scoped allocation is every BlockSpec block times its buffer count (2,
or the pipeline depth where a BlockSpec sets one), its scratch (once), and the float32 values its
body spills (the compiler keeps what does not fit the vector registers in the same scoped stack).
Blocks are laid out in (sublane, 128-lane) tiles: the last dim rounds up to 128 and the one before
to 8 x (4 / itemsize) rows (8 for 32-bit, 16 for bf16, 32 for 8-bit). The compiler's limit is the
kernel's vmem_limit_bytes, or its default of 32 MiB on tpu7x (of a core's 64 MiB).

Triton (GPU shared memory): each pipeline stage holds one copy of the blocks a program loads in its
loop; num_stages copies against the GPU's per-block shared-memory limit.

Each family's limits module lists its kernels' buffers (`Buffer`) from the same tiles its kernels
build their BlockSpecs from; `tests/test_vmem_model.py` checks the lists against the traced
pallas_calls and `tests/test_vmem_tpu_compile.py` the totals against the Mosaic compiler.
"""

from __future__ import annotations

import dataclasses
import math

MIB = 2**20
LANE = 128
# Mosaic's scoped VMEM limit when a kernel sets none (tpu7x: 32 MiB of the core's 64 MiB).
TPU_DEFAULT_LIMIT_MIB = 32.0
TPU_VMEM_MIB = 64.0
# Shared memory one Triton program may use (H100 / H200: 227 KiB of the SM's 228).
GPU_SHARED_LIMIT_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One on-chip buffer of a kernel: `what` it holds, its shape and itemsize, how many copies
    (a pipelined block's buffer count; 1 for scratch and body values), and its kind: "block"
    (a BlockSpec's), "scratch" (scratch_shapes) or "value" (a float32 value of the body)."""

    what: str
    shape: tuple[int, ...]
    itemsize: int
    count: int = 2
    kind: str = "block"

    @property
    def tpu_bytes(self) -> int:
        return tpu_tile_bytes(self.shape, self.itemsize) * self.count

    @property
    def gpu_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize * self.count


def tpu_tile_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one array in Mosaic's (sublane, 128-lane) tiles."""
    dims = [1, *shape] if len(shape) == 1 else list(shape)
    sublanes = 8 * max(1, 4 // itemsize)
    dims[-1] = -(-dims[-1] // LANE) * LANE
    dims[-2] = -(-dims[-2] // sublanes) * sublanes
    return math.prod(dims) * itemsize


def tpu_bytes(buffers: list[Buffer]) -> int:
    return sum(b.tpu_bytes for b in buffers)


def tpu_limit_mib(limit_mib: float) -> float:
    """The scoped VMEM limit a kernel compiles under: the configured one, or the compiler's default."""
    return limit_mib or TPU_DEFAULT_LIMIT_MIB


def tpu_limit_bytes(limit_mib: float) -> int | None:
    """A kernel's vmem_limit_bytes compiler parameter (None = the compiler's default)."""
    return int(limit_mib * MIB) or None


def mib(n_bytes: int) -> float:
    return n_bytes / MIB


@dataclasses.dataclass(frozen=True)
class Need:
    """A kernel's on-chip need at its tiles against the limit it compiles under."""

    kernel: str
    need_bytes: int
    limit_bytes: int

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.limit_bytes

    def text(self) -> str:
        return f"{self.kernel} needs {mib(self.need_bytes):.2f} MiB of its {mib(self.limit_bytes):.2f} MiB limit"
