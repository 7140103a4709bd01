"""Bad input as a new user types it: one clear error naming what is wrong, exit 2, no traceback,
nothing written. And the sharding validator: every weight dimension the rules split is checked."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.cli import main
from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config
from hybridmoe.recipe.validate import rl_sequence_problems
from hybridmoe.model import fit
from hybridmoe.parallel.rules import DEFAULT_RULES

FIXTURE = Path(__file__).parent / "fixtures" / "hf_tiny"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    """The odd files and folders the cases below point at."""
    made = {}
    for name, content in (("truncated", (FIXTURE / "model.safetensors").read_bytes()[:1000]),
                          ("random", np.random.default_rng(0).bytes(5000))):
        d = tmp / f"hf_{name}"
        shutil.copytree(FIXTURE, d)
        (d / "model.safetensors").write_bytes(content)
        made[name] = d
    made["bad_config"] = tmp / "hf_bad_config"
    shutil.copytree(FIXTURE, made["bad_config"])
    (made["bad_config"] / "config.json").write_text("{not json")
    made["empty_tokens"] = tmp / "empty.npy"
    made["empty_tokens"].write_bytes(b"")
    made["text_tokens"] = tmp / "tokens.txt"
    made["text_tokens"].write_text("1 2 3\n")
    made["a_file"] = tmp / "a_file"
    made["a_file"].write_text("not a folder")
    made["a_dir"] = tmp / "a_dir"
    made["a_dir"].mkdir()
    return made


TOKENS = str(FIXTURE / "tokens.npy")
RL_NOTHING = ["rl", "recipe=demo", "rl.warmup_steps=0", "rl.steps=0"]
RL_CONTEXT = ["recipe=tiny", "train.batch_size=8", "train.seq_len=16", "gdn.chunk_size=4", "mesh.context=2",
              "rl.warmup_steps=0", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=4", "rl.max_prompt_len=8"]
# (argv with {placeholders}, text the error must contain). train/rl cases that get past the path
# checks would train: the checks must come first, so these stay fast.
CASES = {
    "empty_layer_pattern": (["describe", "model.layer_pattern=[]"], "model.layer_pattern"),
    "heads_vs_tensor": (["train", "mesh.tensor=4", "model.num_heads=6"], "model.num_heads"),
    "experts_vs_expert": (["train", "mesh.expert=4", "model.num_experts=6"], "model.num_experts"),
    "score_truncated_safetensors": (["score", "--hf", "{truncated}", "--tokens", TOKENS, "--out", "{out}/lp.npy"],
                                    "model.safetensors"),
    "score_random_safetensors": (["score", "--hf", "{random}", "--tokens", TOKENS, "--out", "{out}/lp.npy"],
                                 "model.safetensors"),
    "init_hf_truncated_safetensors": ([*RL_NOTHING, "--init-hf", "{truncated}", "--out", "{out}/run"],
                                      "model.safetensors"),
    "init_hf_random_safetensors": ([*RL_NOTHING, "--init-hf", "{random}"], "model.safetensors"),
    "score_out_is_a_folder": (["score", "--hf", str(FIXTURE), "--tokens", TOKENS, "--out", "{a_dir}"], "--out"),
    "train_out_is_a_file": (["train", "--out", "{a_file}"], "--out"),
    "rl_out_is_a_file": (["rl", "--out", "{a_file}"], "--out"),
    "rl_export_is_a_file": (["rl", "--export-hf", "{a_file}"], "--export-hf"),
    "empty_tokens_file": (["score", "--hf", str(FIXTURE), "--tokens", "{empty_tokens}", "--out", "{out}/lp.npy"],
                          "empty.npy"),
    "text_tokens_file": (["score", "--hf", str(FIXTURE), "--tokens", "{text_tokens}", "--out", "{out}/lp.npy"],
                         "tokens.txt"),
    "score_bad_config_json": (["score", "--hf", "{bad_config}", "--tokens", TOKENS, "--out", "{out}/lp.npy"],
                              "config.json"),
    "init_hf_bad_config_json": ([*RL_NOTHING, "--init-hf", "{bad_config}"], "config.json"),
    "resume_without_out": (["train", "--resume"], "--out"),
    # 8 + 3 = 11 tokens per GRPO row: not whole gdn.chunk_size=4 chunks on each of 2 context ranks.
    "rl_lengths_vs_context": (["rl", *RL_CONTEXT, "rl.max_new_tokens=3", "--out", "{out}/run"], "rl.max_new_tokens"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_error_exit_2_and_nothing_written(case, tmp_path, capsys):
    argv, expected = CASES[case]
    made = _bad_inputs(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    before = _files(tmp_path)
    argv = [a.format(out=out, **made) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    assert _files(tmp_path) == before, "the failed command wrote files"


def test_score_takes_tokens_shorter_than_the_default_sequence(tmp_path):
    short = tmp_path / "short.npy"
    np.save(short, np.load(FIXTURE / "tokens.npy")[:, :10])
    out = tmp_path / "lp.npy"
    assert main(["score", "--hf", str(FIXTURE), "--tokens", str(short), "--out", str(out)]) == 0
    np.testing.assert_allclose(np.load(out), np.load(FIXTURE / "logprobs.npy")[:, :9], atol=1e-4, rtol=0)
    assert _files(tmp_path) == {"short.npy", "lp.npy"}  # no temporary file left


@pytest.mark.parametrize("logical, overrides, key", [
    ("heads", ["mesh.tensor=4", "model.num_heads=6"], "model.num_heads"),
    ("kv_heads", ["mesh.tensor=4", "model.num_heads=4", "model.num_kv_heads=1", "model.gdn_num_key_heads=4",
                  "model.gdn_num_value_heads=4"], "model.num_kv_heads"),
    ("heads", ["mesh.tensor=4", "model.gdn_num_key_heads=1", "model.gdn_num_value_heads=4"], "model.gdn_num_key_heads"),
    ("heads", ["mesh.tensor=2", "model.gdn_num_key_heads=1", "model.gdn_num_value_heads=3"],
     "model.gdn_num_value_heads"),
    ("exp", ["mesh.expert=4", "model.num_experts=6"], "model.num_experts"),
    ("exp", ["mesh.rules=cp_as_ep", "mesh.context=2", "mesh.expert=2", "model.num_experts=6"], "model.num_experts"),
    ("vocab", ["mesh.tensor=2", "model.vocab_size=255"], "model.vocab_size"),
    ("embed", ["model.d_model=30"], "model.d_model"),  # fsdp absorbs 4 of the tiny recipe's 8 devices
    ("mlp", ["mesh.tensor=2", "model.shared_expert_intermediate_size=3"], "model.shared_expert_intermediate_size"),
])
def test_every_split_dimension_is_checked_at_load(logical, overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    named = [m for k, m in e.value.problems if k == key]
    assert named and f"'{logical}'" in named[0], e.value.problems


def test_experts_split_over_the_fsdp_axes_must_divide():
    """mesh.expert_fsdp_dim=exp splits E over expert x fsdp x context: 6 experts over 2 x 2 x 2
    is refused at load naming the key, its split and both ways out; 8 experts load."""
    mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.expert=2", "gdn.chunk_size=32",
            "mesh.expert_fsdp_dim=exp"]
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [*mesh, "model.num_experts=6"])
    named = dict(e.value.problems).get("mesh.expert_fsdp_dim", "")
    assert "model.num_experts=6" in named and "mesh.expert=2 x mesh.fsdp=2 x mesh.context=2" in named, e.value.problems
    assert "mesh.expert_fsdp_dim=embed" in named
    assert load_config("tiny", [*mesh, "model.num_experts=8"]).mesh.expert_fsdp_dim == "exp"


def test_the_check_follows_the_rules_table_not_a_list_of_known_axes(monkeypatch):
    """A rule for a logical axis nobody listed is checked the moment it exists."""
    cfg = load_config("tiny", ["mesh.tensor=2"])
    assert fit.sharding_problems(cfg.model, DEFAULT_RULES, {"tensor": 2, "fsdp": 4, "data": 1}) == []
    # A table that also splits the layer stack over data (an axis no weight dimension uses): the 1
    # stacked block of num_layers=4 with a 4-long pattern does not split in 2.
    problems = fit.sharding_problems(cfg.model, {**DEFAULT_RULES, "layers": "data"},
                                     {"tensor": 2, "fsdp": 4, "data": 2})
    assert [k for k, _ in problems] == ["model.num_layers"], problems


def test_build_checks_the_real_mesh_when_the_device_count_is_known_only_at_run_time():
    from hybridmoe.run.setup import build
    cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.data=1", "model.d_model=30"])  # fsdp=-1: unknown at load
    with pytest.raises(ConfigError, match="model.d_model"):
        build(cfg)


def test_rl_sequences_are_checked_against_the_context_ranks_and_gdn_chunks():
    problems = dict(rl_sequence_problems(load_config("tiny", [*RL_CONTEXT[1:], "rl.max_prompt_len=7",
                                                               "rl.max_new_tokens=3"])))
    assert "multiple of 2" in problems["rl.max_prompt_len"], problems
    assert "multiple of 8" in problems["rl.max_new_tokens"] and "gdn.chunk_size=4" in problems["rl.max_new_tokens"]
    assert rl_sequence_problems(load_config("tiny", [*RL_CONTEXT[1:], "rl.max_new_tokens=8"])) == []
    # Only the rl command checks them (the config loads): the rl keys need not fit a train run's mesh.
    assert rl_sequence_problems(load_config("tiny", [*RL_CONTEXT[1:], "rl.max_new_tokens=3"]))


@pytest.mark.slow
def test_a_grpo_step_runs_with_the_sequence_over_context_ranks(tmp_path):
    """The fix the rule suggests runs: per-target arrays [.., T - 1] no longer split like tokens [.., T]."""
    assert main(["rl", *RL_CONTEXT, "rl.max_new_tokens=8", "--out", str(tmp_path / "run")]) == 0


def test_a_rule_the_load_cannot_decide_is_decided_on_the_real_mesh():
    """mesh.fsdp=-1 leaves the fsdp size open at load; set-up runs the validation pass for its
    devices, which resolve it, so gather8 on an fsdp axis of 1 is one ConfigError naming the key, not a failure
    from inside the traced model."""
    from hybridmoe.run.setup import build
    cfg = load_config("tiny", ["quant.fp8_moe_fake_quant=true", "quant.fp8_fake_quant_hoist=gather8",
                               "mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=-1", "mesh.expert=8"])
    with pytest.raises(ConfigError) as e:
        build(cfg)
    assert [k for k, _ in e.value.problems] == ["quant.fp8_fake_quant_hoist"]
    assert "mesh.fsdp=1" in str(e.value)


def test_build_refuses_a_batch_its_devices_do_not_split():
    """The batch's split over the mesh is a rule of the validation pass, decided for the devices the
    run builds on: 3 rows over the 8 batch shards of the 8 CPU devices (data x fsdp x expert)."""
    from hybridmoe.run.setup import build
    cfg = load_config("tiny", ["train.batch_size=3"])  # accepted at load: the batch may be meant for other devices
    with pytest.raises(ConfigError) as e:
        build(cfg)
    assert e.value.problems == [("train.batch_size", "3 does not split over the 8 shards of mesh axes "
                                 "('data', 'fsdp', 'expert')")]
    build(load_config("tiny", ["train.batch_size=8"]))


def test_a_mesh_the_devices_cannot_hold_is_refused_by_the_validator():
    from hybridmoe.run.setup import build
    cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.data=3", "mesh.fsdp=-1"])
    with pytest.raises(ConfigError) as e:
        build(cfg)
    assert e.value.problems == [("mesh.fsdp", "cannot absorb the rest: 8 devices are not a multiple of the other "
                                 "axes' product 3 (mesh.data=3); change those axes")]


def test_an_init_hf_checkpoint_of_other_shapes_is_refused_naming_each_field():
    from hybridmoe.hf import model_fields_from_hf_config, read_hf_config
    from hybridmoe.run.hf_io import config_with_hf_model
    theirs = model_fields_from_hf_config(read_hf_config(str(FIXTURE)))
    cfg = load_config(f"hf:{FIXTURE}", [f"model.d_model={2 * theirs['d_model']}"])
    with pytest.raises(ConfigError) as e:
        config_with_hf_model(cfg, FIXTURE)
    (key, msg), = e.value.problems
    assert key == "model.d_model" and f"pass: model.d_model={theirs['d_model']}" in msg, msg
    assert config_with_hf_model(load_config(f"hf:{FIXTURE}"), FIXTURE).model.d_model == theirs["d_model"]
