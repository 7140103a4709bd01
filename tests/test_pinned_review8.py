"""Figures and checks a review by sabotage (round 8) found untested, each stated by hand."""

from __future__ import annotations

import pytest

from hybridmoe.hf.config_fields import model_fields_from_hf_config

# A Qwen3.5-MoE text config.json with every field the import needs (the values do not matter here
# beyond being valid); each test sets num_hidden_layers and layer_types.
HF_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 272, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 1, "linear_num_value_heads": 3,
    "linear_key_head_dim": 8, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 3, "num_experts": 6,
    "num_experts_per_tok": 3, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
    "rms_norm_eps": 3e-5, "rope_parameters": {"rope_theta": 500000.0, "partial_rotary_factor": 0.5},
}


def _hf_config(layer_types: list[str], **extra) -> dict:
    return {**HF_CONFIG, "num_hidden_layers": len(layer_types), "layer_types": layer_types, **extra}


def test_an_imported_layer_pattern_is_the_shortest_period_that_divides_the_layers():
    """The native model repeats its layer_pattern a whole number of times: a period of the layer
    kinds that does not divide num_layers is no pattern (the whole list is)."""
    g, a = "linear_attention", "full_attention"
    # [g, a] twice: period 2.
    assert model_fields_from_hf_config(_hf_config([g, a] * 2))["layer_pattern"] == ("gdn", "attention")
    # [g, g, g, a] twice and then [g, g]: 4 repeats to the end but does not divide 10; 5 is no
    # period (layer 3 is attention, layer 8 is gdn), so the pattern is all 10 layers.
    kinds = [g, g, g, a] * 2 + [g, g]
    fields = model_fields_from_hf_config(_hf_config(kinds))
    assert fields["num_layers"] == 10
    assert list(fields["layer_pattern"]) == ["gdn", "gdn", "gdn", "attention"] * 2 + ["gdn", "gdn"]


def test_flash_attention_counts_a_partly_visible_key_block_as_visited():
    """visited_blocks: key block j is visited by query block i when its first key is at or before
    the block's last query, so a key block the diagonal cuts counts (a ceiling, not a floor)."""
    from hybridmoe.kernels.attention.pallas_tpu import visited_blocks
    # Square blocks, 512 tokens in 128s: query block i sees i + 1 key blocks: 1 + 2 + 3 + 4.
    assert visited_blocks(512, 512, 128, 128) == 10
    # Query blocks of 128 against key blocks of 256: query block i ends at (i + 1) * 128 - 1, which
    # reaches into key block ceil((i + 1) * 128 / 256) - 1: 1, 1, 2, 2 key blocks.
    assert visited_blocks(512, 512, 128, 256) == 6
    # Context parallelism, rank 0 of 4 load-balanced: 128 queries as half-chunks at 0 and 448 of
    # 512 keys, blocks of 64 queries and 128 keys: ceil(64 / 128) = 1 and ceil(512 / 128) = 4.
    assert visited_blocks(128, 512, 64, 128, query_runs=((0, 64), (448, 64))) == 5
    # Without a known layout every block counts: 2 query blocks x 4 key blocks.
    assert visited_blocks(128, 512, 64, 128) == 8


def test_an_hf_config_without_routed_experts_is_refused_naming_the_field():
    """num_experts 0 is refused (the native model always routes); 1 expert is a valid config."""
    g, a = "linear_attention", "full_attention"
    with pytest.raises(ValueError, match=r"num_experts=0 is not supported"):
        model_fields_from_hf_config(_hf_config([g, a], num_experts=0, num_experts_per_tok=1))
    assert model_fields_from_hf_config(_hf_config([g, a], num_experts=1, num_experts_per_tok=1))["num_experts"] == 1


def test_a_cpu_target_needs_at_least_one_device():
    """inspect --target cpu:N: N = 0 is refused as a device count; N = 1 is the smallest target."""
    from hybridmoe.tools.train_program import parse_target
    with pytest.raises(ValueError, match="positive device count"):
        parse_target("cpu:0")
    assert parse_target("cpu:1") == ("cpu", 1)
    assert parse_target("cpu:8") == ("cpu", 8)
