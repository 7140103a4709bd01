"""The RL run: a supervised warm-up on the task's solved examples, then GRPO steps.

Steps are counted globally: 0 .. rl.warmup_steps - 1 are warm-up steps (phase 0), the next
rl.steps are GRPO steps (phase 1). One GRPO step: P prompts of the task (a pure function of
(seed, step)), G completions each from the sampler, rewards, group advantages, one policy update.

Everything a step depends on is in the checkpoint or a pure function of the step: the train state
(policy, optimizer, step), the frozen reference policy when rl.beta > 0, the RNG key (meta) and the
data position (the step itself). So a killed run resumed from its last checkpoint replays the same
steps bit for bit. On an error inside the loop the last completed step is checkpointed before the
error propagates, and metrics.jsonl is flushed line by line, so nothing already done is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.recipe.validate import check_rl_requirements
from hybridmoe.model.params import abstract_params
from hybridmoe.parallel.host import fetch_global, put_global
from hybridmoe.rl.advantages import advantage_stats, group_advantages
from hybridmoe.rl.grpo import policy_updates, rl_optimizer, update_batch_shardings, update_rows
from hybridmoe.rl.memory_plan import UpdatePlan, plan_rollout, plan_updates
from hybridmoe.rl.reward_loading import load_rewards
from hybridmoe.rl.rewards import RewardFn, apply_reward_error_policy, score_completions
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts
from hybridmoe.data.arithmetic import PROMPT_STREAM, Task, solved_batch, task_from_config
from hybridmoe.data.prompts import PromptSetTask
from hybridmoe.data.sources import config_tokenizer
from hybridmoe.data.tokenizer import Tokenizer, load_tokenizer
from hybridmoe.run.hf_io import params_from_hf
from hybridmoe.run.memory_fit import Fit, memory_budget_bytes, with_count
from hybridmoe.run.metrics import plot_metrics
from hybridmoe.run.run_dir import RunError
from hybridmoe.run.session import open_session, start_config
from hybridmoe.run.setup import build, init_state, jit_train_step
from hybridmoe.run.step_plan import plan_train

log = logging.getLogger(__name__)

WARMUP, GRPO = 0, 1
PLOT_KEYS = ("reward_mean", "loss", "kl", "entropy", "completion_len_mean", "warmup_loss", "rollout_tokens_per_s",
             ("rollout_time_s", "old_logprobs_time_s", "update_time_s"))
PLOT_EVERY = 5
MAX_EMPTY_STEPS = 3  # GRPO steps in a row without a scored sample before the run stops
ROLLOUT_PASS_STREAM = 7  # folded into a round's key for its sampler passes after the first
@dataclasses.dataclass
class _Run:
    """What the step functions need, built once per run."""
    cfg: Config
    task: Task
    tokenizer: Tokenizer
    reward_fns: Sequence[tuple[RewardFn, float]]
    setup: object
    warmup_step: object
    grpo_step: object
    generate: object
    rl_init: object
    reference_init: object = None  # (the stand-in reference, the policy) -> the reference, in the stand-in's buffers
    old_logprobs: object = None
    old_logprobs_micro_batches: int | None = None
    empty_steps: int = 0  # GRPO steps in a row that scored no sample

    @property
    def total_steps(self) -> int:
        return self.cfg.rl.warmup_steps + self.cfg.rl.steps


def _encode_prompts(run: _Run, prompts: list[str]) -> tuple[list[list[int]], np.ndarray]:
    """Token ids per prompt ([BOS] prompt) and which prompts are skipped (too long, or text the
    tokenizer cannot encode); a skipped prompt is replaced by a one-token placeholder. One warning
    per step sums the skips up."""
    tok, P = run.tokenizer, run.cfg.rl.max_prompt_len
    ids_list, skipped = [], np.zeros(len(prompts), bool)
    too_long, unencodable = [], []
    for i, text in enumerate(prompts):
        try:
            ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)
        except ValueError as e:
            unencodable.append(f"{text[:40]!r}: {e}")
            ids = []
        if len(ids) > P:
            too_long.append(len(ids))
        if not 0 < len(ids) <= P:
            ids, skipped[i] = [tok.pad_id], True
        ids_list.append(ids)
    if too_long:
        log.warning("%d of %d prompts skipped: longer than rl.max_prompt_len=%d (the longest has %d tokens)",
                    len(too_long), len(prompts), P, max(too_long))
    if unencodable:
        log.warning("%d of %d prompts skipped: the tokenizer cannot encode them (first: %s)", len(unencodable),
                    len(prompts), unencodable[0])
    return ids_list, skipped


def _sample_groups(run: _Run, state, step: int, round_index: int, key) -> dict:
    """One sampling round: P prompts (a pure function of (seed, step, round)), G completions each,
    scored. Host arrays over the P * G rows."""
    cfg, r = run.cfg, run.cfg.rl
    stream = [cfg.train.seed, PROMPT_STREAM, step] + ([round_index] if round_index else [])
    examples = run.task.sample(np.random.default_rng(stream), r.prompts_per_step)
    if len(examples) != r.prompts_per_step:
        raise RunError(f"step {step}: task {run.task.name!r} gave {len(examples)} prompts; a GRPO step needs "
                       f"rl.prompts_per_step={r.prompts_per_step}")
    prompts = [e.prompt for e in examples]
    prompt_ids, prompt_skipped = _encode_prompts(run, prompts)
    G = r.group_size
    # The prompts go in rl.rollout_batches passes, one after another, each over its share of them
    # (the rows in flight that fit the device; pass i > 0 draws from a key of its own), replicated:
    # they need not split over the batch shards. The sampler prefills each prompt once and returns
    # its G completions in rows q * G .. q * G + G - 1.
    prompt_rows = left_pad_prompts(prompt_ids, r.max_prompt_len, run.tokenizer.pad_id)
    passes, replicated = r.fewest_rollout_batches, NamedSharding(run.setup.mesh, PartitionSpec())
    per_pass = r.prompts_per_step // passes
    parts = []
    for i in range(passes):
        rows = put_global(tuple(a[i * per_pass:(i + 1) * per_pass] for a in prompt_rows), replicated)
        pass_key = key if i == 0 else jax.random.fold_in(jax.random.fold_in(key, ROLLOUT_PASS_STREAM), i)
        parts.append(fetch_global(run.generate(state["params"], *rows, pass_key)))
    rollout = parts[0] if passes == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    # Rows of a skipped prompt were sampled from a placeholder: they are not scored at all.
    scored_rows = np.flatnonzero(~np.repeat(prompt_skipped, G))
    completions = [run.tokenizer.decode(rollout["completion"][i]) for i in scored_rows]
    scored_rewards, reward_skipped, counts = score_completions(
        run.reward_fns, [prompts[i // G] for i in scored_rows], completions,
        [getattr(examples[i // G], "fields", {}) for i in scored_rows])
    rewards = np.zeros(len(prompts) * G, np.float32)
    skipped = np.ones(len(prompts) * G, bool)
    rewards[scored_rows], skipped[scored_rows] = scored_rewards, reward_skipped
    skipped = apply_reward_error_policy(r.reward_error, skipped, np.repeat(prompt_skipped, G), G)
    return {**{k: np.asarray(v) for k, v in rollout.items()}, "rewards": rewards, "skipped": skipped,
            "prompt_skipped": prompt_skipped, "new_tokens": float(np.asarray(rollout["lengths"]).sum()),
            "rewards_skipped": float(counts["skipped"]),
            "reward_errors": float(sum(v for k, v in counts.items() if k.startswith("raised:") or k == "nonfinite"))}


def _informative_groups(sample: dict, G: int) -> np.ndarray:
    """bool [P]: groups with two valid samples whose rewards differ (a learning signal)."""
    valid_PG = ~sample["skipped"].reshape(-1, G)
    r_PG = sample["rewards"].reshape(-1, G)
    hi = np.where(valid_PG, r_PG, -np.inf).max(axis=1)
    lo = np.where(valid_PG, r_PG, np.inf).min(axis=1)
    return (valid_PG.sum(axis=1) >= 2) & (hi > lo)


def _pick_groups(sample: dict, groups: np.ndarray, G: int) -> dict:
    """The arrays of a round restricted to some of its groups (rows [P * G, ...] and per-prompt [P])."""
    rows = (groups[:, None] * G + np.arange(G)).reshape(-1)
    num_rows = len(sample["rewards"])
    return {k: v if np.ndim(v) == 0 else v[rows] if len(v) == num_rows else v[groups] for k, v in sample.items()}


def _fill_batch(run: _Run, state, step: int, key) -> tuple[dict, dict, dict]:
    """(the P groups to train on, round 0's groups as sampled, dynamic-sampling counts, and the
    tokens sampled and the failures met in all rounds).

    Without rl.dynamic_sampling: one round. With it (DAPO): further rounds of P prompts until P
    groups with reward variance are held or rl.dynamic_sampling_rounds are spent; a short batch is
    filled with the first round's zero-variance groups (which carry no loss)."""
    r = run.cfg.rl
    G = r.group_size
    first = _sample_groups(run, state, step, 0, key)
    if not r.dynamic_sampling:
        return first, first, {"rollout_tokens": first["new_tokens"], **_failures(first)}
    new_tokens = 0.0
    failures = dict.fromkeys(_failures(first), 0.0)
    pick = lambda sample, groups: _pick_groups(sample, groups, G)  # noqa: E731
    informative, rounds, spent = [], 0, 0
    sample = first
    while True:
        rounds += 1
        spent += r.rollouts_per_step
        new_tokens += sample["new_tokens"]
        failures = {k: v + _failures(sample)[k] for k, v in failures.items()}
        informative.append(pick(sample, np.flatnonzero(_informative_groups(sample, G))))
        held = sum(len(x["rewards"]) // G for x in informative)
        if held >= r.prompts_per_step or rounds >= r.dynamic_sampling_rounds:
            break
        sample = _sample_groups(run, state, step, rounds, jax.random.fold_in(key, rounds))
    filler = pick(first, np.flatnonzero(~_informative_groups(first, G)))
    parts = [*informative, filler]
    batch = {k: (parts[0][k] if np.ndim(parts[0][k]) == 0 else np.concatenate([x[k] for x in parts]))
             for k in first if k not in ("prompt_skipped", "rewards_skipped", "reward_errors", "new_tokens")}
    batch = {k: v[:r.rollouts_per_step] for k, v in batch.items()}
    return batch, first, {"ds_rounds": float(rounds), "ds_rollouts": float(spent),
                          "ds_informative_frac": min(held, r.prompts_per_step) / r.prompts_per_step,
                          "rollout_tokens": new_tokens, **failures}


def _failures(sample: dict) -> dict:
    """What a round could not score: rewards that raised or were not finite, prompts too long."""
    return {"rewards_skipped": sample["rewards_skipped"], "reward_errors": sample["reward_errors"],
            "prompts_skipped": float(np.sum(sample["prompt_skipped"]))}


def _grpo_step(run: _Run, state, ref_params, step: int, key):
    cfg, r = run.cfg, run.cfg.rl
    t0 = time.perf_counter()
    rollout, first, ds = _fill_batch(run, state, step, key)
    t_rollout = time.perf_counter() - t0
    G = r.group_size
    if first["skipped"].all():
        run.empty_steps += 1
        if run.empty_steps >= MAX_EMPTY_STEPS:
            n = int(first["prompt_skipped"].sum())
            raise RunError(f"{run.empty_steps} GRPO steps in a row scored no sample (last: step {step}; "
                           f"{n} of {r.prompts_per_step} prompts skipped as too long for rl.max_prompt_len="
                           f"{r.max_prompt_len} or not encodable, {first['rewards_skipped']:.0f} rewards raised or "
                           "were not finite): raise rl.max_prompt_len or fix the reward function")
    else:
        run.empty_steps = 0

    adv_PG, keep_PG, kept_frac = group_advantages(
        jnp.asarray(rollout["rewards"].reshape(-1, G)), estimator=r.estimator,
        skipped_PG=jnp.asarray(rollout["skipped"].reshape(-1, G)),
        truncated_PG=jnp.asarray(rollout["truncated"].reshape(-1, G)), mask_truncated=r.mask_truncated,
        mask_zero_variance=r.mask_zero_variance)
    adv_PG, keep_PG = np.asarray(adv_PG), np.asarray(keep_PG)
    rows = update_rows(cfg, rollout, adv_PG.reshape(-1), keep_PG.reshape(-1))
    t1 = time.perf_counter()
    put = lambda batch, with_old: put_global(batch, update_batch_shardings(run.setup, with_old))  # noqa: E731
    state, m = policy_updates(cfg, rows, step, state, ref_params, run.grpo_step, run.old_logprobs, put, fetch_global,
                              run.old_logprobs_micro_batches)
    t_update = time.perf_counter() - t1
    dt = time.perf_counter() - t0

    # Rewards as sampled (round 0): the policy's performance, not the dynamic sampler's selection.
    scored = first["rewards"][~first["skipped"]]
    lengths = rollout["lengths"].astype(np.float64)
    tokens = float(np.asarray(rollout["segment_ids"]).sum())
    nan = float("nan")
    rec = {
        "phase": GRPO,
        "reward_mean": float(scored.mean()) if scored.size else nan,
        "reward_max": float(scored.max()) if scored.size else nan,
        "reward_min": float(scored.min()) if scored.size else nan,
        "reward_std": float(scored.std()) if scored.size else nan,
        "scored_samples": float(scored.size),
        **{k: m[k] for k in ("loss", "pg_loss", "kl", "entropy", "logp_mean", "grad_norm", "pg_clipfrac",
                             "pg_clipfrac_high", "pg_clipfrac_low", "ratio_mean", "ratio_min", "ratio_max",
                             "sampler_gap_mean", "sampler_gap_max", "is_weight_mean", "is_masked_frac",
                             "update_applied", "update_skipped")},
        "kept_frac": float(kept_frac),
        **{k: float(v) for k, v in advantage_stats(jnp.asarray(adv_PG), jnp.asarray(keep_PG)).items()},
        "completion_len_mean": float(lengths.mean()), "completion_len_min": float(lengths.min()),
        "completion_len_max": float(lengths.max()), "truncated_frac": float(np.mean(rollout["truncated"])),
        **ds,  # every round's sampled tokens and failures (rewards skipped or raised, prompts too long)
        "tokens": tokens, "tokens_per_s": tokens / dt, "step_time_s": dt,
        # The step's time split: sampling and scoring (every dynamic-sampling round), the pi_old
        # pass (several updates per rollout only), the updates.
        "rollout_time_s": t_rollout, "rollout_tokens_per_s": ds["rollout_tokens"] / t_rollout,
        "old_logprobs_time_s": m["old_logprobs_time_s"], "update_time_s": t_update - m["old_logprobs_time_s"],
        # The counts rl/memory_plan.py chose (or checked) for the device's memory.
        "micro_batches": float(r.fewest_micro_batches), "rollout_batches": float(r.fewest_rollout_batches),
        "old_logprobs_micro_batches": float(run.old_logprobs_micro_batches or r.fewest_micro_batches),
    }
    return state, rec


def _warmup_step(run: _Run, state, step: int):
    t0 = time.perf_counter()
    batch = put_global(solved_batch(run.cfg, step, run.task, run.tokenizer), run.setup.batch_sharding(1))
    state, m = run.warmup_step(state, batch)
    m = {k: float(v) for k, v in fetch_global(m).items()}
    dt = time.perf_counter() - t0
    return state, {"phase": WARMUP, "warmup_loss": m["loss"], "grad_norm": m["grad_norm"], "tokens": m["tokens"],
                   "tokens_per_s": m["tokens"] / dt, "step_time_s": dt, "update_skipped": m["update_skipped"],
                   "warmup_micro_batches": float(run.cfg.train.fewest_micro_batches)}


def _key_record(key) -> list[int]:
    return np.asarray(jax.random.key_data(key)).tolist()


def run_rl(cfg: Config, out: Path | None = None, *, resume: bool = False, overwrite: bool = False,
           init_hf: Path | None = None,
           export_hf: Path | None = None, progress: bool = True, task: Task | None = None,
           reward_fns: Sequence[tuple[RewardFn, float]] | None = None) -> list[dict]:
    """Warm-up then GRPO; returns the per-step records (those of this invocation).

    task / reward_fns: the built-in task of cfg.rl and its own reward unless given (the Python API
    for custom tasks and rewards; a resumed run must pass the same ones).
    """
    out = Path(out) if out is not None else None
    cfg = start_config(cfg, out, resume=resume, overwrite=overwrite, init_hf=init_hf, export_hf=export_hf)
    own_task = task is None  # the config's task: the rules measure its prompts
    tokenizer, task, reward_fns = _task_and_rewards(cfg, init_hf, task, reward_fns)
    # After the model section is final, before anything is built; for the devices build() meshes
    # (a -1 axis resolved: the GRPO rows' split over mesh.context decided now, not at their first step).
    devices = jax.devices()
    check_rl_requirements(cfg, platform=devices[0].platform, devices=len(devices),
                          tokenizer=tokenizer if own_task else None)
    r, with_reference = cfg.rl, cfg.rl.beta > 0

    def abstract(setup):
        ref = {"ref_params": abstract_params(setup.specs, setup.param_shardings)} if with_reference else {}
        return {"train": setup.abstract_state(), **ref}

    def fresh(setup, hf_tree):
        state = init_state(setup, jax.random.key(cfg.train.seed))
        if hf_tree is not None:
            state = {**state, "params": params_from_hf(setup, init_hf, hf_tree)}
        # The reference is set when GRPO starts; until then a copy stands in (not the policy's own
        # buffers: the warm-up step donates those, and a checkpoint of the warm-up saves this one).
        ref = {"ref_params": jax.tree.map(jnp.copy, state["params"])} if with_reference else {}
        return {"train": state, **ref}

    def check_saved(saved: dict) -> None:
        if (saved.get("config", {}).get("rl", {}).get("beta", 0) > 0) != with_reference:
            raise RunError("--resume: rl.beta switches the reference policy on or off; keep the run's rl.beta")

    # Before anything is written or placed on the device: rl.micro_batches chosen (auto) or checked
    # against the device's free memory, on the set-up open_session then takes (build() keeps it).
    # Without a budget (a CPU, none set) nothing can be refused: _build_run plans after the run's
    # own checks (a checkpoint of the wrong shape says so before any compile).
    budget = memory_budget_bytes(cfg)
    if budget is not None:
        _memory_plan(cfg, build(cfg), tokenizer, with_reference, budget)
    session = open_session(cfg, out, resume=resume, overwrite=overwrite, init_hf=init_hf, abstract_tree=abstract,
                           fresh_tree=fresh, check_saved=check_saved)
    saved = session.saved_meta
    key = (jax.random.wrap_key_data(jnp.asarray(saved["rng_key"], jnp.uint32)) if saved
           else jax.random.key(cfg.train.seed + 1))
    run = _build_run(cfg, session.setup, task, tokenizer, reward_fns, with_reference, budget)

    def step(tree, i: int):
        nonlocal key
        state, ref_params = tree["train"], tree.get("ref_params")
        if i < r.warmup_steps:
            state, rec = _warmup_step(run, state, i)
            shown = {"phase": "warm-up", "loss": f"{rec['warmup_loss']:.3f}"}
        else:
            if i == r.warmup_steps:
                # What the GRPO phase replaces (the warm-up's optimizer state, the stand-in
                # reference) leaves the device before the first update, which the memory plan sized
                # for its arguments alone. Donation frees only the buffers an output reuses.
                state = released(tree["train"], run.rl_init(state))
                if with_reference:  # the reference is the policy GRPO starts from, frozen
                    ref_params = released(tree["ref_params"], run.reference_init(ref_params, state["params"]))
            key, sample_key = jax.random.split(key)
            state, rec = _grpo_step(run, state, ref_params, i, sample_key)
            shown = {"reward": f"{rec['reward_mean']:.3f}", "kept": f"{rec['kept_frac']:.2f}"}
        return {"train": state, **({"ref_params": ref_params} if with_reference else {})}, rec, shown

    def step_meta(done: int) -> dict:
        return {"step": done, "phase": WARMUP if done < r.warmup_steps else GRPO, "data_position": done,
                "rng_key": _key_record(key)}

    def plot(writer, done=None):
        if done is None or done % PLOT_EVERY == 0:
            plot_metrics(writer.jsonl_path, out / "metrics.png", PLOT_KEYS)

    history = session.run(step, run.total_steps, checkpoint_every=r.checkpoint_every, step_meta=step_meta,
                          progress=progress, desc="rl", on_write=plot, on_close=plot)
    session.export(export_hf, session.tree["train"]["params"])
    return history


def released(replaced, replacement):
    """`replacement`, with every device array of `replaced` it does not hold deleted (its memory
    back to the device now, not when the last Python reference goes)."""
    kept = {id(x) for x in jax.tree.leaves(replacement)}
    for x in jax.tree.leaves(replaced):
        if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
            x.delete()
    return replacement


def _task_and_rewards(cfg: Config, init_hf: Path | None, task: Task | None, reward_fns):
    """(tokenizer, task, [(reward function, weight)]): the task of cfg.rl and its rewards unless given."""
    tokenizer = (config_tokenizer(cfg) if cfg.data.tokenizer else
                 load_tokenizer(init_hf if init_hf is not None and (Path(init_hf) / "tokenizer.json").is_file() else None))
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise RunError(f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}")
    if task is None:
        task = PromptSetTask.from_config(cfg, tokenizer) if cfg.rl.task == "prompts" else task_from_config(cfg)
    if reward_fns is None:
        reward_fns = load_rewards(cfg.rl.reward, cfg.rl.reward_weights) if cfg.rl.reward else [(task.reward, 1.0)]
    return tokenizer, task, list(reward_fns)


def sampling_options(cfg: Config, tokenizer: Tokenizer) -> SamplingOptions:
    r = cfg.rl
    return SamplingOptions(r.max_new_tokens, r.temperature, r.top_p, tokenizer.eos_id, tokenizer.pad_id, r.top_k,
                           stop_ids=tokenizer.stop_ids)


def _memory_plan(cfg: Config, setup, tokenizer: Tokenizer, with_reference: bool,
                 budget: int | None) -> tuple[UpdatePlan | None, Fit | None, Fit | None]:
    """The GRPO update's, the sampler's and the warm-up step's counts and compiled programs for
    `budget` bytes per device (rl/memory_plan.py, run/step_plan.py; kept on the set-up: asked
    again, it compiles nothing); the first two None without GRPO steps, the warm-up's None without
    warm-up steps or a budget (its train.micro_batches is then the fewest count)."""
    warmup = plan_train(setup, budget) if cfg.rl.warmup_steps and budget is not None else None
    if not cfg.rl.steps:
        return None, None, warmup
    return (plan_updates(setup, with_reference, budget),
            plan_rollout(setup, sampling_options(cfg, tokenizer), with_reference, budget), warmup)


def _build_run(cfg: Config, setup, task: Task, tokenizer: Tokenizer, reward_fns, with_reference: bool,
               budget: int | None = None) -> _Run:
    """The compiled step functions of the warm-up, the sampler and the GRPO update (kept on the
    set-up: a resume in this process reuses them); the GRPO update's, the pi_old pass's and the
    sampler's (and the warm-up's) at the counts that fit `budget` (`_memory_plan`), with
    cfg.rl.micro_batches, rl.rollout_batches (and train.micro_batches) resolved to those counts."""
    plan, sampler, warmup = _memory_plan(cfg, setup, tokenizer, with_reference, budget)
    if warmup is not None:
        log.info("train.micro_batches=%s: the warm-up step in %d micro-batch(es) (%s per device)",
                 cfg.train.micro_batches, warmup.count, _gib(warmup.need))
        cfg = with_count(cfg, "train.micro_batches", warmup.count)
    if sampler is not None:
        log.info("rl.rollout_batches=%s: %d sampler pass(es) per round (%s per device)", cfg.rl.rollout_batches,
                 sampler.count, _gib(sampler.need))
        cfg = with_count(cfg, "rl.rollout_batches", sampler.count)
    if plan is not None:
        log.info("rl.micro_batches=%s: the GRPO update in %d micro-batch(es) (%s per device)%s", cfg.rl.micro_batches,
                 plan.micro_batches, _gib(plan.update.need),
                 f", the pi_old pass in {plan.old_logprobs.count} ({_gib(plan.old_logprobs.need)})"
                 if plan.old_logprobs is not None else "")
        cfg = with_count(cfg, "rl.micro_batches", plan.micro_batches)
    r = cfg.rl
    rl_opt = rl_optimizer(cfg)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return _Run(
        cfg, task, tokenizer, reward_fns, setup,
        warmup.compiled if warmup is not None else
        setup.kept("train_step", lambda: jit_train_step(setup)) if r.warmup_steps else None,
        plan.update.compiled if plan is not None else None,
        sampler.compiled if sampler is not None else None,
        # The GRPO phase starts from the warmed-up policy with a fresh optimizer state.
        setup.kept("rl_optimizer_init", lambda: jax.jit(
            lambda s: {"params": s["params"], "opt_state": rl_opt.init(s["params"]), "step": s["step"]},
            in_shardings=(setup.state_shardings,), out_shardings=setup.state_shardings, donate_argnums=(0,))),
        setup.kept("reference_init", lambda: jax.jit(
            lambda stand_in, params: jax.tree.map(jnp.copy, params), donate_argnums=(0,), keep_unused=True,
            in_shardings=(setup.param_shardings, setup.param_shardings), out_shardings=setup.param_shardings)),
        plan.old_logprobs.compiled if plan is not None and plan.old_logprobs is not None else None,
        plan.old_logprobs_micro_batches if plan is not None else None)


def _gib(need: int) -> str:
    return f"{need / 2**30:.2f} GiB"
