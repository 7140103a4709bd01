"""The config schema's remaining field bounds, every section's defaults, the YAML `off` readers, the
one-or-many reward lists, and the mesh's absorbing axis with its messages, all pinned by hand."""

import pydantic
import pytest

from hybridmoe.config import schema as s

# (section, field, value at the bound that is accepted, value past it that is refused)
BOUNDS = [
    (s.ModelConfig, "num_layers", 1, 0), (s.ModelConfig, "rope_theta", 1e-6, 0.0),
    (s.ModelConfig, "gdn_num_key_heads", 1, 0), (s.ModelConfig, "gdn_num_value_heads", 1, 0),
    (s.ModelConfig, "gdn_key_dim", 1, 0), (s.ModelConfig, "gdn_value_dim", 1, 0),
    (s.ModelConfig, "num_experts", 1, 0), (s.ModelConfig, "moe_intermediate_size", 1, 0),
    (s.ModelConfig, "vocab_size", 1, -1), (s.ModelConfig, "layer_pattern", ("attention",), ()),
    (s.MeshConfig, "context", 1, 0), (s.MeshConfig, "context", -1, -2),
    (s.MeshConfig, "expert", 1, 0), (s.MeshConfig, "expert", -1, -2),
    (s.MeshConfig, "data", -1, -2), (s.MeshConfig, "fsdp", 1, 0), (s.MeshConfig, "tensor", 1, -3),
    (s.GmmKernelConfig, "xla_tile_rows", 1, 0), (s.GmmKernelConfig, "tm", 1, 0),
    (s.GmmKernelConfig, "tk", 1, 0), (s.GmmKernelConfig, "tn", 1, 0),
    (s.GmmKernelConfig, "wi_fwd_tile_n_per_half", 0, -1), (s.GmmKernelConfig, "vmem_limit_mib", 0.0, -0.5),
    (s.AttentionKernelConfig, "block_q", 0, -1), (s.AttentionKernelConfig, "block_k", 0, -1),
    (s.AttentionKernelConfig, "vmem_limit_mib", 0.0, -0.5),
    (s.LogprobsKernelConfig, "chunk_tokens", 1, 0), (s.LogprobsKernelConfig, "chunk_vocab", 1, 0),
    (s.TrainConfig, "b2", 0.0, -0.1), (s.TrainConfig, "b1", 0.5, 1.5),
    (s.RLConfig, "operators", "+", ""), (s.RLConfig, "operators", "+-*", "+/"),
    (s.RLConfig, "importance_cap", 100.0, 0.5), (s.RLConfig, "eps_high", 5.0, -0.1),
    (s.RLConfig, "group_size", 3, 0), (s.RLConfig, "top_p", 0.5, -0.5),
]
# Per-kernel tiles of explicit tiling: 0 (= the shared tile) accepted, negative refused.
TILE_FIELDS = [f"{k}_{p}_{t}" for k in ("wi", "wo") for p in ("fwd", "dlhs", "drhs") for t in ("tm", "tk", "tn")]


@pytest.mark.parametrize("section,field,ok,bad", BOUNDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_remaining_field_bound_accepts_its_limit_and_refuses_one_past(section, field, ok, bad):
    assert getattr(section(**{field: ok}), field) == ok
    with pytest.raises(pydantic.ValidationError):
        section(**{field: bad})


def test_every_per_kernel_tile_takes_zero_and_refuses_a_negative():
    assert len(TILE_FIELDS) == 18
    for field in TILE_FIELDS:
        assert getattr(s.GmmKernelConfig(**{field: 0}), field) == 0
        assert getattr(s.GmmKernelConfig(**{field: 8}), field) == 8
        with pytest.raises(pydantic.ValidationError):
            s.GmmKernelConfig(**{field: -1})


def test_an_axis_size_of_zero_is_refused_with_the_rule():
    with pytest.raises(pydantic.ValidationError, match="an axis size is a positive integer, or -1"):
        s.MeshConfig(expert=0)


def test_the_model_defaults():
    m = s.ModelConfig()
    assert (m.vocab_size, m.d_model, m.num_layers, m.layer_pattern) == (256, 64, 4, ("gdn", "gdn", "gdn", "attention"))
    assert (m.num_heads, m.num_kv_heads, m.head_dim, m.rope_theta, m.partial_rotary_factor) == (4, 2, 16, 1e7, 0.25)
    assert (m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_dim, m.gdn_value_dim, m.gdn_conv_kernel) == (
        2, 4, 16, 16, 4)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size) == (
        8, 2, 32, 32)
    assert (m.norm_topk_prob, m.rms_norm_eps, m.tie_word_embeddings, m.max_seq_len) == (True, 1e-6, False, 256)
    assert (m.param_dtype, m.compute_dtype, m.init_std) == ("float32", "float32", 0.02)
    # Derived: 4 layers / a pattern of 4 = 1 block; 16 x 0.25 = 4 rotated dimensions.
    assert (m.num_blocks, m.rotary_dim) == (1, 4)


