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
    batch = t.batch_size * t.micro_batches if batch is None else batch
    seq_len = t.seq_len if seq_len is None else seq_len
    per = component_flops(m, batch, seq_len)
    layers = sum(per[kind] for kind in m.layer_kinds) + m.num_layers * per["moe"]
    return layers + per["embed_head"]

