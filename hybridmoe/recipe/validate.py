"""Cross-field requirements, checked once at load.

Each rule looks at the whole config and returns the unmet requirements it finds as
(dotted key, message). Every rule runs; the error names every unmet requirement at once.
Rules only read the config; they never compute values for later use or change it. The registry is
recipe/rules.py; the Gated DeltaNet rules live in recipe/gdn_rules.py, the rest here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridmoe.config.errors import ConfigError, Problem
from hybridmoe.config.schema import CHECKPOINT_NAMES, SAVE_LIST_POLICIES, Config
from hybridmoe.kernels.attention import limits as attention_limits
from hybridmoe.kernels.gmm import tiling
from hybridmoe.kernels.platform import PALLAS_PLATFORMS
from hybridmoe.recipe import remat_rules  # noqa: F401 (registers its rules)
from hybridmoe.recipe.facts import (Facts, _attention_backend, _context_size, _full_mesh_sizes,  # noqa: F401
                                    _mesh_sizes, _run_platform)
from hybridmoe.recipe.gdn_rules import _gdn_backend
from hybridmoe.recipe.kernel_needs import (attention_vmem_needs, gdn_vmem_needs, gmm_tiles, gmm_vmem_needs,
                                           gpu_attention_problems, limit_problems, over_problems)
from hybridmoe.recipe.rules import RL_RULES, RULES, Rule, rl_rule, rule  # noqa: F401 (the registry, re-exported)


def check_requirements(cfg: Config, *, platform: str | None = None, devices: int | None = None,
                       checkpoint_model: Mapping | None = None) -> None:
    """The one validation pass: every rule, for the platform and device count given (see Facts);
    one ConfigError naming every unmet requirement. The loaders run it with what the config fixes,
    `run.setup.build` with the devices it builds the mesh on."""
    facts = Facts(platform, devices, checkpoint_model)
    problems: list[Problem] = []
    for r in RULES:
        problems.extend(r(cfg, facts))
    if problems:
        raise ConfigError(problems)


@rule("model.num_layers", "model.num_heads", "model.gdn_num_value_heads", "model.num_experts_per_tok", "model.partial_rotary_factor")
def _model_shapes(cfg: Config, f: Facts) -> list[Problem]:
    m, out = cfg.model, []
    if m.layer_pattern and m.num_layers % len(m.layer_pattern):
        out.append(("model.num_layers", f"{m.num_layers} is not a multiple of the layer pattern's length {len(m.layer_pattern)}"))
    if m.num_heads % m.num_kv_heads:
        out.append(("model.num_heads", f"{m.num_heads} query heads are not a multiple of model.num_kv_heads={m.num_kv_heads}"))
    if m.gdn_num_value_heads % m.gdn_num_key_heads:
        out.append(("model.gdn_num_value_heads", f"{m.gdn_num_value_heads} is not a multiple of model.gdn_num_key_heads={m.gdn_num_key_heads}"))
    if m.num_experts_per_tok > m.num_experts:
        out.append(("model.num_experts_per_tok", f"{m.num_experts_per_tok} exceeds model.num_experts={m.num_experts}"))
    rd = m.head_dim * m.partial_rotary_factor
    if rd != int(rd) or int(rd) % 2:
        out.append(("model.partial_rotary_factor", f"model.head_dim * factor = {m.head_dim} * {m.partial_rotary_factor} = {rd} must be an even integer; "
                    "change model.head_dim or the factor"))
    return out


# Model fields that decide a weight's shape: a checkpoint the run starts from must agree on these.
CHECKPOINT_SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "layer_pattern", "num_heads", "num_kv_heads",
                           "head_dim", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_dim", "gdn_value_dim",
                           "gdn_conv_kernel", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "shared_expert_intermediate_size", "tie_word_embeddings")


def _as_tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


@rule(*(f"model.{k}" for k in CHECKPOINT_SHAPE_FIELDS))
def _model_matches_checkpoint(cfg: Config, f: Facts) -> list[Problem]:
    """The shapes of the checkpoint the run starts from (--init-hf) are the model section's."""
    if f.checkpoint_model is None:
        return []
    current, out = cfg.model.model_dump(), []
    for k in CHECKPOINT_SHAPE_FIELDS:
        theirs = f.checkpoint_model.get(k)
        if theirs is None or _as_tuple(current[k]) == _as_tuple(theirs):
            continue
        fix = f"{list(theirs) if isinstance(theirs, (list, tuple)) else theirs}".replace(" ", "").replace("'", "")
        out.append((f"model.{k}", f"the checkpoint's shapes disagree with the recipe's model section: recipe "
                    f"{current[k]!r}, checkpoint {theirs!r}; use a recipe with this model, or pass: model.{k}={fix}"))
    return out


@rule("mesh", "mesh.data", "mesh.fsdp", "mesh.context", "mesh.expert", "mesh.tensor", "mesh.cpu_devices")
def _mesh_axis_sizes(cfg: Config, f: Facts) -> list[Problem]:
    # The device count is known at load only when simulating CPU devices; build passes the rest.
    m = cfg.mesh
    n = f.devices or m.simulated_devices or math.prod(abs(v) for v in m.axis_sizes.values())
    _, problem = m.resolve(n)
    if problem and m.simulated_devices and not f.devices:  # name where the device count comes from
        processes = f" x mesh.num_processes={m.num_processes}" if m.num_processes > 1 else ""
        problem = (problem[0], f"{problem[1]} (the devices are mesh.cpu_devices={m.cpu_devices}{processes})")
    return [problem] if problem else []


