"""Training-step throughput of the Hugging Face Qwen3.5-MoE reference (PyTorch, CPU) at the `small` shape.

One step = forward + next-token cross-entropy + backward + global-norm clip + AdamW step, float32,
batch 4 x 512 tokens, on `--threads` CPU threads (default: one per core this process may run on).

Two modes:
  --worker   the reference side of benchmarks/train_step.py: reads JSON requests on stdin
             ({"cmd": "info"}, {"cmd": "step", "tokens": [[...]]}, {"cmd": "quit"}) and answers one
             JSON line each; the tokens are the ones our step trains on.
  (default)  standalone: `--steps` timed steps on random tokens after one warm-up step; prints a
             JSON record (machine, date, commit, versions, resolved shape, per-step times) to
             stdout, or writes it to --out. Not the pinned, interleaved comparison: use
             benchmarks/train_step.py for that.

On CPU the reference runs its pure-PyTorch fallbacks for the Gated DeltaNet: the chunked delta rule
(torch_chunk_gated_delta_rule) and the causal conv1d, because flash-linear-attention (fla) and
causal_conv1d kernels are CUDA-only; the record says which were found.

Needs torch and transformers (never dependencies of the package): the venv that
benchmarks/reference/setup.sh makes, REFVENV (by default /work/refvenv; benchmarks/reference/README.md):
  REFVENV/bin/python benchmarks/reference/bench_hf_reference.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.pinned import serve, thread_census  # noqa: E402  (standard library + numpy only)
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

# The project's `small` recipe (hybridmoe/config/recipes/small.yml), in Hugging Face field names.
SMALL_SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
}
BATCH, SEQ_LEN = 4, 512
# The project's default optimizer settings (train.*): AdamW lr 3e-3, b1 0.9, b2 0.95, no decay, clip 1.0.
LEARNING_RATE, BETAS, WEIGHT_DECAY, GRAD_CLIP = 3e-3, (0.9, 0.95), 0.0, 1.0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str | None:
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build_model(threads: int, attn_implementation: str | None = None, experts_implementation: str | None = None):
    """(model, optimizer) of the `small` shape, float32, in training mode, on `threads` torch threads."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(**SMALL_SHAPE)
    model = Qwen3_5MoeForCausalLM(config)
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    if experts_implementation:
        model.set_experts_implementation(experts_implementation)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return model, optimizer


def train_step(model, optimizer, tokens: torch.Tensor) -> float:
    """One training step on int64 tokens [B, T]; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    # labels = input_ids: the model shifts them itself (next-token loss over T-1 positions).
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return loss.item()


def info(model, threads: int) -> dict:
    return {"versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "threads_asked": threads, "affinity": sorted(os.sched_getaffinity(0)), "thread_census": thread_census(),
            "model_class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
            "shape": {**SMALL_SHAPE, "batch_size": BATCH, "seq_len": SEQ_LEN, "dtype": "float32"},
            "optimizer": {"name": "torch.optim.AdamW", "lr": LEARNING_RATE, "betas": list(BETAS),
                          "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP},
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "gdn_kernels": {
                "flash_linear_attention_installed": importlib.util.find_spec("fla") is not None,
                "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
                "note": "without fla / causal_conv1d (CUDA-only) the GDN runs transformers' pure-PyTorch "
                        "fallbacks: torch_chunk_gated_delta_rule (chunk 64) and F.conv1d"}}


def worker(model, optimizer, threads: int) -> None:
    def step(req):
        tokens = torch.tensor(req["tokens"], dtype=torch.int64)
        c0, t0 = time.process_time(), time.perf_counter()
        loss = train_step(model, optimizer, tokens)
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "loss": loss,
                "token_sum": int(tokens.sum()), "shape": list(tokens.shape)}

    serve({"info": lambda req: info(model, threads), "step": step})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="serve benchmarks/train_step.py on stdin/stdout")
    parser.add_argument("--out", help="write the JSON record here instead of stdout")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--steps", type=int, default=4, help="timed steps after the warm-up step")
    parser.add_argument("--experts-implementation", default=None,
                        help="transformers experts implementation (default: its own choice, grouped_mm when available)")
    parser.add_argument("--attn-implementation", default=None, help="default: transformers' choice (sdpa)")
    args = parser.parse_args()

    model, optimizer = build_model(args.threads, args.attn_implementation, args.experts_implementation)
    if args.worker:
        worker(model, optimizer, args.threads)
        return
    generator = torch.Generator().manual_seed(0)
    step_seconds, losses = [], []
    for step in range(1 + args.steps):
        tokens = torch.randint(0, SMALL_SHAPE["vocab_size"], (BATCH, SEQ_LEN), generator=generator)
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, tokens))
        step_seconds.append(time.perf_counter() - start)
        print(f"step {step}: {step_seconds[-1]:.3f} s, loss {losses[-1]:.4f}", file=sys.stderr)

    timed = step_seconds[1:]
    mean_s = sum(timed) / len(timed)
    record = {
        "benchmark": "hf_reference_train_step",
        "script": "benchmarks/reference/bench_hf_reference.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "platform": platform.platform()},
        **info(model, args.threads),
        "warmup_steps": 1,
        "step_seconds": step_seconds,
        "losses": losses,
        "mean_step_seconds": mean_s,
        "tokens_per_step": BATCH * SEQ_LEN,
        "tokens_per_s": BATCH * SEQ_LEN / mean_s,
    }
    text = json.dumps(record, indent=2) + "\n"
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, args.out)
    else:
        sys.stdout.write(text)
    print(f"HF reference train step: {record['tokens_per_s']:.1f} tokens/s "
          f"({mean_s:.3f} s/step, {record['torch_threads']} threads)", file=sys.stderr)


if __name__ == "__main__":
    main()
