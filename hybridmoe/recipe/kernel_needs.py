"""Each Pallas kernel's tiles and on-chip memory at a config, as the kernels resolve them: the
figures the validator's VMEM rule (recipe/validate.py) and `hybridmoe describe` read, and the
problems that rule reports from them."""

from __future__ import annotations

from hybridmoe.config.errors import Problem
from hybridmoe.config.schema import Config
from hybridmoe.kernels.attention import limits as attention_limits
from hybridmoe.kernels.gdn import limits as gdn_limits
from hybridmoe.kernels.gmm import tiling

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def gmm_tiles(cfg: Config) -> tiling.KernelTiles:
    """Each grouped matmul's tiles as the MoE layer resolves them (explicit tiling)."""
    return tiling.kernel_tiles(cfg.kernels.gmm.model_dump())


def gmm_layer(cfg: Config) -> dict:
    """tiling.layer_kernels' arguments for the config's MoE layer."""
    g, m, moe = cfg.kernels.gmm, cfg.model, cfg.moe
    return dict(d_model=m.d_model, hidden=m.moe_intermediate_size, tiles=gmm_tiles(cfg),
                wi_fused=moe.wi_fused_swiglu, wo_fused=moe.wo_fused_dswiglu,
                tile_n_per_half=g.wi_fwd_tile_n_per_half or None, row_scale=moe.router_grad_from_wo_input,
                itemsize=ITEMSIZE[m.compute_dtype], accumulate_weight_grads=moe.token_chunks > 1)


def gmm_vmem_needs(cfg: Config) -> dict:
    """Each grouped matmul's VMEM need at its tiles (explicit tiling, Mosaic TPU), by kernel."""
    return tiling.vmem_needs(cfg.kernels.gmm.vmem_limit_mib, **gmm_layer(cfg))


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
                                 value_dim=m.gdn_value_dim, group=m.gdn_num_value_heads // m.gdn_num_key_heads,
                                 itemsize=ITEMSIZE[m.compute_dtype])


# The validator's problems from those figures (recipe/validate.py's on-chip memory rule).

def limit_problems(key: str, limit_mib: float) -> list[Problem]:
    """A VMEM limit key set above what the largest TPU core has (v5e, v6e: 128 MiB; a v5p or tpu7x core
    has 64, which its compiler enforces)."""
    from hybridmoe.kernels.vmem import TPU_VMEM_MIB, TPU_VMEM_MIB_BY_GENERATION

    if limit_mib > TPU_VMEM_MIB:
        cores = ", ".join(f"{g} {m:.0f}" for g, m in TPU_VMEM_MIB_BY_GENERATION.items())
        return [(key, f"{limit_mib} MiB is more than any TPU core's VMEM (MiB per core: {cores}); "
                 "0 (auto) asks for what the kernel needs")]
    return []


def over_problems(key: str, needs: dict, fix: str) -> list[Problem]:
    """One problem naming every kernel of `needs` over its limit, and the fix."""
    over = [n for n in needs.values() if not n.fits]
    if not over:
        return []
    return [(key, "; ".join(n.text() for n in over) + f" (Mosaic TPU VMEM): {fix}")]


def gpu_attention_problems(cfg: Config, context_ranks: int) -> list[Problem]:
    """The Triton flash kernels' shared memory per program against the GPU's per-block limit."""
    from hybridmoe.kernels.vmem import GPU_SHARED_LIMIT_BYTES

    a, m = cfg.kernels.attention, cfg.model
    rows = cfg.train.seq_len // context_ranks
    block_q, block_k = attention_limits.blocks("pallas_gpu", a.block_q, a.block_k, rows, rows, hardware=True)
    over = [(kernel, need) for kernel in attention_limits.KERNELS
            for need in [attention_limits.gpu_shared_bytes(kernel, block_q=block_q, block_k=block_k, head_dim=m.head_dim,
                                                           itemsize=ITEMSIZE[m.compute_dtype])]
            if need > GPU_SHARED_LIMIT_BYTES]
    if not over:
        return []
    text = "; ".join(f"{k} needs {n / 1024:.0f} KiB of shared memory" for k, n in over)
    return [("kernels.attention.block_k", f"{text} at block_q={block_q} block_k={block_k}, over the GPU's "
             f"{GPU_SHARED_LIMIT_BYTES // 1024} KiB per block (Triton, {attention_limits.GPU_NUM_STAGES} stages): lower the blocks")]
