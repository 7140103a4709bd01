"""Rollout speed of the GRPO sampler against Hugging Face `generate`, `small` model, CPU, pinned and interleaved.

Both sides sample G = 8 completions of each of Q prompts of P tokens (B = Q x G rows), exactly N new
tokens (no EOS), temperature 1, no top-p or top-k, float32, with a KV cache (attention) and a
recurrent state (Gated DeltaNet). Sides, each a worker process pinned to the same cores
(`--cores`; benchmarks/pinned.py: XLA's intra-op pool and torch's threads one per core):
  ours          hybridmoe.rl.sampler.make_generate(group_size=G) on one CPU device: each prompt
                prefilled once (Q rows) and its state copied to its G rows, then the whole decode as
                one lax.while_loop; the platform's grouped matmul (kernels.gmm.xla_impl=auto: row
                tiles on CPU; a decode step's few routed rows by every expert, model/moe.py)
  ours-unshared the same sampler on the B rows with every prompt repeated G times (group_size 1: each
                row prefills its prompt), to show what prefilling once per prompt saves
  ours-ragged   kernels.gmm.xla_impl=ragged_dot (the sampler's grouped matmul before it followed the
                platform: every expert for every routed row on CPU)
  reference     transformers' Qwen3_5MoeForCausalLM.generate(num_return_sequences=G) (PyTorch;
                benchmarks/reference/hf_generate_worker.py run by --hf-python); it prefills the B rows
Per round each side runs two calls: N new tokens, and 1 new token (prefill + the first token: the
prefill's time; ours' also runs that token through the decoder once). Decode = the difference, over
B x (N - 1) tokens. The sides take turns, the order rotating each round; the first `--warmup`
rounds (compiles, lazy init) are not timed. Figures: medians over rounds and their spread (min,
quartiles, max) of wall time, process CPU time beside it; per-round ratios of our rollout tokens/s
to the reference's. Prints a table and writes benchmarks/records/rollout_small.json, which also
carries what routing replay (moe.routing_replay) costs to keep per rollout: the sampler's expert
ids, int32 [rows, tokens, layers, k], for this shape and for Qwen3.5-35B-A3B's.

  .venv/bin/python benchmarks/rollout.py --hf-python REFVENV/bin/python [--cores 0] [--rounds 7]

REFVENV: the reference venv benchmarks/reference/setup.sh makes (by default /work/refvenv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402 (stdlib only until configure)
from benchmarks.pinned import Worker, parse_cores, pin, serve, spread, thread_census  # noqa: E402

RECIPE = "small"
ONE_DEVICE = ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1"]
ARMS = {"ours": {"overrides": [], "share": True},
        "ours-unshared": {"overrides": [], "share": False},
        "ours-ragged": {"overrides": ["kernels.gmm.xla_impl=ragged_dot"], "share": True}}


def our_worker(arm: dict) -> None:
    """Serve `info` and `generate` (prompts [Q, P], group_size, new_tokens, seed)."""
    harness.configure(cpu_only=True)
    import jax
    from hybridmoe.model.params import declare_params, init_params
    from hybridmoe.recipe import load_config
    from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
    from hybridmoe.run.setup import build
    from hybridmoe.tools.record import machine_record

    cfg = load_config(RECIPE, ONE_DEVICE + arm["overrides"])
    setup = build(cfg)
    params = init_params(declare_params(cfg.model), jax.random.key(0))
    compiled, compile_s = {}, {}

    def sampler(group_size: int, new_tokens: int, rows):
        key = (group_size, new_tokens)
        if key not in compiled:
            fn = make_generate(cfg, SamplingOptions(new_tokens, temperature=1.0, eos_id=-1), group_size=group_size)
            t0 = time.perf_counter()
            compiled[key] = fn.lower(params, *rows, jax.random.key(0)).compile()
            compile_s[f"G{group_size}_N{new_tokens}"] = time.perf_counter() - t0
        return compiled[key]

    def generate(req):
        G, N = req["group_size"], req["new_tokens"]
        prompts = req["prompts"] if arm["share"] else [p for p in req["prompts"] for _ in range(G)]
        rows = left_pad_prompts(prompts, len(prompts[0]), 0)
        group = G if arm["share"] else 1
        with setup.context():
            fn = sampler(group, N, rows)
            c0, t0 = time.process_time(), time.perf_counter()
            out = fn(params, *rows, jax.random.key(req["seed"]))
            lengths = np.asarray(out["lengths"])  # waits for the rollout
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"wall_s": wall, "cpu_s": cpu, "rows": int(lengths.size), "new_tokens": int(lengths.sum())}

    def info(req):
        return {**machine_record(), "overrides": ONE_DEVICE + arm["overrides"], "prefill_once_per_prompt": arm["share"],
                "compile_s": compile_s, "affinity": sorted(os.sched_getaffinity(0)),
                "xla_intra_op_threads": thread_census().get("tf_XLAEigen", 0), "thread_census": thread_census(),
                "config": json.loads(cfg.model_dump_json())}

    serve({"info": info, "generate": generate})


def routing_bytes(cfg, rows: int, tokens: int) -> int:
    """int32 expert ids of one rollout batch: [rows, tokens, layers, k]."""
    return 4 * rows * tokens * cfg.model.num_layers * cfg.model.num_experts_per_tok


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True, record="rollout_small")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--hf-python", help="a Python with torch and transformers (benchmarks/reference/setup.sh)")
    ap.add_argument("--cores", default="0", help="cores every side is pinned to, e.g. 0 or 0,1 (default 0)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--prompts", type=int, default=2, help="Q distinct prompts")
    ap.add_argument("--group-size", type=int, default=8, help="G completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=128, help="P prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="N new tokens per row")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"which of ours to run (of {', '.join(ARMS)})")
    args = ap.parse_args()
    if args.worker:
        our_worker(json.loads(args.worker))
        return

    harness.configure(cpu_only=True)  # and the commit the record names: the code the run started from
    from hybridmoe.recipe import load_config

    cores = parse_cores(args.cores)
    pin(cores)  # every worker below inherits this affinity
    arms = [a for a in args.arms.split(",") if a]
    if not arms or not set(arms) <= set(ARMS):
        raise SystemExit(f"--arms {args.arms!r}: choose from {', '.join(ARMS)}")
    workers = {name: Worker([sys.executable, __file__, "--worker", json.dumps(ARMS[name])], name) for name in arms}
    if args.hf_python:
        workers["reference"] = Worker([args.hf_python, str(ROOT / "benchmarks" / "reference" / "hf_generate_worker.py"),
                                       "--threads", str(len(cores))], "reference")
    cfg = load_config(RECIPE, ONE_DEVICE)
    Q, G, P, N = args.prompts, args.group_size, args.prompt_len, args.new_tokens
    B = Q * G
    prompts = np.random.default_rng(0).integers(3, cfg.model.vocab_size, (Q, P)).tolist()

    def call(name: str, new_tokens: int, seed: int) -> dict:
        out = workers[name].ask(cmd="generate", prompts=prompts, group_size=G, new_tokens=new_tokens, seed=seed)
        assert out["rows"] == B and out["new_tokens"] == B * new_tokens, (name, out)
        return out

    names = list(workers)
    load_start = os.getloadavg()
    calls = {name: [] for name in names}
    loads = []
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            first = call(name, 1, r)
            full = call(name, N, r)
            if r >= args.warmup:
                calls[name].append({"round": r - args.warmup, "first_token": first, "full": full})
        if r >= args.warmup:
            loads.append(os.getloadavg())
        print(f"round {r}{' (warm-up)' if r < args.warmup else ''} ({'/'.join(order)}): "
              + ", ".join(f"{n} {calls[n][-1]['full']['wall_s']:.2f} s" if calls[n] else n for n in names)
              + f"; load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    infos = {name: w.ask(cmd="info") for name, w in workers.items()}
    for w in workers.values():
        w.close()
    load_end = os.getloadavg()

    def series(name: str, key: str) -> dict[str, list[float]]:
        out = {"rollout_tokens_per_s": [], "prefill_s": [], "decode_tokens_per_s": [], "call_s": []}
        for c in calls[name]:
            full, first = c["full"][key], c["first_token"][key]
            out["call_s"].append(full)
            out["rollout_tokens_per_s"].append(B * N / full)
            out["prefill_s"].append(first)
            # NaN where the 1-token call took as long as the whole (noise swamps decode: too few tokens)
            out["decode_tokens_per_s"].append(B * (N - 1) / (full - first) if full > first else float("nan"))
        return out

    sides = {}
    for n in names:
        wall, cpu = series(n, "wall_s"), series(n, "cpu_s")
        sides[n] = {"wall": {k: spread(v) for k, v in wall.items()}, "cpu": {k: spread(v) for k, v in cpu.items()},
                    "calls": calls[n], "info": infos[n]}
    ratios = {}
    if "reference" in workers:
        for n in arms:
            ratios[n] = {clock: {k: spread([a / b for a, b in zip(series(n, key)[k], series("reference", key)[k])])
                                 for k in ("rollout_tokens_per_s", "decode_tokens_per_s")}
                         for clock, key in (("wall", "wall_s"), ("cpu", "cpu_s"))}
            ratios[n]["wall"]["prefill_speed"] = spread(
                [b / a for a, b in zip(series(n, "wall_s")["prefill_s"], series("reference", "wall_s")["prefill_s"])])

    print(f"pinned to cores {cores}; {args.rounds} rounds; {Q} prompts x G = {G} rows, {P} prompt + {N} new tokens")
    print(f"{'side':<14} {'rollout tok/s':>13} {'p25-p75':>15} {'prefill s':>9} {'decode tok/s':>12} "
          f"{'cpu tok/s':>9} {'x reference':>11}")
    for n in names:
        w, c = sides[n]["wall"], sides[n]["cpu"]
        rt = ratios.get(n, {}).get("wall", {}).get("rollout_tokens_per_s")
        print(f"{n:<14} {w['rollout_tokens_per_s']['median']:>13.1f} "
              f"{w['rollout_tokens_per_s']['p25']:>7.1f}-{w['rollout_tokens_per_s']['p75']:<7.1f} "
              f"{w['prefill_s']['median']:>9.3f} {w['decode_tokens_per_s']['median']:>12.1f} "
              f"{c['rollout_tokens_per_s']['median']:>9.1f} {rt['median'] if rt else float('nan'):>11.2f}")
    print(f"load average {load_start[0]:.1f} at start, {min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} "
          f"during, {load_end[0]:.1f} at end (1-minute)")

    big = load_config("qwen3.5-35b-a3b")
    harness.write(args.out, "rollout_small", **{
        "script": "benchmarks/rollout.py",
        "method": {"cores": cores, "threads_per_side": len(cores), "rounds": args.rounds, "warmup_rounds": args.warmup,
                   "order": "sides alternate, rotated each round; per side and round a 1-token call then the N-token call",
                   "figure": "median over rounds (and spread); ratio = ours / reference tokens/s per round (> 1 is faster)",
                   "prefill": "the 1-new-token call (prefill + first token; ours also runs that token through the "
                              "decoder once)",
                   "decode": "B x (N - 1) tokens / (N-token call - 1-token call)",
                   "thread_control": "XLA: intra-op Eigen pool = schedulable CPUs (the affinity mask), counted as "
                                     "tf_XLAEigen threads; torch: torch.set_num_threads(len(cores))"},
        "load_average": {"start": load_start, "per_round": loads, "end": load_end},
        "shape": {"prompts": Q, "group_size": G, "rows": B, "prompt_len": P, "new_tokens": N, "dtype": "float32",
                  "sampling": "temperature 1, no top-p / top-k, no EOS"},
        "arms": {n: ARMS[n] for n in arms}, "sides": sides, "ratios_over_reference": ratios,
        "routing_replay_ids_bytes": {"small_this_rollout": routing_bytes(cfg, B, P + N),
                                     "qwen3.5-35b-a3b_per_1k_tokens": routing_bytes(big, 1, 1024),
                                     "layout": "int32 [rows, tokens, layers, k]"},
    })


if __name__ == "__main__":
    main()