def test_the_kernel_moe_and_layer_defaults():
    g = s.GmmKernelConfig()
    assert (g.backend, g.xla_impl, g.xla_tile_rows, g.tiling, g.tm, g.tk, g.tn) == (
        "xla", "auto", 128, "heuristic", 128, 128, 128)
    assert (g.wi_fwd_tile_n_per_half, g.wi_fwd_rhs_buffer_count, g.vmem_limit_mib, g.epilogue) == (0, 0, 0.0, "float32")
    assert all(getattr(g, f) == 0 for f in TILE_FIELDS)
    a = s.AttentionKernelConfig()
    assert (a.backend, a.block_q, a.block_k, a.vmem_limit_mib) == ("auto", 0, 0, 0.0)
    lp = s.LogprobsKernelConfig()
    assert (lp.chunk_tokens, lp.chunk_vocab, lp.save_logits) == (256, 4096, False)
    k = s.KernelsConfig()
    assert (k.gdn.backend, k.interpret) == ("auto", False)
    moe = s.MoEConfig()
    assert (moe.impl, moe.expert_parallel, moe.token_chunks) == ("sparse", "ring", 1)
    assert not any((moe.wi_fused_swiglu, moe.wo_fused_dswiglu, moe.router_grad_from_wo_input, moe.gather_backward,
                    moe.routing_replay))
    q = s.QuantConfig()
    assert (q.fp8_moe_fake_quant, q.fp8_fake_quant_hoist, q.fp8_gmm) == (False, "off", False)
    at = s.AttentionConfig()
    assert (at.cp_impl, at.cp_load_balance, at.cp_load_balance_hoist_ids) == ("all_gather", False, False)
    gd = s.GdnConfig()
    assert (gd.cp_m_scan, gd.cp_dh_scan) == (False, False)
    r = s.RematConfig()
    assert (r.policy, r.save, r.unit, r.expert_grad_barrier, r.expert_grad_lag, r.scan_layers) == (
        "auto", (), "block", False, 0, True)
    m = s.MeshConfig()
    assert (m.rules, m.expert_fsdp_dim, m.distributed, m.coordinator_address, m.num_processes, m.process_id) == (
        "default", "embed", False, "", 0, 0)
    t = s.TrainConfig()
    assert (t.seed, t.data) == (0, "synthetic")
    rl = s.RLConfig()
    assert (rl.task, rl.reward, rl.reward_weights, rl.reward_error, rl.digits, rl.operators) == (
        "arithmetic", (), (), "skip_sample", 1, "+")
    assert (rl.rollout_batches, rl.micro_batches, rl.lr_warmup_steps, rl.importance_correction) == (
        "auto", "auto", 0, "none")
    assert (rl.dynamic_sampling, rl.estimator) == (False, "grpo")
    d = s.DataConfig()
    assert (d.path, d.prompts, d.text_field, d.tokenizer, d.on_bad_line, d.shuffle, d.loss_on, d.long_documents) == (
        "", "", "text", "", "stop", True, "assistant", "split")
    assert s.RunConfig().compile_cache_dir == "auto"


def test_a_bare_yaml_off_reads_as_off_in_each_enum_that_has_it():
    """YAML 1.1 reads `off` as False: each of the three keys with an `off` value takes False as off."""
    assert s.bare_off(False) == "off" and s.bare_off("skip") == "skip" and s.bare_off(0) == 0
    assert s.TrainConfig(on_nonfinite=False).on_nonfinite == "off"
    assert s.QuantConfig(fp8_fake_quant_hoist=False).fp8_fake_quant_hoist == "off"
    assert s.RunConfig(compile_cache_dir=False).compile_cache_dir == "off"


