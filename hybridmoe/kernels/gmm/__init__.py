"""Grouped matmuls (MoE experts) with custom VJPs and fused SwiGLU epilogues.

See ops.py for the contract; reference.py for the per-group loop they are tested against;
tiling.py for the tile rules; epilogue.py for the epilogues and the pre-activation layout.
"""

from hybridmoe.kernels.gmm.epilogue import EPILOGUES, scale_rows, swiglu
from hybridmoe.kernels.gmm.ops import (
    BACKENDS,
    XLA_IMPLS,
    contiguous_to_preact,
    gmm,
    wo_fused_dswiglu,
    wi_fused_swiglu,
    preact_to_contiguous,
    split_preact,
    tgmm,
    xla_impl_for,
)
from hybridmoe.kernels.gmm.row_tiles import routed_swiglu_mlp, row_tiled_dot
from hybridmoe.kernels.gmm.tiling import KernelTiles, Tiling, kernel_tiles, tile_problems
from hybridmoe.kernels.gmm.xla import ragged_dot

__all__ = [
    "BACKENDS",
    "XLA_IMPLS",
    "EPILOGUES",
    "KernelTiles",
    "Tiling",
    "contiguous_to_preact",
    "gmm",
    "wo_fused_dswiglu",
    "wi_fused_swiglu",
    "preact_to_contiguous",
    "ragged_dot",
    "routed_swiglu_mlp",
    "row_tiled_dot",
    "scale_rows",
    "split_preact",
    "swiglu",
    "kernel_tiles",
    "tgmm",
    "tile_problems",
    "xla_impl_for",
]
