"""Tile sizes of the Pallas grouped matmuls and the rules they must obey.

`tile_problems` returns every broken rule as a string (empty list = fine), so the config
validator can collect them into one error; the kernels call `check` on their resolved tiles.

Rules:
- tm: a multiple of 8 on hardware (TPU sublanes; the GPU backend wants a power of two >= 16).
  Rows are padded up to a multiple of tm, so tm need not divide M.
- tk, tn: divide their dimension (K is never padded: that would copy the weights each call);
  on TPU a multiple of 128 (lanes) unless the tile spans the whole dimension; on GPU a power of
  two >= 16 (Triton block shapes).
- wi_fused_swiglu: the forward tile per half (tn) divides F and is a multiple of 128 on hardware; the
  pre-activation is stored per tile ([gate_j | up_j] blocks).
- wo_fused_dswiglu: the fused DLHS runs one N tile spanning each half (its tn is F), so it can read
  and write both halves of a row block in one epilogue; F must then be lane-aligned.
- rhs_buffer_count: 0 (the kernel default) or a depth >= 1, at most TPU_MAX_RHS_BUFFERS on Mosaic
  TPU; applied only to the fused up-projection forward kernel, and only when it runs one K tile.

Each grouped matmul of the MoE layer takes its own tiles (`KernelTiles`: wi forward, wi input
gradient, wi weight gradient, wo forward, wo input gradient, wo weight gradient), resolved from the
shared tm/tk/tn and per-kernel keys `<kernel>_<dim>` (0 = the shared tile) by `kernel_tiles`.
`tpu_buffers` / `layer_kernels` / `vmem_needs` (below) are each kernel's on-chip memory at its tiles,
built from kernels/vmem.py's pieces.
"""

from __future__ import annotations

import dataclasses

from hybridmoe.kernels.vmem import MIB, Buffer, Need, tpu_bytes, tpu_limit_mib

