"""The whole training step on a TPU chip, arm by arm, beside the step-time model's estimate; and the
GRPO loop (rollouts and updates) on the same chip.

Run on a TPU host (docs/tpu.md), one process holding the chip:

    python3 benchmarks/tpu_step.py --compile-cache .tpu-cache      # every arm below, in rounds
    python3 benchmarks/tpu_step.py --only default,xla_gdn --grpo      # and the GRPO loop

The arms are `hybridmoe bench` arms of the one-chip recipe (qwen3.5-35b-a3b-v5e-1): each compiled
first, an arm the chip refuses for memory (its compiler, or its runtime at the arm's visit) left out
and recorded as refused with the chip's own figures (analysis/device_refusal.py), then timed in
two alternating visits with one arm's state on the chip at a time (tools/bench.py), each beside the
model's estimate of the same compiled program on the chip's generation (calibrated where
`hybridmoe calibrate` wrote its row). The GRPO loop is `hybridmoe rl` of the same recipe with no
warm-up: rollout tokens/s, the rollout, old-log-prob and update times from its metrics, the first
step (which compiles) left out.

The arms run in rounds of --group beside the default (each round compiles its arms, then times them
in alternating visits; every arm's `over_default_in_round` is against the default timed in its own
round); the record is written after each round and no round starts past --budget-s, so a chip call
cut short keeps what it finished. An earlier record of the same device and overrides is merged into:
the arms run now replace theirs, the others keep their figures and the commit they ran at.

Writes benchmarks/records/tpu_step.json: device, commit, arms (name -> measured_s, estimated_s,
measured_over_estimated, mfu and useful_mfu against the peak they name, overrides, the device's
seconds by the model's categories from a profiled step (profile_category_s, beside the estimate's
category_s), commit, round, over_default_in_round; or refused with the device's own figures), the
fastest arm and default_over_fastest, grpo.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

RECIPE = "qwen3.5-35b-a3b-v5e-1"
# The Pallas grouped matmuls at the tile the chip measured fastest at the seed cell's grouped matmul
# (512 x 2048 x 512: 79 TFLOP/s forward + backward against ragged_dot's 72), which is also what the
# heuristic runs on a TPU (kernels/gmm/tile_table.py TPU_RULE) at the one-chip recipe's widths.
TILED = ["kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit", "kernels.gmm.tm=512",
         "kernels.gmm.tk=2048", "kernels.gmm.tn=512"]
# The recipe's defaults include the levers the chip measured faster (the recipe's comments); the arms
# below turn one off each, or try another kernel or remat setting. Under the recipe's save list the
# fused SwiGLU pair is refused (it keeps [gate | up] as one unnamed pre-activation): its arms keep only
# the flash core's residuals; full remat drops the list.
NO_SAVE_LIST = ["remat.save=[]"]
NO_EXPERT_SAVES = ["remat.save=[attn_core_residuals]"]
FUSED_AT_TUNED_TILES = ["kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=auto", "moe.wi_fused_swiglu=true",
                        "moe.wo_fused_dswiglu=true", *NO_EXPERT_SAVES]
ARMS = {
    # The recipe's defaults: the Mosaic GDN core (kernels.gdn.backend=auto on a TPU), the Pallas grouped
    # matmuls at the tile table's tiles, remat.policy=minimal keeping the expert matmuls' gate and up outputs and the flash core's
    # residuals, gather backwards of the MoE's row moves, the LM head over the whole sequence in one
    # token chunk and the whole vocabulary in one block.
    "default": [],
    "xla_gdn": ["kernels.gdn.backend=xla"],  # the GDN core the defaults ran before the chip's verdict
    # The Mosaic GDN core at one bfloat16 pass for the chunk's own products (docs/levers.md,
    # kernels.gdn.precision), and that at chunk 128 (1.32x and 1.45x the core alone at the 397B cell).
    "gdn_bf16": ["kernels.gdn.precision=bfloat16"],
    # The Mosaic GDN core at three passes for every product, the triangular inverse's doubling too: the
    # precision the defaults ran before the chip's verdict on bfloat16x3_bf16_inverse.
    "gdn_bf16x3": ["kernels.gdn.precision=bfloat16x3"],
    # The Mosaic GDN core's kernels on blocks of the token-major arrays: no layout copies around them
    # (docs/levers.md, kernels.gdn.layout).
    "gdn_token_major": ["kernels.gdn.layout=token_major"],
    "gdn_bf16_chunk128": ["kernels.gdn.precision=bfloat16", "gdn.chunk_size=128"],
    # Chunks of 64 tokens, the recipe's before the chip's verdict on 128 (gdn_chunk128 timed 128 then),
    # and 128 on the token-major blocks.
    "gdn_chunk64": ["gdn.chunk_size=64"],
    "gdn_chunk128": ["gdn.chunk_size=128"],
    "gdn_chunk128_token_major": ["gdn.chunk_size=128", "kernels.gdn.layout=token_major"],
    # The Pallas grouped matmuls at the table's tiles (tm 1,024 at this recipe's shapes) on the layout
    # where no row tile spans two experts (docs/levers.md, moe.group_align_rows).
    "pallas_gmm_auto_aligned": ["kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=auto", "moe.group_align_rows=1024"],
    "pallas_gmm": ["kernels.gmm.tiling=heuristic"],  # at the heuristic: on a TPU the chip's rule
    # The grouped matmuls the defaults ran before the chip's verdict: XLA's ragged_dot.
    "xla_gmm": ["kernels.gmm.backend=xla"],
    "fused_swiglu": [*TILED, "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true", *NO_EXPERT_SAVES],
    # The fused pair at the tiles tune-gmm measured (the table's v5e section).
    "fused_swiglu_auto": FUSED_AT_TUNED_TILES,
    # The LM head's backward adds each token chunk's float32 gradient into the whole [d_model, vocab]
    # accumulator, one read and one write of it per chunk: 32 chunks of 256 tokens move 16 GiB a step
    # at the one-chip shape, 4 of 2,048 an eighth of that, the recipe's one chunk none (its logits
    # block is [8192, 4096] float32, 128 MiB).
    "logprobs_chunk_256": ["kernels.logprobs.chunk_tokens=256"],
    "logprobs_chunk_2048": ["kernels.logprobs.chunk_tokens=2048"],
    # Between the two: the one chunk's dense matmuls took 10 ms more in the profile than four chunks'.
    "logprobs_chunk_4096": ["kernels.logprobs.chunk_tokens=4096"],
    # The MoE dispatch's row moves with autodiff's scatter-add backwards (4.1 and 2.8 ms a layer on the
    # chip, where the model's HBM rate gives 1.0 and 0.6).
    "scatter_backward": ["moe.gather_backward=false"],
    # Under remat.policy=minimal alone the grouped expert matmuls (not dot_generals) run again in the
    # backward's replay: two of each MoE layer's three forward matmuls.
    "expert_matmuls_replayed": NO_EXPERT_SAVES,
    # The recipe keeps the flash core's residuals (attn_core_residuals): this arm replays its forward.
    "attention_core_replayed": ["remat.save=[moe_gate,moe_up]"],
    # The GDN core's residuals kept as well (at one layer block the compiled program already runs the
    # GDN forward kernel once a layer: the chip's profile shows 3 calls).
    "saved_kernel_residuals": ["remat.save=[moe_gate,moe_up,gdn_core_out,gdn_core_residuals,attn_core_residuals]"],
    # The recipe's LM head reads the whole vocabulary in one block, so the compiler keeps the forward's
    # logits for the backward by itself; at 4,096-column blocks (the schema's default) the backward
    # computes them again, a fourth [8192, 2048] x [2048, 32768] matmul.
    "logprobs_vocab_chunk_4096": ["kernels.logprobs.chunk_vocab=4096"],
    # At 4,096-column blocks, the backward reads the forward's stacked logits blocks instead.
    "saved_logits": ["kernels.logprobs.chunk_vocab=4096", "kernels.logprobs.save_logits=true"],
    "remat_full": ["remat.policy=full", *NO_SAVE_LIST],  # what remat.policy=auto chooses at this size
    "remat_sublayer": ["remat.unit=sublayer"],
    "remat_layer": ["remat.unit=layer"],
}
# The GRPO loop: 8 prompts x 8 completions of up to 256 new tokens, three steps (the first compiles).
GRPO = ["rl.warmup_steps=0", "rl.steps=3", "rl.prompts_per_step=8", "rl.group_size=8", "rl.max_new_tokens=256",
        "rl.checkpoint_every=0"]


def time_grpo(common: list[str]) -> dict:
    from hybridmoe.cli import main

    with tempfile.TemporaryDirectory() as out:
        if main(["rl", f"recipe={RECIPE}", *GRPO, *common, "--out", out]) != 0:
            raise SystemExit("hybridmoe rl failed on the chip")
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout_time_s" in r][1:]  # the first compiles
    mean = lambda key: sum(r[key] for r in steps) / len(steps)  # noqa: E731
    return {"overrides": [*GRPO, *common], "steps_timed": len(steps),
            **{k: mean(k) for k in ("rollout_tokens_per_s", "rollout_time_s", "old_logprobs_time_s", "update_time_s",
                                    "step_time_s")}}


def arm_row(a: dict, commit: str, round_index: int, default_s: float | None) -> dict:
    """An arm's entry in the record from run_bench's result."""
    if "refused" in a:
        return {"overrides": a["overrides"], "refused": a["refused"], "device_refusal": a["device_refusal"],
                "commit": commit}
    est = a["estimate"] or {}
    return {"overrides": a["overrides"], "measured_s": a["seconds_per_step"], "estimated_s": est.get("step_s"),
            "measured_over_estimated": a["measured_over_estimated"], "step_times_s": a["step_times_s"],
            "compile_s": a["compile_s"], "mfu": a["mfu"], "useful_mfu": a["useful_mfu"],
            "peak_flops_per_device": a["peak_flops_per_device"], "peak_source": a["peak_source"],
            "tokens_per_s": a["tokens_per_step"] / a["seconds_per_step"], "estimate": est,
            "profile_category_s": a.get("profile_category_s"), "profile_ops": a.get("profile_ops"),
            "memory": {k: a["program"].get(k) for k in ("argument", "temp", "output", "alias")},
            "commit": commit, "round": round_index,
            # Against the default timed in the same round (the same visits, the same noise).
            "over_default_in_round": a["seconds_per_step"] / default_s if default_s else None}


def rounds_of(names: list[str], group: int) -> list[list[str]]:
    """The arms in rounds of `group` others, each round led by `default` (its anchor: every arm is
    compared with the default timed beside it)."""
    others = [n for n in names if n != "default"]
    if not others:
        return [["default"]]
    return [["default", *others[i:i + group]] for i in range(0, len(others), group)]


def summary(arms: dict) -> dict:
    """The fastest timed arm and how far the default is from it."""
    timed = {n: a for n, a in arms.items() if "measured_s" in a}
    fastest = min(timed, key=lambda n: timed[n]["measured_s"]) if timed else None
    default = timed.get("default", {}).get("measured_s")
    return {"fastest": fastest,
            "default_over_fastest": default / timed[fastest]["measured_s"] if default and fastest else None}


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__)
    p.add_argument("--only", help="comma-separated arm names (default: all)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per arm (two visits)")
    p.add_argument("--group", type=int, default=3, help="arms per round beside the default (default 3)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no round after this many seconds (default 420); the record keeps every finished round")
    p.add_argument("--compile-cache", help="JAX's persistent compile cache folder (a rerun compiles nothing again)")
    p.add_argument("--grpo", action="store_true", help="also time the GRPO loop (benchmarks/tpu_rl.py is its record)")
    p.add_argument("--profile", type=int, default=2, metavar="STEPS",
                   help="steps each arm runs under JAX's profiler after its timed ones: the device's time by the "
                   "step-time model's categories, beside the model's (0: none)")
    p.add_argument("overrides", nargs="*", help="section.key=value for every arm (e.g. a smaller model.num_layers)")
    args = p.parse_args(argv)
    harness.configure(cache_dir=args.compile_cache)
    import time

    from hybridmoe.tools.bench import format_table, run_bench
    from hybridmoe.tools.record import machine_record, source_commit

    names = args.only.split(",") if args.only else list(ARMS)
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise SystemExit(f"--only: unknown arms {unknown}; known: {', '.join(ARMS)}")
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    same = old.get("device") == machine_record()["device"] and old.get("overrides", []) == list(args.overrides)
    arms = dict(old.get("arms", {})) if same else {}  # the same device's other arms keep their figures and commits
    start = time.perf_counter()
    for index, round_names in enumerate(rounds_of(names, args.group)):
        if index and time.perf_counter() - start > args.budget_s:  # the first round always runs
            print(f"round {index} ({', '.join(round_names)}): left out, past the {args.budget_s:.0f} s budget", flush=True)
            continue
        results = run_bench(RECIPE, list(args.overrides), [(n, ARMS[n]) for n in round_names], args.steps,
                            skip_unfit=True, profile_steps=args.profile)
        print(format_table(results), flush=True)
        default_s = results.get("default", {}).get("seconds_per_step")
        for name, a in results.items():
            arms[name] = arm_row(a, source_commit(), index, default_s)
        harness.write(args.out, "tpu_step", recipe=RECIPE, overrides=list(args.overrides), arms=arms, **summary(arms))
    record = {"recipe": RECIPE, "overrides": list(args.overrides), "arms": arms, **summary(arms)}
    if args.grpo:
        record["grpo"] = time_grpo(list(args.overrides))
        print(f"GRPO: rollout {record['grpo']['rollout_tokens_per_s']:,.0f} tokens/s, update "
              f"{record['grpo']['update_time_s']:.3f} s per step")
    harness.write(args.out, "tpu_step", **record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
