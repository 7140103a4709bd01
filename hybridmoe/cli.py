"""hybridmoe <command> [recipe=NAME | recipe=hf:DIR[@BASE]] [section.key=value ...] [--flags]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridmoe.analysis.hardware import MAKERS
from hybridmoe.config import ConfigError
from hybridmoe.recipe import load_config, split_args


CONFIG_HELP = """\
the config:
  recipe=NAME          a named recipe (tiny, small, demo, qwen3.5-35b-a3b, qwen3.5-397b-a17b,
                       qwen3-next-80b-a3b) or a path to a recipe .yml; default tiny
  recipe=hf:DIR        the model section from a Hugging Face checkpoint folder's config.json
                       (Qwen3.5-MoE or Qwen3-Next), its tokenizer.json as the tokenizer, every
                       other section from the tiny recipe; recipe=hf:DIR@BASE takes them from
                       recipe BASE instead (--init-hf DIR does the same with the recipe given)
  section.key=value    an override, applied after the recipe (later wins), e.g. train.steps=100
                       model.max_seq_len=4096 rl.reward=[my_rewards.py:correct,mod:fmt]
                       (values are YAML: numbers, true/false, [lists]); `hybridmoe describe`
                       prints every section and key
"""


def _recipe(words: list[str], init_hf: str | None = None) -> tuple[str, list[str]]:
    """(recipe, overrides); with --init-hf DIR the model section comes from DIR's config.json."""
    recipe, overrides = split_args(words)
    if init_hf and not recipe.startswith("hf:"):
        recipe = f"hf:{init_hf}@{recipe}"
    return recipe, overrides


def _runtime(cfg) -> None:
    """What JAX needs before its first compile: simulated CPU devices and the compile cache."""
    from hybridmoe.parallel.mesh import configure_cpu_devices
    from hybridmoe.run.compile_cache import configure_compile_cache
    configure_cpu_devices(cfg.mesh)
    configure_compile_cache(cfg.run.compile_cache_dir)


def _config(words: list[str], init_hf: str | None = None):
    cfg = load_config(*_recipe(words, init_hf))
    _runtime(cfg)
    if cfg.mesh.distributed:
        from hybridmoe.parallel.host import initialize_distributed
        initialize_distributed(cfg.mesh)
    return cfg


def cmd_describe(args, words):
    from hybridmoe.model.params import count_active_params, count_params, declare_params, param_table
    cfg = load_config(*split_args(words))
    specs = declare_params(cfg.model)
    total, active = count_params(specs), count_active_params(cfg.model)
    kernels = kernel_rows(cfg)
    if args.json:
        print(json.dumps({"config": json.loads(cfg.model_dump_json()), "total_params": total,
                          "active_params": active, "kernels": kernels,
                          "params": [{"name": n, "shape": list(s), "dtype": d, "axes": list(a)}
                                     for n, s, d, a in param_table(specs)]}, indent=1))
        return 0
    print(cfg.model_dump_json(indent=1))
    width = max(len(n) for n, *_ in param_table(specs))
    for name, shape, dtype, axes in param_table(specs):
        print(f"  {name:<{width}}  {str(shape):<28} {dtype:<9} {axes}")
    print(f"total parameters:  {total:,} ({total / 1e9:.2f} B)")
    print(f"active per token:  {active:,} ({active / 1e9:.2f} B)")
    if kernels:
        print("grouped matmuls (resolved tiles; VMEM by the model against the scoped limit on Mosaic TPU):")
        for r in kernels:
            vmem = f"  {r['vmem_mib']:.2f} / {r['limit_mib']:.2f} MiB" if "vmem_mib" in r else ""
            print(f"  {r['kernel']:<8} {r['pallas']:<22} tm {r['tm']:<5} tk {r['tk']:<5} tn {r['tn']:<5}{vmem}")
    return 0


