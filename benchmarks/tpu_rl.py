"""The GRPO loop on one TPU chip: a real batch of the one-chip recipe against its HBM bound, and a run
that learns.

    python3 benchmarks/tpu_rl.py                  # on a TPU host (docs/tpu.md): both parts, within 8 minutes
    python3 benchmarks/tpu_rl.py --part batch     # one part; merged into the record
    python3 benchmarks/tpu_rl.py --tiny           # CPU, tiny shapes: a smoke run of both parts

Parts, the learning run first (the cheaper: a tiny model's few compiles), each `hybridmoe rl` run in
a child process this one watches (harness.watched: a part past its share is stopped with its
process and recorded as cut; its share is its --*-budget-s, or what is left of --budget-s if less;
the record is rewritten after each part, so a call cut short keeps what finished):

batch  The real GRPO batch's command, `hybridmoe rl recipe=qwen3.5-35b-a3b-v5e-1 rl.prompts_per_step=16
       rl.group_size=8 rl.max_new_tokens=512`, with no memory override (rl.micro_batches and
       rl.rollout_batches auto: chosen against the chip's free memory, rl/memory_plan.py), for
       three GRPO steps and no warm-up (rl.warmup_steps=0 rl.steps=3 rl.checkpoint_every=0), run by
       hybridmoe.cli.main in the child; its metrics.jsonl read back. The first GRPO step (the loop's
       small programs compile in it) is left out of the timed figures. Recorded: the rows and new
       tokens, the counts chosen (micro_batches, old_logprobs_micro_batches, rollout_batches, as the
       loop logs them, and plan_log: what each count the memory plan tried did), the rollout's, the
       pi_old pass's (--updates-per-rollout > 1 only: with one
       update the update takes its own log-probs as pi_old and there is no such pass) and the
       update's tokens and seconds summed over the timed steps, each rate their count over their
       own time; the step split (rollout / old log-probs / update / rest, rest = the step less the
       three, mean per timed step); the device's peak bytes in use; and the rollout's HBM bound
       (analysis/decode_bytes.py: the bytes a decode step of the rows in flight moves, at the mean
       cache length, over the chip's HBM rate) with the measured rate over it. The HBM rate is the
       highest of the calibration table's row for the chip's generation (hybridmoe calibrate) and
       two passes over --hbm-probe-mib measured here after the run (a read-only sum, a copy): the
       fastest rate the chip showed, so the bound is the strictest of them.
learn  recipe=chip-learn (hybridmoe/config/recipes/chip-learn.yml): the tiny model, a short
       supervised warm-up that leaves the sampled answers about half right, then GRPO on two-digit
       addition until they are right nine times in ten. Recorded: reward_mean_curve (one value per
       GRPO step), the first GRPO step's and the last five's mean reward, wall_s (the child's, from
       before JAX starts to the run's end: compiles included) and whether each of the learning run's
       conditions holds (first <= 0.6, last five >= 0.9, wall_s <= 600). On a chip its metrics.png is
       copied to docs/tpu_rl_learn.png (a CPU run's stays in its run folder).

Writes benchmarks/records/tpu_rl.json: device, commit, batch, learn (a part run earlier on the
same device is kept when only the other runs).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

PARTS = ("learn", "batch")
BATCH_RECIPE = "qwen3.5-35b-a3b-v5e-1"
# The real GRPO batch: >= 16 prompts x 8 completions x >= 512 new tokens, no memory override.
BATCH_WORDS = ["rl.prompts_per_step=16", "rl.group_size=8", "rl.max_new_tokens=512"]
# Three GRPO steps, no warm-up, no checkpoint: the first step compiles, two are timed.
BATCH_RUN = ["rl.warmup_steps=0", "rl.steps=3", "rl.checkpoint_every=0"]
LEARN_RECIPE = "chip-learn"
# The learning run's targets.
FIRST_AT_MOST, LAST_AT_LEAST, LAST_STEPS, WALL_AT_MOST_S = 0.6, 0.9, 5, 600.0
PLOT = harness.ROOT / "docs" / "tpu_rl_learn.png"
# --tiny: the same code paths on CPU in seconds: a few rows of a few tokens, the recipes' own meshes
# (tiny's 8 simulated devices: a mini-batch of 8 rows split over them; chip-learn's platform devices), two updates
# per rollout so the pi_old pass runs and is counted, no warm-up (its step is the trainer's, tested
# elsewhere; its compile is the slowest part of a tiny run).
TINY_ROWS = ["rl.prompts_per_step=4", "rl.group_size=4", "rl.warmup_steps=0", "rl.steps=2", "rl.checkpoint_every=0"]
TINY = {"batch": ("tiny", [*TINY_ROWS, "rl.max_new_tokens=8", "rl.max_prompt_len=8", "rl.updates_per_rollout=2"]),
        "learn": (LEARN_RECIPE, TINY_ROWS)}


def part_words(part: str, args) -> tuple[str, list[str]]:
    """(recipe, overrides) of a part's `hybridmoe rl` run."""
    if args.tiny:
        return TINY[part]
    if part == "batch":
        extra = [f"rl.updates_per_rollout={args.updates_per_rollout}"] if args.updates_per_rollout > 1 else []
        return BATCH_RECIPE, [*BATCH_WORDS, *BATCH_RUN, *extra]
    return LEARN_RECIPE, list(args.learn_override)


