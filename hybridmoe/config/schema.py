"""The config tree: one pydantic model with nested sections.

Field checks live on each section; cross-field requirements live in `validate.py`, which runs once
at load and collects every unmet requirement into one error. Derived values are properties.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LayerKind = Literal["gdn", "attention"]

# Every checkpoint name the layers define (remat.save may only use these).
CHECKPOINT_NAMES = ("attn_q", "attn_out", "attn_core_residuals", "gdn_q", "gdn_k", "gdn_v", "gdn_core_out",
                    "gdn_core_residuals", "moe_gate", "moe_up", "attn_lb_ids", "gdn_cp_transition", "gdn_cp_state_in")
# The remat policies that take remat.save: custom keeps only those names, minimal keeps them besides
# the matmul outputs (model/remat.py).
SAVE_LIST_POLICIES = ("custom", "minimal")
DType = Literal["float32", "bfloat16"]


def bare_off(v):
    """An enum value `off`: YAML 1.1 reads a bare `off` as False."""
    return "off" if v is False else v


def fewest(count: int | str) -> int:
    """A count key's value (micro-batches, sampler passes), or 1 under auto: the fewest auto can
    choose, and what a program called outside a run's memory plan runs at."""
    return 1 if count == "auto" else count


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class ModelConfig(Section):
    vocab_size: int = Field(256, gt=0, description="Vocabulary size (embedding rows, LM head columns).")
    d_model: int = Field(64, gt=0, description="Residual stream width D.")
    num_layers: int = Field(4, gt=0, description="Decoder layers; a multiple of len(layer_pattern).")
    layer_pattern: tuple[LayerKind, ...] = Field(
        ("gdn", "gdn", "gdn", "attention"), min_length=1,
        description="The repeating block of token mixers, e.g. three GDN layers then one attention layer.",
    )
    # Gated attention.
    num_heads: int = Field(4, gt=0, description="Attention query heads.")
    num_kv_heads: int = Field(2, gt=0, description="Attention key/value heads (grouped-query).")
    head_dim: int = Field(16, gt=0, description="Attention head dimension.")
    rope_theta: float = Field(10_000_000.0, gt=0, description="Rotary embedding base.")
    partial_rotary_factor: float = Field(0.25, gt=0, le=1, description="Fraction of head_dim that is rotated.")
    # Gated DeltaNet.
    gdn_num_key_heads: int = Field(2, gt=0, description="GDN query/key heads Hk.")
    gdn_num_value_heads: int = Field(4, gt=0, description="GDN value heads Hv (a multiple of Hk).")
    gdn_key_dim: int = Field(16, gt=0, description="GDN key head dimension dk.")
    gdn_value_dim: int = Field(16, gt=0, description="GDN value head dimension dv.")
    gdn_conv_kernel: int = Field(4, gt=0, description="Causal depthwise conv width over the qkv channels.")
    # Mixture of experts.
    num_experts: int = Field(8, gt=0, description="Routed experts E.")
    num_experts_per_tok: int = Field(2, gt=0, description="Experts each token is routed to (top-k).")
    moe_intermediate_size: int = Field(32, gt=0, description="Routed expert hidden width F.")
    shared_expert_intermediate_size: int = Field(32, ge=0, description="Shared expert hidden width (0 = none).")
    norm_topk_prob: bool = Field(True, description="Renormalise the top-k routing weights to sum to one.")
    rms_norm_eps: float = Field(1e-6, gt=0, description="Epsilon of every RMSNorm.")
    tie_word_embeddings: bool = Field(False, description="The LM head is the embedding table (one tensor, trained by "
                                      "both uses); false: a separate lm_head weight.")
    max_seq_len: int = Field(256, gt=0, description="Longest sequence the model is used with.")
    param_dtype: DType = Field("float32", description="Storage dtype of the weights.")
    compute_dtype: DType = Field("float32", description="Dtype of matmul inputs and activations.")
    init_std: float = Field(0.02, gt=0, description="Standard deviation of the normal weight initialiser.")

    @property
    def num_blocks(self) -> int:
        return self.num_layers // len(self.layer_pattern)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class MeshConfig(Section):
    data: int = Field(1, description="Data-parallel axis size (-1 absorbs the remaining devices).")
    fsdp: int = Field(-1, description="Fully-sharded data-parallel axis size (-1 absorbs the rest).")
    context: int = Field(1, description="Context (sequence) parallel axis size.")
    expert: int = Field(1, description="Expert-parallel axis size.")
    tensor: int = Field(1, description="Tensor-parallel axis size.")
    rules: Literal["default", "cp_as_ep"] = Field(
        "default", description="Logical-axis rules table: default, or experts sharded over context x expert."
    )
    expert_fsdp_dim: Literal["embed", "exp"] = Field(
        "embed", description="The dimension of the routed expert weights (wi, wo) that FSDP splits: the model "
        "width (embed), or the experts (exp: E over the expert axis and then the FSDP axes; needs "
        "model.num_experts to split over them). exp keeps each shard's minor dimension whole, where a split D "
        "pads to the TPU's 128 lanes (wo [E, F, D] at 128 FSDP ranks and D 4096: 4x its bytes). The same "
        "numbers either way (docs/levers.md)."
    )
    cpu_devices: int = Field(
        0, ge=0, description="Simulated devices when running on CPU (0 = the platform's own count)."
    )
    distributed: bool = Field(
        False, description="Join JAX's multi-controller runtime at start-up: one process per host, the "
        "coordinator found from the cluster (TPU pods, SLURM, ...) unless given below; the mesh then spans every "
        "host. With cpu_devices, each process simulates that many devices and collectives run over gloo.")
    coordinator_address: str = Field(
        "", description="host:port of process 0's coordinator (empty = found from the cluster); "
        "`hybridmoe launch` sets it, with num_processes and process_id, for processes on one machine.")
    num_processes: int = Field(0, ge=0, description="Processes of a distributed run (0 = found from the cluster).")
    process_id: int = Field(0, ge=0, description="This process's index in a distributed run (with num_processes).")

    @field_validator("data", "fsdp", "context", "expert", "tensor")
    @classmethod
    def _axis_size(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("an axis size is a positive integer, or -1 to absorb the remaining devices")
        return v

    @property
    def simulated_devices(self) -> int:
        """Simulated CPU devices of the whole run (every process's), 0 when not simulating."""
        return self.cpu_devices * max(self.num_processes, 1)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "context": self.context, "expert": self.expert,
                "tensor": self.tensor}

    def resolve(self, num_devices: int) -> tuple[dict[str, int], tuple[str, str] | None]:
        """(axis sizes with the -1 axis absorbing the rest, or the problem as (key, message))."""
        sizes = dict(self.axis_sizes)
        free = [k for k, v in sizes.items() if v == -1]
        fixed = math.prod(v for v in sizes.values() if v != -1)
        if len(free) > 1:
            return sizes, ("mesh", f"at most one axis may be -1; got {', '.join('mesh.' + k for k in free)}")
        if free:
            if num_devices % fixed:
                others = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items() if v not in (-1, 1))
                return sizes, (f"mesh.{free[0]}", f"cannot absorb the rest: {num_devices} devices are not a "
                               f"multiple of the other axes' product {fixed} ({others}); change those axes")
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            return sizes, ("mesh", f"axis sizes multiply to {fixed} but {num_devices} devices are present; "
                           "set one axis to -1 to absorb the rest")
        return sizes, None