def kernel_rows(cfg) -> list[dict]:
    """Each grouped matmul of the MoE layer at its resolved tiles (explicit tiling), with its VMEM
    need by the model on pallas_tpu."""
    from hybridmoe.kernels.gmm import tiling
    from hybridmoe.recipe.kernel_needs import gmm_layer, gmm_vmem_needs

    g = cfg.kernels.gmm
    if g.tiling != "explicit" or g.backend == "xla":
        return []
    kernels = tiling.layer_kernels(**gmm_layer(cfg))
    needs = gmm_vmem_needs(cfg) if g.backend == "pallas_tpu" else {}
    rows = []
    for name, (pallas, buffers) in kernels.items():
        tm, tk, tn = tiling.resolved_tiles(buffers)
        row = {"kernel": name, "pallas": pallas, "tm": tm, "tk": tk, "tn": tn}
        if name in needs:
            row.update(vmem_mib=round(needs[name].need_bytes / 2**20, 3),
                       limit_mib=round(needs[name].limit_bytes / 2**20, 3))
        rows.append(row)
    return rows


def _check_run_paths(args) -> None:
    """The run's paths, checked before the config is built or anything compiles."""
    from hybridmoe.run.run_dir import check_paths

    def path(flag: str) -> Path | None:
        value = getattr(args, flag, None)
        return Path(value) if value else None

    check_paths(path("out"), resume=args.resume, overwrite=args.overwrite, export_hf=path("export_hf"),
                init_hf=path("init_hf"))


def _run_loop(args, words, loop):
    """A train or rl run: its paths checked before anything is built, then the loop; its history."""
    _check_run_paths(args)
    cfg = _config(words, args.init_hf)
    path = lambda value: Path(value) if value else None  # noqa: E731
    return loop(cfg, path(args.out), resume=args.resume, overwrite=args.overwrite, init_hf=path(args.init_hf),
                export_hf=path(args.export_hf))


def cmd_train(args, words):
    from hybridmoe.train.loop import train
    hist = _run_loop(args, words, train)
    if hist:
        print(f"steps {hist[0]['step']}..{hist[-1]['step']}: loss {hist[0]['loss']:.4f} -> {hist[-1]['loss']:.4f}")
    return 0


def cmd_score(args, words):
    if words:
        raise ValueError(f"score takes no overrides (got {words}): the model comes from the checkpoint's config.json")
    import numpy as np
    from hybridmoe.tools.score import load_token_file, score_tokens
    out_path = Path(args.out)
    if out_path.is_dir():
        raise ValueError(f"--out {out_path} is a folder; it must name the .npy file to write")
    if not out_path.parent.is_dir():
        raise ValueError(f"--out {out_path}: the folder {out_path.parent} does not exist")
    out = score_tokens(Path(args.hf), load_token_file(Path(args.tokens)))
    tmp = out_path.with_name(f".{out_path.name}.tmp.npy")
    try:
        np.save(tmp, out)
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {args.out}: log-probs {out.shape} float32, mean {out.mean():.4f}")
    return 0


def _rl_summary(history: list[dict]) -> str:
    grpo = [h for h in history if h.get("reward_mean") is not None]
    if not grpo:
        return f"{len(history)} warm-up step(s), no GRPO step"
    first, last = grpo[0], grpo[-1]
    return (f"GRPO steps {first['step']}..{last['step']}: reward_mean {first['reward_mean']:.3f} -> "
            f"{last['reward_mean']:.3f}")


def cmd_rl(args, words):
    from hybridmoe.rl.loop import run_rl
    print(_rl_summary(_run_loop(args, words, run_rl)))
    return 0


DEMO_OUT = Path("runs/demo")


def cmd_demo(args, words):
    import shutil
    import time
    cfg = _config(["recipe=demo", *words])
    from hybridmoe.rl.loop import run_rl
    if DEMO_OUT.exists():
        # The demo always starts over: a fresh run, never appended to an earlier one.
        print(f"removing the previous demo run in {DEMO_OUT}/")
        shutil.rmtree(DEMO_OUT)
    print(f"demo: tiny model on {cfg.mesh.cpu_devices or 'the platform'} devices; {cfg.rl.warmup_steps} supervised "
          f"warm-up steps, then {cfg.rl.steps} GRPO steps on {cfg.rl.digits}-digit arithmetic "
          f"({cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} completions)")
    t0 = time.perf_counter()
    hist = run_rl(cfg, DEMO_OUT)
    print(f"{_rl_summary(hist)} in {time.perf_counter() - t0:.0f} s")
    print(f"metrics: {DEMO_OUT}/metrics.jsonl, plot: {DEMO_OUT}/metrics.png, TensorBoard: {DEMO_OUT}/tb")
    return 0


