"""Flash attention on a GPU: the Triton kernels (kernels.attention.backend=pallas_gpu) against cuDNN
(jax.nn.dot_product_attention, implementation="cudnn") at Qwen3.5-35B-A3B's attention shape,
forward + backward, TFLOP/s. Needs an NVIDIA GPU (H100 / H200 class); it refuses to run elsewhere.

Shape: 16 query heads over 2 kv heads of dim 256 (the 35B recipe), bfloat16, one causal document
per row (cuDNN's causal mask; the flash kernels' positions 0..T-1 and one segment), --tokens per row
(default 4096, 8192, 16384) and --batch rows (default 1). Arms, compiled first, then timed in
turns (benchmarks/harness.py: interleaved, `--rounds` turns of `--reps` calls, medians):
  cudnn            jax.nn.dot_product_attention(..., is_causal=True, implementation="cudnn")
  pallas_gpu-QxK   ops.flash_attention backend pallas_gpu, blocks of Q queries x K keys
  xla              ops.flash_attention backend xla (blocked online softmax in XLA ops), blocks 256
TFLOP/s counts the causal attention's model FLOPs: forward 2 matmuls of B N T T A / 2 multiply-adds
(4 B N T^2 A / 2 FLOPs), backward 2.5 times the forward (its 5 matmuls), whatever an arm
recomputes. Every arm's output and gradients are checked against cuDNN's first (max error
relative to the max, printed and recorded).

  .venv/bin/python -m benchmarks.attention_gpu [--tokens 4096 8192 16384] [--rounds 5 --reps 10]
Prints a table and writes benchmarks/records/attention_gpu.json.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.kernels.attention import ops  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402

RECIPE = "qwen3.5-35b-a3b"
GPU_BLOCKS = ((64, 64), (128, 64), (64, 128), (128, 128))


def arms(scale: float, T: int):
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, T))

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")

    def flash(q, k, v, backend, block_q, block_k):
        B = q.shape[0]
        ids = jnp.broadcast_to(pos, (B, T))
        return ops.flash_attention(q, k, v, q_pos_BT=ids, kv_pos_BS=ids, scale=scale, backend=backend,
                                   block_q=block_q, block_k=block_k)

    out = {"cudnn": cudnn}
    for bq, bk in GPU_BLOCKS:
        out[f"pallas_gpu-{bq}x{bk}"] = functools.partial(flash, backend="pallas_gpu", block_q=bq, block_k=bk)
    out["xla"] = functools.partial(flash, backend="xla", block_q=256, block_k=256)
    return out


def fwd_bwd(core):
    def go(q, k, v, do):
        o, vjp = jax.vjp(core, q, k, v)
        return (o, *vjp(do))

    return jax.jit(go)


def model_flops(B, T, N, A) -> float:
    forward = 4 * B * N * T * T * A / 2
    return forward * 3.5


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit(f"benchmarks/attention_gpu.py needs an NVIDIA GPU; JAX's backend here is {jax.default_backend()}")
    m = load_config(RECIPE, ["mesh.cpu_devices=0"]).model
    N, G, A, B = m.num_heads, m.num_kv_heads, m.head_dim, args.batch
    results = {}
    for T in args.tokens:
        keys = jax.random.split(jax.random.key(T), 4)
        q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk, shape in
                       zip(keys, ((B, T, N, A), (B, T, G, A), (B, T, G, A), (B, T, N, A))))
        fns, outs, failed = {}, {}, {}
        for name, core in arms(A ** -0.5, T).items():
            try:
                fns[name] = fwd_bwd(core)
                outs[name] = jax.block_until_ready(fns[name](q, k, v, do))
            except Exception as e:  # a block that does not fit shared memory: recorded, not fatal
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                fns.pop(name, None)
        ref = outs.get("cudnn")
        agreement = {}
        if ref is not None:
            for name, out in outs.items():
                agreement[name] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))
                                            / jnp.max(jnp.abs(r.astype(jnp.float32)))) for a, r in zip(out, ref))
        calls = {name: (lambda fn=fn: [fn(q, k, v, do) for _ in range(args.reps)][-1]) for name, fn in fns.items()}
        times = {name: [t / args.reps for t in ts["wall_s"]]
                 for name, ts in harness.interleaved(calls, args.rounds).items()}
        flops = model_flops(B, T, N, A)
        median = {name: float(np.median(t)) for name, t in times.items()}
        print(f"tokens {T}: {'arm':<18} {'median ms':>10} {'TFLOP/s':>9} {'/ cudnn':>8} {'max rel err':>12}")
        for name in fns:
            ratio = median[name] / median["cudnn"] if "cudnn" in median else float("nan")
            print(f"{'':>13}{name:<18} {median[name] * 1e3:>10.2f} {flops / median[name] / 1e12:>9.1f} {ratio:>8.2f} "
                  f"{agreement.get(name, float('nan')):>12.1e}")
        for name, why in failed.items():
            print(f"{'':>13}{name:<18} failed: {why}")
        results[str(T)] = {"median_seconds": median, "seconds_per_round": times, "model_flops": flops,
                           "tflops": {n: flops / t / 1e12 for n, t in median.items()},
                           "max_rel_error_vs_cudnn": agreement, "failed": failed}
    harness.write(args.out, "attention_gpu", recipe=RECIPE,
                  shape={"batch": B, "query_heads": N, "kv_heads": G, "head_dim": A, "dtype": "bfloat16",
                         "mask": "causal, one document per row"},
                  device=str(jax.devices()[0].device_kind), rounds=args.rounds, reps=args.reps, by_tokens=results)


if __name__ == "__main__":
    main()