@rule("mesh.distributed", "mesh.coordinator_address", "mesh.num_processes", "mesh.process_id")
def _mesh_distributed(cfg: Config, f: Facts) -> list[Problem]:
    m, out = cfg.mesh, []
    explicit = [k for k in ("coordinator_address", "num_processes") if getattr(m, k)]
    if explicit and not m.distributed:
        out.append((f"mesh.{explicit[0]}", "applies to a distributed run: set mesh.distributed=true"))
    if bool(m.coordinator_address) != bool(m.num_processes):
        out.append(("mesh.coordinator_address", "give mesh.coordinator_address and mesh.num_processes together "
                    "(or neither, to find both from the cluster)"))
    if m.num_processes and m.process_id >= m.num_processes:
        out.append(("mesh.process_id", f"{m.process_id} is not below mesh.num_processes={m.num_processes}"))
    return out


@rule("model", "mesh")
def _model_weights_split_over_mesh(cfg: Config, f: Facts) -> list[Problem]:
    """Every weight dimension the rules table shards must split evenly over its mesh axes (read from
    the weight declarations and the rules table themselves), over the axes whose sizes are known."""
    if not cfg.model.layer_pattern or _mesh_axis_sizes(cfg, f):
        return []
    from hybridmoe.model.fit import sharding_problems

    return sharding_problems(cfg.model, _rules(cfg), _mesh_sizes(cfg, f))


def _rules(cfg: Config) -> dict:
    from hybridmoe.parallel.rules import rules_table

    return rules_table(cfg.mesh.rules, cfg.mesh.expert_fsdp_dim)


@rule("mesh.expert_fsdp_dim")
def _mesh_expert_fsdp_dim(cfg: Config, f: Facts) -> list[Problem]:
    """exp splits the routed experts over the expert axis and the FSDP axes it leaves: E must divide."""
    if cfg.mesh.expert_fsdp_dim != "exp" or not cfg.model.layer_pattern:
        return []
    from hybridmoe.model.params import layer_axes
    from hybridmoe.parallel.rules import logical_to_spec, mesh_axes_of

    wi_axes = layer_axes(cfg.model)[0]["moe"]["wi"]
    axes, sizes = mesh_axes_of(logical_to_spec(wi_axes, _rules(cfg))[0]), _mesh_sizes(cfg, f)
    if any(a not in sizes for a in axes):
        return []  # a -1 axis: decided on the real mesh, by the same rule
    shards, E = math.prod(sizes[a] for a in axes), cfg.model.num_experts
    if E % shards:
        split = " x ".join(f"mesh.{a}={sizes[a]}" for a in axes)
        return [("mesh.expert_fsdp_dim", f"exp splits model.num_experts={E} over {split} = {shards} shards, "
                 f"which it does not divide; use mesh.expert_fsdp_dim=embed, or a mesh whose product divides {E}")]
    return []


@rule("train.batch_size", "train.micro_batches")
def _train_batch_size(cfg: Config, f: Facts) -> list[Problem]:
    """A set count of micro-batches divides the step's sequences; each micro-batch splits over the
    batch's mesh axes (for the devices a run builds on only: a recipe may mean fewer)."""
    from hybridmoe.parallel.rules import mesh_axes_of

    t = cfg.train
    if t.batch_size % t.fewest_micro_batches:
        return [("train.micro_batches", f"{t.micro_batches} micro-batches do not divide train.batch_size={t.batch_size} "
                 "(the sequences of one step)")]
    sizes = _full_mesh_sizes(cfg, f)
    if sizes is None or f.devices is None:
        return []
    names = mesh_axes_of(_rules(cfg)["batch"])
    shards = math.prod(sizes[a] for a in names)
    if t.rows_per_micro_batch % shards:
        what = f"{t.batch_size}" + (f" / train.micro_batches={t.micro_batches} = {t.rows_per_micro_batch} per micro-batch"
                                    if t.fewest_micro_batches > 1 else "")
        return [("train.batch_size", f"{what} does not split over the {shards} shards of mesh axes {names}")]
    return []


@rule("train.seq_len")
def _train_seq_len(cfg: Config, f: Facts) -> list[Problem]:
    t, m, out = cfg.train, cfg.model, []
    if t.seq_len > m.max_seq_len:
        out.append(("train.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}"))
    return out


@rule("remat.save", "remat.policy")
def _remat_save(cfg: Config, f: Facts) -> list[Problem]:
    r = cfg.remat
    out = []
    if r.save and r.policy not in SAVE_LIST_POLICIES:
        out.append(("remat.save", f"a save list needs remat.policy=custom or minimal (got {r.policy})"))
    unknown = [n for n in r.save if n not in CHECKPOINT_NAMES]
    if unknown:
        out.append(("remat.save", f"unknown checkpoint names {unknown}; known: {list(CHECKPOINT_NAMES)}"))
    return out


@rule("rl.max_new_tokens", "rl.updates_per_rollout", "rl.micro_batches", "rl.temperature", "rl.operators",
      "rl.prefill_chunk", "gdn.chunk_size", "rl.rollout_batches")
