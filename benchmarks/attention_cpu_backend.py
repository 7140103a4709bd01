"""Which attention core `kernels.attention.backend=auto` runs on CPU: the cores' forward + backward at
the `small` recipe's attention shape, timed interleaved in one run.

Shape: the small recipe's batch (4 rows x 512 tokens, its packed synthetic documents: positions and
segment ids from hybridmoe.data.synthetic), 4 query heads over 2 kv heads of dim 64, float32. Arms:
  masked         xla.attention: the full masked core ([heads, T, T] scores);
  blocked        blocked.causal_attention_blocked: the masked core over 4 query blocks, each against
                 the keys up to its end;
  xla-bQ         ops.flash_attention, backend xla, blocks of Q queries x Q keys.
Each arm is compiled first (vjp: o and dq, dk, dv for a fixed cotangent), then the arms take turns,
`--reps` calls per turn, `--rounds` turns; the table gives each arm's median per-call time and its
ratio to blocked.

  .venv/bin/python -m benchmarks.attention_cpu_backend [--rounds 7 --reps 5]
Prints a table and writes benchmarks/records/attention_cpu_backend.json.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_only=True)
import jax  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.data.synthetic import synthetic_batch  # noqa: E402
from hybridmoe.kernels.attention import blocked, ops, xla  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402

RECIPE = "small"
FLASH_BLOCKS = (32, 64, 128, 256)


def arms(cfg):
    t, m = cfg.train, cfg.model
    batch = synthetic_batch(t.seed, 0, 1, t.batch_size, t.seq_len, m.vocab_size)
    pos, seg = jnp.asarray(batch["positions"][0]), jnp.asarray(batch["segment_ids"][0])
    ids = dict(q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=m.head_dim ** -0.5)
    cores = {"masked": functools.partial(xla.attention, **ids),
             "blocked": functools.partial(blocked.causal_attention_blocked, **ids)}
    for b in FLASH_BLOCKS:
        cores[f"xla-b{b}"] = functools.partial(ops.flash_attention, **ids, backend="xla", block_q=b, block_k=b)
    B, T, N, G, A = t.batch_size, t.seq_len, m.num_heads, m.num_kv_heads, m.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    inputs = (jax.random.normal(keys[0], (B, T, N, A)), jax.random.normal(keys[1], (B, T, G, A)),
              jax.random.normal(keys[2], (B, T, G, A)), jax.random.normal(keys[3], (B, T, N, A)))
    shape = {"batch": B, "tokens": T, "query_heads": N, "kv_heads": G, "head_dim": A, "dtype": "float32",
             "documents_per_row": [int(np.unique(np.asarray(s)[np.asarray(s) > 0]).size) for s in seg]}
    return cores, inputs, shape


def fwd_bwd(core):
    def go(q, k, v, do):
        o, vjp = jax.vjp(core, q, k, v)
        return (o, *vjp(do))

    return jax.jit(go)


def medians(times: dict) -> tuple[dict, dict]:
    """Each arm's median seconds per call over the rounds, and its ratio to the blocked arm's."""
    median = {name: float(np.median(t)) for name, t in times.items()}
    return median, {n: median[n] / median["blocked"] for n in median}


def agreement_with(outs: dict, ref_name: str = "masked") -> dict:
    """Per arm, the largest of its outputs' max |difference| from the reference arm's, relative to
    that output's max |value| in the reference."""
    ref = outs[ref_name]
    return {name: max(float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r))) for a, r in zip(out, ref))
            for name, out in outs.items()}


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(RECIPE, ["mesh.cpu_devices=0"])
    cores, inputs, shape = arms(cfg)
    fns = {name: fwd_bwd(core) for name, core in cores.items()}
    outs = {name: jax.block_until_ready(fn(*inputs)) for name, fn in fns.items()}
    # The arms compute the same thing: every one within float32 rounding of the masked core.
    agreement = agreement_with(outs)
    times = {name: t["wall_s"] for name, t in harness.interleaved(
        {name: functools.partial(fn, *inputs) for name, fn in fns.items()}, args.rounds, args.reps).items()}
    median, ratio_to_blocked = medians(times)
    print(f"{'arm':<10} {'median ms':>10} {'/ blocked':>10} {'max rel err vs masked':>22}")
    for name in fns:
        print(f"{name:<10} {median[name] * 1e3:>10.1f} {median[name] / median['blocked']:>10.3f} {agreement[name]:>22.1e}")
    harness.write(args.out, "attention_cpu_backend", recipe=RECIPE, shape=shape, rounds=args.rounds, reps=args.reps,
                  median_seconds=median, ratio_to_blocked=ratio_to_blocked,
                  seconds_per_round=times, max_rel_error_vs_masked=agreement)


if __name__ == "__main__":
    main()