def cmd_bench(args, words):
    recipe, overrides = split_args(words)
    cfg = _config(words)
    from hybridmoe.tools.bench import format_table, parse_arm, run_bench
    arms = [parse_arm(a) for a in (args.arm or ["control"])]
    results = run_bench(recipe, overrides, arms, cfg.bench.steps, estimate_for=args.estimate_for,
                        profile_steps=args.profile)
    print(format_table(results))
    if args.profile:
        from hybridmoe.tools.profile import format_profile
        for name, a in results.items():
            if a.get("profile_category_s"):
                modelled = (a["estimate"] or {}).get("category_s")
                print(f"{name}: the device's seconds per step by category ({args.profile} steps traced)"
                      + (", the model's beside them" if modelled else ""))
                print(format_profile(a["profile_category_s"], modelled, a["seconds_per_step"]))
    if args.out:
        from hybridmoe.tools.record import machine_record, write_record
        write_record(Path(args.out), {"benchmark": "step_time", "recipe": recipe, "overrides": overrides,
                                      **machine_record(), "arms": results})
    return 0


def _policy(args, words):
    """The policy of --hf DIR (model from its config.json, other sections from `recipe=`) or of
    --run DIR (the run's saved config; overrides apply on top)."""
    if bool(args.hf) == bool(args.run):
        raise ValueError("give exactly one of --hf DIR (a Hugging Face checkpoint) or --run DIR (a run's --out)")
    if args.hf:
        cfg = _config(words, args.hf)
    else:
        from hybridmoe.recipe.load import config_with_overrides
        from hybridmoe.rl.policy_io import run_config
        saved, _, _ = run_config(Path(args.run))
        cfg = config_with_overrides(saved.model_dump(), split_args(words)[1])
        _runtime(cfg)
    from hybridmoe.rl.policy_io import load_policy
    return load_policy(cfg, hf_dir=Path(args.hf) if args.hf else None, run_dir=Path(args.run) if args.run else None)


def _sampling(args, policy) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "seed": args.seed,
            "temperature": policy.cfg.rl.temperature if args.temperature is None else args.temperature,
            "top_p": policy.cfg.rl.top_p if args.top_p is None else args.top_p}


def cmd_generate(args, words):
    if bool(args.prompts) == bool(args.prompt):
        raise ValueError("give --prompts FILE (JSONL/Parquet with `prompt` or `messages`) or --prompt TEXT (repeatable)")
    policy = _policy(args, words)
    if args.prompts:
        from hybridmoe.data.prompts import read_prompt_set
        prompts = [e.prompt for e in read_prompt_set(args.prompts, policy.tokenizer, what="--prompts")]
    else:
        if args.chat and not getattr(policy.tokenizer, "chat_template", None):
            where = args.hf or policy.cfg.data.tokenizer or "the built-in character tokenizer"
            raise ValueError(f"--chat wraps each --prompt as a user message in the chat template, and {where} has "
                             "none (no chat_template.jinja, no chat_template in tokenizer_config.json): drop --chat "
                             "to give the prompts as they are, or add the model's chat_template.jinja to the folder")
        prompts = [policy.tokenizer.render_chat([{"role": "user", "content": p}]) if args.chat else p
                   for p in args.prompt]
    from hybridmoe.rl.policy_io import generate_texts
    records, timing = generate_texts(policy, prompts, **_sampling(args, policy))
    for r in records:
        print(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}, ensure_ascii=False))
    print(f"{timing['new_tokens']} new tokens in {timing['batches']} batch(es) of {timing['rows_per_batch']} rows: "
          f"{timing['tokens_per_s']:.1f} tokens/s, compile not included (compiled in {timing['compile_s']:.1f} s)",
          file=sys.stderr)
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        tmp.replace(args.out)
    return 0