def _rl_shapes(cfg: Config, f: Facts) -> list[Problem]:
    r, out = cfg.rl, []
    if r.sequence_len > cfg.model.max_seq_len:
        out.append(("rl.max_new_tokens", f"rl.max_prompt_len + rl.max_new_tokens = {r.sequence_len} exceeds "
                    f"model.max_seq_len={cfg.model.max_seq_len}; shorten either or raise model.max_seq_len"))
    if r.updates_per_rollout % r.epochs_per_rollout:
        out.append(("rl.updates_per_rollout", f"{r.updates_per_rollout} updates are not a whole number of mini-batches "
                    f"per pass over the batch (rl.epochs_per_rollout={r.epochs_per_rollout} must divide it)"))
    elif r.rollouts_per_step % (r.mini_batches * r.fewest_micro_batches):
        out.append(("rl.micro_batches", f"{r.mini_batches} mini-batches (rl.updates_per_rollout / "
                    f"rl.epochs_per_rollout) x {r.fewest_micro_batches} micro-batches do not divide the "
                    f"{r.rollouts_per_step} rollouts of a step (rl.prompts_per_step * rl.group_size)"))
    if r.rollout_batches != "auto" and r.prompts_per_step % r.rollout_batches:
        out.append(("rl.rollout_batches", f"{r.rollout_batches} sampler passes do not divide rl.prompts_per_step="
                    f"{r.prompts_per_step}; set a divisor, or auto"))
    if r.steps and r.temperature == 0:
        out.append(("rl.temperature", "GRPO samples and trains at rl.temperature; 0 (greedy) gives no distribution "
                    "to train: set it > 0"))
    if r.operators and len(set(r.operators)) != len(r.operators):
        out.append(("rl.operators", f"{r.operators!r} repeats an operator"))
    C = cfg.gdn.chunk_size
    if "gdn" in cfg.model.layer_pattern and r.prefill_chunk % C:
        out.append(("rl.prefill_chunk", f"{r.prefill_chunk} is not a multiple of gdn.chunk_size={C} (it must be, so that "
                    f"a chunked prefill's GDN chunks fall where a one-piece prefill's do); e.g. rl.prefill_chunk="
                    f"{_round_up(r.prefill_chunk, C)}"))
    return out


@rule("rl.prompts_per_step")
def _rl_prompts_per_step(cfg: Config, f: Facts) -> list[Problem]:
    # Rollout rows are sharded over the batch axes (data x fsdp x expert under either rules table at
    # most); decided once the device count is known.
    sizes = _full_mesh_sizes(cfg, f)
    if sizes is None:
        return []
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    r = cfg.rl
    rows = r.rollouts_per_step // (r.mini_batches * r.fewest_micro_batches)
    if rows % shards:
        return [("rl.prompts_per_step", f"a micro-batch of {rows} rollouts (rl.prompts_per_step * rl.group_size / "
                 f"mini-batches / rl.micro_batches) does not split over the {shards} batch shards of the mesh")]
    return []


# ---------------------------------------------------------------------------------------------
# MoE grouped matmuls: the fused SwiGLU levers, the kernel's tiles and its backend.
# Structural requirements that this model always meets are not checked: the expert weights are
# prefused [gate | up], the activation is silu times a linear up (no clipping) and there is no
# MLP bias. Everything the config can get wrong is.

MOE_GATE_UP_NAMES = ("moe_gate", "moe_up")


def _gmm_on_hardware(cfg: Config) -> bool:
    return cfg.kernels.gmm.backend != "xla" and not cfg.kernels.interpret


def _gmm_tile_problems(cfg: Config) -> list[str]:
    # The tile rules belong to the kernel (pure Python, no JAX); imported here, lazily, so the
    # validator and the kernels can never disagree about them.
    from hybridmoe.kernels.gmm.tiling import tile_problems

    g, m = cfg.kernels.gmm, cfg.model
    if g.tiling != "explicit":
        return []
    per_kernel = any(getattr(g, f"{k}_{d}") for k in tiling.KERNELS for d in tiling.DIMS)
    tiles = gmm_tiles(cfg) if per_kernel else tiling.Tiling(tm=g.tm, tk=g.tk, tn=g.tn,
                                                            rhs_buffer_count=g.wi_fwd_rhs_buffer_count)
    return tile_problems(d_model=m.d_model, hidden=m.moe_intermediate_size, tiling=tiles,
                         tile_n_per_half=g.wi_fwd_tile_n_per_half or None, backend=g.backend,
                         hardware=_gmm_on_hardware(cfg))


def _quantized_gmm(cfg: Config) -> list[str]:
    """Quantization keys that rewrite the expert matmuls (the fused epilogues assume bf16/f32).
    fp8_moe_fake_quant is not one: it rounds the weights before any matmul sees them."""
    return ["quant.fp8_gmm"] if cfg.quant.fp8_gmm else []


@rule("moe.wi_fused_swiglu", "moe.wo_fused_dswiglu", "moe.router_grad_from_wo_input", "moe.capacity_factor", "moe.expert_parallel")
def _moe_fused_levers(cfg: Config, f: Facts) -> list[Problem]:
    moe, out = cfg.moe, []
    saved_halves = [n for n in cfg.remat.save if n in MOE_GATE_UP_NAMES] if cfg.remat.policy in SAVE_LIST_POLICIES else []
    tiles = _gmm_tile_problems(cfg)
    for key in ("wi_fused_swiglu", "wo_fused_dswiglu", "router_grad_from_wo_input"):
        if not getattr(moe, key):
            continue
        unmet = []
        if moe.impl != "sparse":
            unmet.append("needs moe.impl=sparse (the grouped-matmul path); moe.impl=dense runs every expert densely")
        if key != "router_grad_from_wo_input":
            if saved_halves:
                unmet.append(f"remat.save names {saved_halves}: the fused kernel keeps [gate | up] as one "
                             "pre-activation, so the gate and up halves cannot be saved by name")
            quant = _quantized_gmm(cfg)
            if quant:
                unmet.append(f"needs unquantized grouped matmuls ({', '.join(quant)} is on)")
            unmet += [f"kernel tile rule: {p}" for p in tiles]
        if unmet:
            out.append((f"moe.{key}", "; ".join(unmet)))
    if moe.impl == "dense" and moe.capacity_factor > 0:
        out.append(("moe.capacity_factor", "the dense reference path has no expert buffers; use moe.impl=sparse"))
    return out


