"""analysis/decode_bytes.py against a count worked out by hand on the schema's default (tiny) model:
vocab 256, D 64, layers gdn gdn gdn attention, 4 query / 2 kv heads of 16, GDN 2 key / 4 value heads
of 16, conv width 4, 8 experts top-2 of F 32, a shared expert of 32, float32 weights and cache."""

from __future__ import annotations

import pytest

from hybridmoe.analysis.decode_bytes import decode_step_bytes, mean_kv_slots, rollout_bound
from hybridmoe.config.schema import ModelConfig

F32 = 4
# One expert's wi [64, 64] + wo [32, 64] in each of the 4 layers.
PER_EXPERT = 4 * (64 * 2 * 32 + 32 * 64) * F32
# Per layer beside the mixer: two norms (64 each), the router [64, 8], the shared expert's wi
# [64, 64], wo [32, 64] and gate [64].
LAYER_REST = 64 + 64 + 64 * 8 + 64 * 64 + 32 * 64 + 64
# GDN mixer: wq, wk [64, 2, 16]; wv, wz [64, 4, 16]; wb, wa [64, 4]; conv_q, conv_k [4, 2, 16];
# conv_v [4, 4, 16]; A_log, dt_bias [4]; norm [16]; wo [4, 16, 64].
GDN_MIXER = 2 * 2048 + 2 * 4096 + 2 * 256 + 2 * 128 + 256 + 4 + 4 + 16 + 4096
# Attention mixer: wq [64, 4, 32], wk, wv [64, 2, 16], q_norm, k_norm [16], wo [4, 16, 64].
ATTENTION_MIXER = 8192 + 2 * 2048 + 2 * 16 + 4096
# Every layer, the final norm [64] and the LM head [64, 256].
DENSE_FIXED = 3 * (GDN_MIXER + LAYER_REST) + ATTENTION_MIXER + LAYER_REST + 64 + 64 * 256


def test_hand_count_of_three_rows():
    m = ModelConfig()
    rows, kv_slots = 3, 10
    got = decode_step_bytes(m, rows, kv_slots)
    assert GDN_MIXER == 17432 and ATTENTION_MIXER == 16416 and LAYER_REST == 6848
    expected = {
        "expert_weights": min(8, rows * 2) * PER_EXPERT,  # 6 of the 8 experts at most
        "dense_weights": (DENSE_FIXED + rows * 64) * F32,  # plus the 3 embedding rows gathered
        # One attention layer: keys and values [3, 10 slots read + 1 written, 2 heads, 16].
        "kv_cache": 2 * rows * (kv_slots + 1) * 2 * 16 * F32,
        # Three GDN layers: the state [3, 4, 16, 16] float32, read and written.
        "gdn_states": 3 * 2 * rows * 4 * 16 * 16 * 4,
        # Three GDN layers: tails [3, 3, 2, 16] of q and k, [3, 3, 4, 16] of v, read and written.
        "conv_tails": 3 * 2 * rows * 3 * (2 * 2 * 16 + 4 * 16) * F32,
    }
    assert expected["expert_weights"] == 589_824 and expected["dense_weights"] == 450_976
    assert got == pytest.approx({**expected, "total": sum(expected.values())}, rel=0, abs=0)


def test_every_expert_once_rows_cover_them_and_a_tied_head_read_whole():
    m = ModelConfig(tie_word_embeddings=True)
    got = decode_step_bytes(m, 16, 0)
    assert got["expert_weights"] == 8 * PER_EXPERT  # 32 routed tokens: every one of the 8 experts, once
    # Tied: no lm_head; the embedding [256, 64] is read whole as the head, no row gathers beside it.
    assert got["dense_weights"] == DENSE_FIXED * F32


def test_mean_cache_length_and_the_bound():
    # Prompt of 8 slots, 4 decode steps: their attention reads 9, 10, 11, 12 slots.
    assert mean_kv_slots(8, 4) == (9 + 10 + 11 + 12) / 4
    m = ModelConfig()
    bound = rollout_bound(m, 3, 8, 4, hbm_bytes_per_s=1e9)
    total = decode_step_bytes(m, 3, 10.5)["total"]
    assert bound["decode_step_s"] == total / 1e9
    assert bound["tokens_per_s"] == pytest.approx(3 * 1e9 / total, rel=1e-12)


def test_a_bf16_cache_keeps_the_delta_rule_state_in_float32():
    """compute_dtype bfloat16: keys, values and conv tails at 2 bytes, the GDN state at 4 (float32)."""
    m = ModelConfig(compute_dtype="bfloat16")
    rows, kv_slots = 3, 10
    got = decode_step_bytes(m, rows, kv_slots)
    assert got["kv_cache"] == 2 * rows * (kv_slots + 1) * 2 * 16 * 2
    assert got["gdn_states"] == 3 * 2 * rows * 4 * 16 * 16 * 4
    assert got["conv_tails"] == 3 * 2 * rows * 3 * (2 * 2 * 16 + 4 * 16) * 2
