"""Context-parallel attention at the `small` recipe on 8 simulated CPU devices: the causal balance
of load balancing, and the program and step time of each key off and on.

Arms (remat.policy=custom, empty save list, in every arm so that only the key differs), for
context 2 and context 4 (fsdp absorbs the rest of the 8 devices):
  cpP            context parallelism, natural order
  cpP-lb         + attention.cp_load_balance
  cpP-lb-hoist   + attention.cp_load_balance_hoist_ids
Every arm is compiled first, then the arms take turns step by step (hybridmoe.tools.bench), so the
step-time ratios are measured interleaved in one run. Program facts come from each arm's lowered
and compiled training step. The balance figures count, per context rank, the (query, key) score
entries the causal and segment mask leaves, for the recipe's packed synthetic batch and for one
document per row, in natural and in load-balanced order.

  .venv/bin/python -m benchmarks.cp_attention [--rounds 4]
Prints tables and writes benchmarks/records/cp_attention.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8, cpu_only=True)
import numpy as np  # noqa: E402

from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.data.synthetic import synthetic_batch  # noqa: E402
from hybridmoe.parallel.context import load_balanced_token_index, unmasked_scores_per_rank  # noqa: E402
from hybridmoe.tools.bench import format_table, run_bench  # noqa: E402

RECIPE = "small"
COMMON = ["mesh.cpu_devices=8", "mesh.data=1", "mesh.fsdp=-1", "remat.policy=custom"]
CONTEXTS = (2, 4)


def arms() -> list[tuple[str, list[str]]]:
    out = []
    for P in CONTEXTS:
        cp = [f"mesh.context={P}"]
        lb = cp + ["attention.cp_load_balance=true"]
        out += [(f"cp{P}", cp), (f"cp{P}-lb", lb), (f"cp{P}-lb-hoist", lb + ["attention.cp_load_balance_hoist_ids=true"])]
    return out


def balance() -> dict:
    cfg = load_config(RECIPE, COMMON)
    t = cfg.train
    packed = synthetic_batch(t.seed, 0, 1, t.batch_size, t.seq_len, cfg.model.vocab_size)
    rows = {"packed synthetic batch": (np.asarray(packed["positions"][0]), np.asarray(packed["segment_ids"][0])),
            "one document per row": (np.broadcast_to(np.arange(t.seq_len), (t.batch_size, t.seq_len)),
                                     np.ones((t.batch_size, t.seq_len), np.int32))}
    out = {}
    for what, (pos, seg) in rows.items():
        for P in CONTEXTS:
            order = load_balanced_token_index(t.seq_len, P)
            natural = unmasked_scores_per_rank(pos, seg, P).tolist()
            balanced = unmasked_scores_per_rank(pos[:, order], seg[:, order], P).tolist()
            spread = lambda c: (max(c) - min(c)) / (sum(c) / len(c))  # noqa: E731
            out[f"{what}, context {P}"] = {"natural": natural, "load_balanced": balanced,
                                           "spread_natural": spread(natural), "spread_load_balanced": spread(balanced)}
    return out


def backward_loop(program: dict) -> str:
    """The lowered loop with the most collectives per iteration: the backward layer scan (replay +
    transposes; the micro-batch scan holds what is hoisted out of the layer scans)."""
    per_loop = program["lowered_collectives_per_loop_iteration"]
    return max(per_loop, key=lambda loop: sum(per_loop[loop].values()))


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    bal = balance()
    print(f"{'unmasked score entries per rank':<44} {'natural':<36} load-balanced")
    for k, v in bal.items():
        print(f"{k:<44} {str(v['natural']):<36} {v['load_balanced']}")
    results = run_bench(RECIPE, COMMON, arms(), args.rounds)
    print(format_table(results))
    # The recipe's 4 layers are one block: XLA removes the one-trip layer loops when it compiles, so
    # the compiled collectives are the whole step's; the lowered program still has the loops.
    print(f"{'arm':<14} {'compiled collectives (whole step)':<80} lowered int32 permutes / bwd iteration")
    for name, a in results.items():
        prog = a["program"]
        ints = prog["lowered_int32_permutes_per_loop_iteration"].get(backward_loop(prog), {})
        print(f"{name:<14} {str(prog['compiled_collectives']):<80} {ints}")
    harness.write(args.out, "cp_attention", recipe=RECIPE, common_overrides=COMMON, rounds=args.rounds, balance=bal,
                  arms=results)


if __name__ == "__main__":
    main()