LANE = 128
SUBLANE = 8
# The rows a one-K-tile kernel computes at a time inside its row tile (pallas_tpu_own_copies.py):
# the MXU's rows on a v5e, where they divide the tile.
CHUNK_ROWS = 128
# JAX 0.10.2's Mosaic TPU grid pipeline takes 1 or 2 weight buffers (2 is its default) and
# refuses more at lowering (benchmarks/records/gmm_vmem.json).
TPU_MAX_RHS_BUFFERS = 2


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Preferred tiles (tm rows, tk contraction, tn output columns; per half for wi_fused_swiglu).

    rhs_buffer_count: the weight operand's pipeline depth in the fused up-projection forward
    kernel (TPU: BlockSpec buffer count; GPU: the pipeline's stage count). 0 = kernel default.
    The TPU grid pipeline of JAX 0.10.2 accepts only 1 or 2 buffers (depth 3 is refused at
    lowering; benchmarks/records/gmm_vmem.json).
    vmem_limit_mib: the Mosaic kernels' scoped VMEM limit; 0 = auto (kernels/vmem.py: the
    compiler's default where a kernel fits it, else its need up to 48 MiB, which the upstream tile
    does not fit).
    """

    tm: int = 128
    tk: int = 128
    tn: int = 128
    rhs_buffer_count: int = 0
    vmem_limit_mib: float = 0.0
    # The plain kernels (gmm, gmm_t, tgmm) take their tiles from the measured table for the chip and
    # shape they are traced at (tile_table.py; kernels.gmm.tiling=auto), these tiles where it has none.
    from_table: bool = False


DEFAULT = Tiling()

# The grouped matmuls of the MoE layer, each with its own tiles: the up projection wi [G, D, 2F] and
# the down projection wo [G, F, D], forward, input gradient (dlhs) and weight gradient (drhs).
KERNELS = ("wi_fwd", "wi_dlhs", "wi_drhs", "wo_fwd", "wo_dlhs", "wo_drhs")
DIMS = ("tm", "tk", "tn")


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """One Tiling per grouped matmul of the MoE layer (KERNELS)."""

    wi_fwd: Tiling = DEFAULT
    wi_dlhs: Tiling = DEFAULT
    wi_drhs: Tiling = DEFAULT
    wo_fwd: Tiling = DEFAULT
    wo_dlhs: Tiling = DEFAULT
    wo_drhs: Tiling = DEFAULT

    @classmethod
    def shared(cls, tiling: Tiling) -> KernelTiles:
        return cls(*(tiling,) * len(KERNELS))

    def items(self):
        return [(name, getattr(self, name)) for name in KERNELS]


def kernel_tiles(values) -> KernelTiles:
    """Each kernel's tiles from flat keys (a mapping): the shared tm / tk / tn, the per-kernel
    `<kernel>_<dim>` (0 or absent = the shared one), vmem_limit_mib, and wi_fwd_rhs_buffer_count
    (the wi forward's only)."""
    shared = {d: int(values.get(d, getattr(DEFAULT, d))) for d in DIMS}
    limit = float(values.get("vmem_limit_mib", 0.0))
    out = {}
    for name in KERNELS:
        dims = {d: int(values.get(f"{name}_{d}", 0)) or shared[d] for d in DIMS}
        depth = int(values.get("wi_fwd_rhs_buffer_count", 0)) if name == "wi_fwd" else 0
        out[name] = Tiling(**dims, rhs_buffer_count=depth, vmem_limit_mib=limit)
    return KernelTiles(**out)


def row_chunk(tm: int) -> int:
    """The row chunk of a one-K-tile kernel at row tile tm: CHUNK_ROWS where it divides tm, else tm."""
    return CHUNK_ROWS if tm % CHUNK_ROWS == 0 else tm


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pick(dim: int, preferred: int) -> int:
    """The preferred tile if it divides dim, else the whole dimension (one tile)."""
    return preferred if preferred <= dim and dim % preferred == 0 else dim


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def resolve_tm(m: int, preferred: int) -> int:
    """Row tile: never larger than M rounded up to a sublane multiple."""
    return max(SUBLANE, min(preferred, round_up(m, SUBLANE)))


def _dim_problems(name: str, dim: int, tile: int, backend: str, hardware: bool) -> list[str]:
    out = []
    if tile <= 0 or dim % tile:
        out.append(f"{name}={tile} must divide {dim}")
    if hardware and backend == "pallas_tpu" and tile != dim and tile % LANE:
        out.append(f"{name}={tile} must be a multiple of {LANE} (TPU lanes) or span {dim}")
    if hardware and backend == "pallas_gpu" and not (_is_pow2(tile) and tile >= 16):
        out.append(f"{name}={tile} must be a power of two >= 16 (Triton blocks)")
    return out


def kernel_dims(d_model: int, hidden: int) -> dict[str, tuple[tuple[str, int], tuple[str, int]]]:
    """Per kernel, its (contraction, output columns) dims as (name, size): what its tk and tn tile
    (the unfused path's; the fused wi forward tiles each half with tile_n_per_half and the fused wo
    input gradient spans F with one N tile)."""
    D, F2, F = ("D", d_model), ("2F", 2 * hidden), ("F", hidden)
    return {"wi_fwd": (D, F2), "wi_dlhs": (F2, D), "wi_drhs": (D, F2),
            "wo_fwd": (F, D), "wo_dlhs": (D, F), "wo_drhs": (F, D)}


def tile_problems(
    *,
    d_model: int,
    hidden: int,
    tiling: Tiling | KernelTiles,
    tile_n_per_half: int | None = None,
    backend: str = "pallas_tpu",
    hardware: bool = True,
) -> list[str]:
    """Every broken tile rule for the MoE pair wi [E, D, 2F] / wo [E, F, D] (F = hidden), each
    kernel at its own tiles (a plain Tiling serves every kernel).

    hardware=False relaxes the alignment rules (interpret mode and the XLA backend).
    """
    tiles = tiling if isinstance(tiling, KernelTiles) else KernelTiles.shared(tiling)
    by_rule: dict[str, list[str]] = {}  # a broken rule -> the kernels that break it
    for name, t in tiles.items():
        found = []
        if t.tm <= 0 or (hardware and t.tm % SUBLANE):
            found.append(f"tm={t.tm} must be a positive multiple of {SUBLANE}")
        if hardware and backend == "pallas_gpu" and not (_is_pow2(t.tm) and t.tm >= 16):
            found.append(f"tm={t.tm} must be a power of two >= 16 (Triton blocks)")
        (k_name, k), (n_name, n) = kernel_dims(d_model, hidden)[name]
        found += _dim_problems(f"tk (over {k_name})", k, pick(k, t.tk), backend, hardware)
        fused_n = (name == "wi_fwd" and tile_n_per_half is not None)  # tiled by tile_n_per_half below
        if not fused_n:
            found += _dim_problems(f"tn (over {n_name})", n, pick(n, t.tn), backend, hardware)
        for p in found:
            by_rule.setdefault(p, []).append(name)
    # Shared tiles (a plain Tiling) report each rule once; per-kernel tiles name the kernels.
    probs = [p if isinstance(tiling, Tiling) else f"{p} ({', '.join(names)})" for p, names in by_rule.items()]
    tn = tile_n_per_half if tile_n_per_half is not None else pick(hidden, tiles.wi_fwd.tn)
    if tn <= 0 or hidden % tn:
        probs.append(f"tile_n_per_half={tn} must divide F={hidden}")
    elif hardware and backend == "pallas_tpu" and tn % LANE:
        probs.append(f"tile_n_per_half={tn} must be a multiple of {LANE}")
    elif hardware and backend == "pallas_gpu" and not (_is_pow2(tn) and tn >= 16):
        probs.append(f"tile_n_per_half={tn} must be a power of two >= 16")
    # The fused DLHS spans each half with one N tile.
    if hardware and backend == "pallas_tpu" and hidden % LANE:
        probs.append(f"F={hidden} must be a multiple of {LANE}: the fused DLHS spans each half")
    if hardware and backend == "pallas_gpu" and not _is_pow2(hidden):
        probs.append(f"F={hidden} must be a power of two: the fused DLHS spans each half")
    depth = tiles.wi_fwd.rhs_buffer_count
    if depth < 0:
        probs.append(f"rhs_buffer_count={depth} must be 0 (the kernel default) or a depth >= 1")
    elif hardware and backend == "pallas_tpu" and depth > TPU_MAX_RHS_BUFFERS:
        probs.append(f"rhs_buffer_count={depth}: Mosaic TPU takes at most {TPU_MAX_RHS_BUFFERS}")
    return probs


def check(problems: list[str]) -> None:
    if problems:
        raise ValueError("gmm tiling: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# On-chip memory (kernels/vmem.py): each Mosaic TPU kernel's buffers at its resolved tiles, as
# pallas_tpu.py builds its BlockSpecs and scratch (tests/test_vmem_model.py compares the two), and
# the float32 values its body spills (tests/test_vmem_tpu_compile.py compares the total with the
# compiler's verdict). Measured on tpu7x (the smallest scoped limit the compiler accepts, bisected
# to 4 KiB): gmm and gmm_t need exactly their blocks and scratch; tgmm its transposed lhs; the fused
# wi forward its epilogue's [tm, tn] values; the fused wo input gradient its epilogue's float32
# [tm, F] values.

# The two DMA semaphores of a kernel that copies its own blocks (they take no VMEM; the traced
# kernel lists them among its scratch, as 4-byte scalars).
DMA_SEMAPHORES = Buffer("dma_semaphores", (2,), 4, 1, "semaphore")

PALLAS_NAMES = {"gmm": "gmm", "gmm_t": "gmm_t", "tgmm": "tgmm", "wi_fused": "wi_fused_swiglu_fwd",
                "wo_fused_dlhs": "wo_fused_dswiglu_dlhs"}


def tpu_buffers(kind: str, *, tm: int, tk: int, tn: int, itemsize: int = 2, out_itemsize: int | None = None,
                depth: int = 0, f: int = 0, row_scale: bool = False, with_h: bool = False,
                accumulate: bool = False, whole_k: bool = False,
                written_behind: bool = False) -> list[Buffer]:
    """The VMEM buffers of one Mosaic kernel (kind: a PALLAS_NAMES key) at resolved tiles: tm rows,
    tk contraction, tn output columns (per half for wi_fused; f = F for wo_fused_dlhs, whose one N
    tile spans it). depth: wi_fused's weight pipeline depth (0 = Mosaic's 2). accumulate: tgmm adds
    into the output's previous value, read as one more block (moe.token_chunks' backward).
    whole_k: gmm / gmm_t with one K tile, which keep the weight in two slots of their own
    (pallas_tpu_own_copies.gmm_prefetched); written_behind: tgmm staging its output in two slots of
    its own (pallas_tpu_own_copies.tgmm_written_behind). plain_buffers picks these as pallas_tpu does."""
    out_itemsize = out_itemsize or itemsize
    F32 = 4
    if kind in ("gmm", "gmm_t"):
        rhs = (tn, tk) if kind == "gmm_t" else (tk, tn)
        if whole_k:  # pallas_tpu_own_copies.gmm_prefetched: the weight in two slots of its own (tpu7x: within 0.06
            # MiB of the blocks and slots at (256, 2048, 256) and (512, 2048, 256), no spilled chunk product)
            return [Buffer("lhs", (tm, tk), itemsize), Buffer("out", (tm, tn), out_itemsize),
                    Buffer("rhs_slots", (2, *rhs), itemsize, 1, "scratch"), DMA_SEMAPHORES]
        return [Buffer("lhs", (tm, tk), itemsize), Buffer("rhs", rhs, itemsize),
                Buffer("out", (tm, tn), out_itemsize), Buffer("acc", (tm, tn), F32, 1, "scratch")]
    if kind == "tgmm" and written_behind:  # pallas_tpu_own_copies.tgmm_written_behind: the output staged in two slots
        # (tpu7x: within 0.04 MiB of the blocks and scratch at (256, 512, 256) to (512, 1024, 512); no
        # transposed lhs kept, unlike the grid-pipelined kernel's)
        return [Buffer("lhs", (tm, tk), itemsize), Buffer("grad", (tm, tn), itemsize),
                Buffer("acc", (tk, tn), F32, 1, "scratch"), Buffer("out_slots", (2, tk, tn), out_itemsize, 1, "scratch"),
                DMA_SEMAPHORES]
    if kind == "tgmm":
        return [Buffer("lhs", (tm, tk), itemsize), Buffer("grad", (tm, tn), itemsize),
                *[Buffer("acc_in", (tk, tn), out_itemsize)] * accumulate,
                Buffer("out", (tk, tn), out_itemsize), Buffer("acc", (tk, tn), F32, 1, "scratch"),
                # the masked lhs, transposed for the MXU (tpu7x: 0 / 48 / 184 KiB over the blocks at
                # (tm, tk, tn) = (128, 256, 128) / (256, 256, 512) / (256, 512, 256); this is 64 / 128 / 256)
                Buffer("lhs_transposed", (tk, tm), itemsize, 1, "value")]
    if kind == "wi_fused" and whole_k:  # pallas_tpu_own_copies.wi_fused_swiglu_prefetched: gate and up in two slots each
        return [Buffer("x", (tm, tk), itemsize), Buffer("h", (tm, tn), itemsize), Buffer("preact", (tm, 2 * tn), itemsize),
                Buffer("w_gate_slots", (2, tk, tn), itemsize, 1, "scratch"),
                Buffer("w_up_slots", (2, tk, tn), itemsize, 1, "scratch"),
                Buffer("dma_semaphores", (2, 2), 4, 1, "semaphore"),
                Buffer("silu_gate", (tm, tn), F32, 1, "value"), Buffer("h_value", (tm, tn), itemsize, 1, "value")]
    if kind == "wi_fused":
        w = depth or 2
        return [Buffer("x", (tm, tk), itemsize), Buffer("w_gate", (tk, tn), itemsize, w),
                Buffer("w_up", (tk, tn), itemsize, w), Buffer("h", (tm, tn), itemsize),
                Buffer("preact", (tm, 2 * tn), itemsize), Buffer("acc_gate", (tm, tn), F32, 1, "scratch"),
                Buffer("acc_up", (tm, tn), F32, 1, "scratch"),
                # the epilogue: silu(gate) in float32 and h in the output dtype (tpu7x at the seed's tile
                # 512 x 4096 x 1024: 2.75 MiB over the blocks; 24 to 56 KiB at 256 x 512 x 256 / 512)
                Buffer("silu_gate", (tm, tn), F32, 1, "value"), Buffer("h_value", (tm, tn), itemsize, 1, "value")]
    if kind == "wo_fused_dlhs":
        # whole_k: pallas_tpu_own_copies.wo_fused_dswiglu_dlhs_prefetched, wo in two slots of its own
        wo = ([Buffer("wo_slots", (2, f, tk), itemsize, 1, "scratch"), DMA_SEMAPHORES] if whole_k
              else [Buffer("wo", (f, tk), itemsize)])
        rows = [Buffer("g", (tm, tk), itemsize), *wo, Buffer("preact", (tm, 2 * f), itemsize)]
        if row_scale:
            rows.append(Buffer("row_scale", (tm, 1), F32))
        if with_h:
            rows.append(Buffer("h", (tm, f), itemsize))
        return rows + [Buffer("d_gate_up", (tm, 2 * f), itemsize), Buffer("row_dot", (tm, 1), F32),
                       *([] if whole_k else [Buffer("acc", (tm, f), F32, 1, "scratch")]),
                       *epilogue_values(row_chunk(tm) if whole_k else tm, f)]
    raise ValueError(f"unknown grouped-matmul kernel {kind!r}; choose one of {tuple(PALLAS_NAMES)}")


def plain_buffers(kind: str, *, tm: int, tk: int, tn: int, k: int, itemsize: int = 2,
                  accumulate: bool = False) -> list[Buffer]:
    """The buffers of the plain kernel (gmm, gmm_t, tgmm) pallas_tpu runs at these resolved tiles
    over contraction k: with one K tile gmm and gmm_t fetch their weight a group ahead themselves
    (gmm_prefetched); tgmm writes its output a group behind unless it adds into a carried one
    (tgmm_written_behind)."""
    if kind != "tgmm" and tk == k:
        return tpu_buffers(kind, tm=tm, tk=tk, tn=tn, itemsize=itemsize, whole_k=True)
    if kind == "tgmm" and not accumulate:
        return tpu_buffers(kind, tm=tm, tk=tk, tn=tn, itemsize=itemsize, written_behind=True)
    return tpu_buffers(kind, tm=tm, tk=tk, tn=tn, itemsize=itemsize, accumulate=accumulate)


def epilogue_values(tm: int, f: int) -> list[Buffer]:
    """The fused input gradient's epilogue spills its float32 [tm, F] values: gate and up read from
    the stored pre-activation, d_gate and d_up (the compiler's need exceeds the blocks by 3.2 to 3.9
    times one [tm, F] float32 array at tm 128, F 1024 on tpu7x: tests/test_vmem_tpu_compile.py). A
    v5e target keeps about three more at D 4096, F 1024: the kernel alone needs 24.62 / 32.50 / 49.12
    MiB at tm 128 / 256 / 512 where this model counts 22.75 / 29.50 / 43.00 (bisected on compile-only
    v5e devices); `auto`'s margin covers it up to its cap (vmem.margin_fits_auto_cap)."""
    return [Buffer(what, (tm, f), 4, 1, "value") for what in ("gate", "up", "d_gate", "d_up")]


def layer_kernels(*, d_model: int, hidden: int, tiles: KernelTiles, wi_fused: bool, wo_fused: bool,
                  tile_n_per_half: int | None, row_scale: bool, itemsize: int = 2,
                  rows: int | None = None, accumulate_weight_grads: bool = False) -> dict[str, tuple[str, list[Buffer]]]:
    """Per grouped matmul of the MoE layer (KERNELS): (its Mosaic kernel's name, its buffers) at
    its own tiles, resolved as the kernels resolve them (rows: the routed rows, when known, cap tm).
    accumulate_weight_grads: the weight gradients add into a carried one (moe.token_chunks > 1)."""
    D, F = d_model, hidden

    def tm_of(t: Tiling) -> int:
        return resolve_tm(rows, t.tm) if rows else t.tm

    def plain(kind: str, t: Tiling, k: int, n: int, accumulate: bool = False):
        return PALLAS_NAMES[kind], plain_buffers(kind, tm=tm_of(t), tk=pick(k, t.tk), tn=pick(n, t.tn), k=k,
                                                 itemsize=itemsize, accumulate=accumulate)

    out = {}
    t = tiles.wi_fwd
    if wi_fused:
        tk = pick(D, t.tk)
        depth = t.rhs_buffer_count if tk == D else 0  # the depth applies with one K tile only
        out["wi_fwd"] = PALLAS_NAMES["wi_fused"], tpu_buffers(
            "wi_fused", tm=tm_of(t), tk=tk, tn=tile_n_per_half or F, itemsize=itemsize, depth=depth)
    else:
        out["wi_fwd"] = plain("gmm", t, D, 2 * F)
    out["wi_dlhs"] = plain("gmm_t", tiles.wi_dlhs, 2 * F, D)
    out["wi_drhs"] = plain("tgmm", tiles.wi_drhs, D, 2 * F, accumulate=accumulate_weight_grads)
    out["wo_fwd"] = plain("gmm", tiles.wo_fwd, F, D)
    t = tiles.wo_dlhs
    if wo_fused:
        out["wo_dlhs"] = PALLAS_NAMES["wo_fused_dlhs"], tpu_buffers(
            "wo_fused_dlhs", tm=tm_of(t), tk=pick(D, t.tk), tn=F, f=F, itemsize=itemsize, row_scale=row_scale)
    else:
        out["wo_dlhs"] = plain("gmm_t", t, D, F)
    out["wo_drhs"] = plain("tgmm", tiles.wo_drhs, F, D, accumulate=accumulate_weight_grads)
    return out


def resolved_tiles(buffers: list[Buffer]) -> tuple[int, int, int]:
    """(tm, tk, tn) a kernel runs, read back from its buffers (tn: per half for the fused forward,
    F for the fused input gradient)."""
    by = {b.what: b.shape for b in buffers}
    if "w_gate" in by:
        return by["x"][0], by["w_gate"][0], by["w_gate"][1]
    if "wo" in by:
        return by["g"][0], by["g"][1], by["wo"][0]
    if "grad" in by:
        return by["lhs"][0], by["lhs"][1], by["grad"][1]
    return by["lhs"][0], by["lhs"][1], by["out"][1]


def vmem_needs(limit_mib: float, **layer) -> dict[str, Need]:
    """Per grouped matmul of the MoE layer, its VMEM need (bytes) against the scoped limit it
    compiles under (limit_mib; 0 = auto: kernels/vmem.py); layer: layer_kernels' arguments."""
    needs = {name: (pallas, tpu_bytes(buffers)) for name, (pallas, buffers) in layer_kernels(**layer).items()}
    return {name: Need(f"{name} ({pallas})", need, int(tpu_limit_mib(limit_mib, need) * MIB))
            for name, (pallas, need) in needs.items()}