def cmd_eval(args, words):
    policy = _policy(args, words)
    if not policy.cfg.rl.reward:
        raise ValueError("eval scores with reward functions: pass rl.reward=[path/to/file.py:function, ...]")
    from hybridmoe.data.prompts import read_prompt_set
    from hybridmoe.tools.evaluate import evaluate
    from hybridmoe.rl.reward_loading import load_rewards
    reward_fns = load_rewards(policy.cfg.rl.reward, policy.cfg.rl.reward_weights)
    examples = read_prompt_set(args.prompts, policy.tokenizer, policy.cfg.data.on_bad_line, what="--prompts")
    result = evaluate(policy, examples, reward_fns, samples=args.samples, pass_threshold=args.pass_threshold,
                      generate_kwargs=_sampling(args, policy))
    for name, t in result["tasks"].items():
        print(f"{name}: {t['prompts']} prompts x {args.samples}: mean reward {t['mean_reward']:.3f}, "
              + ", ".join(f"{k} {v:.3f}" for k, v in t.items() if k.startswith("pass@"))
              + f", reward errors {t['reward_errors']} of {t['samples']}")
    total = sum(t["samples"] for t in result["tasks"].values())
    if result["reward_errors"] == total and not args.accept_reward_errors:
        print(f"hybridmoe eval: error: the reward raised or was not finite on every one of the {total} samples "
              f"({result['reward_error_kinds']}): the mean reward above is no score. Fix the reward function (the "
              "warning above names its first failure), or pass --accept-reward-errors to accept such a result",
              file=sys.stderr)
        return 1
    if args.out:
        from hybridmoe.tools.record import machine_record, write_record
        write_record(Path(args.out), {"benchmark": "eval", "source": {"hf": args.hf, "run": args.run},
                                      "prompts": args.prompts, "rewards": list(policy.cfg.rl.reward),
                                      "reward_weights": list(policy.cfg.rl.reward_weights), **machine_record(),
                                      **result})
    return 0


def _inspect_config(words: list[str], target_kind: str | None, cpu_count: int | None):
    recipe, overrides = split_args(words)
    if target_kind == "cpu":
        overrides = [*overrides, f"mesh.cpu_devices={cpu_count}"]
    elif target_kind == "tpu":
        overrides = [*overrides, "mesh.cpu_devices=0"]
    # A TPU target compiles for compile-only TPU devices: the config is validated for TPU.
    return recipe, overrides, load_config(recipe, overrides, platform="tpu" if target_kind == "tpu" else None)


def _step_estimate(step, recipe: str, args):
    """The step's estimated time on --estimate-for (default: the TPU target's generation)."""
    from hybridmoe.analysis import step_estimate
    grid_step_s = None if args.grid_step_us is None else args.grid_step_us * 1e-6
    return step_estimate.estimate_step(step, args.estimate_for, recipe=recipe, grid_step_s=grid_step_s,
                                       calibration_from=args.calibration_from)


