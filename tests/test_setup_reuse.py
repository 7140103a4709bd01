"""A process keeps set-ups and their jitted programs by config and devices (run/setup.py: build()
and RunSetup.kept): a change in any section of the config, or in the device list, must give its
own set-up and programs, and equal configs must share them. Otherwise a second run that differs
only there trains with the first run's programs: wrong training and no error.

The table below has a row for every section of the Config (nested ones included), and a test per
section that the schema has, so a new section without a row fails; the key's broken variants (a
section dropped, the devices dropped, the device count for the list) must each be caught. An end-to-
end case runs two RL runs in one process that differ only in rl.learning_rate and checks the
second trains at its own rate (Adam's first update scales with it exactly).
"""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest

import hybridmoe.rl.loop as rl_loop
import hybridmoe.rl.memory_plan as memory_plan_mod
from broken_variants import mutated
from helpers import ATTENTION_LAYERS, tiny_config
from hybridmoe.config.schema import Config, Section
from hybridmoe.run import setup as setup_mod

# One change per section of the Config: (overrides in both configs that the change needs to be
# valid on 8 CPU devices, the one override of the section's own key). Any key of the section serves:
# the guarantee is that nothing of the config is left out of the key.
SECTION_CHANGES = {
    "model": ((), "model.init_std=0.03"),
    "mesh": ((), "mesh.data=4"),
    "moe": ((), "moe.capacity_factor=2.0"),
    "kernels": ((), "kernels.interpret=true"),
    "kernels.gmm": ((), "kernels.gmm.xla_impl=row_tiles"),
    "kernels.gdn": (("kernels.interpret=true",), "kernels.gdn.backend=pallas_tpu"),
    "kernels.attention": ((), "kernels.attention.backend=blocked"),
    "kernels.logprobs": ((), "kernels.logprobs.chunk_tokens=128"),
    "quant": ((), "quant.fp8_moe_fake_quant=true"),
    "attention": (("mesh.context=2", "gdn.chunk_size=8"), "attention.cp_impl=ring"),
    "gdn": ((), "gdn.chunk_size=8"),
    "remat": ((), "remat.policy=full"),
    "train": ((), "train.learning_rate=1e-3"),
    "rl": ((), "rl.learning_rate=2e-3"),
    "data": ((), "data.shuffle=false"),
    "run": ((), "run.compile_cache_dir=off"),
    "bench": ((), "bench.steps=3"),
}


def config_sections(model=Config, prefix: str = "") -> list[str]:
    """Every section of the schema by its dotted path, nested sections included (read from the
    pydantic fields, so a section added to the schema appears here by itself)."""
    out = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            out += [prefix + name, *config_sections(kind, f"{prefix}{name}.")]
    return out


