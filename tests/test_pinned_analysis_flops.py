"""The designed FLOP count of a step at the shapes no other test uses (CPU row tiles, a policy that
does not replay the forward), the chunked GDN core's multiply-adds, the model shapes the peak's
itemisation reads, and the rollout bound's record fields, each worked out by hand. Nothing compiles.

tiny with one layer of each mixer (tests/test_figures.py's table): forward FLOPs a token at T = 64,
attention 41088, GDN 39936 (45056 with gdn.chunk_size 8's chunked core), MoE 38016 a layer (routed
experts k (D 2F + F D) = 2 x 6144 MACs of it), LM head 32768; the flash backward's recomputation
12480; 16 rows of 64 tokens (2 micro-batches of 8 rows) over 8 devices."""

from __future__ import annotations

import types

import pytest

from helpers import TWO_LAYERS, tiny_config
from hybridmoe.analysis import flops
from hybridmoe.analysis import peak_memory as pm
from hybridmoe.analysis.decode_bytes import decode_step_bytes, rollout_bound
from hybridmoe.config.schema import ModelConfig

TRAIN = ("train.batch_size=16", "train.seq_len=64", "train.micro_batches=2", "gdn.chunk_size=8")
ROW_TILES = ("kernels.gmm.xla_impl=row_tiles", "kernels.gmm.xla_tile_rows=64")


def test_the_chunked_gdn_core_by_hand():
    # C 8, K = V = 16: 3 C K + 2 C V + 3 K V = 384 + 256 + 768.
    assert flops.gdn_chunk_core_macs_per_token(ModelConfig(), 8) == 1408
    wide = ModelConfig(gdn_value_dim=32)
    assert flops.gdn_chunk_core_macs_per_token(wide, 4) == 3 * 4 * 16 + 2 * 4 * 32 + 3 * 16 * 32


def test_the_designed_count_on_cpu_row_tiles_by_hand():
    """A shard's 8 x 64 / 8 = 64 tokens route 128 rows: cdiv(128, 64) + 8 experts = 10 tiles of 64 rows,
    10 rows a token where k is 2. The MoE forward gains 2 x (10 - 2) x 3 D F = 98304 FLOPs a token: 136320.
    Full remat: 4 x (41088 + 45056 + 2 x 136320) = 1435136, + 4 x 32768 + 12480 = 1578688; the
    weight gradients' one-hot sums over tiles, 2 layers x 2 x E 8 x 10 tiles x 3 D F / 64 tokens =
    30720: 1609408 a token x 1024 tokens / 8 devices."""
    cfg = tiny_config(*TWO_LAYERS, *TRAIN, *ROW_TILES, "remat.policy=full")
    assert flops.routed_rows_per_token(cfg, 64) == 10.0
    assert flops.designed_flops_per_device(cfg, 8, "cpu") == 1609408 * 1024 / 8
    # On a TPU the routed experts run k rows a token: the TPU count, 792256 a token.
    assert flops.designed_flops_per_device(cfg, 8, "tpu") == 792256 * 1024 / 8


def test_a_policy_without_replay_runs_the_forward_three_times():
    """remat none: 3 x (41088 + 45056 + 2 x 38016) = 486528, + 4 x 32768 (the LM head's logits still
    recomputed) + 12480 = 630080 a token."""
    cfg = tiny_config(*TWO_LAYERS, *TRAIN, "remat.policy=none")
    assert flops.designed_flops_per_device(cfg, 8, "tpu") == 630080 * 1024 / 8
    assert flops.designed_flops_per_device(tiny_config(*TWO_LAYERS, *TRAIN, "remat.policy=minimal"), 8,
                                           "tpu") == 630080 * 1024 / 8


def test_model_shapes_hold_each_leafs_global_shard_and_block_shapes():
    class Half:
        def shard_shape(self, shape):
            return (shape[0], shape[1] // 2, *shape[2:])

    wi = types.SimpleNamespace(shape=(5, 8, 16, 1, 32), sharding=Half())
    norm = types.SimpleNamespace(shape=(64,), sharding=None)
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(d_model=16, moe_intermediate_size=32, num_experts=8,
                                                            num_blocks=5))
    shapes = pm.model_shapes(cfg, {"params": {"wi": wi, "norm": norm}})
    assert (shapes.d_model, shapes.moe_intermediate, shapes.num_experts, shapes.num_blocks) == (16, 32, 8, 5)
    # wi: global (5, 8, 16, 32), its shard (5, 4, 16, 32), one block of each (8, 16, 32), (4, 16, 32), dims
    # of 1 dropped; the norm (64,) alone (no block of a rank-1 leaf).
    assert shapes.param_shapes == {(5, 8, 16, 32), (5, 4, 16, 32), (8, 16, 32), (4, 16, 32), (64,)}


def test_the_rollout_bound_records_what_it_assumed():
    """3 rows, a prompt of 8 slots and 4 decode steps read 10.5 slots on average; at 2e9 B/s."""
    m = ModelConfig()
    bound = rollout_bound(m, 3, 8, 4, hbm_bytes_per_s=2e9)
    total = decode_step_bytes(m, 3, 10.5)["total"]
    assert bound["rows_in_flight"] == 3 and bound["mean_kv_slots"] == 10.5 and bound["hbm_bytes_per_s"] == 2e9
    assert bound["bytes_per_decode_step"]["total"] == total
    assert bound["tokens_per_s"] == pytest.approx(3 * 2e9 / total, rel=1e-12)
    # One row of top-2 routing touches 2 of the 8 experts.
    assert decode_step_bytes(m, 1, 0)["expert_weights"] == 2 / 8 * decode_step_bytes(m, 8, 0)["expert_weights"]
