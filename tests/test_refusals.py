"""Refusals at load: every rule of the validator (recipe/validate.py: RULES, and RL_RULES of the rl
command) has a case here that breaks it alone, and the error names the key(s) with the fix.

- The table (CASES): each case is the tiny recipe with overrides (and the facts a caller gives: a
  platform, the device count a run builds on, an --init-hf checkpoint's model fields) that break
  one requirement. The rule it names must be the only rule that reports a problem, with exactly
  the keys listed, each message holding the fragment listed; the loader (or set-up, or the rl
  command's check) raises one ConfigError with the same problems.
- The enumeration: every registered rule has a case, and every case's rule is registered (a rule
  deleted from validate.py fails here and in its refusal case); and every statement of
  validate.py that reports a problem (`out.append(...)`, `unmet.append(...)`, a returned problem
  list) is reached by some case, so a check added to a rule without a refusal case fails.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

from hybridmoe.config import ConfigError
from hybridmoe.data.tokenizer import load_tokenizer
from hybridmoe.recipe import load as load_module
from hybridmoe.recipe import validate
from hybridmoe.recipe.load import load_config


class Case(NamedTuple):
    rules: tuple[str, ...]             # the rule(s) that must report (others must not)
    overrides: tuple[str, ...]
    problems: tuple[tuple[str, str], ...]  # (key, a fragment of its message), one per problem
    facts: dict = {}                   # validate.Facts fields: platform, devices, checkpoint_model, tokenizer


def case(rules, overrides, *problems, **facts) -> Case:
    return Case((rules,) if isinstance(rules, str) else tuple(rules), tuple(overrides), problems, facts)


# Two context ranks (fsdp absorbs 4 of the 8 devices), with GRPO rows of 32 + 96 = 128 tokens that
# split into whole GDN chunks (up to 64) on each rank, so the rl command's rules pass.
CP2 = ("mesh.context=2", "mesh.data=1", "rl.max_prompt_len=32", "rl.max_new_tokens=96")
ATTENTION_ONLY = ("model.layer_pattern=[attention]",)
TWO_LAYER_BLOCKS = ("model.layer_pattern=[gdn,attention]",)
CHARACTERS = load_tokenizer()  # the built-in tokenizer: one id a character, and BOS
TPU = {"platform": "tpu"}
GPU = {"platform": "gpu"}
BUILT = {"devices": 8}  # set-up's pass: the devices the mesh is built on
MOSAIC_GDN = ("kernels.gdn.backend=pallas_tpu", "kernels.interpret=true")
KEPT_CORE = ("remat.policy=minimal", "remat.save=[gdn_core_out,gdn_core_residuals]")  # the Mosaic core replays nothing
KEPT_ATTENTION_CORE = ("remat.policy=minimal", "remat.save=[attn_core_residuals]")  # nor the flash core

CASES: dict[str, Case] = {
    # model shapes
    "layers_vs_pattern": case("_model_shapes", ["model.num_layers=6"],
                              ("model.num_layers", "multiple of the layer pattern's length 4")),
    "heads_vs_kv_heads": case("_model_shapes", ["model.num_heads=3"],
                              ("model.num_heads", "not a multiple of model.num_kv_heads=2")),
    "gdn_value_vs_key_heads": case("_model_shapes", ["model.gdn_num_value_heads=3"],
                                   ("model.gdn_num_value_heads", "not a multiple of model.gdn_num_key_heads=2")),
    "top_k_over_experts": case("_model_shapes", ["model.num_experts_per_tok=9"],
                               ("model.num_experts_per_tok", "exceeds model.num_experts=8")),
    "rotary_dim_odd": case("_model_shapes", ["model.partial_rotary_factor=0.3"],
                           ("model.partial_rotary_factor", "must be an even integer")),
    "checkpoint_shapes": case("_model_matches_checkpoint", [],
                              ("model.d_model", "pass: model.d_model=32"), checkpoint_model={"d_model": 32}),
    # the mesh
    "mesh_product_vs_devices": case("_mesh_axis_sizes", ["mesh.fsdp=2"],
                                    ("mesh", "axis sizes multiply to 4 but 8 devices")),
    "mesh_two_free_axes": case("_mesh_axis_sizes", ["mesh.data=-1"], ("mesh", "at most one axis may be -1")),
    "mesh_free_axis_cannot_absorb": case("_mesh_axis_sizes", ["mesh.data=3"],
                                         ("mesh.fsdp", "(the devices are mesh.cpu_devices=8)")),
    "coordinator_without_distributed": case("_mesh_distributed", ["mesh.coordinator_address=localhost:1"],
                                            ("mesh.coordinator_address", "set mesh.distributed=true"),
                                            ("mesh.coordinator_address", "give mesh.coordinator_address and mesh.num_processes together")),
    "process_id_past_processes": case("_mesh_distributed", ["mesh.distributed=true", "mesh.num_processes=2",
                                                            "mesh.coordinator_address=localhost:1", "mesh.process_id=2"],
                                      ("mesh.process_id", "not below mesh.num_processes=2")),
    "width_vs_fsdp": case("_model_weights_split_over_mesh", ["model.d_model=30"],  # dense and expert weights
                          ("model.d_model", "mesh.fsdp=4 x mesh.context=1 x mesh.expert=1, which the rules give "
                           "logical axis 'embed'"),
                          ("model.d_model", "mesh.fsdp=4 x mesh.context=1, which the rules give logical axis 'embed'")),
    # The weights' split names the experts, the rule of the key that asked for it the way out.
    "experts_vs_expert_fsdp_split": case(("_mesh_expert_fsdp_dim", "_model_weights_split_over_mesh"),
                                         ["mesh.expert_fsdp_dim=exp", "model.num_experts=6"],
                                         ("mesh.expert_fsdp_dim", "use mesh.expert_fsdp_dim=embed"),
                                         ("model.num_experts", "logical axis 'exp'")),
    "batch_vs_built_mesh": case("_train_batch_size", ["train.batch_size=12"],
                                ("train.batch_size", "12 does not split over the 8 shards"), **BUILT),
    "micro_batch_vs_built_mesh": case("_train_batch_size", ["train.batch_size=24", "train.micro_batches=2"],
                                      ("train.batch_size", "24 / train.micro_batches=2 = 12 per micro-batch does not "
                                       "split over the 8 shards"), **BUILT),
    "micro_batches_vs_batch": case("_train_batch_size", ["train.batch_size=8", "train.micro_batches=3"],
                                   ("train.micro_batches", "3 micro-batches do not divide train.batch_size=8")),
    "seq_len_over_max": case("_train_seq_len", ["train.seq_len=512"], ("train.seq_len", "exceeds model.max_seq_len=256")),
    # remat
    "save_list_without_custom": case("_remat_save", ["remat.save=[attn_q]"], ("remat.save", "needs remat.policy=custom")),
    "save_list_under_full": case("_remat_save", ["remat.policy=full", "remat.save=[moe_gate]"],
                                 ("remat.save", "needs remat.policy=custom or minimal (got full)")),
    "save_list_unknown_name": case("_remat_save", ["remat.policy=custom", "remat.save=[nope]"],
                                   ("remat.save", "unknown checkpoint names ['nope']")),
    "expert_grad_lag_without_the_barrier": case("_remat_expert_grad_lag", ["remat.expert_grad_lag=1"],
                                                ("remat.expert_grad_lag", "set remat.expert_grad_barrier=true")),
    "expert_grad_lag_past_the_block": case("_remat_expert_grad_lag", [*TWO_LAYER_BLOCKS, "remat.expert_grad_barrier=true",
                                                                     "remat.expert_grad_lag=2"],
                                           ("remat.expert_grad_lag", "at most 1")),
    # the Mosaic GDN core's residuals kept: one check each
    "core_residuals_without_gdn_layers": case("_remat_save_gdn_core_residuals", [*ATTENTION_ONLY, *KEPT_CORE],
                                              ("remat.save", "model.layer_pattern has no GDN layer")),
    "core_residuals_of_the_xla_core": case("_remat_save_gdn_core_residuals", list(KEPT_CORE),
                                           ("remat.save", "kernels.gdn.backend is xla here")),
    "core_residuals_sequence_sharded": case("_remat_save_gdn_core_residuals", [*CP2, "train.seq_len=128", *MOSAIC_GDN,
                                                                          *KEPT_CORE],
                                            ("remat.save", "sequence-sharded GDN (mesh.context > 1) keeps its own")),
    "core_residuals_without_the_output": case("_remat_save_gdn_core_residuals",
                                              [*MOSAIC_GDN, "remat.policy=minimal", "remat.save=[gdn_core_residuals]"],
                                              ("remat.save", "add gdn_core_out")),
    "attn_residuals_without_attention": case("_remat_save_attn_core_residuals",
                                             ["model.layer_pattern=[gdn]", *KEPT_ATTENTION_CORE],
                                             ("remat.save", "model.layer_pattern has no attention layer")),
    "attn_residuals_of_the_blocked_core": case("_remat_save_attn_core_residuals",
                                               ["kernels.attention.backend=blocked", *KEPT_ATTENTION_CORE],
                                               ("remat.save", "kernels.attention.backend=blocked keeps none")),
    "attn_residuals_of_the_ring": case("_remat_save_attn_core_residuals",
                                       [*CP2, "train.seq_len=128", "attention.cp_impl=ring", *KEPT_ATTENTION_CORE],
                                       ("remat.save", "attention.cp_impl=ring keeps its own")),
    # rl shapes (every load)
    "rl_rows_over_max_seq_len": case("_rl_shapes", ["rl.max_new_tokens=250"],
                                     ("rl.max_new_tokens", "exceeds model.max_seq_len=256")),
    "updates_vs_epochs": case("_rl_shapes", ["rl.updates_per_rollout=3", "rl.epochs_per_rollout=2"],
                              ("rl.updates_per_rollout", "rl.epochs_per_rollout=2 must divide it")),
    "micro_batches_vs_rollouts": case("_rl_shapes", ["rl.micro_batches=128"],
                                      ("rl.micro_batches", "do not divide the 64 rollouts")),
    "rollout_batches_vs_prompts": case("_rl_shapes", ["rl.rollout_batches=3"],
                                       ("rl.rollout_batches", "3 sampler passes do not divide rl.prompts_per_step=8")),
    "greedy_grpo": case("_rl_shapes", ["rl.temperature=0"], ("rl.temperature", "0 (greedy)")),
    "repeated_operator": case("_rl_shapes", ["rl.operators=++"], ("rl.operators", "repeats an operator")),
    "prefill_chunk_vs_gdn_chunk": case("_rl_shapes", ["rl.prefill_chunk=100"],
                                       ("rl.prefill_chunk", "e.g. rl.prefill_chunk=128")),
    "rollout_rows_vs_batch_shards": case("_rl_prompts_per_step", ["rl.prompts_per_step=4", "rl.group_size=3"],
                                         ("rl.prompts_per_step", "a micro-batch of 12 rollouts")),
    # The rows split over the expert axis too (data=2 x fsdp=2 x expert=2): 4 rows fit data x fsdp alone.
    "rollout_rows_vs_expert_shards": case("_rl_prompts_per_step", ["mesh.expert=2", "rl.prompts_per_step=2",
                                                                   "rl.group_size=2"],
                                          ("rl.prompts_per_step", "4 rollouts (rl.prompts_per_step * rl.group_size / "
                                           "mini-batches / rl.micro_batches) does not split over the 8 batch shards")),
    # MoE levers
    "fused_lever_on_dense": case("_moe_fused_levers", ["moe.wi_fused_swiglu=true", "moe.impl=dense"],
                                 ("moe.wi_fused_swiglu", "needs moe.impl=sparse")),
    "fused_lever_saves_a_half": case("_moe_fused_levers", ["moe.wo_fused_dswiglu=true", "remat.policy=custom",
                                                          "remat.save=[moe_gate]"],
                                     ("moe.wo_fused_dswiglu", "the gate and up halves cannot be saved")),
    "fused_lever_saves_a_half_under_minimal": case("_moe_fused_levers", ["moe.wi_fused_swiglu=true",
                                                                        "remat.policy=minimal", "remat.save=[moe_up]"],
                                                   ("moe.wi_fused_swiglu", "remat.save names ['moe_up']")),
    "fused_lever_on_fp8": case(("_moe_fused_levers", "_quant_fp8_gmm"), ["moe.wi_fused_swiglu=true", "quant.fp8_gmm=true"],
                               ("moe.wi_fused_swiglu", "needs unquantized grouped matmuls (quant.fp8_gmm is on)"),
                               ("quant.fp8_gmm", "the fused SwiGLU epilogues (moe.wi_fused_swiglu)")),
    "fused_lever_tile_rule": case("_moe_fused_levers", ["moe.wi_fused_swiglu=true", "kernels.gmm.tiling=explicit",
                                                       "kernels.gmm.wi_fwd_tile_n_per_half=12"],
                                  ("moe.wi_fused_swiglu", "kernel tile rule: tile_n_per_half=12 must divide F=32")),
    "gather_backward_on_dense": case("_moe_gather_backward", ["moe.gather_backward=true", "moe.impl=dense"],
                                     ("moe.gather_backward", "needs moe.impl=sparse")),
    # The tiny recipe's simulated CPU devices: xla_impl=auto is row tiles, whose backward is gathers.
    "gather_backward_on_row_tiles": case("_moe_gather_backward", ["moe.gather_backward=true"],
                                         ("moe.gather_backward", "runs row tiles")),
    # (Expert buffers are refused by the rl command's rule too: its rollouts and updates would drop
    # different tokens.)
    "buffers_on_dense": case(("_moe_fused_levers", "_moe_capacity_factor"), ["moe.impl=dense", "moe.capacity_factor=1.0"],
                             ("moe.capacity_factor", "no expert buffers"), ("moe.capacity_factor", "dropless MoE only")),
    "token_chunks_on_dense": case("_moe_token_chunks", ["moe.token_chunks=2", "moe.impl=dense"],
                                  ("moe.token_chunks", "needs moe.impl=sparse")),
    "token_chunks_with_buffers": case(("_moe_token_chunks", "_moe_capacity_factor"),
                                      ["moe.token_chunks=2", "moe.capacity_factor=1.0"],
                                      ("moe.token_chunks", "needs a dropless MoE"),
                                      ("moe.capacity_factor", "dropless MoE only")),
    "token_chunks_vs_row": case("_moe_token_chunks", ["moe.token_chunks=3"],
                                ("moe.token_chunks", "does not divide the 64 tokens of a training row")),
    # grouped matmul kernels
    "gmm_backend_vs_platform": case("_kernels_gmm", ["kernels.gmm.backend=pallas_tpu"],
                                    ("kernels.gmm.backend", "cannot run on this platform (cpu)")),
    "gmm_tiles": case("_kernels_gmm", ["kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit",
                                       "kernels.gmm.tk=32", "model.moe_intermediate_size=128",
                                       "kernels.attention.backend=xla"],
                      ("kernels.gmm.tiling", "tk (over D)=32 must be a multiple of 128 (TPU lanes) or span 64"), **TPU),
    "tile_per_half_without_fused": case("_kernels_gmm", ["kernels.gmm.wi_fwd_tile_n_per_half=16"],
                                        ("kernels.gmm.wi_fwd_tile_n_per_half",
                                         "needs moe.wi_fused_swiglu (it tiles the fused up-projection forward); "
                                         "needs kernels.gmm.tiling=explicit")),
    "buffer_depth_everything_unmet": case("_kernels_gmm", ["kernels.gmm.wi_fwd_rhs_buffer_count=-1"],
                                          ("kernels.gmm.wi_fwd_rhs_buffer_count",
                                           "-1 must be 0 (the kernel default) or a depth >= 1; needs moe.wi_fused_swiglu "
                                           "(only the fused up-projection forward takes the depth); needs "
                                           "kernels.gmm.tiling=explicit (heuristic tiles may split K, where the depth is "
                                           "not applied); needs a Pallas backend")),
    "buffer_depth_over_split_k": case("_kernels_gmm", ["moe.wi_fused_swiglu=true", "kernels.gmm.tiling=explicit",
                                                      "kernels.gmm.tk=32", "kernels.gmm.wi_fwd_rhs_buffer_count=1"],
                                      ("kernels.gmm.wi_fwd_rhs_buffer_count", "kernels.gmm.tk=32 must span model.d_model=64")),
    # (The tile rules of the fused lever say it too.)
    "buffer_depth_over_mosaic": case(("_kernels_gmm", "_moe_fused_levers"), ["model.d_model=128", "moe.wi_fused_swiglu=true",
                                                     "kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit",
                                                     "kernels.gmm.wi_fwd_rhs_buffer_count=3",
                                                     "model.moe_intermediate_size=128",
                                                     "kernels.gmm.wi_fwd_tile_n_per_half=128",
                                                     "kernels.attention.backend=xla"],
                                     ("kernels.gmm.wi_fwd_rhs_buffer_count", "Mosaic TPU (JAX 0.10.2) accepts 1 or 2"),
                                     ("moe.wi_fused_swiglu", "rhs_buffer_count=3: Mosaic TPU takes at most 2"),
                                     **TPU),
    "fused_wo_dlhs_tile": case("_kernels_gmm", ["moe.wo_fused_dswiglu=true", "kernels.gmm.tiling=explicit",
                                               "kernels.gmm.wo_dlhs_tn=16"],
                               ("kernels.gmm.wo_dlhs_tn", "leave it 0 or set 32")),
    "unfused_wi_tile_on_fused": case("_kernels_gmm", ["moe.wi_fused_swiglu=true", "kernels.gmm.tiling=explicit",
                                                     "kernels.gmm.wi_fwd_tn=32"],
                                     ("kernels.gmm.wi_fwd_tn", "takes kernels.gmm.wi_fwd_tile_n_per_half")),
    "per_kernel_tile_without_explicit": case("_kernels_gmm", ["kernels.gmm.wo_fwd_tm=64"],
                                             ("kernels.gmm.wo_fwd_tm", "needs kernels.gmm.tiling=explicit")),
    "xla_impl_on_dense": case("_kernels_gmm_xla_impl", ["kernels.gmm.xla_impl=ragged_dot", "moe.impl=dense"],
                              ("kernels.gmm.xla_impl", "needs moe.impl=sparse")),
    "xla_impl_on_pallas": case("_kernels_gmm_xla_impl", ["kernels.gmm.xla_impl=row_tiles",
                                                         "kernels.gmm.backend=pallas_tpu", "kernels.interpret=true"],
                               ("kernels.gmm.xla_impl", "applies to the xla backend only")),
    # data
    "files_without_path": case("_data_sources", ["train.data=files"], ("data.path", "set data.path=FILE")),
    "prompt_set_without_its_inputs": case("_data_sources", ["rl.task=prompts"],
                                          ("data.prompts", "set data.prompts=FILE"), ("rl.reward", "needs reward functions"),
                                          ("rl.warmup_steps", "set rl.warmup_steps=0")),
    "reward_weights_vs_rewards": case("_data_sources", ["rl.reward_weights=[1.0]"],
                                      ("rl.reward_weights", "1 weights for 0 rl.reward functions")),
    # context-parallel attention
    "seq_vs_load_balanced_halves": case("_attention_context_parallel", [*CP2, *ATTENTION_ONLY, "train.seq_len=66",
                                                                       "attention.cp_load_balance=true"],
                                        ("train.seq_len", "make it a multiple of 4")),
    "ring_without_ranks": case("_attention_context_parallel", ["attention.cp_impl=ring"],
                               ("attention.cp_impl", "with one rank there is no ring")),
    "ring_without_attention": case("_attention_context_parallel", [*CP2, "model.layer_pattern=[gdn]",
                                                                   "gdn.chunk_size=32", "attention.cp_impl=ring"],
                                   ("attention.cp_impl", "needs attention layers")),
    "ring_on_blocked": case("_attention_context_parallel", [*CP2, "gdn.chunk_size=32", "attention.cp_impl=ring",
                                                            "kernels.attention.backend=blocked"],
                            ("attention.cp_impl", "returns no log-sum-exp")),
    "load_balance_without_ranks": case("_attention_context_parallel", ["attention.cp_load_balance=true"],
                                       ("attention.cp_load_balance", "needs an even mesh.context >= 2 (got 1)")),
    # Three ranks (3 simulated devices; rows of 66 and 6 + 18 tokens split into 6 half-chunks): odd.
    "load_balance_over_odd_ranks": case("_attention_context_parallel", ["mesh.cpu_devices=3", "mesh.context=3",
                                                                        "mesh.data=1", "model.d_model=96", *ATTENTION_ONLY,
                                                                        "train.seq_len=66", "rl.max_prompt_len=6",
                                                                        "rl.max_new_tokens=18",
                                                                        "attention.cp_load_balance=true"],
                                        ("attention.cp_load_balance", "needs an even mesh.context >= 2 (got 3)")),
    "hoist_ids_everything_unmet": case("_attention_context_parallel", ["attention.cp_load_balance_hoist_ids=true",
                                                                       "remat.scan_layers=false"],
                                       ("attention.cp_load_balance_hoist_ids",
                                        "needs attention.cp_load_balance=true (without it there are no reordered ids "
                                        "to hoist); needs an even mesh.context >= 2 (got 1); needs remat.policy=custom")),
    "hoist_ids_without_the_scan": case("_attention_context_parallel", [*CP2, "gdn.chunk_size=32",
                                                                       "attention.cp_load_balance=true",
                                                                       "attention.cp_load_balance_hoist_ids=true",
                                                                       "remat.policy=custom", "remat.scan_layers=false"],
                                       ("attention.cp_load_balance_hoist_ids", "needs remat.scan_layers=true")),
    # the attention core
    # (The rl command's rule says it of the GRPO rows too.)
    "blocked_key_blocks": case(("_kernels_attention", "_rl_sequences"),
                               ["kernels.attention.backend=blocked", "kernels.attention.block_k=16",
                                "rl.max_new_tokens=16"],
                               ("kernels.attention.block_k", "has no key blocks"),
                               ("kernels.attention.block_k", "has no key blocks")),
    "blocked_query_blocks_under_cp": case(("_kernels_attention", "_rl_sequences"), [*CP2, "gdn.chunk_size=32",
                                                                 "kernels.attention.backend=blocked",
                                                                 "kernels.attention.block_q=16"],
                                          ("kernels.attention.block_q", "under context parallelism (mesh.context=2)"),
                                          ("kernels.attention.block_q", "under context parallelism (mesh.context=2)")),
    "query_block_vs_rows": case("_kernels_attention", ["kernels.attention.block_q=48", "rl.max_new_tokens=32"],
                                ("kernels.attention.block_q", "e.g. kernels.attention.block_q=")),
    "no_default_block_fits": case("_kernels_attention", ["kernels.attention.backend=pallas_gpu", "train.seq_len=200",
                                                         "rl.max_new_tokens=16"],
                                  ("kernels.attention.backend", "pallas_gpu has no block_q that tiles the 200"),
                                  ("kernels.attention.backend", "pallas_gpu has no block_k that tiles the 200"), **GPU),
    "attention_backend_vs_platform": case("_kernels_attention", ["kernels.attention.backend=pallas_tpu"],
                                          ("kernels.attention.backend", "cannot run on this platform (cpu)")),
    "attention_head_dim_on_gpu": case("_kernels_attention", ["kernels.attention.backend=pallas_gpu", "model.head_dim=24",
                                                                "rl.max_new_tokens=16"],
                                      ("kernels.attention.backend", "model.head_dim=24 must be a power of two"), **GPU),
    # routing replay
    "replay_with_a_lever": case("_moe_routing_replay", ["moe.routing_replay=true", "moe.router_grad_from_wo_input=true"],
                                ("moe.router_grad_from_wo_input", "turn this lever off")),
    "replay_with_buffers": case(("_moe_routing_replay", "_moe_capacity_factor"),
                                ["moe.routing_replay=true", "moe.capacity_factor=1.0"],
                                ("moe.capacity_factor", "is dropless only"), ("moe.capacity_factor", "dropless MoE only")),
    "replay_on_pallas": case("_moe_routing_replay", ["moe.routing_replay=true", "kernels.gmm.backend=pallas_tpu",
                                                     "kernels.interpret=true"],
                             ("kernels.gmm.backend", "runs the xla grouped matmul")),
    "replay_with_the_ring": case("_moe_routing_replay", ["moe.routing_replay=true", "mesh.expert=2"],
                                 ("mesh.expert", "does not run the ring of experts")),
    # Accepted before, it ran the whole warm-up and then raised NotImplementedError in the sampler.
    "replay_with_token_chunks": case("_moe_routing_replay", ["moe.routing_replay=true", "moe.token_chunks=2"],
                                     ("moe.token_chunks", "one pass over the tokens; set it to 1")),
    "group_align_off_tile_on_dense": case("_moe_group_align_rows", ["moe.group_align_rows=12", "moe.impl=dense"],
                                          ("moe.group_align_rows", "must be a multiple of 8 (a row tile's sublanes), e.g. "
                                           "the grouped matmuls' row tile; got 12; needs moe.impl=sparse (the "
                                           "sort-and-group path); the dense reference has no rows to place")),
    "group_align_with_buffers": case(("_moe_group_align_rows", "_moe_capacity_factor"),
                                     ["moe.group_align_rows=8", "moe.capacity_factor=1.0"],
                                     ("moe.group_align_rows", "needs a dropless MoE (moe.capacity_factor=0)"),
                                     ("moe.capacity_factor", "dropless MoE only")),
    "group_align_with_replay": case("_moe_group_align_rows", ["moe.group_align_rows=8", "moe.routing_replay=true"],
                                    ("moe.group_align_rows", "moe.routing_replay runs the default MoE program")),
    # GDN
    "gdn_chunks_vs_context_ranks": case("_gdn_context_parallel", [*CP2], ("gdn.chunk_size", "whole chunks on every "
                                                                          "context rank")),
    "cp_scan_everything_unmet": case("_gdn_context_parallel", [*ATTENTION_ONLY, "gdn.chunk_size=32", "gdn.cp_m_scan=true"],
                                     ("gdn.cp_m_scan", "needs GDN layers (model.layer_pattern has none); needs "
                                      "sequence-sharded GDN context parallelism (mesh.context > 1); needs "
                                      "gdn.chunk_size=64 (got 32)")),
    "cp_terms_in_kernel_everything_unmet": case(
        ("_gdn_context_parallel", "_gdn_cp_terms_in_kernel"),
        [*ATTENTION_ONLY, "gdn.cp_terms_in_kernel=true", "gdn.cp_dh_scan=true"],
        ("gdn.cp_dh_scan", "needs GDN layers (model.layer_pattern has none); needs sequence-sharded GDN context "
         "parallelism (mesh.context > 1)"),
        ("gdn.cp_terms_in_kernel", "needs GDN layers (model.layer_pattern has none); needs sequence-sharded GDN "
         "context parallelism (mesh.context > 1); runs on the Mosaic GDN core; kernels.gdn.backend is xla here (set "
         "kernels.gdn.backend=pallas_tpu, with kernels.interpret=true off a TPU); leaves gdn.cp_dh_scan nothing to "
         "do (its kernels walk the chunks themselves): set it false")),
    "gdn_pallas_gpu_on_cpu": case("_kernels_gdn_backend", ["kernels.gdn.backend=pallas_gpu", "gdn.chunk_size=8"],
                                  ("kernels.gdn.backend", "cannot run on this platform (cpu); use xla, or "
                                   "kernels.interpret=true to run the Pallas kernel interpreted; needs gdn.chunk_size "
                                   "a power of two >= 16 on GPU (got 8)")),
    "gdn_pallas_tpu_chunk_1": case("_kernels_gdn_backend", ["kernels.gdn.backend=pallas_tpu", "gdn.chunk_size=1",
                                                            "kernels.attention.backend=xla"],
                                   ("kernels.gdn.backend", "needs gdn.chunk_size >= 2 on TPU"), **TPU),
    "gdn_layout_everything_unmet": case("_kernels_gdn_layout", [*CP2, "train.seq_len=128", "kernels.gdn.layout=token_major"],
                                        ("kernels.gdn.layout", "sets the Mosaic GDN core's blocks; kernels.gdn.backend "
                                         "is xla here (set kernels.gdn.backend=pallas_tpu, or layout head_major); under "
                                         "context parallelism needs gdn.cp_terms_in_kernel=true (the grouped core's "
                                         "kernels); needs lane-aligned columns per key head on a TPU: key dim 16 and "
                                         "value heads per key head x value dim 32 not a multiple of 128 lanes "
                                         "(model.gdn_key_dim, model.gdn_value_dim)")),
    "gdn_precision_on_the_xla_core": case("_kernels_gdn_precision", ["kernels.gdn.precision=bfloat16"],
                                          ("kernels.gdn.precision", "kernels.gdn.backend is xla here")),
    # fp8
    "fp8_hoist_everything_unmet": case("_quant_fp8_fake_quant_hoist", ["quant.fp8_fake_quant_hoist=gather8",
                                                                       "moe.impl=dense", "mesh.fsdp=1", "mesh.data=-1"],
                                       ("quant.fp8_fake_quant_hoist", "needs quant.fp8_moe_fake_quant=true (it hoists "
                                        "the fake quantization's absmax); gather8 needs moe.impl=sparse (the "
                                        "grouped-matmul path); gather8 needs FSDP-sharded expert weights")),
    "fp8_gmm_on_dense": case("_quant_fp8_gmm", ["quant.fp8_gmm=true", "moe.impl=dense"],
                             ("quant.fp8_gmm", "needs moe.impl=sparse")),
    "fp8_gmm_with_replay": case("_quant_fp8_gmm", ["quant.fp8_gmm=true", "moe.routing_replay=true"],
                                ("quant.fp8_gmm", "moe.routing_replay runs the default (unquantized) MoE program")),
    "fp8_gmm_on_pallas": case("_quant_fp8_gmm", ["quant.fp8_gmm=true", "kernels.gmm.backend=pallas_tpu",
                                                 "kernels.interpret=true"],
                              ("quant.fp8_gmm", "kernels.gmm.backend=pallas_tpu has no fp8 grouped matmul")),
    # on-chip memory
    "vmem_limit_over_a_core": case("_kernels_vmem", ["kernels.gmm.vmem_limit_mib=1000"],
                                   ("kernels.gmm.vmem_limit_mib", "1000.0 MiB is more than")),
    # the rl command's own rules (check_rl_requirements)
    "prompt_len_vs_context_ranks": case("_rl_sequences", [*CP2, "gdn.chunk_size=4", "rl.max_prompt_len=7",
                                                          "rl.max_new_tokens=9"],
                                        ("rl.max_prompt_len", "e.g. rl.max_prompt_len=8")),
    "rl_rows_vs_context_chunks": case("_rl_sequences", [*CP2, "gdn.chunk_size=4", "rl.max_prompt_len=8",
                                                        "rl.max_new_tokens=3"],
                                      ("rl.max_new_tokens", "must be a multiple of 8")),
    "rl_rows_vs_token_chunks": case("_rl_sequences", ["moe.token_chunks=2", "rl.max_new_tokens=7"],
                                    ("rl.max_new_tokens", "moe.token_chunks=2 does not divide the 23 tokens of a GRPO row")),
    "rl_rows_vs_query_block": case("_rl_sequences", ["kernels.attention.block_q=16"],
                                   ("kernels.attention.block_q", "rl.max_prompt_len + rl.max_new_tokens = 24")),
    "rl_buffers": case("_moe_capacity_factor", ["moe.capacity_factor=1.0"], ("moe.capacity_factor", "dropless MoE only")),
    # Accepted before, every prompt was a counted skip and the run stopped after the warm-up.
    "no_prompt_fits": case("_rl_max_prompt_len", ["rl.task=format"],
                           ("rl.max_prompt_len", "its shortest, 'answer only: 0+0=', is 18 tokens with BOS"),
                           tokenizer=CHARACTERS),
    # 17 slots hold the prompt's 17 characters but not its BOS: still no prompt fits.
    "prompt_fits_but_not_its_bos": case("_rl_max_prompt_len", ["rl.task=format", "rl.max_prompt_len=17"],
                                        ("rl.max_prompt_len", "is 18 tokens with BOS"), tokenizer=CHARACTERS),
    # 2 prompts x 4 = 8 rows: 4 passes divide the rows but not the prompts.
    "rollout_batches_vs_prompts_not_rows": case("_rl_shapes", ["rl.prompts_per_step=2", "rl.group_size=4",
                                                               "rl.rollout_batches=4"],
                                                ("rl.rollout_batches", "4 sampler passes do not divide "
                                                 "rl.prompts_per_step=2")),
    # 2 x 4 = 8 rows in 2 mini-batches: a micro-batch of 4 rows over 8 batch shards (8 rows would split).
    "mini_batch_rows_vs_batch_shards": case("_rl_prompts_per_step", ["rl.prompts_per_step=2", "rl.group_size=4",
                                                                     "rl.updates_per_rollout=2"],
                                            ("rl.prompts_per_step", "a micro-batch of 4 rollouts")),
    # 64-token rows on 2 context ranks: 64 token chunks divide a row, not a rank's 32 tokens.
    "token_chunks_vs_a_ranks_share": case("_moe_token_chunks", [*CP2, *ATTENTION_ONLY, "moe.token_chunks=64"],
                                          ("moe.token_chunks", "does not divide the 32 tokens of a training row")),
    # GRPO rows of 32 + 94 = 126 tokens: whole on 2 ranks, not in the 4 half-chunks of load balancing.
    "rl_rows_vs_load_balanced_halves": case("_rl_sequences", [*CP2, *ATTENTION_ONLY, "attention.cp_load_balance=true",
                                                              "rl.max_new_tokens=94"],
                                            ("rl.max_new_tokens", "must be a multiple of 4")),
}


# Configs at a limit that every rule accepts (the limit itself is allowed): each is the tiny recipe
# with overrides, and the facts a caller gives. A comparison off by one (< for <=) refuses one.
ACCEPTED: dict[str, Case] = {
    # token-major blocks on the Mosaic core, interpreted (every block width fits)
    "gdn_layout_token_major_interpreted": case((), ["kernels.gdn.backend=pallas_tpu", "kernels.interpret=true",
                                                    "kernels.gdn.layout=token_major"]),
    # train.seq_len = model.max_seq_len = 256
    "training_rows_fill_the_context": case((), ["train.seq_len=256"]),
    # remat.expert_grad_lag = len(model.layer_pattern) - 1: the block's input holds every layer's gradient
    "expert_grad_lag_spans_the_block": case((), [*TWO_LAYER_BLOCKS, "remat.expert_grad_barrier=true", "remat.expert_grad_lag=1"]),
    # rl.max_prompt_len + rl.max_new_tokens = 8 + 248 = model.max_seq_len = 256
    "grpo_rows_fill_the_context": case((), ["rl.max_prompt_len=8", "rl.max_new_tokens=248"]),
    # the lever where the sort-and-group dispatch runs: ragged_dot named, or the grouped path (a lever on)
    "gather_backward_on_ragged_dot": case((), ["moe.gather_backward=true", "kernels.gmm.xla_impl=ragged_dot"]),
    "gather_backward_on_the_grouped_path": case((), ["moe.gather_backward=true", "moe.router_grad_from_wo_input=true"]),
    # minimal with a save list: the matmul outputs and the named grouped-matmul halves
    "save_list_under_minimal": case((), ["remat.policy=minimal", "remat.save=[moe_gate,moe_up]"]),
    # the Mosaic GDN core's output and residuals kept, on one sequence shard
    "core_residuals_with_the_output": case((), [*MOSAIC_GDN, *KEPT_CORE]),
    # the flash core's residuals kept under context parallelism that gathers the keys (the core is local)
    "attn_residuals_all_gather": case((), [*CP2, "train.seq_len=128", *KEPT_ATTENTION_CORE]),
    "cp_terms_in_kernel_on_the_mosaic_core": case((), [*CP2, "train.seq_len=128", "gdn.cp_terms_in_kernel=true",
                                                       "kernels.gdn.backend=pallas_tpu", "kernels.interpret=true"]),
    # every token routed to all 8 experts
    "top_k_is_every_expert": case((), ["model.num_experts_per_tok=8"]),
    # the format task's shortest prompt, 'answer only: 0+0=' with BOS, is 18 characters: it fits 18
    "shortest_prompt_fills_the_prompt_rows": case((), ["rl.task=format", "rl.max_prompt_len=18"], tokenizer=CHARACTERS),
    # 8 rows over data=2 x fsdp=2 x expert=2 = 8 batch shards
    "rollout_rows_one_per_batch_shard": case((), ["mesh.expert=2", "rl.prompts_per_step=4", "rl.group_size=2"]),
    # load balancing over 4 ranks (an even count): rows of 64 and 32 + 96 tokens in 8 half-chunks
    "load_balance_over_four_ranks": case((), ["mesh.context=4", "mesh.data=1", *ATTENTION_ONLY,
                                              "rl.max_prompt_len=32", "rl.max_new_tokens=96",
                                              "attention.cp_load_balance=true"], **BUILT),
}


def unchecked_config(overrides) -> object:
    """The tiny recipe with `overrides`, field checks applied but no rule run."""
    real = load_module.check_requirements
    load_module.check_requirements = lambda cfg, **kw: None
    try:
        return load_config("tiny", list(overrides))
    finally:
        load_module.check_requirements = real


def problems_by_rule(cfg, facts: dict) -> dict[str, list]:
    f = validate.Facts(**facts)
    return {r.__name__: r(cfg, f) for r in (*validate.RULES, *validate.RL_RULES)}


def _assert_problems(got: list, want: tuple) -> None:
    assert len(got) == len(want), (got, want)
    for key, fragment in want:
        assert any(k == key and fragment in m for k, m in got), f"no problem ({key}, ...{fragment}...) in {got}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_refuses_its_case_naming_the_keys(name):
    c = CASES[name]
    cfg = unchecked_config(c.overrides)
    fired = {rule: p for rule, p in problems_by_rule(cfg, c.facts).items() if p}
    assert sorted(fired) == sorted(c.rules), f"rules that reported: {fired}"
    _assert_problems([p for rule in c.rules for p in fired[rule]], c.problems)
    # The callers raise one ConfigError with those problems: the loaders and set-up (every rule of
    # RULES), the rl command (RL_RULES, after them).
    load = [p for r in validate.RULES if r.__name__ in fired for p in fired[r.__name__]]
    rl = [p for r in validate.RL_RULES if r.__name__ in fired for p in fired[r.__name__]]
    load_facts = {k: v for k, v in c.facts.items() if k != "tokenizer"}
    rl_facts = {k: v for k, v in c.facts.items() if k != "checkpoint_model"}
    if load:
        with pytest.raises(ConfigError) as e:
            if load_facts.get("devices") or load_facts.get("checkpoint_model"):
                validate.check_requirements(cfg, **load_facts)  # set-up's pass, --init-hf's
            else:
                load_config("tiny", list(c.overrides), platform=c.facts.get("platform"))
        assert e.value.problems == load
    else:
        validate.check_requirements(cfg, **load_facts)
    if rl:
        with pytest.raises(ConfigError) as e:
            validate.check_rl_requirements(cfg, **rl_facts)
        assert e.value.problems == rl
    else:
        validate.check_rl_requirements(cfg, **rl_facts)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_configs_at_a_limit_are_accepted(name):
    c = ACCEPTED[name]
    cfg = unchecked_config(c.overrides)
    fired = {rule: p for rule, p in problems_by_rule(cfg, c.facts).items() if p}
    assert not fired, f"rules that refused a config at its limit: {fired}"
    validate.check_requirements(cfg, **{k: v for k, v in c.facts.items() if k != "tokenizer"})
    validate.check_rl_requirements(cfg, **{k: v for k, v in c.facts.items() if k != "checkpoint_model"})


def test_every_rule_has_a_refusal_case():
    """A rule registered without a case here fails; so does a case whose rule is gone."""
    registered = {r.__name__ for r in (*validate.RULES, *validate.RL_RULES)}
    covered = {rule for c in CASES.values() for rule in c.rules}
    assert registered - covered == set(), f"rules without a refusal case: {sorted(registered - covered)}"
    assert covered - registered == set(), f"cases of rules no longer registered: {sorted(covered - registered)}"


def _problem_sites() -> dict[int, str]:
    """{line: source} of every statement of validate.py that reports a problem: an append to the
    problem lists the rules build (out, unmet, problems) and a returned non-empty list."""
    path = Path(inspect.getsourcefile(validate))
    source = path.read_text()
    lines = source.splitlines()
    sites = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "append" and isinstance(f.value, ast.Name) \
                    and f.value.id in ("out", "unmet", "problems"):
                sites[node.lineno] = lines[node.lineno - 1].strip()
        elif isinstance(node, ast.Return) and node.value is not None:
            value = node.value.body if isinstance(node.value, ast.IfExp) else node.value
            if (isinstance(value, ast.List) and value.elts) or isinstance(value, ast.ListComp):
                sites[node.lineno] = lines[node.lineno - 1].strip()
    return sites


def test_every_problem_a_rule_can_report_has_a_refusal_case():
    """Each statement of validate.py that reports a problem runs in some case of the table: a
    check added to a rule without its refusal case fails here."""
    sites = _problem_sites()
    assert len(sites) > 80, len(sites)  # the walk finds the statements (94 when written)
    path = inspect.getsourcefile(validate)
    reached: set[int] = set()

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            reached.add(frame.f_lineno)
        return tracer

    rules = {r.__name__: r for r in (*validate.RULES, *validate.RL_RULES)}
    for c in CASES.values():
        cfg = unchecked_config(c.overrides)
        f = validate.Facts(**c.facts)
        sys.settrace(tracer)
        try:
            for name in c.rules:
                rules[name](cfg, f)
        finally:
            sys.settrace(None)
    missing = {line: text for line, text in sorted(sites.items()) if line not in reached}
    assert not missing, "problems no case reaches:\n" + "\n".join(f"  validate.py:{k}: {v}" for k, v in missing.items())


# ---------------------------------------------------------------------------------------------
# The rl command runs its rules before anything is built, for the devices it builds on and with
# the tokenizer of its task (both unknown to a plain load).

class _Built(Exception):
    """open_session was reached: the run would build its set-up and start the warm-up."""


@pytest.fixture
def rl_loop(monkeypatch):
    from hybridmoe.rl import loop

    def reached(*args, **kwargs):
        raise _Built()

    monkeypatch.setattr(loop, "open_session", reached)
    return loop


def test_the_rl_command_decides_its_rows_on_the_devices_it_builds_on(rl_loop):
    """mesh.context=-1 on real devices: the load cannot know the context ranks, so the GRPO rows'
    split (24 tokens over 8 ranks, in whole 8-token GDN chunks) went unchecked until the rows were
    placed at the first GRPO step, after the warm-up. The rl command decides it on the 8 devices."""
    cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1", "mesh.context=-1",
                               "gdn.chunk_size=8"])
    validate.check_rl_requirements(cfg)  # undecided without the device count
    with pytest.raises(ConfigError) as e:
        rl_loop.run_rl(cfg, None, progress=False)
    assert [k for k, _ in e.value.problems] == ["rl.max_new_tokens"], e.value.problems
    assert "mesh.context=8" in e.value.problems[0][1]


def test_the_rl_command_measures_its_own_tasks_prompts(rl_loop):
    """The demo's 8 prompt tokens hold no prompt of the format task (18 with BOS): refused before
    the 100 warm-up steps. A task the caller hands in is the caller's to size: no refusal."""
    from hybridmoe.data.arithmetic import ArithmeticTask

    with pytest.raises(ConfigError) as e:
        rl_loop.run_rl(load_config("demo", ["rl.task=format"]), None, progress=False)
    assert [k for k, _ in e.value.problems] == ["rl.max_prompt_len"]
    with pytest.raises(_Built):
        rl_loop.run_rl(load_config("demo", ["rl.task=format"]), None, progress=False,
                       task=ArithmeticTask(digits=1, prefix="answer only: "))


