"""The config schema's field bounds, defaults and derived figures, pinned by hand: every bound at
its limit (accepted or refused as written) and one step past it."""

import pydantic
import pytest

from hybridmoe.config import schema as s

# (section, field, value at the bound that is accepted, value past it that is refused)
BOUNDS = [
    (s.ModelConfig, "vocab_size", 1, 0), (s.ModelConfig, "d_model", 1, 0),
    (s.ModelConfig, "num_heads", 1, 0), (s.ModelConfig, "num_kv_heads", 1, 0), (s.ModelConfig, "head_dim", 1, 0),
    (s.ModelConfig, "partial_rotary_factor", 1.0, 1.01), (s.ModelConfig, "partial_rotary_factor", 0.01, 0.0),
    (s.ModelConfig, "gdn_conv_kernel", 1, 0), (s.ModelConfig, "num_experts_per_tok", 1, 0),
    (s.ModelConfig, "shared_expert_intermediate_size", 0, -1), (s.ModelConfig, "rms_norm_eps", 1e-12, 0.0),
    (s.ModelConfig, "max_seq_len", 1, 0), (s.ModelConfig, "init_std", 1e-6, 0.0),
    (s.MeshConfig, "cpu_devices", 0, -1), (s.MeshConfig, "num_processes", 0, -1), (s.MeshConfig, "process_id", 0, -1),
    (s.MeshConfig, "fsdp", -1, -2), (s.MeshConfig, "data", 1, 0), (s.MeshConfig, "tensor", -1, 0),
    (s.MoEConfig, "capacity_factor", 0.0, -0.1), (s.MoEConfig, "token_chunks", 1, 0),
    (s.GdnConfig, "chunk_size", 1, 0),
    (s.TrainConfig, "steps", 0, -1), (s.TrainConfig, "batch_size", 1, 0), (s.TrainConfig, "seq_len", 2, 1),
    (s.TrainConfig, "micro_batches", 1, 0), (s.TrainConfig, "learning_rate", 1e-9, 0.0),
    (s.TrainConfig, "warmup_steps", 0, -1), (s.TrainConfig, "weight_decay", 0.0, -0.1),
    (s.TrainConfig, "b1", 0.0, -0.1), (s.TrainConfig, "b1", 0.999, 1.0), (s.TrainConfig, "b2", 0.999, 1.0),
    (s.TrainConfig, "grad_clip", 0.0, -1.0), (s.TrainConfig, "checkpoint_every", 0, -1),
    (s.TrainConfig, "log_every", 1, 0), (s.TrainConfig, "max_nonfinite_skips", 0, -1),
    (s.RLConfig, "digits", 1, 0), (s.RLConfig, "prompts_per_step", 1, 0), (s.RLConfig, "group_size", 2, 1),
    (s.RLConfig, "max_prompt_len", 1, 0), (s.RLConfig, "max_new_tokens", 1, 0),
    (s.RLConfig, "rollout_batches", 1, 0), (s.RLConfig, "micro_batches", 1, 0), (s.RLConfig, "prefill_chunk", 1, 0),
    (s.RLConfig, "temperature", 0.0, -0.1), (s.RLConfig, "top_p", 1.0, 1.01), (s.RLConfig, "top_p", 0.01, 0.0),
    (s.RLConfig, "top_k", 0, -1), (s.RLConfig, "warmup_steps", 0, -1), (s.RLConfig, "steps", 0, -1),
    (s.RLConfig, "learning_rate", 1e-9, 0.0), (s.RLConfig, "lr_warmup_steps", 0, -1),
    (s.RLConfig, "updates_per_rollout", 1, 0), (s.RLConfig, "epochs_per_rollout", 1, 0),
    (s.RLConfig, "dynamic_sampling_rounds", 1, 0), (s.RLConfig, "importance_cap", 1.01, 1.0),
    (s.RLConfig, "eps", 0.99, 1.0), (s.RLConfig, "eps", 0.01, 0.0), (s.RLConfig, "eps_high", 0.01, 0.0),
    (s.RLConfig, "beta", 0.0, -0.1), (s.RLConfig, "checkpoint_every", 0, -1),
    (s.RunConfig, "memory_budget_gib", 0.01, 0.0), (s.BenchConfig, "steps", 2, 1),
]


