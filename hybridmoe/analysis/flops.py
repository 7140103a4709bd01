"""Useful FLOPs of the training step, counted from the model shape (the same count for any framework).

Only matmul work counts, as multiply-adds x 2: the weight projections, the attention core over
the causal half of the score matrix, the Gated DeltaNet recurrence (per token and value head:
state times key, state times query and the rank-one update, 3 dk dv multiply-adds), the routed
experts of each token's top-k only (not every expert) and the LM head. Elementwise work (norms,
activations, softmax, the optimizer) counts zero. Forward + backward = 3 x forward (the backward
computes the input and the weight gradients, one matmul each).

Legend: D model, V vocab, T sequence length, N / G attention query / key-value heads, A head dim,
Hk / Hv GDN key / value heads, dk / dv GDN head dims, E experts, k per token, F expert hidden,
S shared-expert hidden.
"""

from __future__ import annotations

from hybridmoe.config.schema import Config, ModelConfig


def forward_flops_per_token(m: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one layer of each kind, and of the embedding + LM head."""
    D = m.d_model
    N, G, A = m.num_heads, m.num_kv_heads, m.head_dim
    Hk, Hv, dk, dv = m.gdn_num_key_heads, m.gdn_num_value_heads, m.gdn_key_dim, m.gdn_value_dim
    k, F, S, E = m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size, m.num_experts
    causal_keys = (seq_len + 1) / 2  # keys a query sees on average
    attention = D * (2 * N * A + 2 * G * A) + N * A * D + 2 * N * A * causal_keys
    gdn = D * (2 * Hk * dk + 2 * Hv * dv + 2 * Hv) + Hv * dv * D + Hv * 3 * dk * dv
    shared = D * 2 * S + S * D + D if S else 0
    moe = D * E + k * (D * 2 * F + F * D) + shared
    return {"attention": 2.0 * attention, "gdn": 2.0 * gdn, "moe": 2.0 * moe, "embed_head": 2.0 * D * m.vocab_size}


def component_flops(m: ModelConfig, batch: int, seq_len: int) -> dict[str, float]:
    """Forward + backward FLOPs of one instance of each component over a [batch, seq_len] batch."""
    tokens = batch * seq_len
    return {name: 3.0 * f * tokens for name, f in forward_flops_per_token(m, seq_len).items()}


def step_flops(cfg: Config, batch: int | None = None, seq_len: int | None = None) -> float:
    """Useful forward + backward FLOPs of one training step (every layer, every micro-batch)."""
    m, t = cfg.model, cfg.train
    batch = t.batch_size if batch is None else batch
    seq_len = t.seq_len if seq_len is None else seq_len
    per = component_flops(m, batch, seq_len)
    layers = sum(per[kind] for kind in m.layer_kinds) + m.num_layers * per["moe"]
    return layers + per["embed_head"]



# ---------------------------------------------------------------------------------------------
# The matmul work the compiled step is built to run (the check of analysis/hlo_cost.py's count)


def gdn_chunk_core_macs_per_token(m: ModelConfig, chunk_size: int) -> float:
    """Multiply-adds per token and value head of the chunked delta rule's core:
    per chunk k k^T, the WY products with k and v, q k^T and its product with the new values (C^2
    K, C^2 K, C^2 V, C^2 K, C^2 V), and the state terms w S, q S, k^T v_new (3 C K V); over C tokens:
    3 C K + 2 C V + 3 K V. The recurrent form needs only the 3 K V of `forward_flops_per_token`."""
    C, K, V = chunk_size, m.gdn_key_dim, m.gdn_value_dim
    return 3 * C * K + 2 * C * V + 3 * K * V


def routed_rows_per_token(cfg: Config, tokens_per_shard: int) -> float:
    """Rows the routed experts' matmuls run per token: k, or on the CPU row tiles (the default
    grouped matmul there) the static tile capacity, cdiv(T k, R) + E tiles of R rows (every tile
    is computed, filled or not: kernels/gmm/row_tiles.py)."""
    m, g = cfg.model, cfg.kernels.gmm
    k = m.num_experts_per_tok
    from hybridmoe.kernels.gmm.ops import xla_impl_for

    if g.backend != "xla" or cfg.moe.impl != "sparse" or xla_impl_for(g.xla_impl, "cpu") != "row_tiles":
        return float(k)
    R = g.xla_tile_rows
    tiles = -(-tokens_per_shard * k // R) + m.num_experts
    return tiles * R / tokens_per_shard


def designed_step_flops(cfg: Config, devices: int, *, remat_policy: str, tokens_per_shard: int,
                        on_cpu: bool = True) -> float:
    """Matmul FLOPs per device of one training step as the implementation runs it: the model's
    count (`forward_flops_per_token`) with the GDN core in its chunked form, the routed experts
    at their grouped matmul's row capacity (plus, on row tiles, the weight gradient's per-expert
    sum over tiles), the flash attention backward's recomputation (the scores in both passes and
    do v^T twice: 7 matmuls a block where the plain backward has 4, 1.5 core forwards more), the
    layer stack's forward run twice under full remat (forward, replay, backward = 4 x forward
    instead of 3) and the LM head's logits recomputed in the chunked log-probs' backward (4 x its
    forward)."""
    m, t = cfg.model, cfg.train
    tokens = t.batch_size * t.seq_len
    per = forward_flops_per_token(m, t.seq_len)
    core = m.gdn_num_value_heads * 2.0
    per["gdn"] += core * (gdn_chunk_core_macs_per_token(m, cfg.gdn.chunk_size) - 3 * m.gdn_key_dim * m.gdn_value_dim)
    k, D, F, E = m.num_experts_per_tok, m.d_model, m.moe_intermediate_size, m.num_experts
    rows = routed_rows_per_token(cfg, tokens_per_shard) if on_cpu else float(k)
    per["moe"] += 2.0 * (rows - k) * 3 * D * F
    stack = 4.0 if remat_policy == "full" else 3.0
    attention_core = 2.0 * 2 * m.num_heads * m.head_dim * (t.seq_len + 1) / 2
    layers = sum(per[kind] for kind in m.layer_kinds) + m.num_layers * per["moe"]
    per_token = stack * layers + 4.0 * per["embed_head"]
    per_token += 1.5 * attention_core * sum(kind == "attention" for kind in m.layer_kinds)
    if rows != k:  # row tiles: one-hot sums [E, tiles] x [tiles, K x N] of wi's and wo's gradients
        tiles = rows * tokens_per_shard / cfg.kernels.gmm.xla_tile_rows
        per_token += m.num_layers * 2.0 * E * tiles * 3 * D * F / tokens_per_shard
    return per_token * tokens / devices


def model_flops_per_device(cfg: Config, devices: int, program_name: str = "train") -> float | None:
    """The step's useful FLOPs from the model shape (step_flops) over the devices: XLA's count
    leaves out the Pallas kernels, this one counts the work whatever runs it. The GRPO update: its
    rows' forward + backward (a reference policy adds a forward); the sampler: not counted."""
    if program_name == "train":
        return step_flops(cfg) / devices
    if program_name == "grpo":
        r = cfg.rl
        rows = r.rollouts_per_step // r.mini_batches
        fwd_bwd = step_flops(cfg, batch=rows, seq_len=r.sequence_len)
        return fwd_bwd * (1 + (1 / 3 if r.beta > 0 else 0)) / devices
    return None


# The remat policies whose backward replays the layer stack's forward matmuls: full saves nothing,
# custom only the names it lists (the levers' ids by default, no matmul output); none and minimal
# keep the matmul outputs. auto is resolved by memory at trace time, so it has no design count here.
_REPLAYS_FORWARD = {"full": True, "custom": True, "none": False, "minimal": False}


def designed_flops_per_device(cfg: Config, devices: int, platform: str) -> float | None:
    """designed_step_flops of the training step as `cfg` builds it for `devices` devices of
    `platform`: the check of a compiled step's FLOP count (analysis/step_estimate). None for an
    auto remat policy (resolved at trace time)."""
    replays = _REPLAYS_FORWARD.get(cfg.remat.policy)
    if replays is None:
        return None
    t = cfg.train
    return designed_step_flops(cfg, devices, remat_policy="full" if replays else "none",
                               tokens_per_shard=t.rows_per_micro_batch * t.seq_len // devices, on_cpu=platform == "cpu")

