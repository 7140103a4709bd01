"""The Hugging Face reference's side of benchmarks/step_anatomy.py: per-component forward + backward times.

Started by the benchmark with a Python that has torch and transformers; reads one request per
line on stdin and answers one JSON line on stdout:
  info   the versions, threads and which GDN kernels transformers found
  round  one timing of every component, [wall s, CPU s]: gdn, attention, moe, rmsnorm,
         embed_head_loss, optimizer (clip + AdamW), step (the whole training step, as
         benchmarks/reference/bench_hf_reference.py)
  peak   the best float32 square-matmul FLOP/s torch reaches here
  quit
The model is the `small` shape of bench_hf_reference.py (the same module, imported from beside this file).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402
from bench_hf_reference import BATCH, BETAS, GRAD_CLIP, LEARNING_RATE, SEQ_LEN, SMALL_SHAPE, WEIGHT_DECAY  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_both(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    threads = (int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv
               else len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(**SMALL_SHAPE)
    model = Qwen3_5MoeForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY)
    layers = model.model.layers
    gdn_layer = next(layer for layer in layers if layer.block_type == "linear_attention")
    attn_layer = next(layer for layer in layers if layer.block_type == "full_attention")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ_LEN, config.hidden_size, generator=g)
    cot = torch.randn(BATCH, SEQ_LEN, config.hidden_size, generator=g)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ_LEN), generator=g)
    position_ids = torch.arange(SEQ_LEN).view(1, 1, -1).expand(3, BATCH, -1)
    rope = model.model.rotary_emb(x, position_ids)

    def fb(module_fn):
        def run():
            xi = x.clone().requires_grad_(True)
            y = module_fn(xi)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(cot)
        return run

    def head_loss():
        h = model.model.embed_tokens(tokens) + x
        logits = model.lm_head(h)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()

    def opt_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()

    components = {
        "gdn": fb(lambda xi: gdn_layer.linear_attn(hidden_states=xi, attention_mask=None)),
        "attention": fb(lambda xi: attn_layer.self_attn(hidden_states=xi, position_embeddings=rope, attention_mask=None)),
        "moe": fb(lambda xi: gdn_layer.mlp(xi)),
        "rmsnorm": fb(lambda xi: gdn_layer.input_layernorm(xi)),
        "embed_head_loss": head_loss,
        "step": step,
    }
    step()  # gradients exist for the optimizer component; warms the allocator
    for line in sys.stdin:
        what = line.strip()
        if what == "quit":
            break
        if what == "info":
            out = {"python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                   "interop_threads": torch.get_num_interop_threads(), "affinity": sorted(os.sched_getaffinity(0)),
                   "attn_implementation": model.config._attn_implementation,
                   "experts_implementation": getattr(model.config, "_experts_implementation", None),
                   "fla_installed": importlib.util.find_spec("fla") is not None,
                   "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None}
        elif what == "round":
            out = {name: timed_both(fn) for name, fn in components.items()}
            out["optimizer"] = timed_both(opt_step)
        elif what == "peak":
            best = 0.0
            for n in (512, 1024, 2048):
                a, b = torch.randn(n, n), torch.randn(n, n)
                a @ b
                for _ in range(5):
                    best = max(best, 2.0 * n ** 3 / timed(lambda: a @ b))  # noqa: B023
            out = {"flops": best}
        else:
            out = {"error": f"unknown request {what!r}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
