"""What the command line prints, writes and refuses, with the loops, the policy and the sampler
replaced by fakes: every figure on a line is worked out from the fake's numbers."""

import json
import types

import pytest

from hybridmoe import cli
from hybridmoe.cli import main


def test_the_rl_summary_starts_at_the_first_grpo_step_not_the_warm_up():
    history = [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0},
               {"step": 2, "reward_mean": 0.25}, {"step": 3, "reward_mean": 0.5}, {"step": 4, "reward_mean": 0.875}]
    assert cli._rl_summary(history) == "GRPO steps 2..4: reward_mean 0.250 -> 0.875"
    assert cli._rl_summary(history[:2]) == "2 warm-up step(s), no GRPO step"


def test_train_prints_the_first_and_last_steps_loss(monkeypatch, capsys):
    import hybridmoe.train.loop as train_loop
    seen = {}

    def fake_train(cfg, out, **kw):
        seen.update(cfg=cfg, out=out, **kw)
        return [{"step": 3, "loss": 2.5}, {"step": 4, "loss": 2.0}, {"step": 5, "loss": 1.25}]
    monkeypatch.setattr(cli, "_config", lambda words, init_hf=None: ("cfg", tuple(words), init_hf))
    monkeypatch.setattr(train_loop, "train", fake_train)
    assert main(["train", "train.steps=6", "--resume", "--out", "somewhere"]) == 0
    assert capsys.readouterr().out == "steps 3..5: loss 2.5000 -> 1.2500\n"
    assert seen["cfg"] == ("cfg", ("train.steps=6",), None)
    assert str(seen["out"]) == "somewhere" and seen["resume"] and not seen["overwrite"] and seen["export_hf"] is None


def test_rl_prints_its_summary(monkeypatch, capsys):
    import hybridmoe.rl.loop as rl_loop
    monkeypatch.setattr(cli, "_config", lambda words, init_hf=None: None)
    monkeypatch.setattr(rl_loop, "run_rl", lambda cfg, out, **kw: [{"step": 0, "reward_mean": 0.5},
                                                                   {"step": 1, "reward_mean": 0.75}])
    assert main(["rl"]) == 0
    assert capsys.readouterr().out == "GRPO steps 0..1: reward_mean 0.500 -> 0.750\n"


def test_sampling_takes_the_runs_settings_unless_given_and_zero_is_given():
    policy = types.SimpleNamespace(cfg=types.SimpleNamespace(rl=types.SimpleNamespace(temperature=0.7, top_p=0.9)))
    args = types.SimpleNamespace(max_new_tokens=5, batch_size=2, seed=3, temperature=None, top_p=None)
    assert cli._sampling(args, policy) == {"max_new_tokens": 5, "batch_size": 2, "seed": 3, "temperature": 0.7,
                                           "top_p": 0.9}
    args.temperature, args.top_p = 0.0, 0.5
    assert cli._sampling(args, policy)["temperature"] == 0.0 and cli._sampling(args, policy)["top_p"] == 0.5


def _fake_policy():
    return types.SimpleNamespace(cfg=types.SimpleNamespace(rl=types.SimpleNamespace(temperature=1.0, top_p=1.0,
                                                                                    reward=["r.py:f"],
                                                                                    reward_weights=[]),
                                                           data=types.SimpleNamespace(on_bad_line="stop")),
                                 tokenizer=None)