def changed_keys(a: Config, b: Config) -> list[str]:
    """Dotted paths of the leaf values that differ between two configs."""
    def leaves(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield prefix + k, v
    la, lb = dict(leaves(a.model_dump())), dict(leaves(b.model_dump()))
    return sorted(k for k in la if la[k] != lb[k])


def equal_copy(cfg: Config) -> Config:
    """Another Config object of equal value (as a second run's load of the same recipe makes)."""
    return Config.model_validate_json(cfg.model_dump_json())


class Maker:
    """A kept program's make(): counts its calls and returns a fresh object each time."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return object()


def reuse_problems(build, cfg: Config, other: Config, devices=None, other_devices=None) -> list[str]:
    """What is wrong with the set-ups `build` gives: an equal config on the same devices must get
    the same set-up and programs; `other` (on other_devices) its own set-up, of its own config, and
    its own programs."""
    setup_mod.forget_setups()
    problems = []
    make = Maker()
    first = build(cfg, devices)
    program = first.kept("probe", make)
    again = build(equal_copy(cfg), None if devices is None else list(devices))
    if again is not first or again.kept("probe", make) is not program or make.calls != 1:
        problems.append("an equal config on the same devices did not share the set-up and its programs")
    second = build(other, other_devices)
    if second is first or second.kept("probe", make) is program or make.calls != 2:
        problems.append("the other config or devices shared the first set-up's programs")
    if second.cfg != other or set(second.mesh.devices.flat) != set(other_devices or jax.devices()):
        problems.append("the other config's set-up holds another config or devices")
    return problems


def section_problems(build, section: str) -> list[str]:
    both, change = SECTION_CHANGES[section]
    return reuse_problems(build, tiny_config(*both), tiny_config(*both, change))


def device_problems(build) -> dict[str, list[str]]:
    """The device list's cases: fewer devices, the same devices in another order (another mesh)."""
    cfg, devices = tiny_config(), jax.devices()
    return {name: problems for name, other in (("half the devices", devices[:4]),
                                               ("the devices reversed", devices[::-1]))
            if (problems := reuse_problems(build, cfg, equal_copy(cfg), devices, other))}


@pytest.mark.parametrize("section", config_sections())
def test_a_change_in_one_section_gives_its_own_set_up_and_programs(section):
    assert section in SECTION_CHANGES, (
        f"the Config has a section {section} with no row in SECTION_CHANGES: add a change of one of its keys")
    both, change = SECTION_CHANGES[section]
    base, changed = tiny_config(*both), tiny_config(*both, change)
    # The row changes its own section and nothing else (a deeper section with a row of its own aside).
    owners = {k: max((s for s in SECTION_CHANGES if k.startswith(s + ".")), key=len)
              for k in changed_keys(base, changed)}
    assert owners and set(owners.values()) == {section}, owners
    assert section_problems(setup_mod.build, section) == []


def test_every_row_is_a_section_of_the_schema():
    assert sorted(SECTION_CHANGES) == sorted(config_sections())


def test_the_device_list_keys_its_own_set_up_and_programs():
    # The default (every device) and the same list given explicitly are one set-up.
    cfg = tiny_config()
    assert setup_mod.build(cfg) is setup_mod.build(equal_copy(cfg), list(jax.devices()))
    assert device_problems(setup_mod.build) == {}


# Broken variants of the key in build(): the broken line, and the rows (sections, device cases)
# that must then report a shared set-up.
KEY = "key = (cfg.model_dump_json(), tuple(devices))"
BROKEN_KEYS = {
    # The devices forgotten: another device list meets the first list's mesh and programs.
    "devices_dropped": ("key = (cfg.model_dump_json(),)", {"half the devices", "the devices reversed"}),
    # The device count for the list: the same devices in another order share the first mesh.
    "device_count_only": ("key = (cfg.model_dump_json(), len(devices))", {"the devices reversed"}),
    # A section thought not to matter to the set-up (the RL loop's programs hang on it).
    "rl_section_dropped": ("key = (cfg.model_dump_json(exclude={'rl'}), tuple(devices))", {"rl"}),
    # A nested section dropped.
    "logprobs_kernel_dropped": ("key = (cfg.model_dump_json(exclude={'kernels': {'logprobs'}}), tuple(devices))",
                                {"kernels.logprobs"}),
    # What the set-up itself is made of (the mesh and the params), not what its programs read.
    "model_and_mesh_only": ("key = (cfg.model.model_dump_json(), cfg.mesh.model_dump_json(), tuple(devices))",
                            set(SECTION_CHANGES) - {"model", "mesh"}),
}


@pytest.mark.parametrize("variant", list(BROKEN_KEYS))
def test_broken_keys_are_caught(variant):
    line, expected = BROKEN_KEYS[variant]
    broken = mutated(setup_mod, "build", KEY, line)
    caught = {s for s in SECTION_CHANGES if section_problems(broken, s)} | set(device_problems(broken))
    assert caught == expected, f"{variant}: reported {sorted(caught)}, expected {sorted(expected)}"


# ---------------------------------------------------------------------------------------------
# End to end: two RL runs in one process that differ only in rl.learning_rate, one GRPO step each
# straight from the initial weights. The shapes are tests/test_rl_glue.py's run (2 prompts x 4
# completions, 3 new tokens, rl.beta=0.05, one layer of each mixer): the first run's programs are
# that run's, read from the compile cache when it ran before; the second compiles its own step.

# Attention layers only (helpers.ATTENTION_LAYERS): which GRPO step a run meets does not depend on
# the mixers, and each run's programs compile in about half of a two-mixer model's time.
RL_OVERRIDES = ("rl.warmup_steps=0", "rl.steps=1", "rl.checkpoint_every=0", "rl.prompts_per_step=2",
                "rl.group_size=4", "rl.max_prompt_len=6", "rl.max_new_tokens=3", "rl.beta=0.05", "train.batch_size=8",
                "train.seq_len=32", "gdn.chunk_size=8", *ATTENTION_LAYERS)
LR_A, LR_B = 1e-3, 4e-3
SCALE_TOL = 1e-4  # relative L2 of the B update against LR_B / LR_A times A's (float32 Adam, eps 1e-8)


def spread_reward(prompt: str, completion: str) -> float:
    """A reward in [0, 1) that changes with the completion: every group has variance, so every
    row carries an advantage and the update is not zero."""
    return zlib.crc32(f"{prompt}|{completion}".encode()) % 1000 / 1000


def first_update(cfg, monkeypatch) -> tuple[dict, dict]:
    """(the params' change by the run's one GRPO step, host numpy; the step's record)."""
    real, seen = rl_loop._grpo_step, {}

    def recording(run, state, *rest):
        before = jax.device_get(state["params"])  # the step donates the state
        state, rec = real(run, state, *rest)
        seen["delta"] = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, jax.device_get(state["params"]),
                                     before)
        return state, rec

    with monkeypatch.context() as patch:
        patch.setattr(rl_loop, "_grpo_step", recording)
        (rec,) = rl_loop.run_rl(cfg, None, progress=False, reward_fns=[(spread_reward, 1.0)])
    return seen["delta"], rec