def cmd_inspect(args, words):
    from hybridmoe.analysis import step_estimate
    from hybridmoe.tools import train_program as tp
    from hybridmoe.parallel.mesh import configure_cpu_devices
    from hybridmoe.run.compile_cache import configure_compile_cache
    kind, count = tp.parse_target(args.target) if args.target else (None, None)
    arms = {"base": words}
    if args.compare is not None:
        bad = [w for w in args.compare if "=" not in w]
        if bad:
            raise ValueError(f"--compare takes overrides section.key=value (or recipe=NAME); got {bad}")
        arms["compare"] = [*words, *args.compare]
    configs = {name: _inspect_config(w, kind, count) for name, w in arms.items()}
    full_cfg = configs["base"][2]
    if args.memory_only and (args.layers is not None or args.compare is not None):
        raise ValueError("--memory-only reads one program's buffer assignment and leaves its compile running "
                         "until the command exits; it takes no --layers or --compare (run one command per arm)")
    if args.layers is not None:
        from hybridmoe.tools import depth
        if args.compare is not None:
            raise ValueError("--layers compiles two depths of one program; it takes no --compare")
        configs = {f"{n} layers": _inspect_config([*words, f"model.num_layers={n}"], kind, count)
                   for n in depth.depths(full_cfg, args.layers)}
    if args.calibration_from:  # refused before any compile
        named = args.estimate_for or (args.target if kind == "tpu" else None)
        if named is None:
            raise ValueError("--calibration-from calibrates the estimate for a TPU --target or an --estimate-for "
                             "generation; name one")
        step_estimate.hardware_for(named, calibration_from=args.calibration_from)
    if kind != "tpu":
        configure_cpu_devices(full_cfg.mesh)
    configure_compile_cache(full_cfg.run.compile_cache_dir)
    target = tp.tpu_target(args.target) if kind == "tpu" else tp.host_target()
    facts = {}
    for name, (recipe, overrides, cfg) in configs.items():
        print(f"{name}: recipe={recipe} {' '.join(overrides)}  (compiling the {args.program} program for "
              f"{target.name}, {target.num_devices} devices)", flush=True)
        step = tp.compile_step(cfg, target, program_name=args.program, memory_only=args.memory_only)
        facts[name] = tp.step_facts(step)
        facts[name]["step_estimate"] = _step_estimate(step, recipe, args)
    print(tp.format_facts(facts))
    for name, f in facts.items():
        if f.get("count_search"):
            print(f"{name}: " + tp.format_count_search(f["count_search"]))
    for name, f in facts.items():
        if f["step_estimate"]:
            print(f"\n{name}: " + step_estimate.format_estimate(f["step_estimate"], f["step_estimate"].get("reference")))
    record = {}
    if args.layers is not None:
        m = full_cfg.model
        record["depth"] = depth.extrapolate({cfg.model.num_layers: facts[name]["memory"]
                                             for name, (_, _, cfg) in configs.items()},
                                            len(m.layer_pattern), m.num_layers, target.hbm_bytes_per_device)
        print()
        print(depth.format_depth(record["depth"]))
        estimates = {cfg.model.num_layers: facts[name]["step_estimate"] for name, (_, _, cfg) in configs.items()}
        if all(estimates.values()):
            from hybridmoe.analysis.flops import model_flops_per_device
            e = record["step_estimate"] = depth.extrapolate_estimate(
                estimates, len(m.layer_pattern), m.num_layers,
                model_flops_per_device(full_cfg, target.num_devices, args.program))
            print(f"\nEXTRAPOLATED to {m.num_layers} layers from {' and '.join(map(str, sorted(estimates)))}: "
                  + step_estimate.format_estimate(e, e.get("reference")))
    if args.out:
        from hybridmoe.tools.record import machine_record, write_record
        write_record(Path(args.out), {
            "benchmark": "inspect", **machine_record(), "target": target.name, "program": args.program,
            "memory_only": args.memory_only,
            "programs": {name: {"recipe": configs[name][0], "overrides": configs[name][1], **facts[name],
                                "config": json.loads(configs[name][2].model_dump_json())}
                         for name in facts}, **record})
    return 0


def cmd_calibrate(args, words):
    if words:
        raise ValueError(f"calibrate takes no config overrides; got {words}")
    from hybridmoe.tools import calibrate

    result = calibrate.calibrate(geometry=args.geometry)
    print(calibrate.format_calibration(result))
    if not args.dry_run:
        calibrate.write(result)
        print(f"wrote the {result['generation']} row of hybridmoe/analysis/chip_calibration.json")
    if args.out:
        from hybridmoe.tools.record import machine_record, write_record
        write_record(Path(args.out), {"benchmark": "calibrate", **machine_record(), **result})
    return 0


def cmd_tune_gmm(args, words):
    from hybridmoe.tools import tune_gmm

    tune_gmm.check_host()
    recipe, overrides = split_args(words)
    cfg = load_config(recipe, [*overrides, *tune_gmm.TUNE_OVERRIDES])
    result = tune_gmm.tune(cfg, budget_s=args.budget_s, missing_only=args.missing)
    print(tune_gmm.format_result(result))
    if not args.dry_run:
        tune_gmm.write_table(result["generation"], result["entries"], tune_gmm.about(result))
        print(f"wrote {len(result['entries'])} {result['generation']} entries into hybridmoe/kernels/gmm/tile_table.json")
    if args.out:
        from hybridmoe.tools.record import machine_record, write_record
        write_record(Path(args.out), {"benchmark": "tune-gmm", **machine_record(), "recipe": recipe,
                                      "overrides": overrides, **result})
    return 0


