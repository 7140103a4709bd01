"""On-chip memory of a Pallas kernel, the pieces every kernel family's model is built from (pure
Python, no JAX: the config validator reads these at load, before anything is traced).

Mosaic TPU (VMEM): a kernel's scoped allocation is every BlockSpec block times its buffer count (2,
or the pipeline depth where a BlockSpec sets one), its scratch (once), and the float32 values its
body spills (the compiler keeps what does not fit the vector registers in the same scoped stack).
Blocks are laid out in (sublane, 128-lane) tiles: the last dim rounds up to 128 and the one before
to 8 x (4 / itemsize) rows (8 for 32-bit, 16 for bf16, 32 for 8-bit). The compiler's limit is the
kernel's vmem_limit_bytes, or its default, which depends on the generation: 16 MiB on v5e and v5p,
32 on v6e and tpu7x (of a core's 128, 64, 128 and 64 MiB). A v5e refused flash attention at
512 x 512 blocks (32 MiB) under its default, where a tpu7x compiled it.

A kernel's limit key at 0 (`auto`) therefore asks for its need, plus a margin for what the model
does not count, when that passes the smallest default: at least tpu7x's default and at most
AUTO_LIMIT_CAP_MIB, which every supported generation's core holds. A need past that cap is refused at load (recipe/validate.py)
naming the key; a limit set by hand is the kernel's, checked against the need the same way.

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
# Mosaic's scoped VMEM limit when a kernel sets none, and a core's VMEM, per generation (the
# defaults: JAX's Pallas TPU guide; the VMEM: its hardware table, pallas/mosaic/tpu_info.py).
TPU_DEFAULT_LIMIT_MIB_BY_GENERATION = {"v5e": 16.0, "v5p": 16.0, "v6e": 32.0, "tpu7x": 32.0}
TPU_VMEM_MIB_BY_GENERATION = {"v5e": 128.0, "v5p": 64.0, "v6e": 128.0, "tpu7x": 64.0}
# A kernel without a limit of its own fits every generation's default only within the smallest one.
TPU_DEFAULT_LIMIT_MIB = min(TPU_DEFAULT_LIMIT_MIB_BY_GENERATION.values())
# The most a limit may ask for: the largest core (a v5e or v6e); a generation's own is checked where
# the generation is known.
TPU_VMEM_MIB = max(TPU_VMEM_MIB_BY_GENERATION.values())
# `auto` asks for at most this much: three quarters of the smallest core (v5p, tpu7x: 64 MiB), the
# rest left to the compiler's internal scratch.
AUTO_LIMIT_CAP_MIB = 0.75 * min(TPU_VMEM_MIB_BY_GENERATION.values())
# What `auto` adds to a need (need x AUTO_MARGIN + AUTO_MARGIN_MIB): the model counts blocks, scratch
# and the body's values as a sweep of small blocks on tpu7x measured them, but at large blocks the
# compiler keeps more. Flash attention at head dim 256 on a v5e target, the compiler's scoped
# allocation against the model: 2,048 folded rows x 512 keys, dk-dv 16.64 MiB (model 13.28); 4,096
# x 512, forward 31.89 (29.53), dq 31.50 (25.53), dk-dv over 32.18 (23.53): up to 1.37 x the model
# (tests/test_vmem_tpu_compile.py compiles the 4,096-row case under auto's limit).
AUTO_MARGIN = 1.25
AUTO_MARGIN_MIB = 4.0
# The least `auto` asks for when it asks: tpu7x's and v6e's own default, so that no kernel gets less
# there than it had before it asked.
AUTO_FLOOR_MIB = 32.0
# Shared memory one Triton program may use (H100 / H200: 227 KiB of the SM's 228).
GPU_SHARED_LIMIT_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One on-chip buffer of a kernel: `what` it holds, its shape and itemsize, how many copies
    (a pipelined block's buffer count; 1 for scratch and body values), and its kind: "block"
    (a BlockSpec's), "scratch" (scratch_shapes), "value" (a float32 value of the body) or
    "semaphore" (DMA semaphores among the scratch, which take no VMEM)."""

    what: str
    shape: tuple[int, ...]
    itemsize: int
    count: int = 2
    kind: str = "block"

    @property
    def tpu_bytes(self) -> int:
        if self.kind == "semaphore":
            return 0
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


def margined_mib(need_bytes: int) -> int:
    """A need with `auto`'s margin for what the model does not count, in whole MiB."""
    return math.ceil(need_bytes * AUTO_MARGIN / MIB + AUTO_MARGIN_MIB)


def margin_fits_auto_cap(need_bytes: int) -> bool:
    """Whether the need with its margin stays within `auto`'s cap: a kernel past it compiles under
    the cap only where the model over-counts (a v5e refused the fused input gradient at 512 rows,
    its need 43.0 MiB by the model, 49.1 by the compiler, under the 48 MiB cap)."""
    return margined_mib(need_bytes) <= AUTO_LIMIT_CAP_MIB


def auto_limit_mib(need_bytes: int) -> float:
    """`auto`'s limit for a need: 0 (the compiler's default) where the need with its margin fits the
    smallest default, else that margined need in whole MiB, at least AUTO_FLOOR_MIB and at most
    AUTO_LIMIT_CAP_MIB."""
    margined = margined_mib(need_bytes)
    if margined <= TPU_DEFAULT_LIMIT_MIB:
        return 0.0
    return min(max(float(margined), AUTO_FLOOR_MIB), AUTO_LIMIT_CAP_MIB)


def tpu_limit_mib(limit_mib: float, need_bytes: int | None = None) -> float:
    """The scoped VMEM limit (MiB) a kernel compiles under: the configured one; at 0, `auto`'s for
    its need (need_bytes), which is the smallest generation's default when the need fits it."""
    if limit_mib:
        return limit_mib
    return (need_bytes is not None and auto_limit_mib(need_bytes)) or TPU_DEFAULT_LIMIT_MIB


def tpu_limit_bytes(limit_mib: float, need_bytes: int | None = None) -> int | None:
    """A kernel's vmem_limit_bytes compiler parameter: the configured limit, else `auto`'s for its
    need (None: the compiler's default, where the need fits the smallest one)."""
    mib_ = limit_mib or (auto_limit_mib(need_bytes) if need_bytes is not None else 0.0)
    return int(mib_ * MIB) or None


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