class MoEConfig(Section):
    impl: Literal["sparse", "dense"] = Field(
        "sparse", description="sparse: dropless sort-and-group grouped matmuls; dense: every expert on every token (reference)."
    )
    expert_parallel: Literal["ring"] = Field(
        "ring", description="How tokens reach experts sharded over the expert axis: ring (all-gather the tokens over "
        "the expert axes, run the local experts, reduce-scatter the outputs), the one scheme built.")
    capacity_factor: float = Field(
        0.0, ge=0, description="Per-expert buffer as a multiple of the even share (0 = dropless); overflow is dropped and counted."
    )
    token_chunks: int = Field(
        1, ge=1, description="The routed experts run over the tokens (after the ring's gather) in this many chunks, one "
        "after another, each replayed alone in the backward: every [tokens x k, d_model] row buffer is this many times "
        "smaller; the tokens a device's MoE sees in training must divide by it. 1 = one chunk."
    )
    wi_fused_swiglu: bool = Field(
        False, description="Up projection as one grouped matmul over the prefused [gate | up] weight with SwiGLU in its epilogue."
    )
    wo_fused_dswiglu: bool = Field(
        False, description="Down projection whose input-gradient grouped matmul runs the SwiGLU backward in its epilogue."
    )
    router_grad_from_wo_input: bool = Field(
        False, description="Routing weight scales the down projection's input (h * w) instead of its output."
    )
    gather_backward: bool = Field(
        False, description="The backward of the dispatch's two row moves (tokens to expert order, outputs back) as "
        "gathers by the inverse permutation, where autodiff writes scatter-adds: the same sums (a token's k rows "
        "summed in float32), no scatter. On the sort-and-group paths (ragged_dot and the kernel family).")
    group_align_rows: int = Field(
        0, ge=0, description="The sort-and-group dispatch writes each local expert's rows from a multiple of this "
        "many and pads the expert to a whole multiple with zero rows, so a grouped matmul whose row tile divides it "
        "never computes a tile that spans two experts twice (on average half a tile of padding per expert instead "
        "of a whole tile per expert edge: docs/levers.md). Every real row is computed as without it. 0 = off; a "
        "multiple of 8; dropless only.")
    routing_replay: bool = Field(
        False, description="Rollout routing replay (GRPO): the sampler records each token's experts per layer and "
        "the trainer's forward routes by them (weights from its own router over those experts)."
    )


