"""Cross-field requirements, checked once at load.

Each rule looks at the whole config and returns the unmet requirements it finds as
(dotted key, message). Every rule runs; the error names every unmet requirement at once.
Rules only read the config; they never compute values for later use or change it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hybridmoe.config.schema import CHECKPOINT_NAMES, Config

Problem = tuple[str, str]
Rule = Callable[[Config], list[Problem]]
RULES: list[Rule] = []


class ConfigError(ValueError):
    """One error naming every unmet requirement, each with its dotted key."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  {k}: {m}" for k, m in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def check_requirements(cfg: Config) -> None:
    problems: list[Problem] = []
    for r in RULES:
        problems.extend(r(cfg))
    if problems:
        raise ConfigError(problems)


@rule
def _model_shapes(cfg: Config) -> list[Problem]:
    m, out = cfg.model, []
    if m.num_layers % len(m.layer_pattern):
        out.append(("model.num_layers", f"{m.num_layers} is not a multiple of the layer pattern's length {len(m.layer_pattern)}"))
    if m.num_heads % m.num_kv_heads:
        out.append(("model.num_heads", f"{m.num_heads} query heads are not a multiple of model.num_kv_heads={m.num_kv_heads}"))
    if m.gdn_num_value_heads % m.gdn_num_key_heads:
        out.append(("model.gdn_num_value_heads", f"{m.gdn_num_value_heads} is not a multiple of model.gdn_num_key_heads={m.gdn_num_key_heads}"))
    if m.num_experts_per_tok > m.num_experts:
        out.append(("model.num_experts_per_tok", f"{m.num_experts_per_tok} exceeds model.num_experts={m.num_experts}"))
    rd = m.head_dim * m.partial_rotary_factor
    if rd != int(rd) or int(rd) % 2:
        out.append(("model.partial_rotary_factor", f"head_dim * factor = {rd} must be an even integer"))
    return out


@rule
def _mesh_fits(cfg: Config) -> list[Problem]:
    # The device count is known at load only when simulating CPU devices; make_mesh checks the rest.
    n = cfg.mesh.cpu_devices or math.prod(abs(v) for v in cfg.mesh.axis_sizes.values())
    _, problem = cfg.mesh.resolve(n)
    return [problem] if problem else []


@rule
def _train_shapes(cfg: Config) -> list[Problem]:
    t, m, out = cfg.train, cfg.model, []
    if t.seq_len > m.max_seq_len:
        out.append(("train.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}"))
    return out


@rule
def _remat(cfg: Config) -> list[Problem]:
    r = cfg.remat
    out = []
    if r.save and r.policy != "custom":
        out.append(("remat.save", f"a save list needs remat.policy=custom (got {r.policy})"))
    unknown = [n for n in r.save if n not in CHECKPOINT_NAMES]
    if unknown:
        out.append(("remat.save", f"unknown checkpoint names {unknown}; known: {list(CHECKPOINT_NAMES)}"))
    return out


@rule
def _rl_shapes(cfg: Config) -> list[Problem]:
    r, out = cfg.rl, []
    if r.sequence_len > cfg.model.max_seq_len:
        out.append(("rl.max_new_tokens", f"rl.max_prompt_len + rl.max_new_tokens = {r.sequence_len} exceeds "
                    f"model.max_seq_len={cfg.model.max_seq_len}; shorten either or raise model.max_seq_len"))
    if r.rollouts_per_step % r.micro_batches:
        out.append(("rl.micro_batches", f"{r.micro_batches} does not divide the {r.rollouts_per_step} rollouts of a "
                    "step (rl.prompts_per_step * rl.group_size)"))
    if r.operators and len(set(r.operators)) != len(r.operators):
        out.append(("rl.operators", f"{r.operators!r} repeats an operator"))
    return out


@rule
def _rl_batch_fits_mesh(cfg: Config) -> list[Problem]:
    # Rollout rows are sharded over the batch axes (data x fsdp x expert under either rules table at
    # most); the device count is known at load only when simulating CPU devices.
    if not cfg.mesh.cpu_devices:
        return []
    sizes, problem = cfg.mesh.resolve(cfg.mesh.cpu_devices)
    if problem:
        return []
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    rows = cfg.rl.rollouts_per_step // cfg.rl.micro_batches
    if rows % shards:
        return [("rl.prompts_per_step", f"a micro-batch of {rows} rollouts (rl.prompts_per_step * rl.group_size / "
                 f"rl.micro_batches) does not split over the {shards} batch shards of the mesh")]
    return []