def test_generate_prints_each_completion_and_the_rate_and_writes_every_field(monkeypatch, capsys, tmp_path):
    import hybridmoe.rl.policy_io as policy_io
    monkeypatch.setattr(cli, "_policy", lambda args, words: _fake_policy())
    records = [{"prompt": "a", "completion": "x", "tokens": 1, "truncated": False, "prompt_ids": [1],
                "completion_ids": [9]},
               {"prompt": "b", "completion": "yz", "tokens": 2, "truncated": True, "prompt_ids": [2],
                "completion_ids": [8, 7]}]
    timing = {"batches": 2, "rows_per_batch": 4, "seconds": 0.5, "compile_s": 12.34, "new_tokens": 3,
              "tokens_per_s": 6.0}
    got = {}

    def fake_generate(policy, prompts, **kw):
        got.update(prompts=prompts, **kw)
        return records, timing
    monkeypatch.setattr(policy_io, "generate_texts", fake_generate)
    out = tmp_path / "g.jsonl"
    assert main(["generate", "--hf", "x", "--prompt", "a", "--prompt", "b", "--temperature", "0",
                 "--max-new-tokens", "7", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out.splitlines() == ['{"prompt": "a", "completion": "x"}', '{"prompt": "b", "completion": "yz"}']
    assert cap.err == ("3 new tokens in 2 batch(es) of 4 rows: 6.0 tokens/s, compile not included "
                       "(compiled in 12.3 s)\n")
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert got == {"prompts": ["a", "b"], "max_new_tokens": 7, "batch_size": 8, "seed": 0, "temperature": 0.0,
                   "top_p": 1.0}


def _eval_result(errors_a, errors_b):
    return {"tasks": {"add": {"prompts": 2, "samples": 8, "mean_reward": 0.625, "pass@1": 0.5, "pass@4": 0.75,
                              "reward_errors": errors_a},
                      "mul": {"prompts": 1, "samples": 4, "mean_reward": 0.0, "pass@1": 0.0, "pass@4": 0.0,
                              "reward_errors": errors_b}},
            "reward_errors": errors_a + errors_b, "reward_error_kinds": {"raised:KeyError": errors_a + errors_b}}


@pytest.fixture
def fake_eval(monkeypatch):
    import hybridmoe.data.prompts as prompts
    import hybridmoe.rl.reward_loading as reward_loading
    import hybridmoe.tools.evaluate as evaluate
    monkeypatch.setattr(cli, "_policy", lambda args, words: _fake_policy())
    monkeypatch.setattr(reward_loading, "load_rewards", lambda specs, weights: [])
    monkeypatch.setattr(prompts, "read_prompt_set", lambda *a, **k: [])
    result = {}
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: result["value"])
    return result


def test_eval_prints_each_tasks_figures(fake_eval, capsys):
    fake_eval["value"] = _eval_result(1, 4)
    assert main(["eval", "--hf", "x", "--prompts", "p.jsonl", "--samples", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "add: 2 prompts x 4: mean reward 0.625, pass@1 0.500, pass@4 0.750, reward errors 1 of 8",
        "mul: 1 prompts x 4: mean reward 0.000, pass@1 0.000, pass@4 0.000, reward errors 4 of 4"]


def test_eval_fails_when_every_sample_is_a_reward_error_unless_accepted(fake_eval, capsys):
    fake_eval["value"] = _eval_result(8, 4)  # 8 + 4 = 12 = every sample of the two tasks
    assert main(["eval", "--hf", "x", "--prompts", "p.jsonl", "--samples", "4"]) == 1
    assert "on every one of the 12 samples ({'raised:KeyError': 12})" in capsys.readouterr().err
    assert main(["eval", "--hf", "x", "--prompts", "p.jsonl", "--samples", "4", "--accept-reward-errors"]) == 0
    fake_eval["value"] = _eval_result(7, 4)  # one sample scored: a result
    assert main(["eval", "--hf", "x", "--prompts", "p.jsonl", "--samples", "4"]) == 0


def test_eval_without_a_reward_is_refused(monkeypatch, capsys):
    policy = _fake_policy()
    policy.cfg.rl.reward = []
    monkeypatch.setattr(cli, "_policy", lambda args, words: policy)
    assert main(["eval", "--hf", "x", "--prompts", "p.jsonl"]) == 2
    assert "eval scores with reward functions: pass rl.reward=" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--prompt", "a"], "give exactly one of --hf DIR"),
    (["generate", "--hf", "a", "--run", "b", "--prompt", "a"], "give exactly one of --hf DIR"),
    (["generate", "--hf", "a", "--prompts", "p.jsonl", "--prompt", "a"], "give --prompts FILE"),
    (["launch", "--processes", "2", "--", "demo"], "launch runs a command in N processes"),
    (["launch", "--processes", "2", "--", "nonsense"], "launch runs a command in N processes"),
    (["launch", "--processes", "2"], "launch runs a command in N processes"),
    (["calibrate", "x.y=1"], "calibrate takes no config overrides"),
    (["gates"], "gates needs --candidate"),
    (["gates", "--candidate", "oops"], "--candidate takes overrides section.key=value"),
    (["train", "--resume"], "--resume continues the run in --out"),
    (["score", "--hf", "h", "--tokens", "t.npy", "--out", "o.npy", "a.b=1"], "score takes no overrides"),
    (["inspect", "--compare", "oops"], "--compare takes overrides section.key=value"),
    (["inspect", "--memory-only", "--layers", "2"], "--memory-only reads one program's buffer assignment"),
    (["inspect", "--memory-only", "--compare", "train.steps=3"], "--memory-only reads one program's buffer"),
    (["inspect", "--layers", "2", "--compare", "train.steps=3"], "--layers compiles two depths of one program"),
])
def test_refusals_are_one_line_with_exit_code_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hybridmoe {argv[0]}: error: ") and needle in err and err.count("\n") == 1