class GmmKernelConfig(Section):
    backend: Literal["xla", "pallas_tpu", "pallas_gpu"] = Field(
        "xla", description="Grouped-matmul backend; checked against the platform at load."
    )
    xla_impl: Literal["auto", "ragged_dot", "row_tiles"] = Field(
        "auto", description="The xla backend's grouped matmul on every MoE path: jax.lax.ragged_dot, or row_tiles "
        "(rows padded once per group to tiles, one batched matmul; on CPU, where ragged_dot computes every group "
        "for every row, several times faster); auto: row_tiles on CPU, ragged_dot on GPU/TPU.")
    xla_tile_rows: int = Field(128, gt=0, description="Rows per tile of the row_tiles grouped matmul.")
    tiling: Literal["heuristic", "auto", "explicit"] = Field(
        "heuristic", description="heuristic: the kernels' default tiles (128 x 128 x 128); auto: each plain grouped "
        "matmul's tiles measured fastest on this chip generation at its shape (kernels/gmm/tile_table.json, filled "
        "by `hybridmoe tune-gmm`), the heuristic ones where the table has none; explicit: the tm/tk/tn and "
        "per-half tile below."
    )
    tm: int = Field(128, gt=0, description="Row tile (explicit tiling; Pallas backends).")
    tk: int = Field(128, gt=0, description="Contraction tile (explicit tiling; Pallas backends).")
    tn: int = Field(128, gt=0, description="Output-column tile (explicit tiling; Pallas backends).")
    wi_fwd_tile_n_per_half: int = Field(
        0, ge=0, description="Fused up-projection forward: output tile per half of [gate | up] (explicit tiling; 0 = F)."
    )
    wi_fwd_rhs_buffer_count: int = Field(
        0, description="Fused up-projection forward: the weight operand's pipeline depth (0 = kernel default, "
        "2 on Mosaic TPU; 1 frees the VMEM of one weight block)."
    )
    vmem_limit_mib: float = Field(0.0, ge=0, description="Mosaic TPU scoped VMEM limit of the grouped matmuls in MiB (0 = auto: the compiler's default where the kernel fits it, else its need, up to 48; kernels/vmem.py).")
    epilogue: Literal["float32", "match_unfused"] = Field(
        "float32", description="Fused epilogues: float32 (real), or match_unfused (rounds where the unfused path does; exactness proofs)."
    )
    # Per-kernel tiles (explicit tiling): 0 = the shared tm / tk / tn above.
    wi_fwd_tm: int = Field(0, ge=0, description="wi forward row tile (0 = tm).")
    wi_fwd_tk: int = Field(0, ge=0, description="wi forward contraction tile over D (0 = tk).")
    wi_fwd_tn: int = Field(0, ge=0, description="wi forward output tile over 2F, unfused only (0 = tn; fused: wi_fwd_tile_n_per_half).")
    wi_dlhs_tm: int = Field(0, ge=0, description="wi input gradient row tile (0 = tm).")
    wi_dlhs_tk: int = Field(0, ge=0, description="wi input gradient contraction tile over 2F (0 = tk).")
    wi_dlhs_tn: int = Field(0, ge=0, description="wi input gradient output tile over D (0 = tn).")
    wi_drhs_tm: int = Field(0, ge=0, description="wi weight gradient row tile (0 = tm).")
    wi_drhs_tk: int = Field(0, ge=0, description="wi weight gradient tile over D (0 = tk).")
    wi_drhs_tn: int = Field(0, ge=0, description="wi weight gradient tile over 2F (0 = tn).")
    wo_fwd_tm: int = Field(0, ge=0, description="wo forward row tile (0 = tm).")
    wo_fwd_tk: int = Field(0, ge=0, description="wo forward contraction tile over F (0 = tk).")
    wo_fwd_tn: int = Field(0, ge=0, description="wo forward output tile over D (0 = tn).")
    wo_dlhs_tm: int = Field(0, ge=0, description="wo input gradient row tile (0 = tm).")
    wo_dlhs_tk: int = Field(0, ge=0, description="wo input gradient contraction tile over D (0 = tk).")
    wo_dlhs_tn: int = Field(0, ge=0, description="wo input gradient output tile over F, unfused only (0 = tn; fused: one tile of F).")
    wo_drhs_tm: int = Field(0, ge=0, description="wo weight gradient row tile (0 = tm).")
    wo_drhs_tk: int = Field(0, ge=0, description="wo weight gradient tile over F (0 = tk).")
    wo_drhs_tn: int = Field(0, ge=0, description="wo weight gradient tile over D (0 = tn).")