def cmd_gates(args, words):
    if not args.candidate:
        raise ValueError("gates needs --candidate section.key=value ... (or recipe=NAME): the candidate's overrides")
    bad = [w for w in args.candidate if "=" not in w]
    if bad:
        raise ValueError(f"--candidate takes overrides section.key=value (or recipe=NAME); got {bad}")
    reference = _config(words)
    cand_recipe, cand_overrides = split_args([*words, *args.candidate])
    candidate = load_config(cand_recipe, cand_overrides)
    from hybridmoe.tools.gates import format_gates, run_gates
    print(f"reference: recipe={split_args(words)[0]} {' '.join(split_args(words)[1])} (run twice)")
    print(f"candidate: recipe={cand_recipe} {' '.join(cand_overrides)}")
    out = run_gates(reference, candidate, args.steps)
    print(format_gates(out["gates"], out["reference"], out["candidate"], out["gaps"]))
    print("all gates PASS" if out["passed"] else "a gate FAILED")
    if args.out:
        from hybridmoe.tools.record import machine_record, write_record
        write_record(Path(args.out), {"benchmark": "gates", **machine_record(), "reference_words": words,
                                      "candidate_words": [*words, *args.candidate], **out})
    return 0 if out["passed"] else 1


def cmd_launch(args, words):
    from hybridmoe.parallel.launch import launch
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv or argv[0] not in COMMANDS or argv[0] in ("launch", "describe", "demo"):
        raise ValueError("launch runs a command in N processes: hybridmoe launch --processes 2 -- train|rl|bench|score ...")
    if args.processes < 1:
        raise ValueError(f"--processes {args.processes}: at least 1")
    return launch(argv, args.processes, args.port)


