"""Remat policies of the layer scan: what the forward keeps for the backward.

none: no rematerialisation (everything the backward needs is stored);
full: only the block's input is kept, the whole block is recomputed;
minimal: weight-matmul outputs are kept, elementwise work and attention are recomputed; with a
  `remat.save` list, the tensors of those checkpoint names are kept as well (the grouped expert
  matmuls are not dot_generals, so their outputs are recomputed unless `moe_gate` and `moe_up`
  are named: on a TPU that replay is two of each MoE layer's three forward matmuls again);
custom: exactly the checkpoint names of `remat.save` are kept, and the names the levers add.
auto (the default): none when the residuals it would keep fit, else full (`resolve_policy`).

remat.unit says what one checkpoint spans. `block` (the default): the repeating block of
model.layer_pattern, so the forward keeps one tensor per block and the backward replays the whole
block, holding every layer's intermediates (gathered expert weights, MoE rows, GDN chunk states) at
once. `layer`: each layer, so the forward keeps each layer's input (pattern-length times as many
[B, T, D] tensors) and the backward replays one layer at a time; the forward still runs twice in
all. `sublayer`: each of a layer's two residual sublayers (the token mixer, then the MoE block), so
the forward keeps both of every layer's inputs and the backward replays the MoE block, runs its
backward, then replays the mixer: the MoE block's backward (the gathered expert weights and their
gradients) never holds the mixer's intermediates (GDN chunk states), at the same compute. At the
397B cell, one block's intermediates are tens of GiB and a layer input 128 MiB per device
(docs/levers.md, "remat.unit").

The auto rule: without remat the backward keeps, per layer and token, roughly the activations
listed in `residual_elements_per_token` (the mixer's projections and score rows, the MoE rows of
the token's k experts, norms and residuals). When that times the layers and the tokens one device
holds is at most a quarter of the device's memory (the rest is left for weights, optimizer state
and the step's temporaries), replaying the forward buys nothing, and `none` is chosen; otherwise
`full`. The `small` recipe on CPU resolves to none (benchmarks/records/step_anatomy.json times its step
against remat full); the 35B, 80B and 397B recipes pin `full` explicitly.
"""

from __future__ import annotations

import math
import os

import jax

from hybridmoe.config.schema import Config, ModelConfig
from hybridmoe.model.attention import LB_IDS_NAME
from hybridmoe.parallel.rules import logical_to_spec, mesh_axes_of

RESIDUAL_FRACTION = 0.25  # of one device's memory, for the residuals `none` keeps


def save_names(cfg: Config) -> tuple[str, ...]:
    """The save list of the custom policy (and the names minimal keeps besides the matmul outputs):
    remat.save, then the names the levers save."""
    lever = (LB_IDS_NAME,) if cfg.attention.cp_load_balance_hoist_ids and LB_IDS_NAME not in cfg.remat.save else ()
    return tuple(cfg.remat.save) + lever


def remat_policy(cfg: Config, policy: str | None = None):
    """The checkpoint policy of `policy` (default remat.policy; auto resolved by the caller)."""
    policy = policy or cfg.remat.policy
    if policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if policy == "minimal":
        dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        names = save_names(cfg)
        if not names:
            return dots
        return jax.checkpoint_policies.save_from_both_policies(
            dots, jax.checkpoint_policies.save_only_these_names(*names))
    if policy == "custom":
        return jax.checkpoint_policies.save_only_these_names(*save_names(cfg))
    raise ValueError(f"remat policy {policy!r} has no checkpoint policy")


def residual_elements_per_token(m: ModelConfig, seq_len: int) -> float:
    """Activations (elements) one layer keeps per token for the backward without remat (an estimate)."""
    D = m.d_model
    attn = (3 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 2 * m.num_heads * seq_len  # q, gate, o, k, v; scores, probs
    qk = 2 * m.gdn_num_key_heads * m.gdn_key_dim
    vz = 2 * m.gdn_num_value_heads * m.gdn_value_dim
    gdn = 3 * (qk + vz)  # projections, conv output, normed q/k and the chunk intermediates
    mixer = max(attn if "attention" in m.layer_pattern else 0, gdn if "gdn" in m.layer_pattern else 0)
    moe = m.num_experts_per_tok * (2 * D + 4 * m.moe_intermediate_size) + m.num_experts \
        + 3 * m.shared_expert_intermediate_size
    return 6 * D + mixer + moe


def device_memory_bytes() -> int:
    """One local device's memory: the accelerator's limit, or the host's memory split over the CPU devices."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, jax.local_device_count())


def resolve_policy(cfg: Config, tokens_per_device: int, device_bytes: int | None = None) -> str:
    """The concrete policy of `remat.policy` (auto: by the rule in the module docstring)."""
    if cfg.remat.policy != "auto":
        return cfg.remat.policy
    m = cfg.model
    seq_len = min(cfg.train.seq_len, m.max_seq_len)
    per_token = residual_elements_per_token(m, seq_len) * jax.numpy.dtype(m.compute_dtype).itemsize
    need = m.num_layers * tokens_per_device * per_token
    budget = RESIDUAL_FRACTION * (device_memory_bytes() if device_bytes is None else device_bytes)
    return "none" if need <= budget else "full"


def tokens_per_device(num_tokens: int) -> int:
    """Tokens of a global batch that one device holds under the mesh in force (the token axes' shards)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return num_tokens
    shards = 1
    for entry in logical_to_spec(("batch", "seq")):
        for axis in mesh_axes_of(entry):
            shards *= mesh.shape[axis]
    return math.ceil(num_tokens / shards)


def checkpointed(fn, cfg: Config, num_tokens: int, unit: str = "block"):
    """`fn` (the layer block, or one layer of it: `unit`) under the resolved remat policy where
    remat.unit is `unit`; itself where it is not, or where the policy resolves to none."""
    if cfg.remat.unit != unit:
        return fn
    policy = resolve_policy(cfg, tokens_per_device(num_tokens))
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=remat_policy(cfg, policy), prevent_cse=not cfg.remat.scan_layers)