def test_score_refuses_an_out_that_is_a_folder_or_in_a_missing_folder(tmp_path, capsys):
    assert main(["score", "--hf", "h", "--tokens", "t.npy", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err
    missing = tmp_path / "no" / "x.npy"
    assert main(["score", "--hf", "h", "--tokens", "t.npy", "--out", str(missing)]) == 2
    assert f"the folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err


def test_score_prints_the_shape_and_mean_of_what_it_wrote(tmp_path, monkeypatch, capsys):
    import numpy as np
    import hybridmoe.tools.score as score
    monkeypatch.setattr(score, "load_token_file", lambda path: None)
    monkeypatch.setattr(score, "score_tokens", lambda hf, tokens: np.array([[-1.0, -2.0], [-0.5, -0.5]], np.float32))
    out = tmp_path / "lp.npy"
    assert main(["score", "--hf", "h", "--tokens", "t.npy", "--out", str(out)]) == 0
    # mean of -1, -2, -0.5, -0.5 = -4 / 4 = -1.0
    assert capsys.readouterr().out == f"wrote {out}: log-probs (2, 2) float32, mean -1.0000\n"
    assert np.load(out).tolist() == [[-1.0, -2.0], [-0.5, -0.5]]
    assert [p.name for p in tmp_path.iterdir()] == ["lp.npy"]


def test_words_without_an_equals_sign_stop_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "stray"])
    assert e.value.code == 2 and "unrecognised arguments ['stray']" in capsys.readouterr().err


def test_init_hf_puts_the_checkpoint_under_the_recipe():
    assert cli._recipe(["recipe=small", "a.b=1"], "ckpt") == ("hf:ckpt@small", ["a.b=1"])
    assert cli._recipe(["recipe=hf:other"], "ckpt") == ("hf:other", [])
    assert cli._recipe(["a.b=1"], None) == ("tiny", ["a.b=1"])


def test_describes_kernel_rows_give_each_kernels_tiles_and_vmem_in_mib(monkeypatch):
    from hybridmoe.kernels.gmm import tiling
    import hybridmoe.recipe.kernel_needs as needs
    monkeypatch.setattr(needs, "gmm_layer", lambda cfg: {})
    monkeypatch.setattr(tiling, "layer_kernels", lambda **kw: {"fwd": ("gmm_fwd", [8, 16, 32]),
                                                               "dlhs": ("gmm_dlhs", [4, 2, 1])})
    monkeypatch.setattr(tiling, "resolved_tiles", lambda buffers: tuple(buffers))
    need = types.SimpleNamespace(need_bytes=3 * 2**20 + 2**19, limit_bytes=16 * 2**20)
    monkeypatch.setattr(needs, "gmm_vmem_needs", lambda cfg: {"fwd": need})
    gmm = types.SimpleNamespace(tiling="explicit", backend="pallas_tpu")
    cfg = types.SimpleNamespace(kernels=types.SimpleNamespace(gmm=gmm))
    assert cli.kernel_rows(cfg) == [
        {"kernel": "fwd", "pallas": "gmm_fwd", "tm": 8, "tk": 16, "tn": 32, "vmem_mib": 3.5, "limit_mib": 16.0},
        {"kernel": "dlhs", "pallas": "gmm_dlhs", "tm": 4, "tk": 2, "tn": 1}]
    gmm.backend = "pallas_gpu"  # VMEM is a Mosaic TPU figure
    assert "vmem_mib" not in cli.kernel_rows(cfg)[0]
    gmm.backend = "xla"
    assert cli.kernel_rows(cfg) == []
    gmm.backend, gmm.tiling = "pallas_tpu", "auto"
    assert cli.kernel_rows(cfg) == []


