"""The `small` recipe's training step on this machine, next to the Hugging Face reference.

Arms, each in its own process (JAX fixes its CPU device count at start-up), run one after the
other in one invocation:
  jax-8dev   the step on 8 simulated CPU devices (the mesh the tests and demo use)
  jax-1dev   the step on 1 CPU device
  hf-torch   the Hugging Face reference (PyTorch, CPU, 2 threads) via benchmarks/reference/bench_hf_reference.py,
             when a Python with torch + transformers is given (--hf-python)
Seconds per step is the mean of steps 1..N (step 0 compiles); compile time is step 0's extra.
Prints a table and writes benchmarks/records/train_step_small.json.

  .venv/bin/python benchmarks/train_step.py [--hf-python /path/to/python] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from hybridmoe.tools.record import machine_record, write_record  # noqa: E402


def jax_arm(devices: int, steps: int) -> dict:
    import jax
    jax.config.update("jax_num_cpu_devices", devices)
    from hybridmoe.recipe import load_config
    from hybridmoe.data.synthetic import synthetic_batch
    from hybridmoe.run.setup import build, init_state, jit_train_step

    mesh = ["mesh.cpu_devices=%d" % devices, "mesh.data=1", "mesh.fsdp=-1"]
    batch = 4 if devices <= 4 else 8
    cfg = load_config("small", mesh + [f"train.batch_size={batch}"])
    setup = build(cfg)
    state = init_state(setup, jax.random.key(0))
    fn = jit_train_step(setup)
    times, tokens = [], []
    with setup.context():
        for s in range(steps):
            b = jax.device_put(synthetic_batch(0, s, 1, batch, cfg.train.seq_len, cfg.model.vocab_size),
                               setup.batch_sharding(1))
            t0 = time.perf_counter()
            state, m = fn(state, b)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
            tokens.append(batch * cfg.train.seq_len)
    sec = sum(times[1:]) / (steps - 1)
    return {"devices": devices, "batch": batch, "seq_len": cfg.train.seq_len, "step_times_s": times,
            "seconds_per_step": sec, "tokens_per_s": tokens[-1] / sec, "compile_s": times[0] - sec,
            "config": json.loads(cfg.model_dump_json())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hf-python", help="a Python with torch and transformers for the reference arm")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "records" / "train_step_small.json"))
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(jax_arm(int(args.arm), args.steps)))
        return
    arms = {}
    for devices in (8, 1):
        out = subprocess.run([sys.executable, __file__, "--arm", str(devices), "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout
        arms[f"jax-{devices}dev"] = json.loads(out.strip().splitlines()[-1])
    if args.hf_python:
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([args.hf_python, str(ROOT / "benchmarks" / "reference" / "bench_hf_reference.py"), "--out",
                            f"{d}/hf.json", "--steps", str(args.steps - 1)], check=True, capture_output=True)
            arms["hf-torch"] = json.loads(Path(f"{d}/hf.json").read_text())
    print(f"{'arm':<10} {'tokens/step':>11} {'s/step':>8} {'tokens/s':>10} {'compile s':>10}")
    for name, a in arms.items():
        tps = a.get("tokens_per_s")
        sec = a.get("seconds_per_step") or a.get("mean_step_seconds")
        tok = a.get("batch", 4) * a.get("seq_len", 512)
        comp = a.get("compile_s")
        print(f"{name:<10} {tok:>11} {sec:>8.3f} {tps:>10.1f} {'' if comp is None else f'{comp:>10.1f}'}")
    write_record(Path(args.out), {"benchmark": "train_step_small", **machine_record(), "arms": arms})


if __name__ == "__main__":
    main()
