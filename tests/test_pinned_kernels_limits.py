"""On-chip memory figures and block rules of the kernels, pinned to hand-worked numbers: the VMEM
tile arithmetic (kernels/vmem.py), the flash kernels' buffers and Triton shared memory
(kernels/attention/limits.py), and the config glue that feeds them (recipe/kernel_needs.py).
Pure Python: nothing here traces or compiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridmoe.kernels import vmem
from hybridmoe.kernels.attention import limits
from hybridmoe.kernels.vmem import MIB, Buffer, Need
from hybridmoe.recipe import kernel_needs

# ---------------------------------------------------------------------------------------------
# kernels/vmem.py


@pytest.mark.parametrize("shape, itemsize, expected", [
    # a 1-D array is one row: (1, 3) -> (8 sublanes, 128 lanes) x 4 bytes
    ((3,), 4, 8 * 128 * 4),
    # bf16 sublanes are 16 rows: (10, 130) -> (16, 256) x 2
    ((10, 130), 2, 16 * 256 * 2),
    # 8-bit sublanes are 32 rows: (33, 5) -> (64, 128) x 1
    ((33, 5), 1, 64 * 128 * 1),
    # leading dims are not padded: (2, 9, 200) -> (2, 16, 256) x 4
    ((2, 9, 200), 4, 2 * 16 * 256 * 4),
    # exactly on the tile edges: (8, 128) float32 stays as it is
    ((8, 128), 4, 8 * 128 * 4),
    # one past each edge: (9, 129) float32 -> (16, 256)
    ((9, 129), 4, 16 * 256 * 4),
])
def test_tpu_tile_bytes_round_lanes_to_128_and_sublanes_by_itemsize(shape, itemsize, expected):
    assert vmem.tpu_tile_bytes(shape, itemsize) == expected


def test_buffer_bytes_count_every_copy_tpu_tiled_and_gpu_dense():
    b = Buffer("x", (3, 5), 2, 3)
    assert b.tpu_bytes == 16 * 128 * 2 * 3  # (3, 5) bf16 -> (16, 128) tiles, 3 copies
    assert b.gpu_bytes == 3 * 5 * 2 * 3     # dense bytes, 3 copies
    assert Buffer("y", (8, 128), 4).tpu_bytes == 8 * 128 * 4 * 2  # a block's default count: 2
    assert vmem.tpu_bytes([b, Buffer("y", (8, 128), 4)]) == 16 * 128 * 2 * 3 + 8 * 128 * 4 * 2


def test_generation_tables_and_derived_limits():
    assert vmem.TPU_DEFAULT_LIMIT_MIB == 16.0   # v5e / v5p's default, the smallest
    assert vmem.TPU_VMEM_MIB == 128.0           # v5e / v6e's core, the largest
    assert vmem.AUTO_LIMIT_CAP_MIB == 48.0      # 0.75 x 64 (v5p / tpu7x)
    assert vmem.GPU_SHARED_LIMIT_BYTES == 232448  # 227 KiB


@pytest.mark.parametrize("need, expected", [
    (8 * MIB, 0.0),               # 8 x 1.25 + 4 = 14 <= 16: the compiler's default
    (int(9.6 * MIB), 0.0),        # 12 (rounded up from just under) + 4 = 16: still the default
    (int(9.6 * MIB) + 1, 32.0),   # just over: ceil(12.000001) + 4 = 17, raised to the 32 MiB floor
    (24 * MIB, 34.0),             # 30 + 4
    (int(22.5 * MIB), 33.0),      # ceil(28.125) + 4 = 33: whole MiB, rounded up
    (35 * MIB, 48.0),             # 43.75 -> 44 + 4 = 48: exactly the cap
    (36 * MIB, 48.0),             # 45 + 4 = 49, capped at 48
])
def test_auto_limit_is_margined_need_in_whole_mib_between_floor_and_cap(need, expected):
    assert vmem.auto_limit_mib(need) == expected


def test_tpu_limit_mib_and_bytes_prefer_the_configured_limit_else_auto():
    assert vmem.tpu_limit_mib(20.0, 40 * MIB) == 20.0   # a limit set by hand wins
    assert vmem.tpu_limit_mib(0.0, None) == 16.0        # no need known: the smallest default
    assert vmem.tpu_limit_mib(0.0, 8 * MIB) == 16.0     # fits the default
    assert vmem.tpu_limit_mib(0.0, 24 * MIB) == 34.0    # auto's ask
    assert vmem.tpu_limit_bytes(20.0, 40 * MIB) == 20 * MIB
    assert vmem.tpu_limit_bytes(0.0, 8 * MIB) is None   # the compiler's default: no parameter
    assert vmem.tpu_limit_bytes(0.0, None) is None
    assert vmem.tpu_limit_bytes(0.0, 24 * MIB) == 34 * MIB
    assert vmem.tpu_limit_bytes(1.5, None) == int(1.5 * MIB)


def test_need_fits_up_to_its_limit_inclusive_and_its_text():
    assert Need("k", 16 * MIB, 16 * MIB).fits
    assert not Need("k", 16 * MIB + 1, 16 * MIB).fits
    assert Need("k", int(1.5 * MIB), 16 * MIB).text() == "k needs 1.50 MiB of its 16.00 MiB limit"
    assert vmem.mib(3 * MIB // 2) == 1.5


# ---------------------------------------------------------------------------------------------
# kernels/attention/limits.py: cores, block rules


def test_resolve_auto_is_pallas_tpu_on_tpu_and_xla_elsewhere():
    assert limits.resolve("auto", "tpu") == "pallas_tpu"
    assert limits.resolve("auto", "gpu") == "xla"
    assert limits.resolve("auto", "cpu") == "xla"
    assert limits.resolve("blocked", "tpu") == "blocked"


def test_block_rule_applies_only_on_hardware():
    assert limits.block_rule("pallas_tpu", True) == "mosaic"
    assert limits.block_rule("pallas_gpu", True) == "triton"
    assert limits.block_rule("pallas_tpu", False) is None
    assert limits.block_rule("xla", True) is None


@pytest.mark.parametrize("block, length, rule, ok", [
    (8, 16, "mosaic", True), (12, 24, "mosaic", False), (12, 12, "mosaic", True),  # the whole length
    (16, 48, "triton", True), (8, 48, "triton", False), (24, 48, "triton", False),
    (12, 24, None, True), (5, 24, None, False), (0, 24, None, False),
])
def test_block_ok_by_rule(block, length, rule, ok):
    assert limits.block_ok(block, length, rule) is ok


@pytest.mark.parametrize("wanted, length, rule, expected", [
    (256, 1000, None, 250),        # divisors of 1000 <= 256: 250 the largest
    (256, 1000, "mosaic", 200),    # multiples of 8 dividing 1000: 8, 40, 200, 1000
    (4, 1000, "mosaic", 8),        # none <= 4: the smallest above
    (512, 520, "mosaic", 104),     # 8, 40, 104, 520
    (520, 520, "mosaic", 520),     # exactly the length
    (64, 96, "triton", 32),        # powers of two >= 16 dividing 96: 16, 32
    (64, 40, "triton", None),      # 40 has no power-of-two divisor >= 16
])
def test_fit_block_largest_below_else_smallest_above(wanted, length, rule, expected):
    assert limits.fit_block(wanted, length, rule) == expected


def test_blocks_fit_each_default_to_its_own_length():
    assert limits.blocks("pallas_tpu", 0, 0, 1024, 2048, True) == (128, 512)
    # queries 200: 8 / 40 / 200 divide it -> 40; keys 200 under 512 -> the whole 200
    assert limits.blocks("pallas_tpu", 0, 0, 200, 200, True) == (40, 200)
    # queries and keys differ: block_q from q_len (96 -> 96 <= 128 ... multiples of 8: 8..96), block_k from k_len
    assert limits.blocks("pallas_tpu", 0, 0, 96, 1000, True) == (96, 200)
    # given blocks pass; the other fits xla's 256 default under any divisor
    assert limits.blocks("xla", 64, 0, 1000, 1000, False) == (64, 250)
    assert limits.blocks("pallas_gpu", 0, 0, 128, 128, True) == (64, 64)
    with pytest.raises(ValueError, match=r"no block_q tiles 40 tokens \(triton blocks: a power of two >= 16 \(Triton\)\)"):
        limits.blocks("pallas_gpu", 0, 0, 40, 64, True)
    with pytest.raises(ValueError, match="no block_k tiles 40 tokens"):
        limits.blocks("pallas_gpu", 0, 0, 64, 40, True)


def test_block_and_head_dim_problem_texts():
    assert limits.block_problem("block_q", 48, 100, "local queries") == "block_q=48 does not divide the 100 local queries"
    assert limits.block_problem("block_k", 12, 24, "keys", "mosaic") == (
        "block_k=12 must be a multiple of 8 (Mosaic's (8, 128) tiles) or the whole length; the keys: 24")
    assert limits.block_problem("block_k", 24, 24, "keys", "mosaic") is None
    assert limits.block_problem("block_k", 8, 24, "keys", "triton") == "block_k=8 must be a power of two >= 16 (Triton); the keys: 24"
    assert limits.head_dim_problem(96, "pallas_gpu", True) == "model.head_dim=96 must be a power of two >= 16 for the Triton kernels"
    assert limits.head_dim_problem(8, "pallas_gpu", True) is not None
    assert limits.head_dim_problem(16, "pallas_gpu", True) is None
    assert limits.head_dim_problem(96, "pallas_gpu", False) is None
    assert limits.head_dim_problem(96, "pallas_tpu", True) is None


# ---------------------------------------------------------------------------------------------
# kernels/attention/limits.py: the flash kernels' VMEM and shared memory

# block_q 128, block_k 512, 2 query heads per kv head (rows 256), head dim 128, bf16; each term one
# buffer's tiled bytes x its count (blocks 2, scratch and values 1).
Q = 2 * 128 * 128 * 2 * 2         # q [2, 128, 128] bf16, 2 buffers
KV = 512 * 128 * 2 * 2            # k or v [512, 128] bf16
Q_IDS = 8 * 256 * 4 * 2           # [2, 256] int32 -> 8 sublanes
KV_IDS = 8 * 512 * 4 * 2          # [2, 512] int32
ROW_STAT = 8 * 256 * 4 * 2        # lse [1, 256] / stats [2, 256] float32
COL = 256 * 128 * 4               # m or l [256, 1] float32 scratch -> 128 lanes
ACC = 256 * 128 * 4               # acc / dq_acc [256, 128] float32 scratch
SCORES = 256 * 512 * 4            # [256, 512] float32 value
PROBS = 256 * 512 * 2             # [256, 512] bf16 value
DKV = 512 * 128 * 2 * 2           # dk or dv [512, 128] bf16, 2 buffers
DKV_ACC = 512 * 128 * 4           # dk_acc or dv_acc float32 scratch
BLOCKS = dict(block_q=128, block_k=512, group=2, head_dim=128, itemsize=2)


def test_flash_forward_vmem_is_its_blocks_scratch_and_values():
    total = vmem.tpu_bytes(limits.tpu_buffers("flash_attention_forward", **BLOCKS))
    assert total == Q + 2 * KV + Q_IDS + KV_IDS + Q + ROW_STAT + 2 * COL + ACC + SCORES + PROBS


def test_flash_dq_vmem_is_its_blocks_scratch_and_scores():
    total = vmem.tpu_bytes(limits.tpu_buffers("flash_attention_dq", **BLOCKS))
    # q, k, v, do, ids, stats, dq (bf16 like q), dq_acc, the scores only
    assert total == Q + 2 * KV + Q + Q_IDS + KV_IDS + ROW_STAT + Q + ACC + SCORES


def test_flash_dkv_vmem_is_its_blocks_scratch_and_values():
    total = vmem.tpu_bytes(limits.tpu_buffers("flash_attention_dkv", **BLOCKS))
    assert total == Q + 2 * KV + Q + Q_IDS + KV_IDS + ROW_STAT + 2 * DKV + 2 * DKV_ACC + SCORES + PROBS


def test_flash_gradients_take_their_own_itemsize():
    f32 = dict(BLOCKS, grad_itemsize=4)
    dq = vmem.tpu_bytes(limits.tpu_buffers("flash_attention_dq", **f32))
    assert dq == Q + 2 * KV + Q + Q_IDS + KV_IDS + ROW_STAT + 2 * Q + ACC + SCORES  # dq doubles
    dkv = vmem.tpu_bytes(limits.tpu_buffers("flash_attention_dkv", **f32))
    assert dkv == Q + 2 * KV + Q + Q_IDS + KV_IDS + ROW_STAT + 4 * DKV + 2 * DKV_ACC + SCORES + PROBS
    with pytest.raises(ValueError, match="unknown flash kernel"):
        limits.tpu_buffers("flash_attention_bwd", **BLOCKS)


def test_flash_vmem_needs_against_the_configured_limit():
    needs = limits.vmem_needs(20.0, **BLOCKS)
    assert set(needs) == set(limits.KERNELS)
    fwd = needs["flash_attention_forward"]
    assert fwd.kernel == "flash_attention_forward"
    assert fwd.need_bytes == Q + 2 * KV + Q_IDS + KV_IDS + Q + ROW_STAT + 2 * COL + ACC + SCORES + PROBS
    assert fwd.limit_bytes == 20 * MIB
    # at 0 (auto) a need of ~2 MiB fits the 16 MiB default
    assert limits.vmem_needs(0.0, **BLOCKS)["flash_attention_dq"].limit_bytes == 16 * MIB


def test_triton_shared_memory_per_kernel():
    # block_q 32, block_k 64, head dim 128, bf16, 3 stages
    kw = dict(block_q=32, block_k=64, head_dim=128, itemsize=2)
    # forward: 3 stages x (k, v) [64, 128] + q [32, 128] + probabilities [32, 64]
    assert limits.gpu_shared_bytes("flash_attention_forward", **kw) == 3 * 2 * 64 * 128 * 2 + 32 * 128 * 2 + 32 * 64 * 2
    # dq: holds q and do
    assert limits.gpu_shared_bytes("flash_attention_dq", **kw) == 3 * 2 * 64 * 128 * 2 + 2 * 32 * 128 * 2 + 32 * 64 * 2
    # dk-dv: 3 stages x (q, do) [32, 128] + k, v [64, 128] + probabilities
    assert limits.gpu_shared_bytes("flash_attention_dkv", **kw) == 3 * 2 * 32 * 128 * 2 + 2 * 64 * 128 * 2 + 32 * 64 * 2
    assert limits.gpu_shared_bytes("flash_attention_dkv", **kw, num_stages=2) == 2 * 2 * 32 * 128 * 2 + 2 * 64 * 128 * 2 + 32 * 64 * 2
    assert limits.GPU_NUM_STAGES == 3


# ---------------------------------------------------------------------------------------------
# recipe/kernel_needs.py: the config glue


def _cfg(seq_len=400, cp_impl="allgather", block_q=0, block_k=0, vmem_limit_mib=0.0, num_heads=8, num_kv_heads=2,
         head_dim=128, dtype="bfloat16"):
    return SimpleNamespace(
        kernels=SimpleNamespace(attention=SimpleNamespace(block_q=block_q, block_k=block_k, vmem_limit_mib=vmem_limit_mib)),
        model=SimpleNamespace(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, compute_dtype=dtype),
        train=SimpleNamespace(seq_len=seq_len), attention=SimpleNamespace(cp_impl=cp_impl))


def _captured(monkeypatch, module, name):
    seen = {}
    monkeypatch.setattr(module, name, lambda limit, **kw: seen.update(limit=limit, **kw) or {})
    return seen


def test_attention_needs_fit_blocks_to_local_queries_and_gathered_keys(monkeypatch):
    seen = _captured(monkeypatch, limits, "vmem_needs")
    kernel_needs.attention_vmem_needs(_cfg(vmem_limit_mib=24.0), context_ranks=2)
    # 400 tokens over 2 ranks: 200 local queries -> block_q 40 (multiples of 8 dividing 200: 8, 40, 200);
    # all-gathered keys: 400 -> 400 (<= 512); group 8 / 2 = 4; bf16 2 bytes
    assert seen == dict(limit=24.0, block_q=40, block_k=400, group=4, head_dim=128, itemsize=2)


def test_attention_needs_under_ring_use_local_keys(monkeypatch):
    seen = _captured(monkeypatch, limits, "vmem_needs")
    kernel_needs.attention_vmem_needs(_cfg(cp_impl="ring", dtype="float32"), context_ranks=2)
    assert seen == dict(limit=0.0, block_q=40, block_k=200, group=4, head_dim=128, itemsize=4)
    kernel_needs.attention_vmem_needs(_cfg(cp_impl="allgather"), context_ranks=1)
    # one rank: 400 queries -> 80 (8, 16, 40, 80 <= 128); keys 400
    assert (seen["block_q"], seen["block_k"]) == (80, 400)
    kernel_needs.attention_vmem_needs(_cfg(block_q=16, block_k=8), context_ranks=1)
    assert (seen["block_q"], seen["block_k"]) == (16, 8)


def test_gdn_needs_read_chunk_dims_and_value_heads_per_key_head(monkeypatch):
    from hybridmoe.kernels.gdn import limits as gdn_limits

    seen = _captured(monkeypatch, gdn_limits, "vmem_needs")
    cfg = SimpleNamespace(gdn=SimpleNamespace(chunk_size=64), model=SimpleNamespace(
        gdn_key_dim=128, gdn_value_dim=256, gdn_num_value_heads=12, gdn_num_key_heads=4, compute_dtype="float16"))
    kernel_needs.gdn_vmem_needs(cfg)
    assert seen == dict(limit=0.0, chunk_size=64, key_dim=128, value_dim=256, group=3, itemsize=2)


def _gmm_cfg(token_chunks=1, per_half=0, dtype="bfloat16"):
    gmm = {"tm": 256, "tk": 512, "tn": 1024, "vmem_limit_mib": 0.0, "wi_fwd_tile_n_per_half": per_half}
    return SimpleNamespace(
        kernels=SimpleNamespace(gmm=SimpleNamespace(model_dump=lambda: dict(gmm), wi_fwd_tile_n_per_half=per_half,
                                                    vmem_limit_mib=0.0)),
        model=SimpleNamespace(d_model=2048, moe_intermediate_size=768, compute_dtype=dtype),
        moe=SimpleNamespace(wi_fused_swiglu=True, wo_fused_dswiglu=False, router_grad_from_wo_input=True,
                            token_chunks=token_chunks))


def test_gmm_layer_reads_the_moe_shape_and_levers():
    layer = kernel_needs.gmm_layer(_gmm_cfg())
    tiles = layer.pop("tiles")
    assert layer == dict(d_model=2048, hidden=768, wi_fused=True, wo_fused=False, tile_n_per_half=None,
                         row_scale=True, itemsize=2, accumulate_weight_grads=False)
    assert (tiles.wo_drhs.tm, tiles.wo_drhs.tk, tiles.wo_drhs.tn) == (256, 512, 1024)
    layer = kernel_needs.gmm_layer(_gmm_cfg(token_chunks=2, per_half=256, dtype="float32"))
    assert (layer["accumulate_weight_grads"], layer["tile_n_per_half"], layer["itemsize"]) == (True, 256, 4)


def test_vmem_limit_key_refused_only_above_the_largest_core():
    assert kernel_needs.limit_problems("kernels.gmm.vmem_limit_mib", 128.0) == []
    [(key, text)] = kernel_needs.limit_problems("kernels.gmm.vmem_limit_mib", 128.5)
    assert key == "kernels.gmm.vmem_limit_mib"
    assert text.startswith("128.5 MiB is more than any TPU core's VMEM (MiB per core: v5e 128, v5p 64, v6e 128, tpu7x 64)")


def test_over_problems_name_only_the_kernels_over_their_limit():
    needs = {"a": Need("a", 16 * MIB, 16 * MIB), "b": Need("b", 17 * MIB, 16 * MIB), "c": Need("c", 40 * MIB, 32 * MIB)}
    assert kernel_needs.over_problems("k", {"a": needs["a"]}, "fix it") == []
    assert kernel_needs.over_problems("k", needs, "lower the tiles") == [
        ("k", "b needs 17.00 MiB of its 16.00 MiB limit; c needs 40.00 MiB of its 32.00 MiB limit "
              "(Mosaic TPU VMEM): lower the tiles")]


def test_gpu_attention_problems_name_each_kernel_over_227_kib():
    cfg = _cfg(seq_len=256, block_q=64, block_k=64, head_dim=256)
    [(key, text)] = kernel_needs.gpu_attention_problems(cfg, context_ranks=1)
    assert key == "kernels.attention.block_k"
    # forward: 3 x 2 x 64 x 256 x 2 + 64 x 256 x 2 + 64 x 64 x 2 = 237,568 B = 232 KiB;
    # dq and dk-dv: 196,608 + 65,536 + 8,192 = 270,336 B = 264 KiB
    assert text == ("flash_attention_forward needs 232 KiB of shared memory; flash_attention_dq needs 264 KiB of "
                    "shared memory; flash_attention_dkv needs 264 KiB of shared memory at block_q=64 block_k=64, "
                    "over the GPU's 227 KiB per block (Triton, 3 stages): lower the blocks")
    # 32 x 32 at head dim 128: the largest, dk-dv, 3 x 2 x 32 x 128 x 2 + 2 x 32 x 128 x 2 + 2048 = 67,584 B
    assert kernel_needs.gpu_attention_problems(_cfg(seq_len=256, block_q=32, block_k=32), 1) == []


def test_gpu_attention_blocks_fit_the_local_rows():
    # head dim 256, blocks unset (Triton's default 64 x 64): 512 tokens on one rank -> 64 x 64, over
    [(_, text)] = kernel_needs.gpu_attention_problems(_cfg(seq_len=512, head_dim=256), context_ranks=1)
    assert "at block_q=64 block_k=64" in text
    # over 16 ranks: 32 local rows -> 32 x 32; dk-dv 3 x 2 x 32 x 256 x 2 + 2 x 32 x 256 x 2 + 32 x 32 x 2
    # = 133,120 B fits
    assert kernel_needs.gpu_attention_problems(_cfg(seq_len=512, head_dim=256), context_ranks=16) == []


def test_per_generation_tables():
    assert vmem.TPU_DEFAULT_LIMIT_MIB_BY_GENERATION == {"v5e": 16.0, "v5p": 16.0, "v6e": 32.0, "tpu7x": 32.0}
    assert vmem.TPU_VMEM_MIB_BY_GENERATION == {"v5e": 128.0, "v5p": 64.0, "v6e": 128.0, "tpu7x": 64.0}
    assert (vmem.AUTO_MARGIN, vmem.AUTO_MARGIN_MIB, vmem.AUTO_FLOOR_MIB) == (1.25, 4.0, 32.0)
    assert limits.DEFAULT_BLOCKS == {"xla": (256, 256), "pallas_tpu": (128, 512), "pallas_gpu": (64, 64)}
    assert limits.JAX_GPU_ATTENTION_DEFAULTS == {"block_q": 128, "block_k": 128, "block_q_bwd": 32, "block_k_bwd": 32,
                                                 "num_stages": 2}


def test_gmm_vmem_needs_compile_under_the_gmm_limit_key():
    cfg = _gmm_cfg()
    cfg.kernels.gmm.vmem_limit_mib = 30.0
    needs = kernel_needs.gmm_vmem_needs(cfg)
    assert set(needs) == {"wi_fwd", "wi_dlhs", "wi_drhs", "wo_fwd", "wo_dlhs", "wo_drhs"}
    assert {n.limit_bytes for n in needs.values()} == {30 * MIB}
    assert needs["wi_fwd"].kernel == "wi_fwd (wi_fused_swiglu_fwd)" and needs["wo_dlhs"].kernel == "wo_dlhs (gmm_t)"