# ---------------------------------------------------------------------------------------------
# Broken validators: each (the RULES list to patch in, the tests here that must fail under it).

def _without(name: str) -> list:
    return [r for r in validate.RULES if r.__name__ != name]


def _dropping(name: str, key: str) -> list:
    """RULES with rule `name` no longer reporting its problems of `key` (one check deleted)."""
    def broken(cfg, f):
        return [p for p in original(cfg, f) if p[0] != key]

    original = next(r for r in validate.RULES if r.__name__ == name)
    broken.__name__, broken.keys = name, original.keys
    return [broken if r is original else r for r in validate.RULES]


def _mutating(name: str, old: str, new: str) -> tuple[list, list]:
    """(RULES, RL_RULES) with rule `name`'s source edited (the one occurrence of `old` made `new`)."""
    original = getattr(validate, name)
    source = textwrap.dedent(inspect.getsource(original))
    assert source.count(old) == 1, f"{name}: {old!r} occurs {source.count(old)} times; update the variant"
    register = lambda *keys, **kw: lambda fn: fn  # noqa: E731 -- the broken copy stays out of the lists
    namespace = {**vars(validate), "rule": register, "rl_rule": register}
    exec(compile(source.replace(old, new), f"<{name}, broken>", "exec"), namespace)  # noqa: S102
    broken = namespace[name]
    broken.keys = original.keys
    return tuple([broken if r is original else r for r in rules] for rules in (validate.RULES, validate.RL_RULES))


