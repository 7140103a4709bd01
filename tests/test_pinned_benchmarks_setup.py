"""The benchmarks' fixed set-ups, as their docstrings and docs/performance.md state them: which
recipe, which mesh, which arms with which overrides, which defaults. A record's figures are only
comparable across runs when these hold."""


from helpers import benchmark_script_unconfigured

_load = benchmark_script_unconfigured


def test_rollout_and_train_step_run_small_on_one_cpu_device():
    rollout, train = _load("rollout"), _load("train_step")
    assert rollout.RECIPE == train.RECIPE == "small"
    assert rollout.ONE_DEVICE == ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1"]
    assert train.ONE_DEVICE == ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=-1"]
    assert rollout.ARMS == {"ours": {"overrides": [], "share": True},
                            "ours-unshared": {"overrides": [], "share": False},
                            "ours-ragged": {"overrides": ["kernels.gmm.xla_impl=ragged_dot"], "share": True}}


def test_rollout_defaults_are_two_prompts_of_eight_completions_of_128_plus_128_tokens():
    """The docstring's shape: Q = 2 prompts, G = 8, P = 128, N = 128; 7 timed rounds after 1 warm-up,
    on core 0."""
    defaults = {a.dest: a.default for a in _rollout_parser(_load("rollout"))._actions}
    assert (defaults["prompts"], defaults["group_size"], defaults["prompt_len"], defaults["new_tokens"],
            defaults["rounds"], defaults["warmup"], defaults["cores"]) == (2, 8, 128, 128, 7, 1, "0")


def _rollout_parser(rollout):
    """The rollout script's command line as main() builds it (read from its own argparse calls)."""
    import argparse

    captured = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        captured["parser"] = self
        raise SystemExit

    argparse.ArgumentParser.parse_args = grab
    try:
        rollout.main()
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real
    return captured["parser"]


def test_step_anatomy_runs_small_on_one_device_with_its_three_controls():
    anatomy = _load("step_anatomy")
    assert anatomy.RECIPE == "small" and anatomy.OVERRIDES == ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=-1"]
    assert anatomy.CONTROLS == {"attention[full core]": "attention", "moe[ragged_dot]": "moe",
                                "step[remat full]": "step"}


def test_context_parallel_benchmarks_arms_and_contexts():
    cpa, ring = _load("cp_attention"), _load("cp_ring")
    assert cpa.CONTEXTS == (2, 4)
    assert cpa.COMMON == ["mesh.cpu_devices=8", "mesh.data=1", "mesh.fsdp=-1", "remat.policy=custom"]
    assert ring.ARMS == {"all_gather": ["attention.cp_impl=all_gather", "kernels.attention.backend=xla"],
                         "all_gather[masked]": ["attention.cp_impl=all_gather", "kernels.attention.backend=blocked"],
                         "ring": ["attention.cp_impl=ring", "kernels.attention.backend=xla"]}


def test_fp8_hoist_common_set_up_is_bfloat16_small_at_eight_rows():
    fp8 = _load("fp8_hoist")
    assert fp8.RECIPE == "small"
    assert fp8.COMMON == ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16", "train.batch_size=8"]
    assert fp8.TWO_BLOCKS == ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16", "model.num_layers=2",
                              "model.layer_pattern=[attention]", "mesh.expert=2"]


def test_compile_cache_runs_each_command_as_the_docstring_lists():
    cc = _load("compile_cache")
    assert cc.COMMANDS == {
        "demo": ["demo"],
        "train small, 2 steps": ["train", "recipe=small", "train.batch_size=8", "train.steps=2", "--out", "run",
                                 "--overwrite"],
        "inspect small (cpu:8)": ["inspect", "recipe=small", "train.batch_size=8", "--target", "cpu:8"],
        "inspect small (tpu7x:2x2x1)": ["inspect", "recipe=small", "train.batch_size=8", "--target", "tpu7x:2x2x1"]}


def test_gdn_core_arms_and_the_commit_before_the_speed_work():
    gdn = _load("gdn_core")
    assert gdn.BEFORE_COMMIT == "0f414be"
    assert gdn.ARMS["layer before autodiff C64"] == ("layer", "before", "xla_autodiff", 64)
    assert gdn.ARMS["core now custom C32"] == ("core", "now", "xla", 32)
    assert gdn.PALLAS_PLATFORM == {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}
    assert len(gdn.ARMS) == 12


def test_demo_curves_runs_demo_and_demo_tis():
    assert _load("demo_curves").RECIPES == ("demo", "demo-tis")
