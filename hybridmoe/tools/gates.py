"""The numerics gates (docs/rl.md, "the numerics gates"): a candidate's GRPO steps against a reference pair.

The same `steps` GRPO updates run three times from the same initial policy on the same batches:
the reference config twice (how far identical code lands apart) and the candidate (the reference
plus overrides) once. A batch is `rl.prompts_per_step * rl.group_size` random token rows of
`rl.sequence_len` tokens whose last `rl.max_new_tokens` are the completion, with random
advantages (every token carries gradient) and every sample kept; the old log-probs are the arm's
own log-probs of the batch before the update (what an exact sampler would report). Everything is
a pure function of (train.seed, step).

Gates on step 0 (steps 1.. are reported, not gated):
  V1      kept_frac equal (every sample kept)
  V2      loss, relative difference               <= 1e-5 (our choice)
  N1      mean token log-prob, absolute difference <= 5e-5
  N1-last the same over the last micro-batch       <= 5e-5
  N2      entropy, relative difference            <= 1e-4
  N3      grad_norm, relative difference          <= 2e-3
Each value is the candidate against the first reference run, shown beside the reference pair's
own difference.

Reported beside the gates, not gated (measured for bfloat16 and context parallelism in
benchmarks/bf16_gaps.py):
  logp gap     per-token |logp_candidate - logp_reference| over the step-0 completion tokens, mean
               and max (a candidate mesh.context=4 against one device: the context-parallel gap)
  sampler gap  each arm's sampler_gap_mean / sampler_gap_max: mean and max |log pi_train -
               log pi_sampler| over the completions its own sampler draws (rl.temperature, top-p,
               top-k) from the arm's initial policy, as a GRPO step logs them
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.parallel.host import fetch_global, put_global
from hybridmoe.rl.grpo import build_update_batch, jit_grpo_step, rl_optimizer, sequence_logprobs, update_batch_shardings
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
from hybridmoe.run.setup import build, init_state


@dataclasses.dataclass(frozen=True)
class Gate:
    name: str
    metric: str
    measure: str          # "equal", "abs" or "rel"
    tolerance: float
    what: str


GATES = (
    Gate("V1", "kept_frac", "equal", 0.0, "kept_frac equal"),
    Gate("V2", "loss", "rel", 1e-5, "loss, relative difference"),
    Gate("N1", "logp_mean", "abs", 5e-5, "mean token log-prob, absolute difference"),
    Gate("N1-last", "logp_mean_last", "abs", 5e-5, "the same, last micro-batch"),
    Gate("N2", "entropy", "rel", 1e-4, "entropy, relative difference"),
    Gate("N3", "grad_norm", "rel", 2e-3, "grad_norm, relative difference"),
)


def _difference(gate: Gate, a: float, b: float) -> float:
    if gate.measure == "equal":
        return float(a != b)
    d = abs(a - b)
    return d if gate.measure == "abs" else d / max(abs(b), 1e-30)


def random_rollout(cfg: Config, step: int) -> tuple[dict, np.ndarray]:
    """(rollout rows as the sampler returns them, advantages) for this step: a pure function of
    (train.seed, step)."""
    r = cfg.rl
    rng = np.random.default_rng([cfg.train.seed, step, 7])
    B, T = r.rollouts_per_step, r.sequence_len
    tokens = rng.integers(1, cfg.model.vocab_size, size=(B, T)).astype(np.int32)
    rollout = {"tokens": tokens, "segment_ids": np.ones((B, T), np.int32),
               "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
               "lengths": np.full((B,), r.max_new_tokens, np.int32)}
    return rollout, rng.standard_normal(B).astype(np.float32)


def sampler_gap_prompts(cfg: Config) -> list[list[int]]:
    """The sampler gap's prompts: rl.rollouts_per_step random full-length prompts of tokens 1.. (0 pads),
    a pure function of train.seed."""
    r = cfg.rl
    rng = np.random.default_rng([cfg.train.seed, 11])
    return rng.integers(1, cfg.model.vocab_size, size=(r.rollouts_per_step, r.max_prompt_len)).tolist()


def sampler_gap(cfg: Config, params, logprobs) -> dict:
    """sampler_gap_mean / sampler_gap_max of completions the arm's sampler draws from `params`
    (random full-length prompts, every new-token slot sampled), against the trainer's log-probs."""
    r = cfg.rl
    rows = left_pad_prompts(sampler_gap_prompts(cfg), r.max_prompt_len, pad_id=0)
    opts = SamplingOptions(r.max_new_tokens, r.temperature, r.top_p, eos_id=-1, pad_id=0, top_k=r.top_k)
    out = fetch_global(make_generate(cfg, opts)(params, *rows, jax.random.key(cfg.train.seed + 11)))
    args = [out[k] for k in ("tokens", "segment_ids", "positions")] + ([out["routing"]] if cfg.moe.routing_replay else [])
    return sampler_gap_of(np.asarray(fetch_global(logprobs(params, *args))), np.asarray(out["logprobs"]),
                          r.max_prompt_len)