BROKEN_VALIDATORS = {
    # a rule deleted (its registration lost)
    "remat_save_unregistered": (lambda: _without("_remat_save"),
                                ["enumeration", "save_list_without_custom", "save_list_unknown_name"]),
    "replay_rule_unregistered": (lambda: _without("_moe_routing_replay"),
                                 ["enumeration", "replay_with_token_chunks", "replay_with_the_ring"]),
    # one check of a rule deleted
    "greedy_check_dropped": (lambda: _dropping("_rl_shapes", "rl.temperature"), ["greedy_grpo"]),
    # a comparison off by one: the limit itself refused
    "grpo_rows_at_the_context_refused": (lambda: _mutating("_rl_shapes", "r.sequence_len > cfg", "r.sequence_len >= cfg"),
                                         ["accepted:grpo_rows_fill_the_context"]),
    "top_k_of_every_expert_refused": (lambda: _mutating("_model_shapes", "num_experts_per_tok > m.", "num_experts_per_tok >= m."),
                                      ["accepted:top_k_is_every_expert"]),
    "prompt_filling_the_rows_refused": (lambda: _mutating("_rl_max_prompt_len", "tokens(shortest) <= r.", "tokens(shortest) < r."),
                                        ["accepted:shortest_prompt_fills_the_prompt_rows"]),
    # the rows' split checked against the wrong product of mesh axes (the expert axis left out)
    "rows_split_without_the_expert_axis": (lambda: _mutating("_rl_prompts_per_step", '["fsdp"] * sizes["expert"]', '["fsdp"]'),
                                           ["rollout_rows_vs_expert_shards"]),
    # load balancing refused over one rank only, not over an odd count
    "odd_ranks_balanced": (lambda: _mutating("_attention_context_parallel",
                                             "(P < 2 or P % 2):\n            out.append((\"attention.cp_load_balance\"",
                                             "P < 2:\n            out.append((\"attention.cp_load_balance\""),
                           ["load_balance_over_odd_ranks"]),
}


@pytest.mark.parametrize("variant", sorted(BROKEN_VALIDATORS))
def test_the_broken_validators_are_caught(variant, monkeypatch):
    rules, caught_by = BROKEN_VALIDATORS[variant]
    rules = rules()
    if isinstance(rules, tuple):
        rules, rl_rules = rules
        monkeypatch.setattr(validate, "RL_RULES", rl_rules)
    monkeypatch.setattr(validate, "RULES", rules)
    for name in caught_by:
        with pytest.raises((AssertionError, ConfigError)):
            if name == "enumeration":
                test_every_rule_has_a_refusal_case()
            elif name.startswith("accepted:"):
                test_configs_at_a_limit_are_accepted(name.removeprefix("accepted:"))
            else:
                test_each_rule_refuses_its_case_naming_the_keys(name)