def test_one_reward_or_one_weight_is_a_list_of_one():
    r = s.RLConfig(reward="r.py:f", reward_weights=2)
    assert r.reward == ("r.py:f",) and r.reward_weights == (2.0,)
    assert s.RLConfig(reward_weights=0.5).reward_weights == (0.5,)
    assert s.RLConfig(reward=["a.py:f", "b:g"]).reward == ("a.py:f", "b:g")


def test_counts_refuse_zero_naming_auto():
    with pytest.raises(pydantic.ValidationError, match="a count of micro-batches is a positive integer, or auto"):
        s.TrainConfig(micro_batches=0)
    with pytest.raises(pydantic.ValidationError, match="micro-batches or sampler passes is a positive integer"):
        s.RLConfig(rollout_batches=0)
    assert s.fewest("auto") == 1 and s.fewest(3) == 3


def test_rotary_dim_floors_the_rotated_fraction():
    """14 x 0.25 = 3.5 rotated dimensions floor to 3; 10 x 0.5 = 5 exactly."""
    assert s.ModelConfig(head_dim=14, partial_rotary_factor=0.25).rotary_dim == 3
    assert s.ModelConfig(head_dim=10, partial_rotary_factor=0.5).rotary_dim == 5
    assert s.ModelConfig(head_dim=10, partial_rotary_factor=1.0).rotary_dim == 10


def test_derived_counts_at_other_shapes():
    """6 layers over a pattern of 3: 2 blocks, kinds repeating; 7 // 2 = 3 mini-batches; 12 rows over
    3 micro-batches = 4 each; 2 simulated devices x 1 process (0 means one)."""
    m = s.ModelConfig(num_layers=6, layer_pattern=("gdn", "attention", "gdn"))
    assert m.num_blocks == 2 and m.layer_kinds == ("gdn", "attention", "gdn") * 2
    assert s.RLConfig(updates_per_rollout=7, epochs_per_rollout=2).mini_batches == 3
    assert s.TrainConfig(batch_size=12, micro_batches=3).rows_per_micro_batch == 4
    assert s.MeshConfig(cpu_devices=2, num_processes=0).simulated_devices == 2
    assert s.MeshConfig(cpu_devices=0, num_processes=4).simulated_devices == 0
    assert s.MeshConfig(cpu_devices=3, num_processes=2).simulated_devices == 6
    r = s.RLConfig(prompts_per_step=3, group_size=5, max_prompt_len=7, max_new_tokens=2)
    assert (r.rollouts_per_step, r.sequence_len) == (15, 9)


def test_mesh_resolve_names_each_fixed_axis_in_its_message():
    """data 2 x tensor 3 = 6 does not divide 8 devices: the message names both (not the 1-sized ones)."""
    _, problem = s.MeshConfig(data=2, tensor=3).resolve(8)
    assert problem == ("mesh.fsdp", "cannot absorb the rest: 8 devices are not a multiple of the other axes' "
                       "product 6 (mesh.data=2 x mesh.tensor=3); change those axes")


def test_mesh_resolve_absorbs_into_whichever_axis_is_minus_one():
    """fsdp 2 x tensor 2 fixed, expert -1 over 16 devices: 16 / 4 = 4; every axis fixed and matching
    the device count: as given; one device: fsdp 1."""
    sizes, problem = s.MeshConfig(fsdp=2, tensor=2, expert=-1).resolve(16)
    assert problem is None and sizes == {"data": 1, "fsdp": 2, "context": 1, "expert": 4, "tensor": 2}
    sizes, problem = s.MeshConfig(data=2, fsdp=2, context=2).resolve(8)
    assert problem is None and sizes == {"data": 2, "fsdp": 2, "context": 2, "expert": 1, "tensor": 1}
    sizes, problem = s.MeshConfig().resolve(1)
    assert problem is None and sizes["fsdp"] == 1
    _, problem = s.MeshConfig(data=2, fsdp=4).resolve(2)  # more axis ranks than devices
    assert problem == ("mesh", "axis sizes multiply to 8 but 2 devices are present; set one axis to -1 to absorb "
                       "the rest")
    _, problem = s.MeshConfig(context=-1, expert=-1, fsdp=2).resolve(8)
    assert problem == ("mesh", "at most one axis may be -1; got mesh.context, mesh.expert")