def completion_logprobs(logp_BT: np.ndarray, prompt_len: int) -> np.ndarray:
    """The log-probs of the tokens after a prompt of `prompt_len` from a row's per-position log-probs
    (position t scores token t + 1)."""
    return logp_BT[:, prompt_len - 1:]


def sampler_gap_of(trainer_BT: np.ndarray, sampler_BN: np.ndarray, prompt_len: int) -> dict:
    """sampler_gap_mean / max: |the trainer's log-probs of the completions - the sampler's|."""
    gap = np.abs(completion_logprobs(trainer_BT, prompt_len) - sampler_BN)
    return {"sampler_gap_mean": float(gap.mean()), "sampler_gap_max": float(gap.max())}


def last_micro_batch_logp(logp_BT: np.ndarray, mask_last: np.ndarray) -> float:
    """The mean token log-prob over the last micro-batch (the batch's last rows) where it is masked in."""
    return float((logp_BT[-mask_last.shape[0]:, :] * mask_last).sum() / mask_last.sum())


def step_metrics(cfg: Config, metrics: dict, logp_last: float) -> dict:
    """A GRPO step's metrics as floats, with kept_frac (kept tokens over the batch's completion
    tokens) and logp_mean_last."""
    m = {k: float(v) for k, v in metrics.items()}
    m["kept_frac"] = m["kept_tokens"] / float(batch_tokens(cfg))
    m["logp_mean_last"] = logp_last
    return m


def run_arm(cfg: Config, steps: int, with_sampler_gap: bool = True) -> dict:
    """{"steps": the arm's per-step metrics over `steps` GRPO updates on the gate batches,
    "logp_tokens": step 0's per-token log-probs of the completion tokens [B, N], "sampler_gap": its
    sampler_gap_mean / max (None without with_sampler_gap)}."""
    # The reference arm runs twice (the reference pair): the second reads the first's programs.
    setup = build(cfg)
    rl_setup = setup.kept("rl_setup", lambda: dataclasses.replace(setup, optimizer=rl_optimizer(cfg)))
    state = init_state(rl_setup, jax.random.key(cfg.train.seed))
    step_fn = setup.kept(("grpo_step", False), lambda: jit_grpo_step(setup, with_reference=False))
    rows_sh = setup.batch_sharding(0)

    with setup.context():
        logprobs = setup.kept("logprobs", lambda: jax.jit(
            lambda p, t, s, q, *routing: sequence_logprobs(p, cfg, t, s, q, *routing)[0]))
        gap = sampler_gap(cfg, state["params"], logprobs) if with_sampler_gap else None
        out, logp_tokens = [], None
        for step in range(steps):
            rollout, adv_B = random_rollout(cfg, step)
            rows = put_global({k: rollout[k] for k in ("tokens", "segment_ids", "positions")}, rows_sh)
            logp_BT = np.asarray(fetch_global(logprobs(state["params"], rows["tokens"], rows["segment_ids"],
                                                       rows["positions"])))
            P = cfg.rl.max_prompt_len
            rollout["logprobs"] = completion_logprobs(logp_BT, P)
            if step == 0:
                logp_tokens = rollout["logprobs"]
            B = adv_B.shape[0]
            batch = build_update_batch(cfg, rollout, adv_B, np.ones((B,), bool))
            logp_last = last_micro_batch_logp(logp_BT, batch["mask"][-1])
            batch = put_global(batch, update_batch_shardings(setup))
            state, m = step_fn(state, None, batch)
            out.append(step_metrics(cfg, fetch_global(m), logp_last))
    return {"steps": out, "logp_tokens": logp_tokens, "sampler_gap": gap}


