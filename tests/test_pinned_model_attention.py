"""Flash attention's glue pinned to hand-worked numbers: kernels/attention/ops.py's shape checks and
options, pallas_tpu.py's block checks, visited block count, CostEstimate, VMEM ask and grids,
pallas_gpu.py's checks and grids, model/attention.py's context-parallel glue and one VMEM tile
(kernels/vmem.py). Pure arithmetic, zero arrays, or traced only with the kernels stubbed; nothing
compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.kernels.attention import ops, pallas_gpu, pallas_tpu


def _qkv(B=1, T=8, S=8, N=4, G=2, A=4, Bk=None, Ak=None):
    return (jnp.zeros((B, T, N, A)), jnp.zeros((Bk or B, S, G, Ak or A)), jnp.zeros((Bk or B, S, G, Ak or A)))


OK = dict(q_pos=None, kv_pos=None, q_seg=None, kv_seg=None, backend="xla", block_q=4, block_k=8)

# ---------------------------------------------------------------------------------------------
# ops._check


def test_flash_refuses_keys_of_another_batch_or_rank():
    q, k, v = _qkv(B=2, Bk=1)
    with pytest.raises(ValueError, match="q must be"):
        ops._check(q, k, v, **OK)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must be"):
        ops._check(q[..., None], k, v, **OK)  # q of rank 5 (its batch and head dim still match k's)
    with pytest.raises(ValueError, match="q must be"):
        ops._check(q, k[0], v[0], **OK)   # k, v of rank 3


def test_flash_checks_every_id_array_against_its_own_length():
    q, k, v = _qkv(T=4, S=12)
    ok = {**OK, "block_q": 4, "block_k": 6}
    good_q, good_k = jnp.zeros((1, 4)), jnp.zeros((1, 12))
    ops._check(q, k, v, **{**ok, "q_pos": good_q, "kv_pos": good_k, "q_seg": good_q, "kv_seg": good_k})
    # each id array named, with the length it must have: queries 4, keys 12
    for name, bad, want in (("q_pos", good_k, 4), ("q_seg", good_k, 4), ("kv_pos", good_q, 12), ("kv_seg", good_q, 12)):
        with pytest.raises(ValueError, match=rf"{name} must be \[B, {want}\] = \(1, {want}\)"):
            ops._check(q, k, v, **{**ok, name: bad})
    # the batch dim counts too
    with pytest.raises(ValueError, match=r"q_seg must be \[B, 4\]"):
        ops._check(q, k, v, **{**ok, "q_seg": jnp.zeros((2, 4))})


def test_flash_refuses_a_block_of_zero_tokens_as_its_own_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="block_q=0 must divide the query length 8"):
        ops._check(q, k, v, **{**OK, "block_q": 0})
    with pytest.raises(ValueError, match="block_k=0 must divide the key length 8"):
        ops._check(q, k, v, **{**OK, "block_k": 0})
    with pytest.raises(ValueError, match="block_k=-8 must divide"):
        ops._check(q, k, v, **{**OK, "block_k": -8})
    # the whole length is a block
    ops._check(q, k, v, **{**OK, "block_q": 8, "block_k": 8})
    ops._check(q, k, v, **{**OK, "block_q": 1, "block_k": 1})


def test_flash_accepts_query_heads_a_multiple_of_kv_heads():
    q, k, v = _qkv(N=6, G=3)
    ops._check(q, k, v, **OK)
    q, k, v = _qkv(N=3, G=6)
    with pytest.raises(ValueError, match="query heads 3 must be a multiple of kv heads 6"):
        ops._check(q, k, v, **OK)


# ---------------------------------------------------------------------------------------------
# pallas_tpu: block checks


def test_mosaic_block_check_on_hardware_takes_multiples_of_8_or_the_whole_length():
    pallas_tpu._check_blocks(16, 24, 32, 48, interpret=False)   # 16 | 32, 24 | 48, both multiples of 8
    pallas_tpu._check_blocks(12, 20, 12, 20, interpret=False)   # whole lengths
    with pytest.raises(ValueError, match=r"flash attention pallas_tpu: block_q=12 must be a multiple of 8 .*"
                                         r"the queries: 24"):
        pallas_tpu._check_blocks(12, 8, 24, 16, interpret=False)
    with pytest.raises(ValueError, match=r"pallas_tpu: block_k=4 must be a multiple of 8 .*the keys: 16"):
        pallas_tpu._check_blocks(8, 4, 16, 16, interpret=False)
    with pytest.raises(ValueError, match="pallas_tpu: block_k=16 does not divide the 24 keys"):
        pallas_tpu._check_blocks(8, 16, 16, 24, interpret=True)
    with pytest.raises(ValueError, match="pallas_tpu: block_q=16 does not divide the 24 queries"):
        pallas_tpu._check_blocks(16, 8, 24, 16, interpret=True)
    # interpreted: any divisor
    pallas_tpu._check_blocks(12, 4, 24, 16, interpret=True)


def test_triton_check_joins_every_problem_and_checks_the_head_dim_on_hardware():
    pallas_gpu._check(16, 32, 64, 64, 64, interpret=False)
    with pytest.raises(ValueError) as e:
        pallas_gpu._check(8, 24, 64, 48, 96, interpret=False)
    assert str(e.value) == ("flash attention pallas_gpu: block_q=8 must be a power of two >= 16 (Triton); the queries: 64; "
                            "block_k=24 must be a power of two >= 16 (Triton); the keys: 48; "
                            "model.head_dim=96 must be a power of two >= 16 for the Triton kernels")
    with pytest.raises(ValueError, match=r"^flash attention pallas_gpu: model.head_dim=96 must be"):
        pallas_gpu._check(16, 16, 64, 64, 96, interpret=False)
    with pytest.raises(ValueError, match=r"^flash attention pallas_gpu: block_k=16 does not divide the 40 keys$"):
        pallas_gpu._check(16, 16, 64, 40, 64, interpret=True)
    pallas_gpu._check(8, 24, 64, 48, 96, interpret=True)  # interpreted: any divisor, any head dim


# ---------------------------------------------------------------------------------------------
# pallas_tpu.visited_blocks and cost


def test_visited_blocks_cap_at_the_key_blocks_and_fall_back_to_all_on_an_unknown_layout():
    # 128 queries at keys 128..255 of 256, blocks 64 x 64: query block 0 ends at 191 -> ceil(192 / 64) = 3
    # key blocks, block 1 at 255 -> 4
    assert pallas_tpu.visited_blocks(128, 256, 64, 64, query_runs=((128, 128),)) == 3 + 4
    # a run past the keys: ceil(264 / 64) = 5 and ceil(328 / 64) = 6, each capped at the 4 key blocks
    assert pallas_tpu.visited_blocks(128, 256, 64, 64, query_runs=((200, 128),)) == 4 + 4
    # runs that do not add up to the queries, or a run not in whole query blocks: every block (2 x 4)
    assert pallas_tpu.visited_blocks(128, 256, 64, 64, query_runs=((0, 64),)) == 8
    assert pallas_tpu.visited_blocks(128, 256, 64, 64, query_runs=((0, 96), (160, 32))) == 8
    # square, no runs: causal over one document: 1 + 2 + 3 + 4 + 5 key blocks of 32 for 5 query blocks
    assert pallas_tpu.visited_blocks(160, 160, 32, 32) == 15
    # query blocks of 64 against key blocks of 32 (160 tokens is not 64s: every block) vs 128 in 64 x 32:
    # query block 0 sees ceil(64 / 32) = 2, block 1 ceil(128 / 32) = 4
    assert pallas_tpu.visited_blocks(128, 128, 64, 32) == 6


# B 2, G 3, R 5, T = S = 256, A 16, blocks 64 x 128, 2-byte inputs. Query block i (of 4) ends at
# 64 (i + 1) - 1 and sees ceil(64 (i + 1) / 128) key blocks: 1, 1, 2, 2 = 6 per (b, g); 36 in all.
B, G, R, T, A, BQ, BK, ITEM = 2, 3, 5, 256, 16, 64, 128, 2
VISITS = B * G * 6
PAIR_FLOPS = 2 * R * BQ * BK * A             # one matmul of one visited block pair
Q_ROWS = B * G * R * T * A * ITEM            # every query row once: 491,520 bytes
KV_ROWS = B * G * T * A * ITEM               # every key row once


def _cost(kernel, **kw):
    return pallas_tpu.cost(kernel, B, G, R, T, T, A, BQ, BK, ITEM, **kw)


def test_forward_cost_is_two_matmuls_per_visited_block_and_one_exp_per_score():
    c = _cost("flash_attention_forward")
    assert c.flops == 2 * PAIR_FLOPS * VISITS                      # q k^T and p v: 70,778,880
    assert c.transcendentals == R * BQ * BK * VISITS              # 1,474,560
    # q in and o out once, (k, v) blocks per visit, lse float32 per row
    assert c.bytes_accessed == 2 * Q_ROWS + VISITS * 2 * BK * A * ITEM + B * G * R * T * 4


def test_backward_costs_are_three_and_four_matmuls_per_visited_block():
    dq = _cost("flash_attention_dq")
    assert dq.flops == 3 * PAIR_FLOPS * VISITS
    assert dq.transcendentals == R * BQ * BK * VISITS
    # q, do in, dq out once, (k, v) per visit, lse and delta float32 per row
    assert dq.bytes_accessed == 3 * Q_ROWS + VISITS * 2 * BK * A * ITEM + B * G * R * T * 8
    dkv = _cost("flash_attention_dkv")
    assert dkv.flops == 4 * PAIR_FLOPS * VISITS
    assert dkv.transcendentals == R * BQ * BK * VISITS
    # k, v in, dk, dv out once; per visit the R heads' q and do blocks and their two float32 stats
    assert dkv.bytes_accessed == 4 * KV_ROWS + VISITS * (2 * R * BQ * A * ITEM + R * BQ * 8)


def test_cost_counts_the_query_runs_blocks_under_context_parallelism():
    # 128 queries at keys 0..127 of 256, blocks 64 x 128: ceil(64 / 128) = 1 and ceil(128 / 128) = 1
    # key block each (without the runs: every block, 2 x 2)
    c = pallas_tpu.cost("flash_attention_forward", 1, 1, 1, 128, 256, 8, 64, 128, 4, query_runs=((0, 128),))
    assert c.flops == 2 * (2 * 1 * 64 * 128 * 8) * 2
    assert c.transcendentals == 64 * 128 * 2
    assert c.bytes_accessed == 2 * 128 * 8 * 4 + 2 * 2 * 128 * 8 * 4 + 128 * 4
    assert pallas_tpu.cost("flash_attention_forward", 1, 1, 1, 128, 256, 8, 64, 128, 4).flops == 2 * (2 * 64 * 128 * 8) * 4


def test_dkv_cost_reads_every_key_row_once_of_the_keys_not_the_queries():
    # B 1, G 2, R 3, 64 queries against 256 keys (no layout: every block, 1 x 2), A 8, float32
    c = pallas_tpu.cost("flash_attention_dkv", 1, 2, 3, 64, 256, 8, 64, 128, 4)
    visits = 2 * 2
    assert c.bytes_accessed == 4 * (2 * 256 * 8 * 4) + visits * (2 * 3 * 64 * 8 * 4 + 3 * 64 * 8)
    assert c.flops == 4 * (2 * 3 * 64 * 128 * 8) * visits
    with pytest.raises(KeyError):
        pallas_tpu.cost("flash_attention_bwd", 1, 1, 1, 128, 256, 8, 64, 128, 4)


# ---------------------------------------------------------------------------------------------
# model/attention.py: the layer's glue under context parallelism (mixers and mesh stubbed)


def _cp_layer(monkeypatch, cp_impl, backend, ranks=4, T=64, head_dim=8, interpret=False):
    from hybridmoe.config.schema import AttentionConfig, KernelsConfig, ModelConfig
    from hybridmoe.model import attention as layer

    seen = {}
    monkeypatch.setattr(layer.context, "context_axes", lambda: ("context",))
    monkeypatch.setattr(layer.context, "context_size", lambda axes: ranks)
    q, k = jnp.zeros((1, T, 4, head_dim)), jnp.zeros((1, T, 2, head_dim))
    monkeypatch.setattr(layer, "project_qkv", lambda p, x, pos, m: (q, None, k, k))
    monkeypatch.setattr(layer, "gated_output", lambda p, o, gate: o)
    monkeypatch.setattr(layer, "ring_attention", lambda *a, **kw: seen.update(kw, impl="ring") or q)
    monkeypatch.setattr(layer, "context_parallel_attention", lambda *a, **kw: seen.update(kw, impl="allgather") or q)
    m = ModelConfig(head_dim=head_dim, num_heads=4, num_kv_heads=2)
    a = AttentionConfig.model_validate({"cp_impl": cp_impl, "cp_load_balance": False})
    kc = KernelsConfig.model_validate({"attention": {"backend": backend, "vmem_limit_mib": 20.0}, "interpret": interpret})
    layer.attention_layer({}, jnp.zeros((1, T, 16)), None, None, m, a, kernels=kc)
    return seen


def test_ring_steps_fit_blocks_to_one_ranks_share_of_the_tokens(monkeypatch):
    # 64 tokens over 4 ranks: 16 a rank; Mosaic's 128 x 512 defaults fit to 16 x 16
    seen = _cp_layer(monkeypatch, "ring", "pallas_tpu")
    assert seen["impl"] == "ring" and (seen["block_q"], seen["block_k"]) == (16, 16)
    assert seen["scale"] == 8 ** -0.5 and seen["backend"] == "pallas_tpu" and seen["vmem_limit_mib"] == 20.0
    assert seen["interpret"] is False and seen["axes"] == ("context",)
    # 800 tokens over 4 ranks: 200 a rank. On hardware (Mosaic: multiples of 8 or the whole length)
    # block_q is 40 (8, 40, 200 divide 200); interpreted, any divisor: 100; block_k the whole 200 (<= 512)
    seen = _cp_layer(monkeypatch, "ring", "pallas_tpu", T=800)
    assert (seen["block_q"], seen["block_k"]) == (40, 200)
    seen = _cp_layer(monkeypatch, "ring", "pallas_tpu", T=800, interpret=True)
    assert (seen["block_q"], seen["block_k"], seen["interpret"]) == (100, 200, True)
    # 80 tokens over 2 ranks on hardware: 40 a rank, multiples of 8 dividing 40: 8, 40 -> 40
    seen = _cp_layer(monkeypatch, "ring", "pallas_tpu", T=80, ranks=2, head_dim=32)
    assert (seen["block_q"], seen["block_k"], seen["scale"]) == (40, 40, 32 ** -0.5)


def test_allgather_context_parallelism_runs_the_configured_core(monkeypatch):
    seen = _cp_layer(monkeypatch, "all_gather", "xla", head_dim=16)
    assert seen["impl"] == "allgather" and seen["scale"] == 0.25 and seen["axes"] == ("context",)
    assert seen["check_vma"] is True
    assert _cp_layer(monkeypatch, "all_gather", "pallas_tpu")["check_vma"] is False


def test_mosaic_kernels_ask_the_vmem_of_their_blocks_group_head_dim_and_dtypes():
    # q [B 1, G 1, R 2, T 256, A 128] bf16, blocks 128 x 512: rows 256; each term one buffer's tiled
    # bytes x its count (blocks 2, scratch and values 1), as in the limits module's model
    q = jax.ShapeDtypeStruct((1, 1, 2, 256, 128), jnp.bfloat16)
    Q, KV = 2 * 128 * 128 * 2 * 2, 512 * 128 * 2 * 2              # q [2, 128, 128], k or v [512, 128]
    IDS = 8 * 256 * 4 * 2 + 8 * 512 * 4 * 2                        # q_ids [2, 256], kv_ids [2, 512] int32
    STAT, ACC, SCORES = 8 * 256 * 4 * 2, 256 * 128 * 4, 256 * 512 * 4
    assert pallas_tpu._vmem_need("flash_attention_forward", q, 128, 512) == (
        Q + 2 * KV + IDS + Q + STAT + 2 * ACC + ACC + SCORES + 256 * 512 * 2)  # o, lse, m and l, acc, probabilities
    # dq in the inputs' dtype unless a gradient dtype is given: float32 doubles its two buffers
    dq = Q + 2 * KV + Q + IDS + STAT + ACC + SCORES
    assert pallas_tpu._vmem_need("flash_attention_dq", q, 128, 512) == dq + Q
    assert pallas_tpu._vmem_need("flash_attention_dq", q, 128, 512, grad_dtype=jnp.float32) == dq + 2 * Q


def _record_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(pallas_tpu, "cost", lambda *a: ("cost", *a))
    monkeypatch.setattr(pallas_tpu, "_vmem_need", lambda name, q, bq, bk, grad_dtype=None: ("need", name, bq, bk, grad_dtype))

    def call(kernel, name, grid, in_specs, out_specs, out_shape, scratch, interpret, estimate=None, limit=0.0, need=None):
        calls.append(dict(name=name, grid=grid, interpret=interpret, cost=estimate, limit=limit, need=need))
        zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        return lambda *args: [zeros(s) for s in out_shape] if isinstance(out_shape, list) else zeros(out_shape)

    monkeypatch.setattr(pallas_tpu, "_call", call)
    return calls


def test_mosaic_forward_and_backward_hand_each_kernel_its_grid_cost_and_vmem(monkeypatch):
    calls = _record_calls(monkeypatch)
    # B 1, G 2, R 3, T 16 queries, S 32 keys, A 8, bf16; blocks 8 x 16: 2 query blocks, 2 key blocks
    q = jnp.zeros((1, 2, 3, 16, 8), jnp.bfloat16)
    k = jnp.zeros((1, 2, 32, 8), jnp.bfloat16)
    ids_q, ids_k = jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 32), jnp.int32)
    runs = ((16, 16),)
    kw = dict(scale=0.5, block_q=8, block_k=16, interpret=True, vmem_limit_mib=12.0, query_runs=runs)
    # traced only (eval_shape): the glue runs, nothing executes
    o, lse = jax.eval_shape(lambda: pallas_tpu.forward(q, k, k, ids_q, ids_q, ids_k, ids_k, **kw))
    assert o.shape == q.shape and lse.shape == (1, 2, 3, 16)
    stats = jnp.zeros((1, 2, 3, 16), jnp.float32)
    dq, dk, dv = jax.eval_shape(lambda: pallas_tpu.backward(q, k, k, q, stats, stats, ids_q, ids_q, ids_k, ids_k,
                                                            grad_dtypes=(jnp.bfloat16, jnp.float32, jnp.float16), **kw))
    assert (dq.dtype, dk.dtype, dv.dtype) == (jnp.bfloat16, jnp.float32, jnp.float16)
    assert dk.shape == dv.shape == k.shape
    shape = (1, 2, 3, 16, 32, 8, 8, 16, 2, runs)  # B, G, R, T, S, A, block_q, block_k, itemsize, runs
    fwd, dq_call, dkv = calls
    assert fwd == dict(name="flash_attention_forward", grid=(1, 2, 2, 2), interpret=True,
                       cost=("cost", "flash_attention_forward", *shape), limit=12.0,
                       need=("need", "flash_attention_forward", 8, 16, None))
    assert dq_call == dict(name="flash_attention_dq", grid=(1, 2, 2, 2), interpret=True,
                           cost=("cost", "flash_attention_dq", *shape), limit=12.0,
                           need=("need", "flash_attention_dq", 8, 16, jnp.bfloat16))
    # dk-dv: outer key blocks (32 / 16 = 2), inner query blocks (16 / 8 = 2); dk's dtype for the need
    assert dkv == dict(name="flash_attention_dkv", grid=(1, 2, 2, 2), interpret=True,
                       cost=("cost", "flash_attention_dkv", *shape), limit=12.0,
                       need=("need", "flash_attention_dkv", 8, 16, jnp.float32))


def test_mosaic_grids_run_outer_blocks_then_inner_ones(monkeypatch):
    calls = _record_calls(monkeypatch)
    # 24 queries in blocks of 8 (3), 32 keys in blocks of 16 (2): forward and dq (B, G, 3, 2), dk-dv (B, G, 2, 3)
    q, k = jnp.zeros((2, 1, 1, 24, 8)), jnp.zeros((2, 1, 32, 8))
    ids_q, ids_k = jnp.zeros((2, 24), jnp.int32), jnp.zeros((2, 32), jnp.int32)
    stats = jnp.zeros((2, 1, 1, 24))
    jax.eval_shape(lambda: (
        pallas_tpu.forward(q, k, k, ids_q, ids_q, ids_k, ids_k, scale=1.0, block_q=8, block_k=16, interpret=True),
        pallas_tpu.backward(q, k, k, q, stats, stats, ids_q, ids_q, ids_k, ids_k, scale=1.0, block_q=8, block_k=16,
                            interpret=True)))
    assert [c["grid"] for c in calls] == [(2, 1, 3, 2), (2, 1, 3, 2), (2, 1, 2, 3)]
    assert [c["limit"] for c in calls] == [0.0, 0.0, 0.0]


def test_triton_drivers_run_a_program_per_query_head_and_block_and_per_kv_head_and_key_block(monkeypatch):
    calls = []

    def call(kernel, name, grid, in_specs, out_specs, out_shape, interpret):
        calls.append((name, grid, interpret))
        zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        return lambda *args: [zeros(s) for s in out_shape] if isinstance(out_shape, list) else zeros(out_shape)

    monkeypatch.setattr(pallas_gpu, "_call", call)
    # B 2, G 3, R 2 (6 query heads), 32 queries in blocks of 16 (2), 64 keys in blocks of 16 (4), A 16
    q, k = jnp.zeros((2, 3, 2, 32, 16)), jnp.zeros((2, 3, 64, 16))
    ids_q, ids_k = jnp.zeros((2, 32), jnp.int32), jnp.zeros((2, 64), jnp.int32)
    stats = jnp.zeros((2, 3, 2, 32))
    o, lse = jax.eval_shape(lambda: pallas_gpu.forward(q, k, k, ids_q, ids_q, ids_k, ids_k, scale=1.0, block_q=16,
                                                       block_k=16, interpret=True))
    dq, dk, dv = jax.eval_shape(lambda: pallas_gpu.backward(
        q, k, k, q, stats, stats, ids_q, ids_q, ids_k, ids_k, scale=1.0, block_q=16, block_k=16,
        grad_dtypes=(jnp.bfloat16, jnp.float32, jnp.float16), interpret=True))
    assert calls == [("flash_attention_forward_gpu", (2, 6, 2), True), ("flash_attention_dq_gpu", (2, 6, 2), True),
                     ("flash_attention_dkv_gpu", (2, 3, 4), True)]
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 3, 2, 32), jnp.float32)
    assert (dq.dtype, dk.dtype, dv.dtype) == (jnp.bfloat16, jnp.float32, jnp.float16)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_flash_backward_gives_each_input_its_dtype_only_when_asked():
    q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    k = jnp.zeros((1, 8, 1, 4), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 8), jnp.float32)
    ids = jnp.zeros((1, 8), jnp.int32)
    kw = dict(q_pos=ids, kv_pos=ids, scale=0.5, block_q=4, block_k=4)
    out = jax.eval_shape(lambda: ops.attention_bwd(q, k, k, q, lse, q, **kw))
    assert [a.dtype for a in out] == [jnp.float32] * 3                      # default: float32 for summing
    out = jax.eval_shape(lambda: ops.attention_bwd(q, k, k, q, lse, q, grad_dtype=None, **kw))
    assert [a.dtype for a in out] == [jnp.bfloat16] * 3
    assert [a.shape for a in out] == [(1, 8, 2, 4), (1, 8, 1, 4), (1, 8, 1, 4)]
    o, lse = jax.eval_shape(lambda: ops.attention_fwd(q, k, k, **kw))
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((1, 8, 2, 4), jnp.bfloat16, (1, 2, 8), jnp.float32)


def test_flash_attention_hands_its_options_to_both_passes_and_its_gradients_their_inputs_dtypes(monkeypatch):
    seen = {}

    def fwd(q, k, v, **kw):
        seen["fwd"] = kw
        return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def bwd(q, k, v, o, lse, do, **kw):
        seen["bwd"] = kw
        return q, k, v

    monkeypatch.setattr(ops, "attention_fwd", fwd)
    monkeypatch.setattr(ops, "attention_bwd", bwd)
    q, k, v = _qkv()
    pos = jnp.zeros((1, 8), jnp.int32)
    kw = dict(q_pos_BT=pos, kv_pos_BS=pos, scale=0.5, backend="pallas_tpu", block_q=4, block_k=8, interpret=True,
              vmem_limit_mib=12.0, query_runs=[(0, 8)])
    jax.vjp(lambda q, k, v: ops.flash_attention(q, k, v, **kw), q, k, v)[1](q)
    options = dict(scale=0.5, backend="pallas_tpu", block_q=4, block_k=8, interpret=True, vmem_limit_mib=12.0,
                   query_runs=((0, 8),))
    assert {n: seen["fwd"][n] for n in options} == options
    assert {n: seen["bwd"][n] for n in options} == options
    assert seen["bwd"]["grad_dtype"] is None            # each gradient in its input's dtype
    assert seen["fwd"]["q_seg"].shape == (1, 8)         # no segment ids: all zeros (one segment)


def test_an_8_byte_dtype_tiles_in_8_sublanes_like_32_bit():
    from hybridmoe.kernels import vmem

    # (3, 5) of 8-byte items -> (8, 128) x 8 bytes: never fewer than 8 sublanes
    assert vmem.tpu_tile_bytes((3, 5), 8) == 8 * 128 * 8
    assert vmem.tpu_tile_bytes((9,), 8) == 8 * 128 * 8