def scaled_update_error(a: dict, b: dict, scale: float) -> float:
    num = sum(np.sum((y - scale * x) ** 2) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(np.sum((scale * x) ** 2) for x in jax.tree.leaves(a))
    return float(np.sqrt(num / den))


def test_two_rl_runs_that_differ_only_in_the_learning_rate_train_at_their_own_rates(monkeypatch):
    """Adam's first step moves each weight by lr * g / (|g| + eps) (the moments' bias corrections
    cancel; no warm-up, no decay): the same rollout at LR_B moves the weights LR_B / LR_A times as far
    as at LR_A. A second run that met the first run's GRPO step would move them as far."""
    delta_a, rec_a = first_update(tiny_config(*RL_OVERRIDES, f"rl.learning_rate={LR_A}"), monkeypatch)
    delta_b, rec_b = first_update(tiny_config(*RL_OVERRIDES, f"rl.learning_rate={LR_B}"), monkeypatch)
    # The same rollout (the same initial weights and sampling key), so the same gradient.
    assert rec_a["reward_mean"] == rec_b["reward_mean"] and rec_a["loss"] == rec_b["loss"], (rec_a, rec_b)
    assert rec_a["kept_frac"] > 0 and sum(np.abs(x).sum() for x in jax.tree.leaves(delta_a)) > 0
    error = scaled_update_error(delta_a, delta_b, LR_B / LR_A)
    print(f"B's update against {LR_B / LR_A:g} x A's: relative L2 {error:.2e} (tolerance {SCALE_TOL:.0e})")
    assert error < SCALE_TOL, error


# ---------------------------------------------------------------------------------------------
# What a run keeps besides the config: the sampler is built with the tokenizer's ids (EOS, pad,
# generation_config.json's stop ids), and two --init-hf checkpoints of one model config may differ
# there alone (same Config, same set-up). Each run must sample with its own tokenizer's ids.

def test_a_run_with_another_tokenizers_ids_gets_its_own_sampler(monkeypatch):
    import types

    setup_mod.forget_setups()
    cfg = tiny_config("rl.warmup_steps=0", "rl.steps=1")
    setup = setup_mod.build(cfg)

    class Program:
        """A compiled program that says which sampling options it was made with (none is compiled)."""

        def __init__(self, opts=None):
            self.opts = opts

        def memory_analysis(self):
            return types.SimpleNamespace(argument_size_in_bytes=0, temp_size_in_bytes=0, output_size_in_bytes=0,
                                         alias_size_in_bytes=0)

    monkeypatch.setattr(memory_plan_mod, "update_measured", lambda *_: (Program(), 0))
    monkeypatch.setattr(memory_plan_mod, "make_generate", lambda _cfg, opts, **__: types.SimpleNamespace(
        lower=lambda *_: types.SimpleNamespace(compile=lambda: Program(opts))))
    tok_a = types.SimpleNamespace(eos_id=7, pad_id=0, stop_ids=(9,))
    tok_b = types.SimpleNamespace(eos_id=11, pad_id=0, stop_ids=(12, 13))

    def sampler_of(tok):
        return rl_loop._build_run(cfg, setup_mod.build(equal_copy(cfg)), None, tok, [], False).generate

    first = sampler_of(tok_a)
    assert sampler_of(tok_a) is first  # the same run again: the kept program
    other = sampler_of(tok_b)
    assert (first.opts.eos_id, first.opts.stop_ids) == (7, (9,))
    assert (other.opts.eos_id, other.opts.stop_ids) == (11, (12, 13)), other.opts


def test_the_last_set_ups_used_are_the_ones_kept():
    """build() keeps the SETUPS_KEPT set-ups used last (least recently used goes first): a run
    repeated between others (the gates' reference arm, a resume after another run) finds its
    set-up and programs; the newest is always kept."""
    setup_mod.forget_setups()
    n = setup_mod.SETUPS_KEPT
    cfgs = [tiny_config(f"train.seed={i}") for i in range(n + 1)]
    first = [setup_mod.build(c) for c in cfgs[:n]]
    assert setup_mod.build(equal_copy(cfgs[0])) is first[0]  # used again: now the most recent
    newest = setup_mod.build(cfgs[n])  # one too many: the least recently used (cfgs[1]) goes
    assert setup_mod.build(equal_copy(cfgs[n])) is newest
    assert setup_mod.build(equal_copy(cfgs[0])) is first[0]
    assert [setup_mod.build(equal_copy(c)) is s for c, s in zip(cfgs[2:n], first[2:n])] == [True] * (n - 2)
    assert setup_mod.build(equal_copy(cfgs[1])) is not first[1]