class GdnKernelConfig(Section):
    backend: Literal["auto", "xla", "pallas_tpu", "pallas_gpu"] = Field(
        "auto", description="Gated DeltaNet core backend: xla (any platform), pallas_tpu (Mosaic TPU kernels) or "
        "pallas_gpu (Triton kernels); the Pallas ones run on CPU with kernels.interpret=true; auto: pallas_tpu on "
        "TPU (4.4x the xla path on a v5e chip: docs/tpu.md), xla elsewhere.")
    precision: Literal["auto", "bfloat16x3", "bfloat16x3_bf16_inverse", "bfloat16", "float32"] = Field(
        "auto", description="The Mosaic GDN core's products (kernels/gdn/tpu_chunk.py PRECISIONS; docs/gdn.md): auto: "
        "float32 for float32 activations, bfloat16x3_bf16_inverse for bfloat16 (three bfloat16 passes per product "
        "but for the triangular inverse's doubling, at one: the xla path's errors but the final state's; 1.08x "
        "bfloat16x3's forward + backward on a v5e at the 397B cell's core, benchmarks/records/tpu_kernels.json "
        "gdn_cell); bfloat16x3: three passes for every product (the xla path's errors); bfloat16: one pass for the "
        "chunk's own products and the triangular inverse, three for the state and the chain between chunks (1.09x "
        "the default, 1.23x with gdn.chunk_size=128); needs the pallas_tpu core (on the whole sequence or under "
        "context parallelism).")
    layout: Literal["head_major", "token_major"] = Field(
        "head_major", description="How the Mosaic GDN core's kernels read q, k, v (and dO) and write o (and dq, dk, "
        "dv): head_major, XLA transposes them to [B, G, (H/G,) T, X] and back; token_major, the kernels' blocks are "
        "a key head's lane-aligned columns of the token-major arrays, so the layer's flat projections reach them "
        "with no copy (at the 397B cell's core six value-sized copies fewer per forward + backward by the compiled "
        "program; yet a v5e chip timed the core 1.02x slower on them and the one-chip step 1.02x: docs/gdn.md, "
        "Layouts); needs the pallas_tpu core, the key dim and "
        "H/G x the value dim multiples of 128 on a TPU, and under context parallelism gdn.cp_terms_in_kernel.")


class AttentionKernelConfig(Section):
    backend: Literal["auto", "xla", "blocked", "pallas_tpu", "pallas_gpu"] = Field(
        "auto", description="The attention core (self-attention, and the local core of context parallelism): "
        "xla (flash attention in XLA ops), blocked (the masked XLA core over query blocks), pallas_tpu / pallas_gpu "
        "(flash kernels; on CPU with kernels.interpret=true; pallas_gpu not yet run on a GPU); auto: pallas_tpu on "
        "TPU, xla elsewhere (on CPU "
        "0.47 of blocked's time at the small shape: benchmarks/records/attention_cpu_backend.json).")
    block_q: int = Field(0, ge=0, description="Query tokens per block (flash backends; blocked: its query block "
                         "length); 0 = the backend's default (xla 256, pallas_tpu 128, pallas_gpu 64) fitted to the local length.")
    block_k: int = Field(0, ge=0, description="Key tokens per block (flash backends); 0 = the backend's default "
                         "(xla 256, pallas_tpu 512, pallas_gpu 64) fitted to the key length.")
    vmem_limit_mib: float = Field(0.0, ge=0, description="Mosaic TPU scoped VMEM limit of the flash kernels in MiB (0 = auto: the compiler's default where the kernel fits it, else its need, up to 48; kernels/vmem.py).")


