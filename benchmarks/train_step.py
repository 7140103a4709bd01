"""The `small` recipe's training step on this machine against the PyTorch reference, pinned and interleaved.

Sides, each a worker process, started pinned to the same cores (`--cores`, the method of
benchmarks/pinned.py: XLA's intra-op pool and torch's threads both one per pinned core):
  ours       the default step (forward, next-token loss, backward, clip, AdamW) of `recipe=small`
             on one CPU device (mesh.cpu_devices=1), 4 x 512 tokens, float32; further arms of ours
             with `--arm NAME:key=value,...` (overrides on top of that one-device base), or
             `--arm NAME@COMMIT` (the step as that commit's code runs it: a before / after pair in
             one interleaved run)
  reference  transformers' Qwen3.5-MoE at the same shape (benchmarks/reference/bench_hf_reference.py
             --worker, run by `--hf-python`), trained on the same tokens (our synthetic batch of
             each round, sent to it), AdamW with the same settings and global-norm clip
Each side compiles / warms up for `--warmup` steps, then the sides take turns for `--rounds`
rounds, `--steps-per-round` steps each, the order alternating every round. A round's time is the
median of its steps; the ratio of a round is ours over the reference's (time per token: lower is
faster); the record keeps every step, the median and spread (min, quartiles, max) of each side
and of the per-round ratios, the load average at every round, each side's versions, affinity
and threads. Prints a table and writes benchmarks/records/train_step_small.json.

  .venv/bin/python benchmarks/train_step.py --hf-python REFVENV/bin/python [--cores 0] [--rounds 15]

REFVENV: the reference venv benchmarks/reference/setup.sh makes (by default /work/refvenv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402
from benchmarks.pinned import Worker, parse_cores, pin, serve, spread, thread_census  # noqa: E402

RECIPE = "small"
ONE_DEVICE = ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=-1"]


def our_worker(overrides: list[str]) -> None:
    """Serve `info` and `step` (by step index: the batch is synthetic_batch(seed, index))."""
    import jax
    from hybridmoe.data.synthetic import synthetic_batch
    from hybridmoe.recipe import load_config
    from hybridmoe.run.setup import build, init_state, jit_train_step
    from hybridmoe.tools.record import machine_record

    cfg = load_config(RECIPE, overrides)
    t = cfg.train
    setup = build(cfg)
    state = [init_state(setup, jax.random.key(t.seed))]
    fn = jit_train_step(setup)

    def batch(index: int):
        return synthetic_batch(t.seed, index, t.fewest_micro_batches, t.rows_per_micro_batch, t.seq_len,
                               cfg.model.vocab_size)

    with setup.context():
        t0 = time.perf_counter()
        compiled = fn.lower(setup.abstract_state(), jax.device_put(batch(0), setup.batch_sharding(1))).compile()
        compile_s = time.perf_counter() - t0

    def step(req):
        b = batch(req["index"])
        with setup.context():
            on_device = jax.device_put(b, setup.batch_sharding(1))
            jax.block_until_ready(on_device)
            c0, t0 = time.process_time(), time.perf_counter()
            state[0], m = compiled(state[0], on_device)
            loss = float(m["loss"])  # waits for the step
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"wall_s": wall, "cpu_s": cpu, "loss": loss, "token_sum": int(b["tokens"].sum()),
                "shape": list(b["tokens"].shape)}

    def info(req):
        return {**machine_record(), "overrides": overrides, "compile_s": compile_s,
                "devices": len(jax.devices()), "affinity": sorted(os.sched_getaffinity(0)),
                "xla_intra_op_threads": thread_census().get("tf_XLAEigen", 0), "thread_census": thread_census(),
                "tokens_per_step": t.batch_size * t.seq_len,
                "config": json.loads(cfg.model_dump_json())}

    serve({"info": info, "step": step, "tokens": lambda req: {"tokens": batch(req["index"])["tokens"].tolist()}})


def parse_arm(text: str) -> tuple[str, list[str], str | None]:
    """NAME[@COMMIT]:overrides -> (name, overrides on the one-device base, commit or None)."""
    head, _, rest = text.partition(":")
    name, _, commit = head.partition("@")
    if not name or name == "reference":
        raise SystemExit(f"--arm {text!r}: an arm is NAME[@COMMIT]:section.key=value,... (NAME not 'reference')")
    return name, ONE_DEVICE + [o for o in rest.split(",") if o], commit or None


def source_tree(commit: str, into: Path) -> Path:
    """The repository's files at `commit`, unpacked under `into` (an arm runs that code)."""
    out = into / commit
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    if not (out / "benchmarks" / "train_step.py").exists():
        raise SystemExit(f"--arm ...@{commit}: that commit has no benchmarks/train_step.py worker")
    return out


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True, record="train_step_small")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--hf-python", help="a Python with torch and transformers (benchmarks/reference/setup.sh)")
    ap.add_argument("--cores", default="0", help="cores both sides are pinned to, e.g. 0 or 0,1 (default 0)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps-per-round", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side before round 0")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:OVERRIDES",
                    help="another arm of ours (repeatable); the default arm 'ours' always runs")
    args = ap.parse_args()
    if args.worker:
        our_worker(json.loads(args.worker))
        return

    harness.configure(cpu_only=True)  # and the commit now: the record names the code the run started from
    from hybridmoe.tools.record import source_commit

    cores = parse_cores(args.cores)
    pin(cores)  # every worker below inherits this affinity
    arms = [("ours", ONE_DEVICE, None)] + [parse_arm(a) for a in args.arm]
    if len({n for n, _, _ in arms}) != len(arms):
        raise SystemExit("--arm names must be distinct (and not 'ours')")
    trees = tempfile.TemporaryDirectory()
    scripts = {name: (source_tree(c, Path(trees.name)) / "benchmarks" / "train_step.py" if c else Path(__file__))
               for name, _, c in arms}
    workers = {name: Worker([sys.executable, str(scripts[name]), "--worker", json.dumps(ov)], name)
               for name, ov, _ in arms}
    if args.hf_python:
        workers["reference"] = Worker([args.hf_python, str(ROOT / "benchmarks" / "reference" / "bench_hf_reference.py"),
                                       "--worker", "--threads", str(len(cores))], "reference")
    tokens_of = workers["ours"]

    def run(name: str, index: int) -> dict:
        if name == "reference":
            return workers[name].ask(cmd="step", tokens=tokens_of.ask(cmd="tokens", index=index)["tokens"][0])
        return workers[name].ask(cmd="step", index=index)

    load_start = os.getloadavg()
    for w in range(args.warmup):  # batches 10**6, 10**6 + 1, ...: never a timed one
        for name in workers:
            run(name, 10**6 + w)
    infos = {name: w.ask(cmd="info") for name, w in workers.items()}
    steps = {name: [] for name in workers}
    loads = []
    names = list(workers)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            for k in range(args.steps_per_round):
                out = run(name, r * args.steps_per_round + k)
                steps[name].append({"round": r, **out})
        loads.append(os.getloadavg())
        line = ", ".join(f"{n} {steps[n][-1]['wall_s']:.3f}" for n in names)
        print(f"round {r} ({'/'.join(order)}): s/step {line}; load {loads[-1][0]:.1f}", file=sys.stderr)
    for w in workers.values():
        w.close()
    load_end = os.getloadavg()

    sums = {n: {s["token_sum"] for s in steps[n]} for n in names}
    same_tokens = all(sorted(s["token_sum"] for s in steps[n]) == sorted(s["token_sum"] for s in steps["ours"])
                      for n in names)
    tokens = infos["ours"]["tokens_per_step"]

    def per_round(name: str, key: str) -> list[float]:
        return [float(np.median([s[key] for s in steps[name] if s["round"] == r])) for r in range(args.rounds)]

    sides = {}
    for n in names:
        wall = per_round(n, "wall_s")
        sides[n] = {"seconds_per_step": spread(wall), "cpu_seconds_per_step": spread(per_round(n, "cpu_s")),
                    "tokens_per_s_at_median": tokens / spread(wall)["median"], "steps": steps[n], "info": infos[n]}
    ratios = {}
    if "reference" in workers:
        ref_wall, ref_cpu = per_round("reference", "wall_s"), per_round("reference", "cpu_s")
        for n, _, _ in arms:
            ratios[n] = {"time_ratio": spread([a / b for a, b in zip(per_round(n, "wall_s"), ref_wall)]),
                         "cpu_time_ratio": spread([a / b for a, b in zip(per_round(n, "cpu_s"), ref_cpu)])}

    print(f"pinned to cores {cores}; {args.rounds} rounds x {args.steps_per_round} steps; tokens/step {tokens}")
    print(f"{'side':<12} {'median s':>9} {'min':>7} {'p25':>7} {'p75':>7} {'max':>7} {'tokens/s':>9}"
          f" {'ratio':>7} {'ratio p25-p75':>14}")
    for n in names:
        s = sides[n]["seconds_per_step"]
        rt = ratios.get(n, {}).get("time_ratio")
        rtxt = f"{rt['median']:>7.3f} {rt['p25']:>6.3f}-{rt['p75']:<7.3f}" if rt else ""
        print(f"{n:<12} {s['median']:>9.3f} {s['min']:>7.3f} {s['p25']:>7.3f} {s['p75']:>7.3f} {s['max']:>7.3f} "
              f"{sides[n]['tokens_per_s_at_median']:>9.1f} {rtxt}")
    print(f"load average {load_start[0]:.1f} at start, {min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} "
          f"during, {load_end[0]:.1f} at end (1-minute)")
    if not same_tokens:
        print(f"WARNING: the sides trained on different tokens: {sums}")

    harness.write(args.out, "train_step_small", **{
        "script": "benchmarks/train_step.py",
        "method": {"cores": cores, "threads_per_side": len(cores), "rounds": args.rounds,
                   "steps_per_round": args.steps_per_round, "warmup_steps": args.warmup,
                   "order": "alternating round by round (rotated)", "figure": "median over rounds of each "
                   "round's median step; ratio = ours / reference per round (time per token; < 1 is faster)",
                   "thread_control": "XLA: intra-op Eigen pool = schedulable CPUs (the affinity mask), "
                   "counted as tf_XLAEigen threads; torch: torch.set_num_threads(len(cores))"},
        "load_average": {"start": load_start, "per_round": loads, "end": load_end},
        "same_tokens": same_tokens, "tokens_per_step": tokens,
        "arms": {n: {"overrides": ov, "commit": c or source_commit()} for n, ov, c in arms},
        "sides": sides, "ratios": ratios})


if __name__ == "__main__":
    main()
