"""The MoE combine on this host's chip: a token's k output rows summed slot by slot against the
[T k, D] gather viewed as [T, k, D].

The combine reads each token's k rows of the grouped MLP's expert-ordered output at their places
(`inverse`, the sort order's inverse) and sums them in float32. Two ways, timed interleaved on the
same arrays (harness.interleaved, median of the rounds), forward and forward + backward (autodiff's
backward, and moe.gather_backward's gather):
  view_and_sum  y[inverse] as one [T k, D] gather, viewed as [T, k, D] and summed over the slots
                (the combine before moe_align.slot_sum)
  slot_sum      moe_align.slot_sum: one [T, D] gather per slot into a float32 running sum
                (the combine now; `_combine` with and without moe.gather_backward)
at the 397B cell's per-device shape (T 32,768 rows gathered over the context axis, k 10, D 4,096)
and the one-chip recipe's (T 8,192, k 8, D 2,048). With k not a multiple of the tile's rows the
TPU compiler copies the viewed rows into a padded layout; the record says what that costs here.
Each arm's output and gradient are compared with view_and_sum's (max relative differences recorded).

    python3 benchmarks/tpu_moe_combine.py [--rounds 10]     # on a TPU host (docs/tpu.md)

Writes benchmarks/records/tpu_moe_combine.json: device, commit, rounds, shapes -> {T, k, D, arms: arm ->
{fwd_ms (not for slot_sum_gather_backward: its forward is slot_sum's), fwd_bwd_ms, out_max_rel_diff,
grad_max_rel_diff}}.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

SHAPES = {"cell": (32768, 10, 4096), "one_chip": (8192, 8, 2048), "tiny": (64, 10, 128)}  # tiny: a CPU smoke run


def view_and_sum(y_MD, inverse_M, k: int):
    """The combine before slot_sum: the rows gathered at once, viewed as [T, k, D], summed."""
    import jax.numpy as jnp

    M, D = y_MD.shape
    return jnp.sum(y_MD[inverse_M].reshape(M // k, k, D).astype(jnp.float32), axis=1).astype(y_MD.dtype)


def arms(k: int) -> dict:
    """name -> (forward fn (y, order, inverse) -> [T, D], its forward + backward fn)."""
    import functools

    import jax

    from hybridmoe.model import moe

    def with_backward(fn):
        def both(y, order, inverse, g):
            out, vjp = jax.vjp(lambda y: fn(y, order, inverse), y)
            return out, vjp(g)[0]
        return jax.jit(both)

    def old(y, order, inverse):
        return view_and_sum(y, inverse, k)

    def new(y, order, inverse, gather_backward=False):
        return moe._combine(y, order, inverse, k, gather_backward)

    new_gathers = functools.partial(new, gather_backward=True)
    return {"view_and_sum": (jax.jit(old), with_backward(old)),
            "slot_sum": (jax.jit(new), with_backward(new)),
            "slot_sum_gather_backward": (None, with_backward(new_gathers))}


def main(argv=None) -> int:
    p = harness.parser(__doc__, __file__, raw=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--shapes", default="cell,one_chip", help=f"comma-separated of {', '.join(SHAPES)}")
    args = p.parse_args(argv)
    harness.configure()
    import jax
    import jax.numpy as jnp
    import numpy as np

    results = {}
    for name in args.shapes.split(","):
        T, k, D = SHAPES[name]
        M = T * k
        fns = arms(k)
        key = jax.random.key(0)
        y = jax.random.normal(key, (M, D), jnp.float32).astype(jnp.bfloat16)
        g = jax.random.normal(jax.random.key(1), (T, D), jnp.float32).astype(jnp.bfloat16)
        order = jax.random.permutation(jax.random.key(2), M).astype(jnp.int32)
        inverse = jnp.argsort(order).astype(jnp.int32)
        reference = [np.asarray(a, np.float32) for a in fns["view_and_sum"][1](y, order, inverse, g)]
        calls, row = {}, {}
        for arm, (fwd, both) in fns.items():
            out = [np.asarray(a, np.float32) for a in both(y, order, inverse, g)]
            row[arm] = {f"{part}_max_rel_diff": float(np.abs(a - r).max() / np.abs(r).max())
                        for part, a, r in zip(("out", "grad"), out, reference)}
            if fwd is not None:
                calls[f"{arm}/fwd"] = (lambda f=fwd: f(y, order, inverse))
            calls[f"{arm}/fwd_bwd"] = (lambda f=both: f(y, order, inverse, g))
        for call in calls.values():  # compiled before the rounds
            jax.block_until_ready(call())
        times = harness.interleaved(calls, rounds=args.rounds)
        for call, t in times.items():
            arm, part = call.split("/")
            row[arm][f"{part}_ms"] = statistics.median(t["wall_s"]) * 1e3
        results[name] = {"T": T, "k": k, "D": D, "arms": row}
        print(f"{name} (T {T}, k {k}, D {D})")
        for arm, r in row.items():
            print(f"  {arm:26s} fwd {r.get('fwd_ms', float('nan')):8.3f} ms   fwd+bwd {r['fwd_bwd_ms']:8.3f} ms"
                  f"   max rel diff: out {r['out_max_rel_diff']:.1e}, gradient {r['grad_max_rel_diff']:.1e}")
        del y, g, order, inverse
    harness.write(args.out, "tpu_moe_combine", rounds=args.rounds, shapes=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