class LogprobsKernelConfig(Section):
    chunk_tokens: int = Field(256, gt=0, description="Tokens per chunk of the LM head's log-probs (the supervised "
                              "loss and GRPO's; the full [tokens, vocab] logits are never built).")
    chunk_vocab: int = Field(4096, gt=0, description="Vocabulary columns per chunk of the LM head's log-probs.")
    save_logits: bool = Field(False, description="The backward reads the forward's logits instead of computing them "
                              "again: one of the LM head's three matmuls fewer, for the [tokens, vocab] float32 logits "
                              "kept from the forward to the backward (same gradients; kernels/logprobs.py).")


class KernelsConfig(Section):
    gmm: GmmKernelConfig = GmmKernelConfig()
    gdn: GdnKernelConfig = GdnKernelConfig()
    attention: AttentionKernelConfig = AttentionKernelConfig()
    logprobs: LogprobsKernelConfig = LogprobsKernelConfig()
    interpret: bool = Field(False, description="Run Pallas kernels in interpret mode (CPU testing).")


class QuantConfig(Section):
    fp8_moe_fake_quant: bool = Field(
        False, description="Round every routed-expert weight to its per-output-channel float8_e4m3fn grid "
        "(straight-through gradient), in every layer, forward and remat replay.")
    fp8_fake_quant_hoist: Literal["off", "absmax", "gather8"] = Field(
        "off", description="off; absmax: the fake quant's absmax computed once for the scanned stack before "
        "the layer scan; gather8: that, plus FSDP all-gathers of 1-byte fp8 codes instead of the weight.")
    fp8_gmm: bool = Field(
        False, description="MoE grouped matmuls in fp8 (forward, input and weight gradients): e4m3 weights "
        "and activations, e5m2 gradients, per-row / per-channel scales, float32 accumulation.")

    @field_validator("fp8_fake_quant_hoist", mode="before")
    @classmethod
    def _bare_off(cls, v):
        return bare_off(v)


class AttentionConfig(Section):
    cp_impl: Literal["all_gather", "ring"] = Field(
        "all_gather", description="Context parallelism's attention: all_gather (every rank gathers all keys and "
        "values) or ring (K/V blocks passed round the context ranks by collective-permute while the held block "
        "computes; partials merged by online softmax; two shards held instead of all keys). Needs mesh.context > 1.")
    cp_load_balance: bool = Field(
        False, description="Under context parallelism, each attention layer works in load-balanced order (rank r "
        "holds half-chunks r and 2P-1-r of the sequence) so causal work is even over the ranks; natural order outside.")
    cp_load_balance_hoist_ids: bool = Field(
        False, description="Save the load-balanced positions and segment ids (checkpoint name attn_lb_ids) under "
        "the custom remat policy, so the layer scan reorders them once instead of in every layer's backward.")


class GdnConfig(Section):
    chunk_size: int = Field(64, gt=0, description="Chunk length C of the chunked delta rule.")
    cp_m_scan: bool = Field(
        False, description="Sequence-sharded GDN (mesh.context > 1): form each rank's chunk-transition product "
        "by one sequential scan keeping one [dk, dk] product per head, instead of a balanced tree over the "
        "materialised [chunks, heads, dk, dk] stack.")
    cp_dh_scan: bool = Field(
        False, description="Sequence-sharded GDN: the backward's local state cotangent by the reverse "
        "recurrence as one scan instead of a tree over the [chunks, heads, dk, dk] stack.")
    cp_terms_in_kernel: bool = Field(
        False, description="Sequence-sharded GDN on the Mosaic core (kernels.gdn.backend pallas_tpu): each rank's "
        "pass 1 (its end state from zero and its chunks' transition product) and the backward's local state "
        "cotangent as Mosaic kernels that form the chunk terms in VMEM on the core's own layout (each key head "
        "once), instead of from chunk terms formed by float32 XLA ops; cp_m_scan and cp_dh_scan then have no part.")


