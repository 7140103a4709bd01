"""The reference side of benchmarks/rollout.py: transformers' Qwen3.5-MoE `generate` at the `small` shape.

Reads JSON requests on stdin and answers one JSON line each ({"cmd": "info"}, {"cmd": "generate",
"prompts": [[...]] (Q x P token ids), "group_size": G, "new_tokens": N, "seed": s}, {"cmd": "quit"}).
`generate` samples G completions of each prompt (num_return_sequences=G: transformers repeats each
prompt G times and prefills the Q x G rows), exactly N new tokens (no EOS), temperature 1, no top-k
or top-p, with the model's cache (the attention layers' keys/values, the linear-attention layers'
conv and recurrent states), float32, on --threads CPU threads. On CPU its Gated DeltaNet runs the
pure-PyTorch fallbacks (flash-linear-attention and causal_conv1d are CUDA-only).

  REFVENV/bin/python benchmarks/reference/hf_generate_worker.py --threads 1

REFVENV: the reference venv benchmarks/reference/setup.sh makes (by default /work/refvenv).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hf_reference import SMALL_SHAPE  # noqa: E402
from benchmarks.pinned import serve, thread_census  # noqa: E402  (standard library + numpy only)
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SMALL_SHAPE)).eval()

    def generate(req):
        prompts = torch.tensor(req["prompts"], dtype=torch.long)
        torch.manual_seed(req["seed"])
        n = req["new_tokens"]
        with torch.inference_mode():
            c0, t0 = time.process_time(), time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n,
                                 num_return_sequences=req["group_size"], pad_token_id=0, eos_token_id=None,
                                 use_cache=True)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows, length = out.shape
        return {"wall_s": wall, "cpu_s": cpu, "rows": rows, "new_tokens": (length - prompts.shape[1]) * rows}

    def info(req):
        return {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
                "affinity": sorted(os.sched_getaffinity(0)), "thread_census": thread_census(),
                "model": "transformers.Qwen3_5MoeForCausalLM (random init, seed 0)", "shape": SMALL_SHAPE}

    serve({"info": info, "generate": generate})


if __name__ == "__main__":
    main()