def logp_gap(a: dict, b: dict) -> dict:
    """Mean and max per-token |logp_a - logp_b| of two arms' step-0 completion tokens (NaN when the
    candidate's batch has another shape: other rl.* lengths or counts)."""
    x, y = (np.asarray(arm["logp_tokens"], np.float64) for arm in (a, b))
    if x.shape != y.shape:
        return {"mean": float("nan"), "max": float("nan")}
    d = np.abs(x - y)
    return {"mean": float(d.mean()), "max": float(d.max())}


def batch_tokens(cfg: Config) -> int:
    return cfg.rl.rollouts_per_step * cfg.rl.max_new_tokens


def evaluate(reference: list[dict], replicate: list[dict], candidate: list[dict]) -> list[dict]:
    """One row per gate on step 0: value (candidate vs reference), the pair's own spread, PASS."""
    rows = []
    for g in GATES:
        ref, rep, cand = (run[0][g.metric] for run in (reference, replicate, candidate))
        value = _difference(g, cand, ref)
        rows.append({"gate": g.name, "what": g.what, "reference": ref, "candidate": cand, "value": value,
                     "reference_pair": _difference(g, rep, ref), "tolerance": g.tolerance,
                     "passed": value <= g.tolerance})
    return rows


def format_gates(rows: list[dict], reference: list[dict], candidate: list[dict], gaps: dict | None = None) -> str:
    lines = [f"{'gate':<8} {'what':<42} {'reference':>14} {'candidate':>14} {'value':>10} {'ref pair':>10} "
             f"{'tolerance':>10}  result"]
    for r in rows:
        lines.append(f"{r['gate']:<8} {r['what']:<42} {r['reference']:>14.8g} {r['candidate']:>14.8g} "
                     f"{r['value']:>10.3g} {r['reference_pair']:>10.3g} {r['tolerance']:>10.3g}  "
                     f"{'PASS' if r['passed'] else 'FAIL'}")
    if gaps is not None:
        lg, ref_pair, sg = gaps["logp_gap"], gaps["logp_gap_reference_pair"], gaps["sampler_gap"]
        lines.append("")
        lines.append("gaps (reported, not gated)")
        lines.append(f"  logp gap per token, candidate vs reference (step 0): mean {lg['mean']:.3g}  max {lg['max']:.3g}"
                     f"   (reference pair: mean {ref_pair['mean']:.3g}  max {ref_pair['max']:.3g})")
        lines.append("  sampler gap (sampler_gap_mean / max): "
                     + "  |  ".join(f"{arm} {sg[arm]['sampler_gap_mean']:.3g} / {sg[arm]['sampler_gap_max']:.3g}"
                                    for arm in ("reference", "candidate")))
    lines.append("")
    lines.append("steps (logged, not gated): step  loss  grad_norm  entropy  logp_mean  (reference | candidate)")
    for i, (a, b) in enumerate(zip(reference, candidate)):
        lines.append(f"  {i}  " + "  ".join(f"{a[k]:.8g} | {b[k]:.8g}" for k in ("loss", "grad_norm", "entropy",
                                                                              "logp_mean")))
    return "\n".join(lines)


def run_gates(reference_cfg: Config, candidate_cfg: Config, steps: int = 3) -> dict:
    """Reference twice, candidate once; the gate rows and every run's per-step metrics."""
    if steps < 1:
        raise ValueError("the gates need at least one step")
    reference = run_arm(reference_cfg, steps)
    replicate = run_arm(reference_cfg, steps, with_sampler_gap=False)  # the reference's sampler, again
    candidate = run_arm(candidate_cfg, steps)
    rows = evaluate(reference["steps"], replicate["steps"], candidate["steps"])
    gaps = {"logp_gap": logp_gap(candidate, reference), "logp_gap_reference_pair": logp_gap(replicate, reference),
            "sampler_gap": {"reference": reference["sampler_gap"], "candidate": candidate["sampler_gap"]}}
    return {"gates": rows, "passed": all(r["passed"] for r in rows), "gaps": gaps, "reference": reference["steps"],
            "replicate": replicate["steps"], "candidate": candidate["steps"]}
