"""The tiles and row layouts the kernel cases' grouped-matmul arms run (tools/chip_cases.py): the tile
table's tiles for a call on this host's chip, the fused SwiGLU pair at the tiles of the kernels it
replaces, and moe.group_align_rows' layout (hybridmoe/model/moe_align.py) of a case's rows, made
before anything is timed (`LaidOut`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LaidOut:
    """A backend that runs on another layout of the case's inputs, made before anything is timed:
    lay(args, cot) -> (its args, its cot, restore), restore(out, backward) -> out in the case's layout
    (the rows moved back outside the timed program: the moves belong to the dispatch, which makes
    the layout anyway)."""

    fn: Callable
    lay: Callable


def table_tiling(kind: str, k: int, n: int, *, m: int, groups: int, tm: int | None = None):
    """The tile table's tiles for a grouped matmul of `kind` at this host's chip (the heuristic ones
    where it has no entry), each clipped to its dimension; tm: this row tile instead of the entry's."""
    from hybridmoe.kernels.gmm import Tiling, tile_table
    from hybridmoe.kernels.gmm.tiling import pick
    from hybridmoe.kernels.platform import generation_of_device

    found = tile_table.lookup(tile_table.Call(kind, m, k, n, groups, 2, generation_of_device(jax.devices()[0])))
    t = found or tile_table.tpu_rule(k, n)
    return Tiling(tm=tm or t.tm, tk=pick(k, t.tk), tn=pick(n, t.tn))


def fused_up_projection(wi, f: int):
    """(the fused up projection's tiling, its N tile per half) from the plain wi forward's tiling: its N
    tile spans T gate and T up columns, an even split of the plain one's where T divides F, else all of F."""
    per_half = wi.tn // 2 if wi.tn % 2 == 0 and f % (wi.tn // 2) == 0 else f
    return dataclasses.replace(wi, tn=2 * per_half), per_half


def fitting_rows(kind: str, t, **dims):
    """t with its row tile halved until the kernel `kind` (a tiling.tpu_buffers kind) fits `auto`'s
    VMEM cap by the model with its margin: the fused input gradient borrows the plain kernel's table
    entry, measured for a kernel that keeps less in VMEM (the plain one-K-tile kernel holds no float32
    accumulator; the fused one an accumulator and four float32 [tm, F] epilogue values). At the
    cell's shape (D 4096, F 1024) a v5e refused it at 512 rows under the 48 MiB cap: the compiler's
    need 49.1 MiB where the model counts 43.0 (tiling.epilogue_values); with the margin the model
    halves it to 256."""
    from hybridmoe.kernels.gmm.tiling import SUBLANE, tpu_buffers
    from hybridmoe.kernels.vmem import margin_fits_auto_cap, tpu_bytes

    def fits(tm: int) -> bool:
        return margin_fits_auto_cap(tpu_bytes(tpu_buffers(kind, tm=tm, tk=t.tk, tn=t.tn, **dims)))

    tm = t.tm
    while tm > SUBLANE and tm % 2 == 0 and not fits(tm):
        tm //= 2
    return dataclasses.replace(t, tm=tm)


def fused_table_tiles(g):
    """(the fused pair's KernelTiles, its N tile per half) from the tile table at the geometry's shapes
    on this host's chip: the fused up projection at the plain wi forward's entry (gmm, D -> 2F), the
    fused input gradient at the wo input gradient's (gmm_t, D -> F), its row tile halved until it fits
    VMEM (fitting_rows: a v5e refused it at the 512-row tile the plain kernel's entry now has); the
    other kernels from the table as they run; where the table has no entry (another chip, the tiny
    geometry), the heuristic tiles."""
    from hybridmoe.kernels.gmm import KernelTiles, Tiling

    m, d, f, groups = g["rows"], g["d"], g["f"], g["groups"]
    entry = functools.partial(table_tiling, m=m, groups=groups)
    table = Tiling(from_table=True)
    wi, per_half = fused_up_projection(entry("gmm", d, 2 * f), f)
    wo_dlhs = fitting_rows("wo_fused_dlhs", dataclasses.replace(entry("gmm_t", d, f), tn=f), f=f, row_scale=True)
    return KernelTiles(wi_fwd=wi, wi_dlhs=table, wi_drhs=table, wo_fwd=table, wo_dlhs=wo_dlhs, wo_drhs=table), per_half


def aligned_moe_plan(g, align: int, interpret: bool):
    """The fused pair on moe.group_align_rows' layout: every kernel at row tile `align` with the tile
    table's tk and tn for its shape (the fused up projection's N tile both halves of the wi forward's)."""
    from hybridmoe.kernels.gmm import KernelTiles
    from hybridmoe.model.moe import GroupedPlan

    m, d, f, groups = g["rows"], g["d"], g["f"], g["groups"]
    t = functools.partial(table_tiling, m=m, groups=groups, tm=align)
    wi, per_half = fused_up_projection(t("gmm", d, 2 * f), f)
    tiles = KernelTiles(wi_fwd=wi, wi_dlhs=t("gmm_t", 2 * f, d), wi_drhs=t("tgmm", d, 2 * f), wo_fwd=t("gmm", f, d),
                        wo_dlhs=t("gmm_t", d, f), wo_drhs=t("tgmm", f, d))
    return GroupedPlan(num_experts=groups, router_grad_from_wo_input=True, xla_impl="ragged_dot", backend="pallas_tpu",
                       tiles=tiles, interpret=interpret, wi_fused_swiglu=True, wo_fused_dswiglu=True,
                       tile_n_per_half=per_half)


def aligned_rows_of(sizes, rows: int, align: int):
    """(padded sizes, gather: [rows, ...] -> the aligned buffer's rows (zero padding), back: the
    buffer's rows -> [rows, ...]) for rows sorted by group into `sizes`."""
    from hybridmoe.model import moe_align

    groups = sizes.shape[0]
    flat = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), sizes, total_repeat_length=rows)
    buffer_A, inverse, padded = moe_align.aligned_layout(flat, jnp.arange(rows, dtype=jnp.int32), sizes, align=align,
                                                         group_offset=0, num_local=groups)
    gather = jax.jit(lambda a: moe_align.token_rows(a, buffer_A, inverse, 1, False) if a.ndim == 2
                     else moe_align.row_values(a, buffer_A))
    return padded, gather, jax.jit(lambda a: a[inverse])


def aligned(fn, rows: int, align: int, row_args: tuple[int, ...], sizes_arg: int) -> LaidOut:
    """fn(*args) on the aligned layout of a case's `rows` rows: the arguments at row_args (and the
    cotangent) laid out, the group sizes at sizes_arg padded; the output and the gradients of the
    row arguments (fn's differentiated arguments are the ones before sizes_arg) brought back."""
    def lay(args, cot):
        padded, gather, back = aligned_rows_of(args[sizes_arg], rows, align)
        laid = tuple(gather(a) if i in row_args else padded if i == sizes_arg else a for i, a in enumerate(args))

        def restore(out, backward):
            if not backward:
                return back(out)
            y, grads = out
            return back(y), tuple(back(gr) if i in row_args else gr for i, gr in enumerate(grads))
        return laid, gather(cot), restore
    return LaidOut(fn, lay)
