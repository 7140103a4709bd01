"""Long sequences in bfloat16: how far the context-parallel trainer and the sampler land from the
one-device trainer.

    nice -n 5 .venv/bin/python benchmarks/bf16_gaps.py [--tokens 4096] [--warmup-steps 100] [--grpo-steps 3]

Part 1, the context-parallel log-prob gap: the `tiny` model (3 Gated DeltaNet + 1 attention layer,
8 experts top-2; model.max_seq_len raised to the sequence) on 2 packed rows of --tokens tokens,
per-token log-probs of every next token inside a document (rl/grpo.sequence_logprobs, T = 1) with
the sequence split over mesh.context=4 (8 simulated CPU devices: data 2 x context 4) against one
device without a mesh. Row 0 is one document (the GDN state chain crosses every shard edge); row 1
is packed with documents that start exactly on a shard edge and documents that cross one. Arms:
float32; bfloat16 compute (model.compute_dtype, float32 weights); bfloat16 with the cross-rank
state chain rounded to bfloat16 at the collective (the bug reported by another project: the
broken variant tests/test_gdn_context_parallel.py catches). The figures: mean and max
|logp_cp - logp_1|, the mean k3 estimate of KL(one device || cp), and how many (token, layer)
routings picked other experts (a flip moves that token's log-prob by far more than rounding).

Part 2, the GDN layer alone (its cross-rank state not hidden under the rest of the model's
rounding): the output on 4 ranks against one device, the same three arms.

Part 3, the sampler/trainer gap on the demo model: `recipe=demo` (rl.warmup_steps supervised
warm-up steps on solved examples, then GRPO), float32 and bfloat16 compute, and the trainer's own
sampler_gap_mean / sampler_gap_max (mean and max |log pi_train - log pi_sampler| over completion
tokens, T = 1) of each GRPO step.

Writes benchmarks/records/bf16_gaps.json (machine, date, commit, versions, resolved configs): parts
1 and 2 as soon as they are measured (complete: false), everything at the end (complete: true).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: this checkout's packages
from benchmarks import harness  # noqa: E402

harness.configure(cpu_devices=8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe.kernels.gdn import context_parallel as cp  # noqa: E402
from hybridmoe.model.forward import decoder_hidden  # noqa: E402
from hybridmoe.model.gdn import gdn_layer  # noqa: E402
from hybridmoe.model.params import declare_params, init_params  # noqa: E402
from hybridmoe.recipe import load_config  # noqa: E402
from hybridmoe.rl.grpo import sequence_logprobs  # noqa: E402
from hybridmoe.rl.loop import run_rl  # noqa: E402
from hybridmoe.run.setup import build  # noqa: E402

RANKS = 4


def packed_rows(tokens: int, vocab: int, seed: int = 0) -> dict:
    """Row 0 one document; row 1 documents starting at 0, 0.07 T, T/4 (a shard edge), ~0.62 T (so
    the third crosses the T/2 edge), ~0.93 T (the fourth crosses 3T/4)."""
    rng = np.random.default_rng(seed)
    shard = tokens // RANKS
    starts = [0, int(0.07 * tokens), shard, int(0.616 * tokens), int(0.933 * tokens)]
    seg = np.ones((2, tokens), np.int32)
    pos = np.tile(np.arange(tokens, dtype=np.int32), (2, 1))
    for i, s in enumerate(starts):
        seg[1, s:] = i + 1
        pos[1, s:] = np.arange(tokens - s)
    return {"tokens": rng.integers(3, vocab, size=(2, tokens)).astype(np.int32), "segment_ids": seg,
            "positions": pos, "doc_starts_row1": starts, "shard_edges": [shard * r for r in range(1, RANKS)]}


def _bf16_chain(a_BHKK, b_BHKV, axis_name, *, reverse=False):
    """The broken variant: the cross-rank prefix's payload (M_r and S_ext_r) gathered in bfloat16."""
    r = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    out = _REAL_ALL_GATHER(r(a_BHKK).astype(jnp.float32), r(b_BHKV).astype(jnp.float32), axis_name, reverse=reverse)
    return r(out).astype(jnp.float32)


_REAL_ALL_GATHER = cp.exclusive_prefix_all_gather


def logprob_gap(logp_1, logp_cp, routing_1, routing_cp, seg) -> dict:
    """The gap between one device's next-token log-probs [B, T - 1] and the context-parallel ones
    over the targets inside a document: mean and max |difference| (and each row's max), the mean k3
    estimate of KL(one device || cp), and the (token, layer) routings [B, T, L, k] that picked other
    experts."""
    logp_1, logp_cp = np.asarray(logp_1, np.float64), np.asarray(logp_cp, np.float64)
    flipped = np.any(np.sort(np.asarray(routing_1), -1) != np.sort(np.asarray(routing_cp), -1), axis=-1)  # [B, T, L]
    inside = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)  # targets inside a document
    d = (logp_1 - logp_cp)[inside]
    per_row = [float(np.abs(logp_1 - logp_cp)[r][inside[r]].max()) for r in range(2)]
    return {"targets": int(inside.sum()), "gap_mean": float(np.abs(d).mean()), "gap_max": float(np.abs(d).max()),
            "gap_max_row0_one_document": per_row[0], "gap_max_row1_packed": per_row[1],
            "kl_k3_mean": float(np.mean(np.exp(-d) + d - 1.0)), "logp_mean": float(logp_1[inside].mean()),
            "routing_flips": int(flipped.sum()), "tokens_with_a_flip": int(flipped.any(-1).sum()),
            "routings": int(flipped.size)}


