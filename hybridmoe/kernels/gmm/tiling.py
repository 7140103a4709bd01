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
"""

from __future__ import annotations

import dataclasses

LANE = 128
SUBLANE = 8
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
    vmem_limit_mib: the Mosaic kernels' scoped VMEM limit; 0 = the compiler default (32 MiB on
    tpu7x, which the upstream tile does not fit).
    """

    tm: int = 128
    tk: int = 128
    tn: int = 128
    rhs_buffer_count: int = 0
    vmem_limit_mib: float = 0.0


DEFAULT = Tiling()


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


def tile_problems(
    *,
    d_model: int,
    hidden: int,
    tiling: Tiling,
    tile_n_per_half: int | None = None,
    backend: str = "pallas_tpu",
    hardware: bool = True,
) -> list[str]:
    """Every broken tile rule for the MoE pair wi [E, D, 2F] / wo [E, F, D] (F = hidden).

    hardware=False relaxes the alignment rules (interpret mode and the XLA backend).
    """
    probs: list[str] = []
    if tiling.tm <= 0 or (hardware and tiling.tm % SUBLANE):
        probs.append(f"tm={tiling.tm} must be a positive multiple of {SUBLANE}")
    if hardware and backend == "pallas_gpu" and not (_is_pow2(tiling.tm) and tiling.tm >= 16):
        probs.append(f"tm={tiling.tm} must be a power of two >= 16 (Triton blocks)")
    probs += _dim_problems("tk (over D)", d_model, pick(d_model, tiling.tk), backend, hardware)
    tn = tile_n_per_half if tile_n_per_half is not None else pick(hidden, tiling.tn)
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
    if tiling.rhs_buffer_count < 0:
        probs.append(f"rhs_buffer_count={tiling.rhs_buffer_count} must be 0 (the kernel default) or a depth >= 1")
    elif hardware and backend == "pallas_tpu" and tiling.rhs_buffer_count > TPU_MAX_RHS_BUFFERS:
        probs.append(f"rhs_buffer_count={tiling.rhs_buffer_count}: Mosaic TPU takes at most {TPU_MAX_RHS_BUFFERS}")
    return probs


def check(problems: list[str]) -> None:
    if problems:
        raise ValueError("gmm tiling: " + "; ".join(problems))