COMMANDS = {
    "describe": (cmd_describe, "the resolved config, the parameter tree and its totals"),
    "train": (cmd_train, "supervised next-token training"),
    "bench": (cmd_bench, "the training step of named arms (override sets), timed interleaved in one run"),
    "score": (cmd_score, "per-token log-probs of token ids under a Hugging Face checkpoint"),
    "rl": (cmd_rl, "GRPO post-training: supervised warm-up on the task, then rollouts, rewards and policy updates"),
    "generate": (cmd_generate, "sample completions of prompts from a checkpoint (--hf DIR or --run DIR), with tokens/s"),
    "eval": (cmd_eval, "mean reward and pass@k per task of a prompt set under rl.reward functions; a JSON record"),
    "inspect": (cmd_inspect, "compile the training step, a GRPO update or the sampler without running it (this "
                "host or a TPU topology): per-device memory, what fills it at the peak, collectives, FLOPs, saved residuals"),
    "gates": (cmd_gates, "the six numerics gates: a candidate's GRPO steps against the reference run twice"),
    "demo": (cmd_demo, "the embedded default: GRPO on one-digit addition with the tiny model, into runs/demo"),
    "launch": (cmd_launch, "N processes of one distributed run on this machine (as one per host on a cluster)"),
    "calibrate": (cmd_calibrate, "measure this host's TPU for the step-time model (matmul and HBM rates, fixed costs, "
                  "each Pallas kernel's measured/modelled time) and write its generation's row of the model's table"),
    "tune-gmm": (cmd_tune_gmm, "time the Pallas grouped matmuls of a config's step at candidate tiles on this TPU "
                 "and write the fastest into the tile table that kernels.gmm.tiling=auto reads"),
}
# The commands whose --out is a JSON record (machine, date, commit, versions).
RECORD_COMMANDS = ("bench", "eval", "inspect", "gates", "calibrate", "tune-gmm")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridmoe", description=__doc__, epilog=CONFIG_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=f"hybridmoe {name}: {help_}", epilog=CONFIG_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           usage=f"hybridmoe {name} [recipe=NAME | recipe=hf:DIR[@BASE]] [section.key=value ...] [--flags]")
        if name == "describe":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        if name in ("train", "rl"):
            p.add_argument("--out", help="run directory: metrics.jsonl, metrics.png (rl), TensorBoard events, "
                           "checkpoints")
            run_flags = p.add_mutually_exclusive_group()
            run_flags.add_argument("--resume", action="store_true",
                                   help="continue the run in --out from its latest finished checkpoint (step 0 if none)")
            run_flags.add_argument("--overwrite", action="store_true",
                                   help="delete the run already in --out and start a fresh one")
        if name == "train":
            p.add_argument("--init-hf", help="start from this Hugging Face checkpoint directory (its config.json gives "
                           "the model section, its tokenizer.json the tokenizer)")
            p.add_argument("--export-hf", help="write the final weights to this directory in the Hugging Face layout")
        if name == "rl":
            p.add_argument("--init-hf", help="start from this Hugging Face checkpoint directory")
            p.add_argument("--export-hf", help="write the final policy to this directory in the Hugging Face layout")
        if name == "launch":
            p.add_argument("--processes", type=int, required=True, help="processes to start (one per host on a cluster)")
            p.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0 = a free one)")
            p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- train recipe=tiny ...")
        if name == "bench":
            p.add_argument("--arm", action="append", help="NAME or NAME:section.key=value,... (repeatable)")
            p.add_argument("--estimate-for", choices=tuple(MAKERS), default=None,
                           help="the step-time model's estimate of each arm on this hardware, beside its measured time "
                           "(default: the device's own generation; none on a CPU unless named)")
            p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                           help="trace STEPS more steps of each arm under JAX's profiler and report the device's "
                           "time by the step-time model's categories, beside the model's")
            p.add_argument("--out", help="write the JSON record here")
        if name == "inspect":
            p.add_argument("--target", help="cpu:N (simulated CPU devices) or a TPU topology, e.g. tpu7x:2x2x1, "
                           "v5p:4x4x4 (compile-only devices; needs libtpu)")
            p.add_argument("--compare", nargs="*", metavar="OVERRIDE",
                           help="a second program: the same words plus these overrides, shown side by side")
            p.add_argument("--estimate-for", choices=tuple(MAKERS), default=None,
                           help="estimate the step's time on this hardware from the compiled program (default: "
                           "the TPU target's generation, or this host's own accelerator; none for a CPU unless named)")
            p.add_argument("--calibration-from", choices=tuple(MAKERS), default=None,
                           help="calibrate the estimate of a generation no chip has measured by another's row of "
                           "the calibration table: its matmul and HBM rates at the fractions of the maker's figures "
                           "that chip reached, its fixed costs and kernel factors as measured (docs/tpu.md)")
            p.add_argument("--grid-step-us", type=float, default=None,
                           help="the estimate's fixed cost per Pallas grid step in microseconds (default: the "
                           "chip's measured one where `hybridmoe calibrate` ran on its generation, else 0.35)")
            p.add_argument("--program", choices=("train", "grpo", "sample"), default="train",
                           help="train: the supervised step; grpo: one GRPO update (rl.* rows and micro-batches, "
                           "pi_old, the reference policy); sample: the rollout sampler (prefill + decode loop)")
            p.add_argument("--layers", type=int, metavar="N",
                           help="a fast answer to 'does it fit': compile the step with N layers and with one "
                           "block more (N a whole number of blocks of model.layer_pattern, at least two) and "
                           "extrapolate memory to the model's depth (memory is affine in the blocks)")
            p.add_argument("--memory-only", action="store_true",
                           help="the fastest answer to 'does it fit': read the compile at its buffer assignment "
                           "(XLA's default memory space, the peak itemised, collectives, the step estimate from "
                           "the optimised HLO) and stop before code generation (at the 397B cell under a tenth "
                           "of the whole compile); no memory analysis or XLA cost figures")
            p.add_argument("--out", help="write the JSON record here")
        if name == "calibrate":
            p.add_argument("--geometry", default="one_chip", choices=("one_chip", "cell"),
                           help="the kernel cases' shapes the Pallas kernels are timed at (tools/chip_cases.py)")
            p.add_argument("--dry-run", action="store_true", help="measure and print; leave the table as it is")
            p.add_argument("--out", help="write the JSON record here")
        if name == "tune-gmm":
            p.add_argument("--budget-s", type=float, default=500.0,
                           help="stop timing new shapes after this many seconds (the rest are listed as untuned)")
            p.add_argument("--missing", action="store_true",
                           help="time only the shapes the table has no entry for on this chip's generation "
                                "(a run the budget cut short, continued)")
            p.add_argument("--dry-run", action="store_true", help="measure and print; leave the table as it is")
            p.add_argument("--out", help="write the JSON record here")
        if name == "gates":
            p.add_argument("--candidate", nargs="*", metavar="OVERRIDE",
                           help="the candidate: the reference's words plus these overrides (recipe=NAME allowed)")
            p.add_argument("--steps", type=int, default=3, help="GRPO steps per run (step 0 is gated)")
            p.add_argument("--out", help="write the JSON record here")
        if name == "score":
            p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
            p.add_argument("--tokens", required=True, help=".npy of int token ids [B, T]")
            p.add_argument("--out", required=True, help=".npy to write the [B, T-1] float32 log-probs to")
        if name in ("generate", "eval"):
            p.add_argument("--hf", help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json)")
            p.add_argument("--run", help="a train/rl run's --out folder: its latest checkpoint")
            p.add_argument("--prompts", required=name == "eval",
                           help="JSONL/Parquet prompt set: `prompt` or `messages` per line (+ fields the rewards read)")
            p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy; default rl.temperature)")
            p.add_argument("--top-p", type=float, help="nucleus mass (default rl.top_p)")
            p.add_argument("--max-new-tokens", type=int, default=64, help="completion tokens at most (default 64)")
            p.add_argument("--batch-size", type=int, default=8, help="rows per generation batch (default 8)")
            p.add_argument("--seed", type=int, default=0, help="sampling seed")
        if name == "generate":
            p.add_argument("--prompt", action="append", help="a prompt on the command line (repeatable)")
            p.add_argument("--chat", action="store_true", help="wrap each --prompt as a user message in the chat template")
            p.add_argument("--out", help="write one JSON line per prompt: prompt, completion, tokens, truncated, "
                           "prompt_ids, completion_ids")
        if name == "eval":
            p.add_argument("--samples", type=int, default=4, help="completions per prompt (pass@1 and pass@samples)")
            p.add_argument("--pass-threshold", type=float, default=1.0, help="a sample passes at this reward or more")
            p.add_argument("--accept-reward-errors", action="store_true",
                           help="exit 0 (and write --out) even when the reward raised on every sample")
            p.add_argument("--out", help="write the JSON record here")
    args, words = parser.parse_known_args(argv)
    bad = [w for w in words if "=" not in w]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides are section.key=value")
    if args.command in RECORD_COMMANDS and args.out:
        from hybridmoe.tools.record import source_commit
        source_commit()  # the record names the commit this process started from
    try:
        return COMMANDS[args.command][0](args, words)
    except ConfigError as e:
        print(f"hybridmoe {args.command}: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        if type(e).__module__.startswith("jax"):
            if not _out_of_memory(e):
                raise
            print(f"hybridmoe {args.command}: {_out_of_memory(e)}", file=sys.stderr)
            return 1
        print(f"hybridmoe {args.command}: error: {e}", file=sys.stderr)
        return 2


# What the one line of a device's memory refusal says to do.
MEMORY_FIX = ("leave rl.micro_batches at auto (it picks a count that fits), lower train.batch_size, "
              "rl.prompts_per_step or rl.max_new_tokens, remat more (remat.policy=full), or set "
              "run.memory_budget_gib below the device's memory to keep headroom")


def _out_of_memory(error: BaseException) -> str | None:
    """One line for a device's (or its compiler's) memory refusal, instead of JAX's traceback; None
    for any other error."""
    from hybridmoe.analysis.compiled_facts import memory_refusal

    if not memory_refusal(error):
        return None
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"out of device memory ({first[:300]}){_device_memory_words()}: {MEMORY_FIX}"


def _device_memory_words() -> str:
    """', with X GiB of arrays in use of the device's Y (largest free block Z)' from the first local
    device's memory statistics at the refusal, '' where the device keeps none (a CPU). What is in use
    beside the program that failed is what its memory plan did not count."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 -- a figure for the message, never a second error
        return ""
    if not stats.get("bytes_limit") or "bytes_in_use" not in stats:
        return ""
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    free = stats.get("largest_free_block_bytes")
    return (f", with {gib(stats['bytes_in_use'])} GiB of arrays in use of the device's {gib(stats['bytes_limit'])}"
            + (f" (largest free block {gib(free)} GiB)" if free is not None else ""))


def entry() -> None:
    """The `hybridmoe` program: main(), then exit. A compile `inspect --memory-only` left running
    (analysis/program.read_buffer_assignment) cannot be stopped and would hold the interpreter's
    exit for the rest of its code generation: with one alive, the process ends at once, its
    output flushed and its records already written."""
    import os
    import threading
    import traceback

    from hybridmoe.analysis.program import COMPILE_THREAD

    try:
        code = main()
    except BaseException as e:
        if isinstance(e, SystemExit):
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        else:
            traceback.print_exc()
            code = 1
    if any(t.name == COMPILE_THREAD and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