def output_gap(y_1, y_cp) -> dict:
    """The context-parallel output against one device's: relative L2 and max |difference| / max |output|."""
    return {"rel_l2": float(np.linalg.norm(y_cp - y_1) / np.linalg.norm(y_1)),
            "rel_max": float(np.abs(y_cp - y_1).max() / np.abs(y_1).max())}


def grpo_gap(history: list[dict]) -> dict:
    """The GRPO steps' (phase 1) sampler gaps: each step's figures, the mean of the means, the max of the maxes."""
    grpo = [h for h in history if h["phase"] == 1]
    return {"steps": [{k: h[k] for k in ("step", "sampler_gap_mean", "sampler_gap_max", "reward_mean", "kl",
                                         "entropy")} for h in grpo],
            "sampler_gap_mean": float(np.mean([h["sampler_gap_mean"] for h in grpo])),
            "sampler_gap_max": float(np.max([h["sampler_gap_max"] for h in grpo]))}


def context_parallel_gap(tokens: int, dtype: str, bf16_chain: bool = False) -> dict:
    base = ["gdn.chunk_size=64", f"model.max_seq_len={tokens}", f"train.seq_len={tokens}",
            f"model.compute_dtype={dtype}", "train.batch_size=2"]
    one = load_config("tiny", base)
    many = load_config("tiny", [*base, f"mesh.context={RANKS}", "mesh.fsdp=1", "mesh.data=-1"])
    rows = packed_rows(tokens, one.model.vocab_size)
    batch = {k: jnp.asarray(rows[k]) for k in ("tokens", "segment_ids", "positions")}
    params = init_params(declare_params(one.model), jax.random.key(0))

    def logp_fn(cfg):  # the trainer's log-probs, and (another forward) the experts each token went to
        return jax.jit(lambda p, t, s, q: (sequence_logprobs(p, cfg, t, s, q)[0],
                                           decoder_hidden(p, cfg, t, s, q, with_routing=True)[1]))

    t0 = time.perf_counter()
    logp_1, routing_1 = logp_fn(one)(params, batch["tokens"], batch["segment_ids"], batch["positions"])
    setup = build(many)
    if bf16_chain:
        cp.exclusive_prefix_all_gather = _bf16_chain
    try:
        with setup.context():
            sh = setup.batch_sharding(0)
            b = jax.device_put(batch, {k: sh for k in batch})
            logp_cp, routing_cp = logp_fn(many)(jax.device_put(params, setup.param_shardings), b["tokens"],
                                                b["segment_ids"], b["positions"])
    finally:
        cp.exclusive_prefix_all_gather = _REAL_ALL_GATHER
    return {"dtype": dtype, "cross_rank_chain": "bfloat16 (broken variant)" if bf16_chain else "float32",
            **logprob_gap(logp_1, logp_cp, routing_1, routing_cp, rows["segment_ids"]),
            "seconds": time.perf_counter() - t0,
            "config": {"one_device": json.loads(one.model_dump_json()), "context": json.loads(many.model_dump_json())}}


def layer_chain_gap(tokens: int, dtype: str, bf16_chain: bool = False) -> dict:
    """One GDN layer alone (the tiny model's first, its initial gates: A in [1, 16], dt in [1e-3, 0.1],
    so some heads remember ~1000 tokens, across a shard), its output on 4 ranks against one device
    on the same packed rows: relative L2 and max |difference| / max |output|. Here the chain's own
    rounding is not hidden under the rest of the model's."""
    cfg = load_config("tiny", [f"model.compute_dtype={dtype}", f"model.max_seq_len={tokens}"])
    m = cfg.model
    p = jax.tree.map(lambda a: a[0], init_params(declare_params(m), jax.random.key(0))["blocks"][0]["mixer"])
    rows = packed_rows(tokens, m.vocab_size)
    seg = jnp.asarray(rows["segment_ids"])
    x = jax.random.normal(jax.random.key(1), (2, tokens, m.d_model), jnp.float32).astype(dtype)
    fn = jax.jit(lambda p, x, seg: gdn_layer(p, x, seg, m, chunk_size=64))
    y_1 = np.asarray(fn(p, x, seg), np.float64)
    many = load_config("tiny", [f"model.compute_dtype={dtype}", f"model.max_seq_len={tokens}", f"train.seq_len={tokens}",
                                f"mesh.context={RANKS}", "mesh.fsdp=1", "mesh.data=-1", "gdn.chunk_size=64"])
    setup = build(many)
    if bf16_chain:
        cp.exclusive_prefix_all_gather = _bf16_chain
    try:
        with setup.context():
            y_cp = np.asarray(jax.jit(lambda p, x, seg: gdn_layer(p, x, seg, m, chunk_size=64))(p, x, seg), np.float64)
    finally:
        cp.exclusive_prefix_all_gather = _REAL_ALL_GATHER
    return {"dtype": dtype, "cross_rank_chain": "bfloat16 (broken variant)" if bf16_chain else "float32",
            **output_gap(y_1, y_cp)}