class RematConfig(Section):
    policy: Literal["auto", "none", "full", "minimal", "custom"] = Field(
        "auto", description="What the layer scan saves for the backward: nothing extra, only inputs, matmul outputs, or the save list; "
        "auto: none when the estimated residuals fit a quarter of a device's memory, else full (model/remat.py)."
    )
    save: tuple[str, ...] = Field((), description="Checkpoint names saved: under the custom policy, these only; under "
                                  "minimal, these besides the matmul outputs (moe_gate and moe_up keep the grouped expert "
                                  "matmuls' outputs, which minimal alone recomputes; gdn_core_out with gdn_core_residuals, "
                                  "the Mosaic GDN core's chunk start states and inverses, spare the backward its second "
                                  "forward kernel; attn_core_residuals, the flash attention core's output and log-sum-exp, "
                                  "its second flash forward).")
    unit: Literal["block", "layer", "sublayer"] = Field(
        "block", description="What one checkpoint spans: the repeating block of model.layer_pattern (its input is kept, "
        "the backward replays the whole block and holds every layer's intermediates at once), each layer (every "
        "layer's input is kept, the backward replays one layer at a time: the peak holds one layer's intermediates) "
        "or each residual sublayer (the token mixer, the MoE block: both inputs of every layer are kept, the backward "
        "replays one sublayer at a time: the MoE block's backward never holds the mixer's intermediates)."
    )
    expert_grad_barrier: bool = Field(
        False, description="Each layer's backward hands its input's cotangent on only together with its MoE "
        "weights' gradient reduced to their shards (an optimization barrier): the gathered-size expert gradients of "
        "at most one layer are alive at once, and their reduction overlaps that layer's token-mixer backward only "
        "(off: the compiler may hold several layers' until the end of the block's backward). The values are "
        "unchanged."
    )
    expert_grad_lag: int = Field(
        0, ge=0, description="Under remat.expert_grad_barrier, how many layers below a layer's MoE weights' gradient "
        "reduction may still run: 0, only under that layer's token-mixer backward (its input's cotangent waits for "
        "it); 1, also under the whole backward of the layer below, which hands its input's cotangent on only with "
        "it (the gathered-size expert gradients of two layers alive at once). Within a repeating block of "
        "model.layer_pattern: the block's first layers' weights, which have no layer that far below them in the "
        "block, are tied to the block's input. The values are unchanged."
    )
    scan_layers: bool = Field(True, description="Run the layer stack as a lax.scan over repeating blocks.")