def test_describe_prints_the_totals_in_billions_and_each_kernels_row(monkeypatch, capsys):
    import hybridmoe.model.params as params
    monkeypatch.setattr(params, "count_params", lambda specs: 1_234_567_890)
    monkeypatch.setattr(params, "count_active_params", lambda model: 346_000_000)
    monkeypatch.setattr(cli, "kernel_rows", lambda cfg: [
        {"kernel": "fwd", "pallas": "gmm_fwd", "tm": 8, "tk": 16, "tn": 32, "vmem_mib": 3.5, "limit_mib": 16.0},
        {"kernel": "dlhs", "pallas": "gmm_dlhs", "tm": 4, "tk": 2, "tn": 1}])
    assert main(["describe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "total parameters:  1,234,567,890 (1.23 B)" in lines
    assert "active per token:  346,000,000 (0.35 B)" in lines
    assert "  fwd      gmm_fwd                tm 8     tk 16    tn 32     3.50 / 16.00 MiB" in lines
    assert "  dlhs     gmm_dlhs               tm 4     tk 2     tn 1    " in lines


def test_a_runs_policy_takes_the_runs_config_with_the_overrides_on_top(monkeypatch, tmp_path):
    import hybridmoe.rl.policy_io as policy_io
    from hybridmoe.recipe import load_config
    saved = load_config("tiny", ["rl.temperature=0.5"])
    monkeypatch.setattr(policy_io, "run_config", lambda run_dir: (saved, 3, {}))
    monkeypatch.setattr(cli, "_runtime", lambda cfg: None)
    got = {}
    monkeypatch.setattr(policy_io, "load_policy", lambda cfg, hf_dir, run_dir: got.update(cfg=cfg, hf=hf_dir,
                                                                                         run=run_dir) or "policy")
    args = types.SimpleNamespace(hf=None, run=str(tmp_path))
    assert cli._policy(args, ["rl.top_p=0.75"]) == "policy"
    assert (got["cfg"].rl.temperature, got["cfg"].rl.top_p) == (0.5, 0.75)  # the run's, then the override
    assert got["hf"] is None and str(got["run"]) == str(tmp_path)


def test_eval_writes_a_record_naming_its_source_prompts_and_rewards(fake_eval, monkeypatch, tmp_path):
    import hybridmoe.tools.record as record
    written = {}
    monkeypatch.setattr(record, "source_commit", lambda: "c0ffee")
    monkeypatch.setattr(record, "machine_record", lambda: {"machine": "m"})
    monkeypatch.setattr(record, "write_record", lambda path, rec: written.update(path=path, rec=rec))
    fake_eval["value"] = _eval_result(1, 0)
    out = tmp_path / "e.json"
    assert main(["eval", "--run", "r", "--prompts", "p.jsonl", "--out", str(out)]) == 0
    rec = written["rec"]
    assert written["path"] == out and rec["benchmark"] == "eval" and rec["machine"] == "m"
    assert rec["source"] == {"hf": None, "run": "r"} and rec["prompts"] == "p.jsonl"
    assert rec["rewards"] == ["r.py:f"] and rec["reward_weights"] == [] and rec["reward_errors"] == 1
    assert rec["tasks"]["add"]["pass@4"] == 0.75