def _token_chunk_problem(cfg: Config, f: Facts, seq_len: int, what: str, key: str) -> list[Problem]:
    """moe.token_chunks must divide the tokens of one row on one context rank (then every device's)."""
    C, ranks = cfg.moe.token_chunks, _context_size(cfg, f) or 1
    if C == 1 or (seq_len // ranks) % C == 0:
        return []
    return [(key, f"moe.token_chunks={C} does not divide the {seq_len // ranks} tokens of a {what} on one of "
             f"mesh.context={ranks} ranks; make moe.token_chunks a divisor of it (e.g. "
             f"{math.gcd(C, seq_len // ranks)}) or the length a multiple of {C * ranks}")]


@rule("moe.token_chunks")
def _moe_token_chunks(cfg: Config, f: Facts) -> list[Problem]:
    moe, out = cfg.moe, []
    if moe.token_chunks == 1:
        return out
    if moe.impl != "sparse":
        out.append(("moe.token_chunks", "needs moe.impl=sparse (the grouped-matmul path); the dense reference has no rows"))
    if moe.capacity_factor > 0:
        out.append(("moe.token_chunks", "needs a dropless MoE (moe.capacity_factor=0): each chunk would keep its own "
                    "share of the expert buffers and drop other tokens than one pass does"))
    return out + _token_chunk_problem(cfg, f, cfg.train.seq_len, "training row (train.seq_len)", "moe.token_chunks")


@rule("moe.gather_backward", "moe.impl", "kernels.gmm.xla_impl", "kernels.gmm.backend")
def _moe_gather_backward(cfg: Config, f: Facts) -> list[Problem]:
    # The lever rewrites the sort-and-group dispatch's row moves. The dense reference has none, and
    # the default program on row tiles (CPU) runs kernels/gmm/row_tiles, whose backward is gathers
    # already: there it would change nothing, so it is refused rather than silently ignored.
    moe = cfg.moe
    if not moe.gather_backward:
        return []
    if moe.impl != "sparse":
        return [("moe.gather_backward", "needs moe.impl=sparse (the sort-and-group path); the dense reference "
                 "moves no rows")]
    from hybridmoe.model.moe import GroupedPlan

    platform = _run_platform(cfg, f)
    if GroupedPlan.of(cfg.model, moe, cfg.kernels, cfg.quant, platform).runs_row_tiles:
        return [("moe.gather_backward", f"the default MoE program on {platform} runs row tiles "
                 "(kernels.gmm.xla_impl=row_tiles), whose backward is already gathers; set "
                 "kernels.gmm.xla_impl=ragged_dot, or turn the lever off")]
    return []


@rule("kernels.gmm.backend", "kernels.gmm.tiling", "kernels.gmm.wi_fwd_tile_n_per_half", "kernels.gmm.wi_fwd_rhs_buffer_count",
      *(f"kernels.gmm.{k}_{d}" for k in tiling.KERNELS for d in tiling.DIMS))
def _kernels_gmm(cfg: Config, f: Facts) -> list[Problem]:
    g, moe, out = cfg.kernels.gmm, cfg.moe, []
    fused = moe.wi_fused_swiglu or moe.wo_fused_dswiglu
    if g.backend != "xla" and not cfg.kernels.interpret:
        platform = _run_platform(cfg, f)
        if platform not in PALLAS_PLATFORMS[g.backend]:
            out.append(("kernels.gmm.backend", f"{g.backend} cannot run on this platform ({platform}); use xla, "
                        "or kernels.interpret=true to run the Pallas kernel interpreted"))
    tiles = _gmm_tile_problems(cfg)
    if tiles and not fused:
        out.append(("kernels.gmm.tiling", "; ".join(tiles)))
    if g.wi_fwd_tile_n_per_half:
        unmet = []
        if not moe.wi_fused_swiglu:
            unmet.append("needs moe.wi_fused_swiglu (it tiles the fused up-projection forward)")
        if g.tiling != "explicit":
            unmet.append("needs kernels.gmm.tiling=explicit")
        if unmet:
            out.append(("kernels.gmm.wi_fwd_tile_n_per_half", "; ".join(unmet)))
    depth = g.wi_fwd_rhs_buffer_count
    if depth:
        unmet = []
        if depth < 0:
            unmet.append(f"{depth} must be 0 (the kernel default) or a depth >= 1")
        if not moe.wi_fused_swiglu:
            unmet.append("needs moe.wi_fused_swiglu (only the fused up-projection forward takes the depth)")
        if g.tiling != "explicit":
            unmet.append("needs kernels.gmm.tiling=explicit (heuristic tiles may split K, where the depth is not applied)")
        elif gmm_tiles(cfg).wi_fwd.tk < cfg.model.d_model:
            key = "wi_fwd_tk" if g.wi_fwd_tk else "tk"
            unmet.append(f"needs one K tile: kernels.gmm.{key}={gmm_tiles(cfg).wi_fwd.tk} must span model.d_model="
                         f"{cfg.model.d_model} (the depth is applied only when the kernel runs one K tile)")
        if g.backend == "xla":
            unmet.append("needs a Pallas backend (kernels.gmm.backend=pallas_tpu or pallas_gpu): the xla backend "
                         "has no weight pipeline")
        if g.backend == "pallas_tpu" and not cfg.kernels.interpret and depth > tiling.TPU_MAX_RHS_BUFFERS:
            unmet.append(f"Mosaic TPU (JAX 0.10.2) accepts 1 or {tiling.TPU_MAX_RHS_BUFFERS} buffers (its default is 2; "
                         "1 is the depth that frees VMEM, benchmarks/records/gmm_vmem.json)")
        if unmet:
            out.append(("kernels.gmm.wi_fwd_rhs_buffer_count", "; ".join(unmet)))
    F = cfg.model.moe_intermediate_size
    if g.wo_dlhs_tn and moe.wo_fused_dswiglu and g.wo_dlhs_tn != F:
        out.append(("kernels.gmm.wo_dlhs_tn", f"{g.wo_dlhs_tn}: the fused wo input gradient (moe.wo_fused_dswiglu) "
                    f"spans F=model.moe_intermediate_size={F} with one N tile; leave it 0 or set {F}"))
    if g.wi_fwd_tn and moe.wi_fused_swiglu:
        out.append(("kernels.gmm.wi_fwd_tn", "tiles the unfused wi forward only; the fused one (moe.wi_fused_swiglu) "
                    "takes kernels.gmm.wi_fwd_tile_n_per_half"))
    if g.tiling != "explicit":
        out += [(f"kernels.gmm.{k}_{d}", "a per-kernel tile needs kernels.gmm.tiling=explicit")
                for k in tiling.KERNELS for d in tiling.DIMS if getattr(g, f"{k}_{d}")]
    return out


@rule("kernels.gmm.xla_impl")
def _kernels_gmm_xla_impl(cfg: Config, f: Facts) -> list[Problem]:
    """An explicit xla grouped matmul needs the grouped path on the xla backend (auto always fits)."""
    g = cfg.kernels.gmm
    if g.xla_impl == "auto":
        return []
    unmet = []
    if cfg.moe.impl != "sparse":
        unmet.append("needs moe.impl=sparse (the dense path runs no grouped matmul)")
    if g.backend != "xla":
        unmet.append(f"applies to the xla backend only (kernels.gmm.backend={g.backend})")
    return [("kernels.gmm.xla_impl", "; ".join(unmet))] if unmet else []


@rule("data.path", "data.prompts", "rl.reward", "rl.warmup_steps", "rl.reward_weights")
def _data_sources(cfg: Config, f: Facts) -> list[Problem]:
    out = []
    if cfg.train.data == "files" and not cfg.data.path:
        out.append(("data.path", "train.data=files reads a JSONL/Parquet file or folder: set data.path=FILE"))
    if cfg.rl.task == "prompts":
        if not cfg.data.prompts:
            out.append(("data.prompts", "rl.task=prompts reads a JSONL/Parquet prompt set: set data.prompts=FILE"))
        if not cfg.rl.reward:
            out.append(("rl.reward", "rl.task=prompts needs reward functions: rl.reward=[path/to/file.py:function]"))
        if cfg.rl.warmup_steps:
            out.append(("rl.warmup_steps", "rl.task=prompts has no solved examples to warm up on: set rl.warmup_steps=0 "
                        "(fine-tune first with `train train.data=files` if the model needs it)"))
    if cfg.rl.reward_weights and len(cfg.rl.reward_weights) != len(cfg.rl.reward):
        out.append(("rl.reward_weights", f"{len(cfg.rl.reward_weights)} weights for {len(cfg.rl.reward)} rl.reward "
                    "functions; give one weight each, or none (1.0 each)"))
    return out


# ---------------------------------------------------------------------------------------------
# Context-parallel attention: the sequence split over mesh.context, its load balancing and the
# id hoist. (Both rules tables map logical "seq" to the context axis.)


@rule("attention.cp_load_balance", "attention.cp_impl", "attention.cp_load_balance_hoist_ids", "mesh.context",
      "train.seq_len")
def _attention_context_parallel(cfg: Config, f: Facts) -> list[Problem]:
    a, r, out = cfg.attention, cfg.remat, []
    P = _context_size(cfg, f)
    if P and P > 1:
        pieces = 2 * P if a.cp_load_balance else P
        what = f"the {pieces} half-chunks of load balancing over" if a.cp_load_balance else "the"
        if cfg.train.seq_len % pieces:
            out.append(("train.seq_len", f"{cfg.train.seq_len} tokens do not split into {what} mesh.context={P} "
                        f"shards; make it a multiple of {pieces}"))
    if a.cp_impl == "ring":
        unmet = []
        if P is not None and P <= 1:
            unmet.append(f"needs context parallelism, mesh.context > 1 (got {P}): with one rank there is no ring; "
                         "set mesh.context or attention.cp_impl=all_gather")
        if "attention" not in cfg.model.layer_pattern:
            unmet.append("needs attention layers (model.layer_pattern has none)")
        if _attention_backend(cfg, f) == "blocked":
            unmet.append("needs a flash attention core (kernels.attention.backend=auto, xla or pallas_tpu): the "
                         "blocked core returns no log-sum-exp to merge the ring's partials by")
        if unmet:
            out.append(("attention.cp_impl", "ring " + "; ".join(unmet)))
    if a.cp_load_balance:
        if P is not None and (P < 2 or P % 2):
            out.append(("attention.cp_load_balance", f"needs an even mesh.context >= 2 (got {P}): with one rank "
                        "there is nothing to balance, and the half-chunk pairing (r, 2P-1-r) is built for an even "
                        "count"))
    if a.cp_load_balance_hoist_ids:
        unmet = []
        if not a.cp_load_balance:
            unmet.append("needs attention.cp_load_balance=true (without it there are no reordered ids to hoist)")
        if P is not None and (P < 2 or P % 2):
            unmet.append(f"needs an even mesh.context >= 2 (got {P})")
        if r.policy != "custom":
            unmet.append(f"needs remat.policy=custom, the policy the hoist is proven under (got {r.policy})")
        if not r.scan_layers:
            unmet.append("needs remat.scan_layers=true (the hoist out of the layer loop is the scan's)")
        if unmet:
            out.append(("attention.cp_load_balance_hoist_ids", "; ".join(unmet)))
    return out


# The attention core (kernels.attention): a backend the platform runs, blocks that tile the rows.


def attention_block_problems(cfg: Config, rows: int, rows_what: str, f: Facts = Facts()) -> list[Problem]:
    """kernels.attention.block_q / block_k against rows of `rows` tokens (train.seq_len, or the rl
    rows): the query blocks tile each context rank's queries, the key blocks the keys it attends
    (every key of the row, all-gathered under context parallelism)."""
    a = cfg.kernels.attention
    P = _context_size(cfg, f)
    if "attention" not in cfg.model.layer_pattern or P is None or rows % P:
        return []  # unknown context size: decided on the built mesh; rows % P: reported under the rows' key
    backend, out = _attention_backend(cfg, f), []
    t = rows // P
    if backend == "blocked":
        if a.block_k:
            out.append(("kernels.attention.block_k", "kernels.attention.backend=blocked has no key blocks (each query "
                        "block attends every key before it): set it to 0, or use a flash backend (xla, pallas_tpu)"))
        if a.block_q and P > 1:
            out.append(("kernels.attention.block_q", f"under context parallelism (mesh.context={P}) "
                        "kernels.attention.backend=blocked runs the masked core over the gathered keys, which has no "
                        "query blocks: set it to 0, or use a flash backend (xla, pallas_tpu)"))
            return out
        rule = None
    else:
        rule = attention_limits.block_rule(backend, hardware=not cfg.kernels.interpret)
    q_what = f"local queries ({rows_what} / mesh.context={P})" if P > 1 else f"queries ({rows_what})"
    k_what = f"keys ({rows_what}, every key gathered to each context rank)" if P > 1 else f"keys ({rows_what})"
    k_len = rows
    if P > 1 and cfg.attention.cp_impl == "ring":  # a key block tiles the one rank's shard held at a step
        k_len, k_what = t, f"keys of a ring step ({rows_what} / mesh.context={P}, one rank's shard)"
    for name, block, length, what in (("block_q", a.block_q, t, q_what), ("block_k", a.block_k, k_len, k_what)):
        defaults = attention_limits.DEFAULT_BLOCKS.get(backend)
        if not block and defaults is None:
            continue
        problem = block and attention_limits.block_problem(f"kernels.attention.{name}", block, length, what, rule)
        fit = attention_limits.fit_block(block or defaults[name == "block_k"], length, rule)
        if problem:
            hint = f"e.g. kernels.attention.{name}={fit}" if fit else "no block tiles them: use kernels.attention.backend=xla"
            out.append((f"kernels.attention.{name}", f"{problem}; {hint}"))
        elif not block and fit is None:  # the backend's default cannot fit either
            out.append(("kernels.attention.backend", f"{backend} has no {name} that tiles the {length} {what} "
                        f"({attention_limits.rule_text(rule)}); use xla or another length"))
    return out


@rule("kernels.attention.backend", "kernels.attention.block_q", "kernels.attention.block_k")
def _kernels_attention(cfg: Config, f: Facts) -> list[Problem]:
    out = []
    backend = _attention_backend(cfg, f)
    if backend in PALLAS_PLATFORMS and not cfg.kernels.interpret:
        platform = _run_platform(cfg, f)
        if platform not in PALLAS_PLATFORMS[backend]:
            out.append(("kernels.attention.backend", f"{backend} cannot run on this platform ({platform}); use auto or "
                        "xla, or kernels.interpret=true to run the Pallas kernels interpreted"))
        head = attention_limits.head_dim_problem(cfg.model.head_dim, backend, hardware=True)
        if head and "attention" in cfg.model.layer_pattern:
            out.append(("kernels.attention.backend", f"{backend}: {head}; use xla"))
    return out + attention_block_problems(cfg, cfg.train.seq_len, f"train.seq_len={cfg.train.seq_len}", f)


@rule("moe.routing_replay", "moe.wi_fused_swiglu", "moe.wo_fused_dswiglu", "moe.router_grad_from_wo_input", "moe.capacity_factor", "kernels.gmm.backend", "mesh.expert",
      "moe.token_chunks")
def _moe_routing_replay(cfg: Config, f: Facts) -> list[Problem]:
    # Replay feeds the sampler's expert ids into the trainer's default MoE program; the levers and
    # the ring of experts route inside their own kernels and shard_maps, which take no ids.
    moe, out = cfg.moe, []
    if not moe.routing_replay:
        return out
    for key in ("wi_fused_swiglu", "wo_fused_dswiglu", "router_grad_from_wo_input"):
        if getattr(moe, key):
            out.append((f"moe.{key}", "moe.routing_replay runs the default MoE program; turn this lever off"))
    if moe.capacity_factor:
        out.append(("moe.capacity_factor", "moe.routing_replay is dropless only; set it to 0"))
    if cfg.kernels.gmm.backend != "xla":
        out.append(("kernels.gmm.backend", "moe.routing_replay runs the xla grouped matmul; set it to xla"))
    if cfg.mesh.expert != 1 and moe.impl == "sparse":
        out.append(("mesh.expert", "moe.routing_replay does not run the ring of experts; set mesh.expert=1"))
    if moe.token_chunks > 1:
        # The token-chunked experts are not the default program: the sampler's first replayed
        # layer (after the whole supervised warm-up) would raise NotImplementedError.
        out.append(("moe.token_chunks", "moe.routing_replay runs the default MoE program, one pass over the tokens; "
                    "set it to 1"))
    return out


# ---------------------------------------------------------------------------------------------
# The rl command's sequences under context parallelism. Checked by run_rl (not at every config
# load: a `train` run never builds these sequences, and the rl defaults need not fit its mesh).


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def rl_sequence_problems(cfg: Config, f: Facts = Facts()) -> list[Problem]:
    """The GRPO update's rows (rl.max_prompt_len + rl.max_new_tokens tokens) split over
    mesh.context like training rows, in whole GDN chunks per rank, and the sampler's prompt rows
    [B, rl.max_prompt_len] split over it as they are handed in; the attention blocks tile those rows."""
    ranks, r = _context_size(cfg, f), cfg.rl
    out = attention_block_problems(cfg, r.sequence_len, f"rl.max_prompt_len + rl.max_new_tokens = {r.sequence_len}", f)
    out += _token_chunk_problem(cfg, f, r.sequence_len, "GRPO row (rl.max_prompt_len + rl.max_new_tokens)",
                                "rl.max_new_tokens")
    if not ranks or ranks <= 1:
        return out
    if r.max_prompt_len % ranks:
        out.append(("rl.max_prompt_len", f"{r.max_prompt_len} prompt tokens do not split over mesh.context={ranks}; "
                    f"make it a multiple of {ranks} (e.g. rl.max_prompt_len={_round_up(r.max_prompt_len, ranks)})"))
    need, why = ranks, [f"mesh.context={ranks}"]
    if "attention" in cfg.model.layer_pattern and cfg.attention.cp_load_balance:
        need, why = 2 * ranks, [f"the 2 x mesh.context={ranks} half-chunks of attention.cp_load_balance"]
    if "gdn" in cfg.model.layer_pattern:
        need = math.lcm(need, ranks * cfg.gdn.chunk_size)
        why.append(f"whole gdn.chunk_size={cfg.gdn.chunk_size} chunks on each context rank")
    if r.sequence_len % need:
        out.append(("rl.max_new_tokens", f"rl.max_prompt_len + rl.max_new_tokens = {r.sequence_len} tokens per GRPO "
                    f"row must be a multiple of {need} ({'; '.join(why)}); e.g. rl.max_new_tokens="
                    f"{_round_up(r.sequence_len, need) - r.max_prompt_len}"))
    return out


@rl_rule("rl.max_prompt_len", "rl.max_new_tokens", "kernels.attention.block_q", "kernels.attention.block_k")
def _rl_sequences(cfg: Config, f: Facts) -> list[Problem]:
    return rl_sequence_problems(cfg, f)


@rl_rule("moe.capacity_factor")
def _moe_capacity_factor(cfg: Config, f: Facts) -> list[Problem]:
    # The rollout and the policy update would drop different tokens, and the update does not
    # report its drops: refused rather than trained on a silently different model.
    if cfg.moe.capacity_factor > 0:
        return [("moe.capacity_factor", "the RL trainer runs dropless MoE only; set it to 0")]
    return []


class _ZeroDraws:
    """A numpy Generator stand-in whose integer draws are all 0: a built-in task's prompt of
    operands 0 and 0 (its shortest)."""

    def integers(self, low, high=None, size=None):
        import numpy as np

        return np.zeros(size, np.int64)


@rl_rule("rl.max_prompt_len", "rl.task", "rl.digits")
def _rl_max_prompt_len(cfg: Config, f: Facts) -> list[Problem]:
    """Some prompt of the built-in task fits rl.max_prompt_len (as the loop encodes it: [BOS]
    prompt). Otherwise every prompt is a counted skip, no GRPO step scores a sample and the run
    stops after the whole warm-up. (A prompt set is measured when it is read: data/prompts.py.)"""
    r, tok = cfg.rl, f.tokenizer
    if tok is None or r.task == "prompts":
        return []
    from hybridmoe.data.arithmetic import task_from_config

    def tokens(prompt: str) -> int:
        return len(tok.encode(prompt)) + (tok.bos_id is not None)

    task = task_from_config(cfg)
    shortest = task.sample(_ZeroDraws(), 1)[0].prompt
    if tokens(shortest) <= r.max_prompt_len:
        return []
    largest = str(10**r.digits - 1)
    longest = max(tokens(shortest.replace("0", largest)), tokens(shortest))
    return [("rl.max_prompt_len", f"{r.max_prompt_len} tokens hold no prompt of rl.task={r.task}: its shortest, "
             f"{shortest!r}, is {tokens(shortest)} tokens with BOS, so every GRPO step would score nothing and the run "
             f"stop after the warm-up; set rl.max_prompt_len={longest} (the longest prompt at rl.digits={r.digits})")]


def check_rl_requirements(cfg: Config, *, platform: str | None = None, devices: int | None = None,
                          tokenizer: Any = None) -> None:
    """What only the rl command needs of a config that passed check_requirements (for the same
    platform and device count): every rule of RL_RULES; one ConfigError. run_rl passes the devices
    its mesh is built on (a -1 axis resolved) and the tokenizer of the config's own task."""
    facts = Facts(platform, devices, tokenizer=tokenizer)
    problems = [p for r in RL_RULES for p in r(cfg, facts)]
    if problems:
        raise ConfigError(problems)


# fp8: fake quantization of the routed experts and its hoist (docs/levers.md, "fp8 experts").


def _expert_fsdp_shards(cfg: Config, f: Facts) -> tuple[int | None, str]:
    """(shards of the routed expert weights' FSDP split, or None where a -1 axis it uses is not known
    at load; the mesh axes, with their sizes where known, as text). Read from the weight declaration
    and the rules table: the axes a weight gathers where it is used, on whichever dimension."""
    from hybridmoe.model.params import layer_axes
    from hybridmoe.parallel.rules import gathered_at_use

    wi_axes = layer_axes(cfg.model)[0]["moe"]["wi"]
    axes, sizes = tuple(a for dim in gathered_at_use(wi_axes, _rules(cfg)) for a in dim), _mesh_sizes(cfg, f)
    if any(a not in sizes for a in axes):
        return None, " x ".join(f"mesh.{a}" for a in axes)
    return math.prod(sizes[a] for a in axes), " x ".join(f"mesh.{a}={sizes[a]}" for a in axes) or "no mesh axis"


@rule("quant.fp8_fake_quant_hoist")
def _quant_fp8_fake_quant_hoist(cfg: Config, f: Facts) -> list[Problem]:
    q, unmet = cfg.quant, []
    mode = q.fp8_fake_quant_hoist
    if mode == "off":
        return []
    if not q.fp8_moe_fake_quant:
        unmet.append("needs quant.fp8_moe_fake_quant=true (it hoists the fake quantization's absmax)")
    if mode == "gather8":
        if cfg.moe.impl != "sparse":
            unmet.append("gather8 needs moe.impl=sparse (the grouped-matmul path)")
        shards, axes = _expert_fsdp_shards(cfg, f)
        if shards == 1:
            unmet.append(f"gather8 needs FSDP-sharded expert weights: their FSDP dimension is split over {axes}, "
                         "1 shard, so nothing is gathered (give one of those axes a size > 1)")
    return [("quant.fp8_fake_quant_hoist", "; ".join(unmet))] if unmet else []


@rule("quant.fp8_gmm")
def _quant_fp8_gmm(cfg: Config, f: Facts) -> list[Problem]:
    if not cfg.quant.fp8_gmm:
        return []
    moe, unmet = cfg.moe, []
    if moe.impl != "sparse":
        unmet.append("needs moe.impl=sparse (the grouped-matmul path)")
    fused = [k for k in ("wi_fused_swiglu", "wo_fused_dswiglu") if getattr(moe, k)]
    if fused:
        unmet.append(f"the fused SwiGLU epilogues (moe.{', moe.'.join(fused)}) do not run on a dequantized "
                     "float32 accumulator; turn them off")
    if moe.routing_replay:
        unmet.append("moe.routing_replay runs the default (unquantized) MoE program; turn one of them off")
    if cfg.kernels.gmm.backend != "xla":
        unmet.append(f"kernels.gmm.backend={cfg.kernels.gmm.backend} has no fp8 grouped matmul; use xla "
                     "(ragged_dot over exact fp8 codes with float32 accumulation)")
    return [("quant.fp8_gmm", "; ".join(unmet))] if unmet else []


# ---------------------------------------------------------------------------------------------
# On-chip memory: every Mosaic TPU kernel the step runs must fit its scoped VMEM limit at the
# configured tiles (the memory models beside each kernel family: kernels/vmem.py), refused here
# instead of after a compile.

@rule("kernels.gmm.vmem_limit_mib", "kernels.attention.vmem_limit_mib")
def _kernels_vmem(cfg: Config, f: Facts) -> list[Problem]:
    k = cfg.kernels
    out = limit_problems("kernels.gmm.vmem_limit_mib", k.gmm.vmem_limit_mib)
    out += limit_problems("kernels.attention.vmem_limit_mib", k.attention.vmem_limit_mib)
    if out or k.interpret:
        return out
    moe_kernels = (cfg.moe.impl == "sparse" and k.gmm.backend == "pallas_tpu" and k.gmm.tiling == "explicit"
                   and not _gmm_tile_problems(cfg))
    if moe_kernels:
        out += over_problems("kernels.gmm.vmem_limit_mib", gmm_vmem_needs(cfg),
                     "lower that kernel's tiles (kernels.gmm.<kernel>_tm / _tk / _tn) or raise kernels.gmm.vmem_limit_mib")
    if "attention" in cfg.model.layer_pattern and not attention_block_problems(cfg, cfg.train.seq_len, "", f) \
            and _attention_backend(cfg, f) == "pallas_tpu":
        out += over_problems("kernels.attention.vmem_limit_mib", attention_vmem_needs(cfg, _context_size(cfg, f) or 1),
                     "lower kernels.attention.block_q / block_k or raise kernels.attention.vmem_limit_mib")
    if "attention" in cfg.model.layer_pattern and not attention_block_problems(cfg, cfg.train.seq_len, "", f) \
            and _attention_backend(cfg, f) == "pallas_gpu":
        out += gpu_attention_problems(cfg, _context_size(cfg, f) or 1)
    if "gdn" in cfg.model.layer_pattern and _gdn_backend(cfg, f) == "pallas_tpu":
        out += over_problems("kernels.gdn.backend", gdn_vmem_needs(cfg), "lower gdn.chunk_size or use kernels.gdn.backend=xla")
    return out


@rule("moe.group_align_rows", "moe.impl", "moe.capacity_factor", "moe.routing_replay")
def _moe_group_align_rows(cfg: Config, f: Facts) -> list[Problem]:
    """The aligned dispatch (model/moe_align.py) is the sort-and-group path's, dropless."""
    moe, a = cfg.moe, cfg.moe.group_align_rows
    if not a:
        return []
    unmet = []
    if a % 8:
        unmet.append(f"must be a multiple of 8 (a row tile's sublanes), e.g. the grouped matmuls' row tile; got {a}")
    if moe.impl != "sparse":
        unmet.append("needs moe.impl=sparse (the sort-and-group path); the dense reference has no rows to place")
    if moe.capacity_factor > 0:
        unmet.append("needs a dropless MoE (moe.capacity_factor=0)")
    if moe.routing_replay:
        unmet.append("moe.routing_replay runs the default MoE program; set it to 0")
    return [("moe.group_align_rows", "; ".join(unmet))] if unmet else []