def sampler_gap(dtype: str, warmup_steps: int, grpo_steps: int) -> dict:
    cfg = load_config("demo", [f"model.compute_dtype={dtype}", f"rl.warmup_steps={warmup_steps}",
                               f"rl.steps={grpo_steps}", "rl.checkpoint_every=0"])
    t0 = time.perf_counter()
    history = run_rl(cfg, None, progress=False)
    return {"dtype": dtype, "warmup_steps": warmup_steps, **grpo_gap(history),
            "seconds": time.perf_counter() - t0, "config": json.loads(cfg.model_dump_json())}


def main() -> None:
    ap = harness.parser(__doc__, __file__, raw=True)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per packed row (a multiple of 4 x 64)")
    ap.add_argument("--warmup-steps", type=int, default=100, help="the demo's supervised warm-up before GRPO")
    ap.add_argument("--grpo-steps", type=int, default=3, help="GRPO steps whose sampler gap is recorded")
    args = ap.parse_args()
    if args.tokens % (RANKS * 64):
        raise SystemExit(f"--tokens {args.tokens}: a multiple of {RANKS * 64} (4 ranks x whole chunks of 64)")

    cp_arms = [context_parallel_gap(args.tokens, "float32"), context_parallel_gap(args.tokens, "bfloat16"),
               context_parallel_gap(args.tokens, "bfloat16", bf16_chain=True)]
    print(f"log-prob gap, mesh.context={RANKS} vs one device, 2 rows x {args.tokens} tokens ({cp_arms[0]['targets']} "
          "targets)")
    print(f"{'compute':<10} {'cross-rank chain':<28} {'mean':>10} {'max':>10} {'max row 0':>10} {'max row 1':>10} "
          f"{'KL k3':>10} {'routing flips':>14}")
    for a in cp_arms:
        print(f"{a['dtype']:<10} {a['cross_rank_chain']:<28} {a['gap_mean']:>10.3g} {a['gap_max']:>10.3g} "
              f"{a['gap_max_row0_one_document']:>10.3g} {a['gap_max_row1_packed']:>10.3g} {a['kl_k3_mean']:>10.3g} "
              f"{a['routing_flips']:>6} / {a['routings']}")

    layer_arms = [layer_chain_gap(args.tokens, "float32"), layer_chain_gap(args.tokens, "bfloat16"),
                  layer_chain_gap(args.tokens, "bfloat16", bf16_chain=True)]
    print(f"\nthe GDN layer alone, mesh.context={RANKS} vs one device (output relative L2 / max)")
    for a in layer_arms:
        print(f"{a['dtype']:<10} {a['cross_rank_chain']:<28} {a['rel_l2']:>10.3g} {a['rel_max']:>10.3g}")

    rows = packed_rows(args.tokens, 256)
    common = dict(tokens=args.tokens, ranks=RANKS, doc_starts_row1=rows["doc_starts_row1"], shard_edges=rows["shard_edges"],
                  context_parallel=cp_arms, gdn_layer=layer_arms, command=" ".join(["benchmarks/bf16_gaps.py", *sys.argv[1:]]))
    # Parts 1 and 2 written now (the demo runs of part 3 take longest): a stopped run keeps them.
    harness.write(args.out, "bf16_gaps", **common, sampler=None, complete=False)

    sampler_arms = [sampler_gap(d, args.warmup_steps, args.grpo_steps) for d in ("float32", "bfloat16")]
    print(f"\nsampler/trainer gap, recipe=demo after {args.warmup_steps} warm-up steps, {args.grpo_steps} GRPO steps")
    print(f"{'compute':<10} {'sampler_gap_mean':>17} {'sampler_gap_max':>16}   per step (mean / max)")
    for a in sampler_arms:
        steps = "  ".join(f"{s['sampler_gap_mean']:.3g} / {s['sampler_gap_max']:.3g}" for s in a["steps"])
        print(f"{a['dtype']:<10} {a['sampler_gap_mean']:>17.3g} {a['sampler_gap_max']:>16.3g}   {steps}")

    harness.write(args.out, "bf16_gaps", **common, sampler=sampler_arms, complete=True)


if __name__ == "__main__":
    main()