class TrainConfig(Section):
    steps: int = Field(100, ge=0, description="Optimizer steps.")
    batch_size: int = Field(8, gt=0, description="Sequences per optimizer step (global), split into train.micro_batches.")
    seq_len: int = Field(64, gt=1, description="Tokens per sequence.")
    micro_batches: int | Literal["auto"] = Field(
        "auto", description="Micro-batches the step's sequences are split into; gradients accumulate. auto: the fewest "
        "that divide train.batch_size (each micro-batch split over the batch shards) and whose compiled step fits "
        "run.memory_budget_gib (run/step_plan.py). A count set by hand whose step does not fit is refused before "
        "the first step, naming the count that fits.")
    learning_rate: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps: step k (from 0) runs at learning_rate * "
                              "min(k, warmup_steps) / warmup_steps (step 0 moves Adam's moments, not the weights); 0 = "
                              "the full rate from step 0.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay, scaled by the scheduled learning "
                                "rate, on every parameter (norm weights included).")
    b1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    b2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(1.0, ge=0, description="Global-norm clip (0 = off).")
    seed: int = Field(0, description="Seed of initialisation and data.")
    data: Literal["synthetic", "arithmetic", "files"] = Field(
        "synthetic", description="Training data: packed synthetic documents, the arithmetic task's solved examples, "
        "or the JSONL/Parquet text of data.path."
    )
    checkpoint_every: int = Field(50, ge=0, description="Steps between checkpoints (0 = only at the end).")
    log_every: int = Field(1, gt=0, description="Steps between metric records.")
    on_nonfinite: Literal["skip", "stop", "off"] = Field(
        "skip", description="A step whose loss or gradient norm is NaN/inf leaves the weights and optimizer state "
        "as they were (decided inside the jitted step) and is counted (metric update_skipped); stop: the run "
        "then checkpoints and exits; off: no guard (the step has no such select and applies every update, "
        "NaN included; max_nonfinite_skips is then unused).")
    max_nonfinite_skips: int = Field(
        10, ge=0, description="Consecutive skipped steps after which the run checkpoints and exits (0 = never).")

    @field_validator("on_nonfinite", mode="before")
    @classmethod
    def _bare_off(cls, v):
        return bare_off(v)

    @field_validator("micro_batches")
    @classmethod
    def _positive_count(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("a count of micro-batches is a positive integer, or auto")
        return v

    @property
    def fewest_micro_batches(self) -> int:
        return fewest(self.micro_batches)

    @property
    def rows_per_micro_batch(self) -> int:
        """Sequences per micro-batch at fewest_micro_batches (the validator checks the split)."""
        return self.batch_size // self.fewest_micro_batches


class RLConfig(Section):
    # The task and its prompts.
    task: Literal["arithmetic", "format", "prompts"] = Field(
        "arithmetic", description="Built-in task (exact-match arithmetic, the stated-format reward), or prompts: "
        "the prompt set of data.prompts scored by rl.reward.")
    reward: tuple[str, ...] = Field(
        (), description="Reward functions as path/to/file.py:function or module:function, called with "
        "(prompt, completion, example fields) -> float; replace the task's own reward when given.")
    reward_weights: tuple[float, ...] = Field((), description="Weight of each rl.reward (empty = 1.0 each).")
    reward_error: Literal["skip_sample", "zero", "skip_group"] = Field(
        "skip_sample", description="A reward that raises or is not finite (counted and logged): its sample is masked "
        "out, scored 0 and kept, or its whole group is masked out.")
    digits: int = Field(1, ge=1, description="Operand digits of the arithmetic prompts (each operand in [0, 10**digits)).")
    operators: str = Field("+", pattern=r"^[+\-*]+$", description="Operators the prompts draw from, any subset of '+-*'.")
    prompts_per_step: int = Field(8, gt=0, description="Prompts P per GRPO step.")
    group_size: int = Field(8, ge=2, description="Completions G sampled per prompt (the group of the advantage).")
    max_prompt_len: int = Field(16, gt=0, description="Prompt tokens (left-padded to this); a longer prompt is a counted skip.")
    max_new_tokens: int = Field(8, gt=0, description="Completion tokens sampled at most; a completion without EOS by then is truncated.")
    rollout_batches: int | Literal["auto"] = Field(
        "auto", description="Sampler passes per sampling round: the round's prompts in this many equal groups, "
        "sampled one after another (rows in flight: rl.prompts_per_step / rl.rollout_batches x rl.group_size, "
        "their KV cache and GDN states on the device at once). auto: the fewest whose compiled sampler fits "
        "run.memory_budget_gib beside the optimizer state; a set count that does not fit is refused before the "
        "first step. Each pass draws from its own key: the completions depend on the count.")
    prefill_chunk: int = Field(2048, gt=0, description="Prompt tokens the sampler prefills per pass: a longer prompt is "
                               "prefilled chunk by chunk through the cache (attention scores [chunk, slots], never [prompt, prompt]).")
    # Sampling.
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Sample from the k most likely tokens only (0 = off).")
    # Phases.
    warmup_steps: int = Field(20, ge=0, description="Supervised steps on the task's solved examples before GRPO (batch and lr from train.*).")
    steps: int = Field(30, ge=0, description="GRPO policy-update steps.")
    # The policy update.
    learning_rate: float = Field(1e-3, gt=0, description="Peak AdamW learning rate of the GRPO phase (betas, clip, decay from train.*).")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps of the GRPO phase, counted "
                                 "from its first step (as train.warmup_steps).")
    micro_batches: int | Literal["auto"] = Field(
        "auto", description="Micro-batches each update's sequences are split into; gradients accumulate. auto: the "
        "fewest that divide the update's rows (each micro-batch split over the batch shards) and whose compiled "
        "update fits run.memory_budget_gib; the pi_old pass picks its own the same way (rl/memory_plan.py). A count "
        "set by hand whose update does not fit is refused before the first step, naming the count that fits.")
    updates_per_rollout: int = Field(1, ge=1, description="Policy updates (optimizer steps) per rollout batch, PPO-style: "
                                     "updates_per_rollout / epochs_per_rollout mini-batches per pass (1 = one update on the whole batch).")
    epochs_per_rollout: int = Field(1, ge=1, description="Passes over the rollout batch (each in a fresh shuffle); divides updates_per_rollout.")
    importance_correction: Literal["none", "tis", "mis"] = Field(
        "none", description="Correction for the sampler's and trainer's probabilities differing: none, tis (token-level "
        "weight min(pi_train / pi_sampler, importance_cap)) or mis (mask sequences whose ratio exceeds importance_cap).")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: sample further rounds of prompts until "
                                   "prompts_per_step groups have reward variance (zero-variance groups dropped).")
    dynamic_sampling_rounds: int = Field(3, ge=1, description="Sampling rounds per step at most with rl.dynamic_sampling; "
                                         "a short batch is filled with zero-variance groups (no loss).")
    importance_cap: float = Field(2.0, gt=1, description="C of rl.importance_correction: the TIS weight cap or the MIS sequence-ratio threshold.")
    estimator: Literal["grpo", "rloo", "drgrpo"] = Field("grpo", description="Group advantage estimator.")
    mask_truncated: bool = Field(False, description="Truncated completions (no EOS) carry no loss (off: their low reward teaches the policy to stop).")
    mask_zero_variance: bool = Field(True, description="Groups whose rewards are all equal carry no loss.")
    eps: float = Field(0.2, gt=0, lt=1, description="Lower clip of the ratio: 1 - eps.")
    eps_high: float | None = Field(None, gt=0, description="Upper clip of the ratio: 1 + eps_high (None = eps).")
    beta: float = Field(0.0, ge=0, description="Weight of the k3 KL to the frozen reference policy (0 = no reference held).")
    aggregation: Literal["token_mean", "seq_mean_token_mean"] = Field("token_mean", description="How per-token losses reduce to the step loss.")
    checkpoint_every: int = Field(10, ge=0, description="Steps (warm-up and GRPO alike) between checkpoints (0 = only at the end).")

    @field_validator("micro_batches", "rollout_batches")
    @classmethod
    def _positive_count(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("a count of micro-batches or sampler passes is a positive integer, or auto")
        return v

    @field_validator("reward", "reward_weights", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        """`rl.reward=file.py:fn` (one) or `rl.reward=[a.py:f, b:g]` (several)."""
        return (v,) if isinstance(v, (str, int, float)) else v

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def fewest_micro_batches(self) -> int:
        return fewest(self.micro_batches)

    @property
    def fewest_rollout_batches(self) -> int:
        return fewest(self.rollout_batches)

    @property
    def mini_batches(self) -> int:
        """Mini-batches (one update each) per pass over the rollout batch."""
        return max(1, self.updates_per_rollout // self.epochs_per_rollout)

    @property
    def sequence_len(self) -> int:
        """Tokens of a rollout row: the left-padded prompt then the completion."""
        return self.max_prompt_len + self.max_new_tokens


class DataConfig(Section):
    path: str = Field("", description="train.data=files: a JSONL or Parquet file, or a folder of them (read in name order).")
    prompts: str = Field("", description="rl.task=prompts: a JSONL or Parquet prompt set (`prompt` or `messages`, plus any "
                         "fields the rewards read, e.g. `answer`).")
    text_field: str = Field("text", description="Field of a training document's text (a `messages` field is rendered "
                            "with the chat template instead).")
    tokenizer: str = Field("", description="A checkpoint folder or tokenizer.json (empty: the hf:DIR recipe's, else the "
                           "built-in character tokenizer).")
    on_bad_line: Literal["stop", "skip"] = Field(
        "stop", description="A line that is not JSON or lacks the fields: stop (one error naming the first such line and "
        "the count) or skip (counted, logged).")
    shuffle: bool = Field(True, description="Shuffle the documents each epoch (a pure function of train.seed and the epoch).")
    loss_on: Literal["assistant", "all"] = Field(
        "assistant", description="`messages` records: train the assistant's turns only (through each turn's end "
        "token) or every token; `text` records always train every token.")
    long_documents: Literal["split", "truncate"] = Field(
        "split", description="A document longer than train.seq_len: split (the default, so no trained token is lost: it "
        "becomes several rows of at most train.seq_len tokens, each beginning with the previous one's last token, so every "
        "target is trained exactly once with its loss mask; a later row does not see the earlier rows' tokens) or "
        "truncate (its first train.seq_len tokens; what is cut is counted). Both are logged at start and in the "
        "first step's metrics.")


class RunConfig(Section):
    compile_cache_dir: str = Field(
        "auto", description="Compiled programs kept on disk and reused by later runs of the same program (a second "
        "demo, a --resume, inspect again): a directory, off, or auto (JAX's own jax_compilation_cache_dir when "
        "set, else ~/.cache/hybridmoe/xla).")
    memory_budget_gib: float | None = Field(
        None, gt=0, description="Device memory one compiled program may use, GiB per device (its arguments + "
        "temporaries + outputs - aliased, as the compiler reports them): what the auto micro-batch counts fit and "
        "set counts are checked against. None: the device's free memory (bytes_limit - bytes_in_use, the run's own "
        "state counted back in); on a CPU, which reports no limit, nothing is checked. Lower it to keep headroom.")

    @field_validator("compile_cache_dir", mode="before")
    @classmethod
    def _bare_off(cls, v):
        return bare_off(v)


class BenchConfig(Section):
    steps: int = Field(5, ge=2, description="Timed steps per arm, split over two visits of the arm (each visit runs one untimed step first).")


class Config(Section):
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    moe: MoEConfig = MoEConfig()
    kernels: KernelsConfig = KernelsConfig()
    quant: QuantConfig = QuantConfig()
    attention: AttentionConfig = AttentionConfig()
    gdn: GdnConfig = GdnConfig()
    remat: RematConfig = RematConfig()
    train: TrainConfig = TrainConfig()
    rl: RLConfig = RLConfig()
    data: DataConfig = DataConfig()
    run: RunConfig = RunConfig()
    bench: BenchConfig = BenchConfig()
