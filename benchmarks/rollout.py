"""Rollout speed: generated tokens/s of the GRPO sampler against Hugging Face `generate`, `small` model, CPU.

Both arms sample B rows of a P-token prompt to exactly N new tokens (no EOS), temperature 1, no top-p
or top-k, float32, with a KV cache (attention) and a recurrent state (Gated DeltaNet):
  jax       hybridmoe.rl.sampler.make_generate on 1 CPU device: prefill, then one lax.while_loop
            over the new tokens (compiled once per prompt shape; no host round trip per token)
  jax-rt8   the same with kernels.gmm.xla_impl=row_tiles, 8-row tiles (on CPU ragged_dot computes
            every expert for every routed row; a decode step routes only rows x k of them)
  hf-torch  transformers' Qwen3_5MoeForCausalLM.generate (PyTorch, CPU, --threads threads; its GDN
            runs the pure-PyTorch fallbacks, flash-linear-attention being CUDA-only), in a worker
            process of the Python given by --hf-python (torch and transformers are never
            dependencies of this package)
The arms alternate call by call in one invocation (jax, jax-rt8, hf, jax, ...) so that both see the same
machine load; the first call of each is a warm-up (compile / lazy init) and is not averaged. The
figure is B * N / mean seconds per call, and the ratio jax / hf of the two.

The record also carries what routing replay (moe.routing_replay) costs to keep per rollout: the
sampler's expert ids, int32 [rows, tokens, layers, k], for this shape and for Qwen3.5-35B-A3B's.

  .venv/bin/python benchmarks/rollout.py --hf-python /tmp/refvenv/bin/python [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402 (stdlib only until configure: the reference worker runs without JAX)

BATCH, PROMPT_LEN, NEW_TOKENS = 8, 64, 64


def hf_worker(threads: int) -> None:
    """Serve `generate` calls: one line in (anything), one JSON line out (seconds, tokens)."""
    import torch
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    sys.path.insert(0, str(ROOT / "benchmarks" / "reference"))
    from bench_hf_reference import SMALL_SHAPE

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SMALL_SHAPE)).eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, SMALL_SHAPE["vocab_size"], (BATCH, PROMPT_LEN), generator=generator)
    print(json.dumps({"ready": True, "torch": torch.__version__, "transformers": transformers.__version__,
                      "threads": torch.get_num_threads()}), flush=True)
    for _ in sys.stdin:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0, eos_token_id=None, use_cache=True)
            seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "new_tokens": int(out.shape[1] - PROMPT_LEN) * BATCH}), flush=True)


def routing_bytes(cfg, rows: int, tokens: int) -> int:
    """int32 expert ids of one rollout batch: [rows, tokens, layers, k]."""
    return 4 * rows * tokens * cfg.model.num_layers * cfg.model.num_experts_per_tok


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True, record="rollout_small")
    ap.add_argument("--hf-python", help="a Python with torch and transformers (the reference arm)")
    ap.add_argument("--calls", type=int, default=5, help="timed calls per arm after the warm-up call")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads of the reference")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_worker:
        return hf_worker(args.threads)

    harness.configure(cpu_devices=1)
    import jax
    import numpy as np

    from hybridmoe.recipe import load_config
    from hybridmoe.model.params import declare_params, init_params
    from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
    from hybridmoe.run.setup import build

    mesh = ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1"]
    jax_arms = {"jax": mesh, "jax-rt8": mesh + ["kernels.gmm.xla_impl=row_tiles", "kernels.gmm.xla_tile_rows=8"]}
    cfgs = {name: load_config("small", o) for name, o in jax_arms.items()}
    cfg = cfgs["jax"]
    setup = build(cfg)
    params = init_params(declare_params(cfg.model), jax.random.key(0))
    rng = np.random.default_rng(0)
    rows = left_pad_prompts(rng.integers(3, cfg.model.vocab_size, (BATCH, PROMPT_LEN)).tolist(), PROMPT_LEN, 0)
    generates = {name: make_generate(c, SamplingOptions(NEW_TOKENS, temperature=1.0, eos_id=-1))
                 for name, c in cfgs.items()}

    hf = None
    if args.hf_python:
        hf = subprocess.Popen([args.hf_python, __file__, "--hf-worker", "--threads", str(args.threads)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        hf_info = json.loads(hf.stdout.readline())

    jax_s, hf_s = {name: [] for name in generates}, []
    with setup.context():
        for call in range(1 + args.calls):
            for name, generate in generates.items():
                t0 = time.perf_counter()
                out = generate(params, *rows, jax.random.key(call))
                jax.block_until_ready(out)
                jax_s[name].append(time.perf_counter() - t0)
                assert int(np.asarray(out["lengths"]).sum()) == BATCH * NEW_TOKENS
            if hf is not None:
                hf.stdin.write("go\n")
                hf.stdin.flush()
                reply = json.loads(hf.stdout.readline())
                assert reply["new_tokens"] == BATCH * NEW_TOKENS, reply
                hf_s.append(reply["seconds"])
            print(f"call {call}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in jax_s.items())
                  + (f", hf {hf_s[-1]:.3f} s" if hf_s else ""), file=sys.stderr)
    if hf is not None:
        hf.stdin.close()
        hf.wait()

    tokens = BATCH * NEW_TOKENS
    arms = {name: {"call_seconds": s, "tokens_per_s": tokens / float(np.mean(s[1:])), "first_call_seconds": s[0],
                   "overrides": jax_arms[name]} for name, s in jax_s.items()}
    if hf_s:
        arms["hf-torch"] = {"call_seconds": hf_s, "tokens_per_s": tokens / float(np.mean(hf_s[1:])),
                            "first_call_seconds": hf_s[0], **hf_info}
    big = load_config("qwen3.5-35b-a3b")
    record = {
        "script": "benchmarks/rollout.py",
        "shape": {"rows": BATCH, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "dtype": "float32",
                  "sampling": "temperature 1, no top-p / top-k, no EOS"},
        "config": json.loads(cfg.model_dump_json()),
        "arms": arms,
        "ratio_over_hf": ({name: arms[name]["tokens_per_s"] / arms["hf-torch"]["tokens_per_s"] for name in jax_s}
                          if hf_s else None),
        "routing_replay_ids_bytes": {
            "small_this_rollout": routing_bytes(cfg, BATCH, PROMPT_LEN + NEW_TOKENS),
            "qwen3.5-35b-a3b_per_1k_tokens": routing_bytes(big, 1, 1024),
            "layout": "int32 [rows, tokens, layers, k]",
        },
    }
    print(f"{'arm':10s} {'tokens/s':>10s} {'s/call':>8s}")
    for name, arm in arms.items():
        print(f"{name:10s} {arm['tokens_per_s']:10.1f} {np.mean(arm['call_seconds'][1:]):8.3f}")
    if hf_s:
        print("tokens/s over hf-torch: " + ", ".join(f"{n} {r:.2f}" for n, r in record["ratio_over_hf"].items()))
    harness.write(args.out, "rollout_small", **record)


if __name__ == "__main__":
    main()