def run_rl(recipe: str, overrides: list[str], out: Path, plan_log: list[str] | None = None) -> list[dict]:
    """`hybridmoe rl` in this process into `out` (started over); its metrics.jsonl records. With
    `plan_log`, the project's INFO lines about its counts (the memory plan: what each count tried
    did, and the counts chosen) are appended to it and echoed."""
    import logging

    from hybridmoe.cli import main

    class Lines(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "micro_batches" in text or "rollout_batches" in text:
                plan_log.append(text)
                print(text, flush=True)

    logger, handler = logging.getLogger("hybridmoe"), Lines()
    if plan_log is not None:
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    try:
        if main(["rl", f"recipe={recipe}", *overrides, "--out", str(out), "--overwrite"]) != 0:
            raise SystemExit(f"hybridmoe rl recipe={recipe} {' '.join(overrides)} failed")
    finally:
        logger.removeHandler(handler)
    return read_metrics(out)


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def grpo_records(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("phase") == 1]


def rate(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def batch_figures(steps: list[dict], epochs_per_rollout: int = 1) -> dict:
    """The timed GRPO records' counts, seconds and rates (each rate its count over its own seconds,
    summed over the steps) and the step split (mean per step; rest = the step less the parts)."""
    total = lambda key: float(sum(r[key] for r in steps))  # noqa: E731
    with_old = [r for r in steps if r["old_logprobs_time_s"] > 0]
    rollout = {"new_tokens": total("rollout_tokens"), "time_s": total("rollout_time_s")}
    # The pi_old pass runs over the rollout's rows once; the updates over them once per epoch.
    old = {"tokens": float(sum(r["tokens"] for r in with_old)), "time_s": total("old_logprobs_time_s")}
    update = {"tokens": total("tokens") * epochs_per_rollout, "time_s": total("update_time_s")}
    rollout["tokens_per_s"] = rate(rollout["new_tokens"], rollout["time_s"])
    old["tokens_per_s"] = rate(old["tokens"], old["time_s"])
    update["tokens_per_s"] = rate(update["tokens"], update["time_s"])
    n = len(steps)
    split = {"rollout": total("rollout_time_s") / n, "old_logprobs": total("old_logprobs_time_s") / n,
             "update": total("update_time_s") / n, "step": total("step_time_s") / n}
    split["rest"] = split["step"] - split["rollout"] - split["old_logprobs"] - split["update"]
    return {"steps_timed": n, "rollout": rollout, "old_logprobs": old, "update": update, "step_split_s": split,
            "completion_len_mean": total("completion_len_mean") / n,
            "completion_len_max": max(r["completion_len_max"] for r in steps)}


def hbm_probe(mib: int, repeats: int = 5) -> dict:
    """The device's HBM rate by two passes over a bf16 array of `mib` MiB (median of `repeats` after a
    warm call): a sum (read once) and a copy plus one (read and written)."""
    import statistics

    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 2
    x = jnp.ones((n,), jnp.bfloat16)
    passes = {"read_bytes_per_s": (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), 2 * n),
              "copy_bytes_per_s": (jax.jit(lambda a: a + 1), 4 * n)}
    out = {"probe_mib": mib}
    for name, (fn, moved) in passes.items():
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        out[name] = moved / statistics.median(times)
    del x
    return out


def hbm_rates(probe: dict) -> dict:
    """The chip's HBM rates: its generation's calibration row (the v5e's where this device has none,
    e.g. a CPU smoke run) and the probe's; `judged_by` names the highest, which the bound uses."""
    import jax

    from hybridmoe.analysis.hardware import hardware_for, read_calibration
    from hybridmoe.kernels.platform import generation_of_device

    generation = generation_of_device(jax.devices()[0]) or "v5e"
    rates = {"calibration_bytes_per_s": hardware_for(generation).hbm_bytes_per_s,
             "read_bytes_per_s": probe["read_bytes_per_s"], "copy_bytes_per_s": probe["copy_bytes_per_s"]}
    judged_by = max(rates, key=rates.get)
    row = read_calibration().get(generation, {})
    return {"generation": generation, "calibration_source": row.get("measured", {}).get("commit", "maker's figures"),
            "probe_mib": probe["probe_mib"], **rates, "judged_by": judged_by, "bytes_per_s": rates[judged_by]}


def peak_memory() -> dict:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit")}


def batch_part(args, out: Path) -> dict:
    from hybridmoe.analysis.decode_bytes import rollout_bound
    from hybridmoe.recipe import load_config

    recipe, overrides = part_words("batch", args)
    t0, plan_log = time.perf_counter(), []
    rows = run_rl(recipe, overrides, out, plan_log)
    wall = time.perf_counter() - t0
    memory = peak_memory()
    cfg = load_config(recipe, overrides)  # after the run: reading the platform starts JAX's backend
    grpo = grpo_records(rows)
    if len(grpo) < 2:
        raise SystemExit(f"batch: {len(grpo)} GRPO step(s) ran; the figures need two (the first compiles)")
    r, first = cfg.rl, grpo[0]
    figures = batch_figures(grpo[1:], r.epochs_per_rollout)
    passes = int(first["rollout_batches"])
    in_flight = r.rollouts_per_step // passes
    hbm = hbm_rates(hbm_probe(args.hbm_probe_mib))
    bound = rollout_bound(cfg.model, in_flight, r.max_prompt_len, figures["completion_len_max"], hbm["bytes_per_s"])
    measured = figures["rollout"]["tokens_per_s"]
    return {
        "command": f"hybridmoe rl recipe={recipe} {' '.join(overrides)}", "recipe": recipe, "overrides": overrides,
        "rows": r.rollouts_per_step, "prompts": r.prompts_per_step, "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens, "prompt_slots": r.max_prompt_len,
        "micro_batches": int(first["micro_batches"]), "old_logprobs_micro_batches": int(first["old_logprobs_micro_batches"]),
        "rollout_batches": passes, "updates_per_rollout": r.updates_per_rollout, "plan_log": plan_log, **figures,
        "first_step_s": first["step_time_s"], "wall_s": wall, **memory, "hbm": hbm, "bound": bound,
        "rollout_over_bound": measured / bound["tokens_per_s"] if measured else None,
        "per_step": [{k: g[k] for k in ("step", "step_time_s", "rollout_time_s", "rollout_tokens_per_s",
                                        "old_logprobs_time_s", "update_time_s", "completion_len_mean")} for g in grpo],
    }


def learn_figures(rows: list[dict]) -> dict:
    """The GRPO phase's reward curve and the learning run's conditions on it (the wall-time one is the caller's)."""
    curve = [r["reward_mean"] for r in grpo_records(rows)]
    last = curve[-LAST_STEPS:]
    return {"grpo_steps": len(curve), "warmup_steps": sum(r.get("phase") == 0 for r in rows),
            "reward_mean_curve": curve, "reward_first": curve[0] if curve else None,
            f"reward_last_{LAST_STEPS}_mean": sum(last) / len(last) if last else None,
            "first_at_most_0.6": bool(curve) and curve[0] <= FIRST_AT_MOST,
            f"last_{LAST_STEPS}_at_least_0.9": bool(last) and sum(last) / len(last) >= LAST_AT_LEAST}


def learn_part(args, out: Path, started: float) -> dict:
    recipe, overrides = part_words("learn", args)
    rows = run_rl(recipe, overrides, out)
    wall = time.perf_counter() - started
    import jax

    # docs/ shows the chip's run: a CPU run's plot stays in its run folder.
    plot = PLOT if jax.default_backend() != "cpu" else out / "metrics.png"
    if plot == PLOT:
        shutil.copyfile(out / "metrics.png", PLOT)
    grpo_s = sorted(r["step_time_s"] for r in grpo_records(rows))
    return {"recipe": recipe, "overrides": overrides, **learn_figures(rows), "wall_s": wall,
            "within_600_s": wall <= WALL_AT_MOST_S, "steps_s": sum(r["step_time_s"] for r in rows),
            "grpo_step_s_median": grpo_s[len(grpo_s) // 2] if grpo_s else None,
            "plot": str(plot.relative_to(harness.ROOT)) if plot.is_relative_to(harness.ROOT) else str(plot)}


def merge_part(out: Path, part: str, figures: dict, device: str, write) -> None:
    """The record at `out` with `part` set to `figures`; the other part kept from an earlier run on the
    same `device` (written by `write(**fields)`, which adds the device and commit)."""
    old = json.loads(out.read_text()) if out.is_file() and out.stat().st_size else {}
    if old.get("device") not in (None, device):  # another device's parts are not this one's
        old = {}
    write(**{p: old[p] for p in PARTS if p in old and p != part}, **{part: figures})


def run_part(args, part: str) -> int:
    """One part in this process (what each watched child runs)."""
    started = time.perf_counter()  # before JAX starts: the learning run's wall time counts it
    harness.configure(cpu_only=args.tiny, cache_dir=args.compile_cache or None)
    out = Path(args.out)
    run_dir = Path(args.run_dir) / part
    harness.mark("start", part)
    figures = batch_part(args, run_dir) if part == "batch" else learn_part(args, run_dir, started)
    harness.mark("done", part)
    from hybridmoe.tools.record import machine_record  # after the run: it starts JAX's backend

    merge_part(out, part, figures, machine_record()["device"], lambda **fields: harness.write(out, "tpu_rl", **fields))
    return 0


def record_cut(out: Path, part: str, reason: str, run_dir: Path) -> None:
    """Write into the record that `part` was cut, and why, with the GRPO reward curve its run got to."""
    from hybridmoe.tools.record import source_commit, write_record

    record = json.loads(out.read_text()) if out.is_file() and out.stat().st_size else {"benchmark": "tpu_rl"}
    rows = read_metrics(run_dir / part)
    record[part] = {"cut": reason, "commit": source_commit(), **(learn_figures(rows) if part == "learn" else {})}
    write_record(out, record)


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--part", choices=PARTS, action="append", help="learn or batch (repeatable; default both)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="the parts' seconds together (default 480: one 10-minute call with the host's set-up, ~65 s, "
                   "before it)")
    p.add_argument("--batch-budget-s", type=float, default=420.0,
                   help="stop the batch part after this many seconds (default 420: its compiles, ~85 s each on a v5e)")
    p.add_argument("--learn-budget-s", type=float, default=600.0,
                   help="stop the learning run after this many seconds (default 600: the learning run's limit)")
    p.add_argument("--updates-per-rollout", type=int, default=1,
                   help="the batch part's rl.updates_per_rollout (above 1 the pi_old pass runs and is timed)")
    p.add_argument("--learn-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the learning run's recipe (repeatable), e.g. rl.warmup_steps=80")
    p.add_argument("--hbm-probe-mib", type=int, default=1024, help="the HBM probe's array size (default 1 GiB)")
    p.add_argument("--compile-cache", default=str(harness.ROOT / "runs" / "tpu_rl" / "xla"),
                   help="JAX's persistent compile cache (default runs/tpu_rl/xla: ignored by git, kept between "
                   "calls on a warm host, so a second call compiles nothing it compiled before; '' leaves JAX's as it is)")
    p.add_argument("--run-dir", default=str(harness.ROOT / "runs" / "tpu_rl"),
                   help="the parts' run folders (metrics.jsonl, metrics.png) go under this")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (a smoke run); a temporary record "
                   "unless --out is given")
    p.add_argument("--in-process", action="store_true", help="run the (one) part in this process, unwatched")
    args = p.parse_args(argv)
    parts = args.part or list(PARTS)
    if args.tiny and args.out == p.get_default("out"):
        args.out = tempfile.mkstemp(prefix="tpu_rl_tiny_", suffix=".json")[1]
    if args.in_process:
        if len(parts) != 1:
            raise SystemExit("--in-process runs one --part")
        return run_part(args, parts[0])
    # This process never starts JAX: one process at a time may hold the chip.
    status, start = 0, time.perf_counter()
    for part in [p for p in PARTS if p in parts]:
        left = args.budget_s - (time.perf_counter() - start)
        share = min(args.batch_budget_s if part == "batch" else args.learn_budget_s, left)
        if share <= 0:
            print(f"{part}: not run, past the {args.budget_s:.0f} s budget", flush=True)
            status = 1
            continue
        child = [sys.executable, __file__, "--in-process", "--part", part, "--out", args.out,
                 "--updates-per-rollout", str(args.updates_per_rollout), "--hbm-probe-mib", str(args.hbm_probe_mib),
                 "--compile-cache", args.compile_cache, "--run-dir", args.run_dir, *(["--tiny"] if args.tiny else []),
                 *(f"--learn-override={word}" for word in args.learn_override)]
        ended = harness.watched(child, share)
        if ended.cut is not None:
            reason = ended.reason(share)
            print(f"{part}: cut, {reason}", flush=True)
            record_cut(Path(args.out), part, reason, Path(args.run_dir))
            status = 1
        elif ended.returncode:
            status = ended.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
