"""Figures, formulas, layouts and refusals pinned by hand: each test states its expectation as
literals or simple arithmetic on its own small fixture (no model compiles)."""

import json

import numpy as np
import pytest

from helpers import benchmark_script


# ---------------------------------------------------------------------------------------------
# benchmarks/step_estimate.py: what its record keeps of an estimate


def _estimate(serial_s, overlapped_s, serial_mfu, overlapped_mfu):
    """An estimate with only the fields the record reads; tokens/s per chip = 1000 / step_s."""
    return {"hardware": {"name": "tpu7x", "grid_step_s": 1e-6},
            "serial": {"step_s": serial_s, "tokens_per_s_per_chip": 1000 / serial_s, "mfu": serial_mfu},
            "overlapped": {"step_s": overlapped_s, "tokens_per_s_per_chip": 1000 / overlapped_s,
                           "mfu": overlapped_mfu},
            "categories": {"gmm": {"s": 0.25}}, "collectives": {}, "kernels": {},
            "kernels_without_cost_estimate": [], "loops_with_unknown_trip_count": [],
            "hlo_flops_per_device": 1.0, "model_flops_per_device": 1.0, "tokens_per_step": 1000, "chips": 1,
            "devices": 1}


def test_the_step_estimate_record_keeps_serial_and_overlapped_figures_apart():
    """Serial 2 s at MFU 0.2, overlapped 1 s at MFU 0.4: each figure from its own half."""
    module = benchmark_script("step_estimate")
    out = module._summary(_estimate(2.0, 1.0, 0.2, 0.4))
    assert (out["step_s"], out["overlapped_step_s"]) == (2.0, 1.0)
    assert (out["tokens_per_s_per_chip"], out["overlapped_tokens_per_s_per_chip"]) == (500.0, 1000.0)
    assert (out["mfu"], out["overlapped_mfu"]) == (0.2, 0.4)
    assert out["category_s"] == {"gmm": 0.25}


def test_an_arm_from_inspect_records_both_programs_compile_seconds(tmp_path, monkeypatch):
    """inspect --layers compiled 8 layers in 3 s and 12 in 5 s: the arm's compile_s is 3 + 5 = 8;
    its recipe and overrides are the programs' (num_layers dropped), its estimate the extrapolated one."""
    module = benchmark_script("step_estimate")
    from hybridmoe.analysis import step_estimate as se

    monkeypatch.setattr(se, "format_estimate", lambda *a, **k: "")
    written = []
    monkeypatch.setattr(module.harness, "write", lambda out, name, **fields: written.append(fields))

    def program(layers, seconds, est):
        return {"config": {"model": {"num_layers": layers}}, "recipe": "small", "compile_s": seconds,
                "overrides": ["kernels.gmm.tm=512", f"model.num_layers={layers}"], "step_estimate": est}

    record = {"programs": {"a": program(8, 3.0, _estimate(4.0, 3.0, 0.1, 0.15)),
                           "b": program(12, 5.0, _estimate(5.0, 4.0, 0.12, 0.16))},
              "step_estimate": _estimate(10.0, 8.0, 0.3, 0.35), "target": "tpu7x:4x4x8", "commit": "abc"}
    path = tmp_path / "inspect.json"
    path.write_text(json.dumps(record))
    assert module._from_inspect(path, {"cell": []}, tmp_path / "out.json", {}) == 0
    arm = written[0]["arms"]["cell"]
    assert arm["compile_s"] == 8.0
    assert (arm["recipe"], arm["overrides"], arm["target"]) == ("small", ["kernels.gmm.tm=512"], "tpu7x:4x4x8")
    assert (arm["step_s"], arm["overlapped_mfu"]) == (10.0, 0.35)
    assert sorted(arm["extrapolated_from"]) == ["12", "8"]


# ---------------------------------------------------------------------------------------------
# rl/grpo.py: a rollout's updates combined


def test_a_rollouts_skipped_updates_add_up():
    """Three updates, the guard skipped the first two: update_skipped 2 (not 1), update_applied
    1/3, grad_norm the mean 2.0 and its max 3.0."""
    from hybridmoe.rl.grpo import _SUM_KEYS, combine_update_metrics

    def update(skipped, grad_norm):
        return {**{k: 1.0 for k in _SUM_KEYS}, "ratio_max": 1.0, "ratio_min": 1.0, "gap_max": 0.0, "loss": 0.0,
                "pg_loss": 0.0, "grad_norm": grad_norm, "update_applied": 1.0 - skipped, "update_skipped": skipped}

    out = combine_update_metrics([update(1.0, 1.0), update(1.0, 2.0), update(0.0, 3.0)])
    assert out["update_skipped"] == 2.0
    assert out["update_applied"] == pytest.approx(1 / 3)
    assert (out["grad_norm"], out["grad_norm_max"], out["updates"]) == (2.0, 3.0, 3.0)
    assert out["kept_tokens"] == 3.0  # sums add up too


# ---------------------------------------------------------------------------------------------
# hf/config_fields.py: a config.json read into model fields

_HF_TEXT = {"model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000.0,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "rms_norm_eps": 1e-6}


def test_a_config_without_layer_types_puts_attention_last_in_each_interval():
    """Qwen3-Next's rule: layer i is full attention when (i + 1) % full_attention_interval == 0,
    so 8 layers at the default interval 4 are gdn, gdn, gdn, attention twice, and at interval 2
    gdn, attention four times."""
    from hybridmoe.hf.config_fields import model_fields_from_hf_config

    assert model_fields_from_hf_config(_HF_TEXT)["layer_pattern"] == ("gdn", "gdn", "gdn", "attention")
    every_second = model_fields_from_hf_config({**_HF_TEXT, "full_attention_interval": 2})
    assert every_second["layer_pattern"] == ("gdn", "attention")


# ---------------------------------------------------------------------------------------------
# tools/score.py: the token ids a checkpoint is scored on


def test_score_takes_ids_below_the_vocabulary_and_refuses_the_vocabulary_size():
    """vocab 8: ids 0..7 are the vocabulary; 8 is one past its end."""
    from hybridmoe.tools.score import check_tokens

    assert check_tokens(np.array([[0, 7]], np.int64), 8, "--tokens").dtype == np.int32
    with pytest.raises(ValueError, match=r"lie in \[0, 8\); found 0..8"):
        check_tokens(np.array([[0, 8]]), 8, "--tokens")
    with pytest.raises(ValueError, match=r"found -1..3"):
        check_tokens(np.array([[-1, 3]]), 8, "--tokens")


# ---------------------------------------------------------------------------------------------
# kernels/attention/ops.py: the flash core's shape check


def test_flash_attention_refuses_keys_of_another_head_dim_by_its_shape_rule():
    """q [1, 4, 2, 8] against k, v [1, 4, 1, 4]: the head dims (8 and 4) differ, refused before
    anything is traced, naming the layouts; the same keys at head dim 8 pass the check."""
    import jax.numpy as jnp

    from hybridmoe.kernels.attention import ops

    pos = jnp.arange(4, dtype=jnp.int32)[None]
    q, k = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 4))
    with pytest.raises(ValueError, match=r"q must be \[B, T, N, A\] and k, v \[B, S, G, A\]"):
        ops.flash_attention(q, k, k, q_pos_BT=pos, kv_pos_BS=pos, scale=1.0, block_q=4, block_k=4)
    k8 = jnp.zeros((1, 4, 1, 8))
    ops._check(q, k8, k8, pos, pos, None, None, "xla", 4, 4)  # no error
