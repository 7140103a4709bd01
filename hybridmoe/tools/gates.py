"""The numerics gates (design/RL.md): a candidate's GRPO steps against a reference pair.

The same `steps` GRPO updates run three times from the same initial policy on the same batches:
the reference config twice (how far identical code lands apart) and the candidate (the reference
plus overrides) once. A batch is `rl.prompts_per_step * rl.group_size` random token rows of
`rl.sequence_len` tokens whose last `rl.max_new_tokens` are the completion, with random
advantages (every token carries gradient) and every sample kept; the old log-probs are the arm's
own log-probs of the batch before the update (what an exact sampler would report). Everything is
a pure function of (train.seed, step).

Gates on step 0 (steps 1.. are reported, not gated):
  V1      kept_frac equal (every sample kept)
  V2      loss, relative difference               <= 1e-5 (our choice; RL.md names no value)
  N1      mean token log-prob, absolute difference <= 5e-5
  N1-last the same over the last micro-batch       <= 5e-5
  N2      entropy, relative difference            <= 1e-4
  N3      grad_norm, relative difference          <= 2e-3
Each value is the candidate against the first reference run, shown beside the reference pair's
own difference.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.parallel.host import fetch_global, put_global
from hybridmoe.rl.grpo import build_update_batch, jit_grpo_step, rl_optimizer, sequence_logprobs, update_batch_shardings
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


def run_arm(cfg: Config, steps: int) -> list[dict]:
    """The arm's per-step metrics over `steps` GRPO updates on the gate batches."""
    setup = build(cfg)
    optimizer = rl_optimizer(cfg)
    state = init_state(dataclasses.replace(setup, optimizer=optimizer), jax.random.key(cfg.train.seed))
    step_fn = jit_grpo_step(setup, optimizer, with_reference=False)
    rows_sh = setup.batch_sharding(0)

    with setup.context():
        logprobs = jax.jit(lambda p, t, s, q: sequence_logprobs(p, cfg, t, s, q)[0])
        out = []
        for step in range(steps):
            rollout, adv_B = random_rollout(cfg, step)
            rows = put_global({k: rollout[k] for k in ("tokens", "segment_ids", "positions")}, rows_sh)
            logp_BT = np.asarray(fetch_global(logprobs(state["params"], rows["tokens"], rows["segment_ids"],
                                                       rows["positions"])))
            P = cfg.rl.max_prompt_len
            rollout["logprobs"] = logp_BT[:, P - 1:]
            B = adv_B.shape[0]
            batch = build_update_batch(cfg, rollout, adv_B, np.ones((B,), bool))
            last = batch["mask"][-1]
            logp_last = float((logp_BT[-last.shape[0]:, :] * last).sum() / last.sum())
            batch = put_global(batch, update_batch_shardings(setup))
            state, m = step_fn(state, None, batch)
            m = {k: float(v) for k, v in fetch_global(m).items()}
            m["kept_frac"] = m["kept_tokens"] / float(batch_tokens(cfg))
            m["logp_mean_last"] = logp_last
            out.append(m)
    return out


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


def format_gates(rows: list[dict], reference: list[dict], candidate: list[dict]) -> str:
    lines = [f"{'gate':<8} {'what':<42} {'reference':>14} {'candidate':>14} {'value':>10} {'ref pair':>10} "
             f"{'tolerance':>10}  result"]
    for r in rows:
        lines.append(f"{r['gate']:<8} {r['what']:<42} {r['reference']:>14.8g} {r['candidate']:>14.8g} "
                     f"{r['value']:>10.3g} {r['reference_pair']:>10.3g} {r['tolerance']:>10.3g}  "
                     f"{'PASS' if r['passed'] else 'FAIL'}")
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
    replicate = run_arm(reference_cfg, steps)
    candidate = run_arm(candidate_cfg, steps)
    rows = evaluate(reference, replicate, candidate)
    return {"gates": rows, "passed": all(r["passed"] for r in rows), "reference": reference,
            "replicate": replicate, "candidate": candidate}