@pytest.mark.parametrize("section,field,ok,bad", BOUNDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_field_bound_accepts_its_limit_and_refuses_one_past(section, field, ok, bad):
    assert getattr(section(**{field: ok}), field) == ok
    with pytest.raises(pydantic.ValidationError):
        section(**{field: bad})


def test_the_defaults_a_user_relies_on():
    t, r = s.TrainConfig(), s.RLConfig()
    assert (t.steps, t.batch_size, t.seq_len, t.micro_batches) == (100, 8, 64, "auto")
    assert (t.learning_rate, t.warmup_steps, t.weight_decay, t.b1, t.b2, t.grad_clip) == (3e-3, 10, 0.0, 0.9, 0.95, 1.0)
    assert (t.checkpoint_every, t.log_every, t.on_nonfinite, t.max_nonfinite_skips) == (50, 1, "skip", 10)
    assert (r.prompts_per_step, r.group_size, r.max_prompt_len, r.max_new_tokens) == (8, 8, 16, 8)
    assert (r.temperature, r.top_p, r.top_k, r.warmup_steps, r.steps, r.learning_rate) == (1.0, 1.0, 0, 20, 30, 1e-3)
    assert (r.eps, r.eps_high, r.beta, r.importance_cap, r.dynamic_sampling_rounds) == (0.2, None, 0.0, 2.0, 3)
    assert (r.estimator, r.aggregation, r.mask_truncated, r.mask_zero_variance) == ("grpo", "token_mean", False, True)
    assert (r.updates_per_rollout, r.epochs_per_rollout, r.checkpoint_every, r.prefill_chunk) == (1, 1, 10, 2048)
    m = s.MeshConfig()
    assert (m.data, m.fsdp, m.context, m.expert, m.tensor, m.cpu_devices) == (1, -1, 1, 1, 1, 0)
    assert s.MoEConfig().capacity_factor == 0.0 and s.GdnConfig().chunk_size == 64
    assert s.BenchConfig().steps == 5 and s.RunConfig().memory_budget_gib is None
    assert s.ModelConfig().partial_rotary_factor == 0.25 and s.ModelConfig().rope_theta == 10_000_000.0


def test_derived_figures_by_hand():
    """rollouts 6 x 4 = 24; rows 16 // 4 = 4; sequence 12 + 5 = 17; mini-batches 6 // 2 = 3 (at least 1);
    rotary dim int(16 x 0.25) = 4; simulated devices 4 x max(3, 1) = 12 (4 x 1 with no processes)."""
    r = s.RLConfig(prompts_per_step=6, group_size=4, max_prompt_len=12, max_new_tokens=5,
                   updates_per_rollout=6, epochs_per_rollout=2, micro_batches=3, rollout_batches="auto")
    assert (r.rollouts_per_step, r.sequence_len, r.mini_batches) == (24, 17, 3)
    assert (r.fewest_micro_batches, r.fewest_rollout_batches) == (3, 1)
    assert s.RLConfig(updates_per_rollout=1, epochs_per_rollout=2).mini_batches == 1
    t = s.TrainConfig(batch_size=16, micro_batches=4)
    assert (t.fewest_micro_batches, t.rows_per_micro_batch) == (4, 4)
    assert s.TrainConfig(batch_size=16).rows_per_micro_batch == 16
    assert s.ModelConfig(head_dim=16, partial_rotary_factor=0.25).rotary_dim == 4
    assert s.MeshConfig(cpu_devices=4, num_processes=3).simulated_devices == 12
    assert s.MeshConfig(cpu_devices=4).simulated_devices == 4


def test_mesh_resolve_absorbs_the_rest_or_names_the_problem():
    """8 devices, tensor 2 and fsdp -1: fsdp 4; 6 devices over tensor 4: refused on mesh.fsdp; two -1
    axes refused; fixed axes of product 2 against 4 devices refused on mesh."""
    sizes, problem = s.MeshConfig(tensor=2).resolve(8)
    assert problem is None and sizes == {"data": 1, "fsdp": 4, "context": 1, "expert": 1, "tensor": 2}
    _, problem = s.MeshConfig(tensor=4).resolve(6)
    assert problem[0] == "mesh.fsdp" and "6 devices are not a multiple of the other axes' product 4" in problem[1]
    _, problem = s.MeshConfig(data=-1).resolve(8)
    assert problem[0] == "mesh" and "mesh.data, mesh.fsdp" in problem[1]
    sizes, problem = s.MeshConfig(fsdp=2).resolve(2)
    assert problem is None and sizes["fsdp"] == 2
    _, problem = s.MeshConfig(fsdp=2).resolve(4)
    assert problem == ("mesh", "axis sizes multiply to 2 but 4 devices are present; set one axis to -1 to absorb the rest")


def test_layer_kinds_repeat_the_pattern_and_blocks_count_whole_patterns():
    m = s.ModelConfig(num_layers=4, layer_pattern=("gdn", "gdn", "gdn", "attention"))
    assert m.num_blocks == 1 and m.layer_kinds == ("gdn", "gdn", "gdn", "attention")
    m = s.ModelConfig(num_layers=4, layer_pattern=("gdn", "attention"))
    assert m.num_blocks == 2 and m.layer_kinds == ("gdn", "attention", "gdn", "attention")
