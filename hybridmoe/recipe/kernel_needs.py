"""Each Pallas kernel's tiles and on-chip memory at a config, as the kernels resolve them: the
figures the validator's VMEM rules (recipe/validate.py) and `hybridmoe describe` read."""

from __future__ import annotations

from hybridmoe.config.schema import Config
from hybridmoe.kernels.attention import limits as attention_limits
from hybridmoe.kernels.gdn import limits as gdn_limits
from hybridmoe.kernels.gmm import tiling

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def gmm_tiles(cfg: Config) -> tiling.KernelTiles:
    """Each grouped matmul's tiles as the MoE layer resolves them (explicit tiling)."""
    return tiling.kernel_tiles(cfg.kernels.gmm.model_dump())


def gmm_vmem_needs(cfg: Config) -> dict:
    """Each grouped matmul's VMEM need at its tiles (explicit tiling, Mosaic TPU), by kernel."""
    g, m, moe = cfg.kernels.gmm, cfg.model, cfg.moe
    return tiling.vmem_needs(g.vmem_limit_mib, d_model=m.d_model, hidden=m.moe_intermediate_size,
                             tiles=gmm_tiles(cfg), wi_fused=moe.wi_fused_swiglu, wo_fused=moe.wo_fused_dswiglu,
                             tile_n_per_half=g.wi_fwd_tile_n_per_half or None,
                             row_scale=moe.router_grad_from_wo_input, itemsize=ITEMSIZE[m.compute_dtype])


def attention_vmem_needs(cfg: Config, context_ranks: int = 1) -> dict:
    """The flash kernels' VMEM needs at the blocks they run (the self-attention's, train.seq_len, its
    rows split over `context_ranks`)."""
    a, m = cfg.kernels.attention, cfg.model
    P = context_ranks
    rows = cfg.train.seq_len // P
    keys = rows if cfg.attention.cp_impl == "ring" or P == 1 else cfg.train.seq_len
    block_q, block_k = attention_limits.blocks("pallas_tpu", a.block_q, a.block_k, rows, keys, hardware=True)
    return attention_limits.vmem_needs(a.vmem_limit_mib, block_q=block_q, block_k=block_k,
                                       group=m.num_heads // m.num_kv_heads, head_dim=m.head_dim,
                                       itemsize=ITEMSIZE[m.compute_dtype])


def gdn_vmem_needs(cfg: Config) -> dict:
    m = cfg.model
    return gdn_limits.vmem_needs(0.0, chunk_size=cfg.gdn.chunk_size, key_dim=m.gdn_key_dim,
                                 value_dim=m.gdn_value_dim)
