"""The GRPO bookkeeping between the parts, each against an independent re-derivation from what the
rollout holds (never from the code under test), with the one-line bugs each check catches:

- Rewards and rows: a run on a prompt set whose reward depends on the prompt, the example and the
  completion; every row of every update batch must carry the advantage of its own prompt's group,
  re-derived from the prompt written in the row's own tokens.
- Completions that end in EOS: real rollouts that stop at EOS at different lengths in one batch;
  the trained positions (EOS in, the padding after it and the prompt out) are derived from the
  sampled tokens, then read back from the step's per-token gradient and from the real step's metrics.
- Dynamic sampling: the rounds stop at the threshold and every logged figure comes from its rows.

The loss normalisers' checks are tests/test_rl_normalisers.py's (the helpers both use:
tests/rl_glue_shared.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hybridmoe.rl.grpo as grpo_module
import hybridmoe.rl.loop as rl_loop
import hybridmoe.run.session as run_session
from broken_variants import mutated
from helpers import TWO_LAYERS, tiny_config
from hybridmoe.run.setup import build, init_state
from rl_glue_shared import (COMPLETIONS, NORM_G, NORM_N, NORM_P, NORM_PROMPT, TOK, FixedPrompts, flat_rows, logp_table,
                            norm_config, number_reward, reference_advantages, sampler_stub, table_policy)



# ---------------------------------------------------------------------------------------------
# 1. Rewards and rows: a run on a prompt set (a user reward file, rl.task=prompts) whose reward
# depends on the prompt, the example's answer and the completion. The shapes are
# tests/test_rl_run.py's (its compiled programs serve: keep the keys its programs read equal, the
# GRPO learning-rate ramp included): 2 prompts x 4 completions, 3 new tokens.

RUN_OVERRIDES = ("rl.warmup_steps=0", "rl.steps=2", "rl.checkpoint_every=0", "rl.prompts_per_step=2",
                 "rl.group_size=4", "rl.max_prompt_len=6", "rl.max_new_tokens=3", "rl.beta=0.05",
                 "rl.lr_warmup_steps=2", "train.batch_size=8", "train.seq_len=32", "gdn.chunk_size=8",
                 "rl.task=prompts", *TWO_LAYERS)
# Eight prompts, each with an answer no other prompt has.
PROMPT_SET = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in
              ((1, 2), (7, 5), (3, 3), (9, 8), (4, 0), (2, 9), (6, 7), (5, 5))]
ROW_TOL = 1e-5  # advantages: float32 against float64 (measured clean: ~1e-7)


def graded(prompt, completion, example):
    """A stand-in for a graded answer check that a random policy cannot pass: a value in [0, 1)
    that changes whenever the prompt, the example's answer or the completion changes."""
    return zlib.crc32(f"{prompt}|{example['answer']}|{completion}".encode()) % 1000 / 1000


# The user's reward file (the run loads it through rl.reward; the test re-derives with `graded`).
REWARD_FILE = "import zlib\n\n\n" + inspect.getsource(graded)


@pytest.fixture(scope="module")
def prompt_run_cfg(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt_set")
    (folder / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in PROMPT_SET))
    (folder / "rewards.py").write_text(REWARD_FILE)
    return tiny_config(*RUN_OVERRIDES, f"data.prompts={folder / 'prompts.jsonl'}",
                       f"rl.reward={folder / 'rewards.py'}:graded")


_PROGRAMS: dict = {}


def share_programs(monkeypatch):
    """run_rl's setup and initial state built once per config and reused by the later runs of this
    module; the set-up keeps the loop's programs (RunSetup.kept), so its sampler and GRPO step are
    traced once too (each run_rl otherwise traces and loads them again: ~20 s a run)."""
    def memo(name, key_of, fresh=lambda x: x, module=rl_loop):
        real = getattr(module, name)

        def shared(*args, **kwargs):
            key = (name, key_of(*args, **kwargs))
            if key not in _PROGRAMS:
                _PROGRAMS[key] = real(*args, **kwargs)
            return fresh(_PROGRAMS[key])
        monkeypatch.setattr(module, name, shared)

    memo("build", lambda cfg: cfg.model_dump_json(), module=run_session)
    # The GRPO step donates its state: every run starts from its own copy.
    memo("init_state", lambda setup, key: (id(setup), str(jax.random.key_data(key))),
         lambda state: jax.tree.map(jnp.copy, state))


def recorded_run(cfg, monkeypatch, broken: tuple[str, str, str] | None = None) -> tuple[list[dict], list[dict]]:
    """run_rl on cfg (with one of ROW_BROKEN patched in): (the rows of every update batch as the
    step received them, after the split into micro-batches and the transfer to the mesh; the run's
    per-step records)."""
    real_updates, batches = rl_loop.policy_updates, []

    def recording_updates(cfg, rows, step, state, ref_params, step_fn, *rest):
        def recording_step(state, ref_params, batch):
            batches.append(flat_rows(batch))
            return step_fn(state, ref_params, batch)
        return real_updates(cfg, rows, step, state, ref_params, recording_step, *rest)

    monkeypatch.setattr(rl_loop, "policy_updates", recording_updates)
    share_programs(monkeypatch)
    if broken is not None:  # after the recorder: a recompiled function sees the module as it is now
        name, old, new = broken
        monkeypatch.setattr(rl_loop, name, mutated(rl_loop, name, old, new))
    history = rl_loop.run_rl(cfg, None, progress=False)
    return batches, history


def row_errors(cfg, run) -> dict:
    """Each row's prompt read from its own tokens, its completion scored against that prompt's line
    of the prompt set, the group advantages re-derived: the largest advantage error, the rows whose
    keep flag differs, the largest error of the logged reward_mean, and the groups whose rows hold
    more than one prompt."""
    batches, history = run
    by_prompt = {line["prompt"]: line for line in PROMPT_SET}
    G, P = cfg.rl.group_size, cfg.rl.max_prompt_len
    worst, keep_wrong, mixed_groups, informative, reward_mean = 0.0, 0, 0, 0, 0.0
    assert len(batches) == len(history)
    for rows, record in zip(batches, history):
        prompts = [TOK.decode(t) for t in rows["tokens"][:, :P]]
        completions = [TOK.decode(t) for t in rows["tokens"][:, P:]]
        mixed_groups += sum(len(set(prompts[g * G:(g + 1) * G])) > 1 for g in range(len(prompts) // G))
        rewards = np.asarray([graded(p, c, by_prompt[p]) for p, c in zip(prompts, completions)])
        none = np.zeros(len(rewards), bool)
        adv, keep = reference_advantages(rewards, none, none, G)
        worst = max(worst, float(np.max(np.abs(rows["advantages"] - adv))))
        reward_mean = max(reward_mean, abs(record["reward_mean"] - rewards.mean()))
        keep_wrong += int(np.sum(rows["keep"] != keep))
        informative += int(keep.sum())
    return {"advantage": worst, "keep": keep_wrong, "reward_mean": reward_mean, "mixed_groups": mixed_groups,
            "kept_rows": informative}


# One-line bugs between the sampler's rows, the rewards and the advantages.
ROW_BROKEN = {
    # The completion of a group's last row scored against the next prompt (wrapping around).
    "rows_scored_against_rotated_prompts": ("_sample_groups", "[prompts[i // G] for i in scored_rows]",
                                            "[prompts[(i + 1) // G % len(prompts)] for i in scored_rows]"),
    # Every completion scored with the first prompt's line of the prompt set.
    "example_of_group_0_for_all": ("_sample_groups", '[getattr(examples[i // G], "fields", {}) for i in scored_rows]',
                                   '[getattr(examples[0], "fields", {}) for i in scored_rows]'),
    # The advantages reach the rows one row late.
    "advantages_rolled_by_one_row": ("_grpo_step", "update_rows(cfg, rollout, adv_PG.reshape(-1),",
                                     "update_rows(cfg, rollout, np.roll(adv_PG.reshape(-1), 1),"),
}


def test_each_row_is_scored_against_its_own_prompt_and_example_and_trains_on_its_advantage(prompt_run_cfg,
                                                                                           monkeypatch):
    run = recorded_run(prompt_run_cfg, monkeypatch)
    errors = row_errors(prompt_run_cfg, run)
    assert len(run[0]) == 2 and errors["mixed_groups"] == 0, errors
    assert errors["kept_rows"] >= 8, errors  # the reward separates the rows: most groups teach something
    assert errors["advantage"] < ROW_TOL and errors["keep"] == 0 and errors["reward_mean"] < ROW_TOL, errors


@pytest.mark.parametrize("variant", list(ROW_BROKEN))
def test_broken_rows_are_caught(variant, prompt_run_cfg, monkeypatch):
    errors = row_errors(prompt_run_cfg, recorded_run(prompt_run_cfg, monkeypatch, ROW_BROKEN[variant]))
    assert errors["advantage"] >= 10 * ROW_TOL or errors["keep"] > 0, f"{variant}: {errors}"


# ---------------------------------------------------------------------------------------------
# 2. Completions that end in EOS: real rollouts of the tiny model (tests/test_grpo.py's config and
# compiled step: 16 rows, 6 prompt slots, 5 new tokens, T = 0.7, top-p 0.9, 2 micro-batches), with
# the EOS and stop ids chosen among the tokens this policy samples most, so that rows end at
# several lengths in one batch, some at their first token, some truncated.

EOS_CFG = ("rl.temperature=0.7", "rl.top_p=0.9", "rl.micro_batches=2")
EOS_WEIGHT_TOL = 1e-5  # the per-token weights, relative to the largest (float32; measured clean ~1e-7)
EOS_STEP_TOL = 1e-4  # the real step's metrics against unchunked float32 log-probs (test_grpo.STEP_TOL)


def trained_positions(tokens_BT, prompt_len, end_ids):
    """The expected loss mask [B, T - 1] from the sampled tokens alone: completion token j (row
    index prompt_len + j) is predicted at index prompt_len - 1 + j; a row trains its completion
    through the first end id (EOS trains), nothing after it (padding) and no prompt slot."""
    B, T = tokens_BT.shape
    mask = np.zeros((B, T - 1))
    for b in range(B):
        completion = tokens_BT[b, prompt_len:]
        ends = np.flatnonzero(np.isin(completion, end_ids))
        n = ends[0] + 1 if len(ends) else len(completion)
        mask[b, prompt_len - 1:prompt_len - 1 + n] = 1.0
    return mask


def covers_the_cases(tokens_BT, prompt_len, end_ids, keep_B) -> bool:
    """Whether kept rows end at EOS at three lengths or more (with padding after some), and some
    kept row does not end (truncated)."""
    lengths = trained_positions(tokens_BT, prompt_len, end_ids).sum(axis=1)
    ended = np.isin(tokens_BT[:, prompt_len:], end_ids).any(axis=1)
    N = tokens_BT.shape[1] - prompt_len
    return (len(set(lengths[ended & keep_B])) >= 3 and (ended & keep_B & (lengths < N)).sum() >= 3
            and bool((~ended & keep_B).any()))


@pytest.fixture(scope="module")
def eos_case():
    from helpers import tiny_params
    from test_grpo import PROMPT_LEN, _advantages, _config, _sampled_rollout

    cfg = _config(*EOS_CFG)
    params = tiny_params(cfg)
    adv, keep = _advantages()
    # The end ids: the fewest of the tokens this policy samples most (EOS the first, the others
    # stop ids) with which the rows end at several lengths. A row's tokens up to its end do not
    # depend on the end ids (the same prompts and key), so a rollout without EOS shows where each
    # choice ends the rows.
    plain = _sampled_rollout(cfg, params)
    ids, counts = np.unique(plain["completion"], return_counts=True)
    by_count = [int(i) for i in ids[np.lexsort((ids, -counts))]]
    end_ids = next((tuple(by_count[:k]) for k in range(1, 9)
                    if covers_the_cases(plain["tokens"], PROMPT_LEN, by_count[:k], keep)), None)
    assert end_ids is not None, "no few end ids end this policy's rows at several lengths: reseed the fixture"
    rollout = _sampled_rollout(cfg, params, eos_id=end_ids[0], stop_ids=end_ids[1:])
    # The fixture holds what it claims (the sampler stopped the rows where the ids fall).
    assert covers_the_cases(rollout["tokens"], PROMPT_LEN, end_ids, keep)
    mask = trained_positions(rollout["tokens"], PROMPT_LEN, end_ids)
    return types.SimpleNamespace(cfg=cfg, params=params, rollout=rollout, adv=adv, keep=keep, mask=mask)


def eos_weight_error(case) -> float:
    """The per-token weight of the loss, d loss / d logp, read from the real update batch and
    micro-batch loss (the policy's log-probs a free array), against -A_b / kept tokens on exactly
    the expected positions of kept rows (on policy: ratio 1)."""
    cfg = case.cfg
    batch = grpo_module.build_update_batch(cfg, case.rollout, case.adv, case.keep)
    B, T = case.rollout["tokens"].shape
    M = batch["tokens"].shape[0]
    logp = logp_table(B, T, seed=3)
    grads = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_module, "sequence_logprobs", table_policy)
        for m in range(M):
            mb = {k: jnp.asarray(v[m]) for k, v in batch.items()}
            grads.append(np.asarray(jax.grad(lambda lp: grpo_module.micro_batch_loss(lp, None, cfg, mb)[0])(
                logp[m * (B // M):(m + 1) * (B // M)])))
    kept = case.mask * case.keep[:, None]
    want = -case.adv[:, None] * kept / kept.sum()
    return float(np.abs(np.concatenate(grads) - want).max() / np.abs(want).max())


_LOGP = {}


def eos_step_errors(case) -> dict:
    """The real GRPO step (compiled, 8 devices, 2 micro-batches) on the rollout's update batch: its
    loss, kept and completion token counts, mean log-prob and entropy of the completion tokens,
    against the same figures from the model's unchunked log-probs on the expected positions."""
    from grpo_reference import grpo_reference
    from test_grpo import _run_step
    from hybridmoe.kernels.logprobs import token_logprobs_reference
    from hybridmoe.model.forward import decoder_hidden

    cfg, ro = case.cfg, case.rollout
    batch = grpo_module.build_update_batch(cfg, ro, case.adv, case.keep)
    _, m = jax.device_get(_run_step(cfg, case.params, None, batch))
    if "logp" not in _LOGP:
        def logp_of(p, tokens, seg, pos):
            h = decoder_hidden(p, cfg, tokens, seg, pos)
            return token_logprobs_reference(h[:, :-1], p["lm_head"], tokens[:, 1:], temperature=0.7)
        _LOGP["logp"] = jax.device_get(jax.jit(logp_of)(case.params, ro["tokens"], ro["segment_ids"],
                                                        ro["positions"]))
    logp, entropy = (np.asarray(x, np.float64) for x in _LOGP["logp"])
    mask = case.mask
    want = {"loss": grpo_reference(logp, logp, case.adv, mask, eps=0.2, keep=case.keep)["loss"],
            "kept_tokens": float((mask * case.keep[:, None]).sum()), "completion_tokens": float(mask.sum()),
            "logp_mean": float((logp * mask).sum() / mask.sum()),
            "entropy": float((entropy * mask).sum() / mask.sum())}
    return {k: abs(float(m[k]) - v) / max(abs(v), 1e-3) for k, v in want.items()}


def test_rows_ending_in_eos_train_through_eos_and_not_the_padding_after(eos_case):
    assert eos_weight_error(eos_case) < EOS_WEIGHT_TOL
    errors = eos_step_errors(eos_case)
    assert max(errors.values()) < EOS_STEP_TOL, errors


# One-line bugs in the update rows' loss mask.
EOS_BROKEN = {
    "eos_not_trained": ("mask_BN = np.arange(r.max_new_tokens)[None, :] < lengths[:, None]",
                        'mask_BN = np.arange(r.max_new_tokens)[None, :] < np.where(rollout["truncated"], lengths, '
                        'lengths - 1)[:, None]'),
    "one_past_eos_trained": ("mask_BN = np.arange(r.max_new_tokens)[None, :] < lengths[:, None]",
                             "mask_BN = np.arange(r.max_new_tokens)[None, :] <= lengths[:, None]"),
    "mask_shifted_by_one": ("np.zeros((B, P - 1), np.float32), mask_BN.astype(np.float32)",
                            "np.zeros((B, P), np.float32), mask_BN[:, :-1].astype(np.float32)"),
}


@pytest.mark.parametrize("variant", list(EOS_BROKEN))
def test_broken_eos_masks_are_caught(variant, eos_case, monkeypatch):
    monkeypatch.setattr(grpo_module, "update_rows", mutated(grpo_module, "update_rows", *EOS_BROKEN[variant]))
    weights = eos_weight_error(eos_case)
    step = max(eos_step_errors(eos_case).values())
    # Each check catches it on its own: the gradient's positions, and the real step's figures.
    assert weights >= 10 * EOS_WEIGHT_TOL and step >= 10 * EOS_STEP_TOL, (
        f"{variant}: weights {weights:.2e}, step {step:.2e}")


# ---------------------------------------------------------------------------------------------
# 4. Dynamic sampling (rl.dynamic_sampling) with the real sampler, the real scoring and a real
# update: one GRPO step (loop._grpo_step) on section 1's prompt set, set-up and programs (the
# sampler and the GRPO step read no dynamic-sampling key: a run with them compiles these same
# programs), scored by a reward that teaches on the prompts a case names only (a graded value of
# the completion there; 0.5 elsewhere, so such a group has no reward variance). Step DS_STEP's
# first three rounds draw six distinct prompts of the eight (asserted: each round is a draw of its
# own, and samples with a key of its own); round r's two prompts are named a<r> and b<r>, in the
# order drawn. The batch must be the named groups' rows as sampled, in order. Every figure the step
# logs about rewards, advantages, lengths and rounds is re-derived from the rows it should come
# from: the reward figures from round 0 as sampled (the policy, docs/rl.md), the advantage, length
# and token figures from the batch the update trains on, the rollout tokens from every round.

DS_STEP = 12
DS_TOL = 1e-5  # float32 figures against float64 (measured clean: ~1e-7)
# name: (rl.dynamic_sampling_rounds, the prompts that teach, the rounds sampled, the batch's groups
# in order, ds_informative_frac). P = 2 groups are held when a batch is full.
DS_CASES = {
    "nothing_teaches": (3, (), 3, ("a0", "b0"), 0.0),
    "held_at_the_threshold_in_round_0": (3, ("a0", "b0"), 1, ("a0", "b0"), 1.0),
    "held_at_the_threshold_in_round_1": (3, ("b0", "a1"), 2, ("b0", "a1"), 1.0),
    "held_past_the_threshold_in_round_1": (3, ("b0", "a1", "b1"), 2, ("b0", "a1"), 1.0),
    "one_below_the_threshold_to_the_last_round": (3, ("b0",), 3, ("b0", "a0"), 0.5),
    "one_below_the_threshold_at_a_cap_of_2": (2, ("b0",), 2, ("b0", "a0"), 0.5),
}


def teaching_value(prompt: str, completion: str) -> float:
    return zlib.crc32(f"{prompt}|{completion}".encode()) % 1000 / 1000


def completion_lengths(tokens_BT, prompt_len):
    """Each row's completion tokens through its first EOS (all of them when it has none), and
    whether it has none (truncated), from the sampled tokens alone."""
    lengths = trained_positions(tokens_BT, prompt_len, TOK.stop_ids).sum(axis=1)
    truncated = ~np.isin(tokens_BT[:, prompt_len:], TOK.stop_ids).any(axis=1)
    return lengths, truncated


def eos_often(lm_head):
    """The head with EOS's logit ten times the sum of 24 other tokens' logits: far above the others
    at some positions and far below at others, so that rows end at several lengths (the initial
    policy's logits spread by ~0.16: it samples EOS at 1 in 256, and every row would run to the
    same length)."""
    column = 10 * lm_head[:, 3:27].sum(axis=1)
    return jax.device_put(lm_head.at[:, TOK.eos_id].set(column), lm_head.sharding)


@pytest.fixture(scope="module")
def ds_base(prompt_run_cfg):
    """(the set-up of section 1's runs, the dynamic-sampling config of a case)."""
    key = ("build", prompt_run_cfg.model_dump_json())  # share_programs' memo: section 1's set-up
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build(prompt_run_cfg)
    words = (*RUN_OVERRIDES, f"data.prompts={prompt_run_cfg.data.prompts}", f"rl.reward={prompt_run_cfg.rl.reward[0]}",
             "rl.dynamic_sampling=true")
    return _PROGRAMS[key], lambda rounds: tiny_config(*words, f"rl.dynamic_sampling_rounds={rounds}")


def ds_step(ds_base, case, names, broken=None) -> dict:
    """One GRPO step of a case (names: the survey's prompt of each name; broken: one of DS_BROKEN
    patched in): every round as sampled, the batch's rows as the update received them, the record."""
    setup, ds_config = ds_base
    max_rounds, teaching, *_ = DS_CASES[case]
    cfg = ds_config(max_rounds)
    teaching_prompts = {names[n] for n in teaching}

    def reward(prompt, completion):
        return teaching_value(prompt, completion) if prompt in teaching_prompts else 0.5

    rounds, batches = [], []
    with pytest.MonkeyPatch.context() as mp:
        def spy():
            sample_groups = rl_loop._sample_groups  # a broken one when the variant breaks it

            def recording(run, state, step, round_index, key):
                sample = sample_groups(run, state, step, round_index, key)
                rounds.append({**{k: np.copy(v) for k, v in sample.items()},
                               "sampler_key": np.asarray(jax.random.key_data(key))})
                return sample
            mp.setattr(rl_loop, "_sample_groups", recording)

        def patch():
            name, old, new, _ = DS_BROKEN[broken]
            mp.setattr(rl_loop, name, mutated(rl_loop, name, old, new))

        if broken is None:
            spy()
        elif DS_BROKEN[broken][0] == "_sample_groups":
            patch(), spy()  # the spy wraps the broken round
        else:
            spy(), patch()  # the broken caller, recompiled from its source, calls the spy
        tokenizer, task, reward_fns = rl_loop._task_and_rewards(cfg, None, None, [(reward, 1.0)])
        run = rl_loop._build_run(cfg, setup, task, tokenizer, reward_fns, True)
        update = run.grpo_step

        def recording_update(state, ref_params, batch):
            batches.append(flat_rows(batch))
            return update(state, ref_params, batch)

        run = dataclasses.replace(run, grpo_step=recording_update)
        with setup.context():
            state = init_state(setup, jax.random.key(cfg.train.seed))
            state["params"]["lm_head"] = eos_often(state["params"]["lm_head"])
            ref = jax.tree.map(jnp.copy, state["params"])
            _, record = rl_loop._grpo_step(run, state, ref, DS_STEP, jax.random.key(DS_STEP))
    return {"cfg": cfg, "rounds": rounds, "batch": batches[0], "record": record, "reward": reward}


def round_prompts(cfg, sample) -> list[str]:
    """The prompt of each group of a round, read from its rows' own tokens."""
    G, P = cfg.rl.group_size, cfg.rl.max_prompt_len
    prompts = [TOK.decode(t) for t in sample["tokens"][:, :P]]
    assert all(len(set(prompts[g * G:(g + 1) * G])) == 1 for g in range(len(prompts) // G))
    return prompts[::G]


@pytest.fixture(scope="module")
def ds_survey(ds_base):
    """(the prompt of each name, the step where nothing teaches): every round runs there, so its
    rounds name every prompt."""
    seen = ds_step(ds_base, "nothing_teaches", {})
    drawn = [round_prompts(seen["cfg"], s) for s in seen["rounds"]]
    return {f"{ab}{r}": prompts[i] for r, prompts in enumerate(drawn) for i, ab in enumerate("ab")}, seen


def ds_errors(case, names, seen) -> dict:
    """A case's step against its table row and the re-derivations (above): counts of wrong
    rounds, prompts, groups and rows, and the largest error of every logged figure."""
    cfg, rec, batch = seen["cfg"], seen["record"], seen["batch"]
    _, _, want_rounds, want_groups, want_frac = DS_CASES[case]
    G, P, rows = cfg.rl.group_size, cfg.rl.max_prompt_len, cfg.rl.rollouts_per_step
    drawn = [round_prompts(cfg, s) for s in seen["rounds"]]
    keys = [s["sampler_key"].tobytes() for s in seen["rounds"]]
    errors = {"rounds": abs(len(drawn) - want_rounds),
              "prompts": sum(p != names.get(f"{ab}{r}") for r, ps in enumerate(drawn) for ab, p in zip("ab", ps)),
              "round_keys": len(keys) - len(set(keys))}  # each round samples with a key of its own
    # The batch: the named groups' rows as their round sampled them.
    sampled = {f"{ab}{r}": s["tokens"][i * G:(i + 1) * G]
               for r, s in enumerate(seen["rounds"]) for i, ab in enumerate("ab")}
    batch_groups = batch["tokens"].reshape(-1, G, batch["tokens"].shape[-1])
    errors["batch_rows"] = sum(int(n not in sampled or not np.array_equal(rows_g, sampled[n]))
                               for rows_g, n in zip(batch_groups, want_groups, strict=True))
    # Advantages and keep of the batch re-derived from its rows' own text.
    texts = [(TOK.decode(t[:P]), TOK.decode(t[P:])) for t in batch["tokens"]]
    rewards = np.asarray([seen["reward"](p, c) for p, c in texts])
    lengths, truncated = completion_lengths(batch["tokens"], P)
    adv, keep = reference_advantages(rewards, np.zeros(rows, bool), truncated, G)
    errors["advantages"] = float(np.abs(batch["advantages"] - adv).max())
    errors["keep"] = int(np.sum(batch["keep"] != keep))
    # Round 0 as sampled: the reward figures.
    first = seen["rounds"][0]
    r0 = np.asarray([seen["reward"](TOK.decode(t[:P]), TOK.decode(t[P:])) for t in first["tokens"]])
    kept_adv = adv[keep]
    every_round = sum(completion_lengths(s["tokens"], P)[0].sum() for s in seen["rounds"])
    prompt_tokens = sum(len(TOK.encode(p)) + 1 for p, _ in texts)  # BOS and the prompt
    want = {"reward_mean": r0.mean(), "reward_max": r0.max(), "reward_min": r0.min(), "reward_std": r0.std(),
            "scored_samples": rows, "kept_frac": keep.mean(),
            "adv_mean": kept_adv.mean() if keep.any() else 0.0, "adv_std": kept_adv.std() if keep.any() else 0.0,
            "adv_min": kept_adv.min() if keep.any() else 0.0, "adv_max": kept_adv.max() if keep.any() else 0.0,
            "completion_len_mean": lengths.mean(), "completion_len_min": lengths.min(),
            "completion_len_max": lengths.max(), "truncated_frac": truncated.mean(),
            "tokens": prompt_tokens + lengths.sum(), "rollout_tokens": every_round, "ds_rounds": want_rounds,
            "ds_rollouts": want_rounds * rows, "ds_informative_frac": want_frac}
    for k, v in want.items():
        errors[k] = abs(rec[k] - float(v)) / max(abs(float(v)), 1.0)
    return errors


DS_COUNTS = ("rounds", "prompts", "round_keys", "batch_rows", "keep")


def out_of_tolerance(errors: dict) -> dict:
    """The entries of a case's errors that fail: a count above 0, a figure's error at DS_TOL or more."""
    return {k: v for k, v in errors.items() if (v != 0 if k in DS_COUNTS else v >= DS_TOL)}


def test_dynamic_sampling_rounds_stop_at_the_threshold_and_each_figure_comes_from_its_rows(ds_base, ds_survey):
    names, nothing_teaches = ds_survey
    # Each round is a draw of its own: the three rounds drew six distinct prompts of the eight.
    assert len(set(names.values())) == 6, names
    errors = {case: ds_errors(case, names, nothing_teaches if case == "nothing_teaches" else
                              ds_step(ds_base, case, names)) for case in DS_CASES}
    failing = {case: bad for case, e in errors.items() if (bad := out_of_tolerance(e))}
    assert not failing, failing


# One-line bugs in the dynamic sampler's rounds and in which rows each logged figure is taken from,
# each with the case that shows it (the cases above run them all; one each keeps the table cheap).
DS_BROKEN = {
    "rounds_redraw_round_0s_prompts": ("_sample_groups", " + ([round_index] if round_index else [])", "",
                                       "nothing_teaches"),
    "rounds_sample_with_one_key": ("_fill_batch", "jax.random.fold_in(key, rounds)", "key", "nothing_teaches"),
    "held_threshold_off_by_one": ("_fill_batch", "if held >= r.prompts_per_step or", "if held > r.prompts_per_step or",
                                  "held_at_the_threshold_in_round_0"),
    "stops_one_group_short": ("_fill_batch", "if held >= r.prompts_per_step or",
                              "if held >= r.prompts_per_step - 1 or", "one_below_the_threshold_at_a_cap_of_2"),
    "round_cap_off_by_one": ("_fill_batch", "rounds >= r.dynamic_sampling_rounds", "rounds > r.dynamic_sampling_rounds",
                             "one_below_the_threshold_at_a_cap_of_2"),
    "filler_from_the_last_round": ("_fill_batch", "filler = pick(first,", "filler = pick(sample,",
                                   "one_below_the_threshold_at_a_cap_of_2"),
    "rollout_tokens_of_the_last_round": ("_fill_batch", 'new_tokens += sample["new_tokens"]',
                                         'new_tokens = sample["new_tokens"]', "held_at_the_threshold_in_round_1"),
    "reward_figures_from_the_trained_batch": ("_grpo_step", 'scored = first["rewards"][~first["skipped"]]',
                                              'scored = rollout["rewards"][~rollout["skipped"]]',
                                              "held_at_the_threshold_in_round_1"),
    "reward_figures_from_the_kept_rows": ("_grpo_step", 'scored = first["rewards"][~first["skipped"]]',
                                          'scored = first["rewards"][keep_PG.reshape(-1)]',
                                          "one_below_the_threshold_at_a_cap_of_2"),
    "advantage_figures_over_every_row": ("_grpo_step", "advantage_stats(jnp.asarray(adv_PG), jnp.asarray(keep_PG))",
                                         "advantage_stats(jnp.asarray(adv_PG), jnp.ones_like(jnp.asarray(keep_PG)))",
                                         "one_below_the_threshold_at_a_cap_of_2"),
    "completion_lengths_of_round_0": ("_grpo_step", 'lengths = rollout["lengths"].astype(np.float64)',
                                      'lengths = first["lengths"].astype(np.float64)',
                                      "held_at_the_threshold_in_round_1"),
}


@pytest.mark.parametrize("variant", list(DS_BROKEN))
def test_broken_dynamic_sampling_is_caught(variant, ds_base, ds_survey):
    names, _ = ds_survey
    case = DS_BROKEN[variant][3]
    errors = ds_errors(case, names, ds_step(ds_base, case, names, variant))
    worst = max(v if k in DS_COUNTS else v / (10 * DS_TOL) for k, v in errors.items())
    assert worst >= 1, f"{variant}: {errors}"


# ---------------------------------------------------------------------------------------------
# 5. The loop's own counts: prompts at rl.max_prompt_len, and GRPO steps in a row that score nothing
# (section 3's prompts, sampler stub and set-up; the update is a stub that trains nothing).

def test_a_prompt_of_exactly_max_prompt_len_tokens_is_kept_and_one_more_is_skipped():
    # [BOS] + the characters: "1+2=" is 5 tokens, "10+2=" 6, at rl.max_prompt_len=5.
    run = types.SimpleNamespace(cfg=tiny_config("rl.max_prompt_len=5"), tokenizer=TOK)
    ids, skipped = rl_loop._encode_prompts(run, ["1+2=", "10+2=", "3="])
    assert skipped.tolist() == [False, True, False]
    assert ids == [[TOK.bos_id, *TOK.encode("1+2=")], [TOK.pad_id], [TOK.bos_id, *TOK.encode("3=")]]


def test_the_count_of_steps_that_score_nothing_restarts_at_a_step_that_scores():
    """MAX_EMPTY_STEPS (3) GRPO steps IN A ROW without a scored sample stop the run: two empty steps,
    one that scores, two more empty ones run on; a third empty one in a row stops it."""
    from hybridmoe.run.run_dir import RunError

    cfg = norm_config("drgrpo", "token_mean", "skip_sample", False, True, 1)
    scoring = {"on": False}

    def reward(prompt: str, completion: str) -> float:
        if not scoring["on"]:
            raise ValueError("nothing scores this step")
        return number_reward(prompt, completion)

    def no_update(state, ref_params, batch):
        return state, dict.fromkeys((*grpo_module._SUM_KEYS, *grpo_module._EXTREMES, "loss", "grad_norm",
                                     "update_applied", "update_skipped"), 0.0)

    run = rl_loop._Run(cfg, FixedPrompts(), TOK, [(reward, 1.0)], build(cfg), None, no_update,
                       sampler_stub(COMPLETIONS, NORM_G, NORM_N), None)
    counts = []
    for step, scores in enumerate((False, False, True, False, False)):
        scoring["on"] = scores
        _, rec = rl_loop._grpo_step(run, {"params": None}, None, step, jax.random.key(step))
        assert (rec["scored_samples"] > 0) == scores
        counts.append(run.empty_steps)
    assert counts == [1, 2, 0, 1, 2]
    scoring["on"] = False
    with pytest.raises(RunError, match=r"3 GRPO steps in a row scored no sample \(last: step 5;"):
        rl_loop._grpo_step(run, {"params": None}, None, 5, jax.random.key(5))


def test_the_steps_time_split_and_rollout_rate_by_their_definitions(monkeypatch):
    check_time_split(monkeypatch)


def check_time_split(monkeypatch):
    """The GRPO record's timing figures on a made-up clock that only the stubs move: the sampler takes
    2 s, the pi_old pass 0.5 s (two updates a rollout), each update 0.75 s. So rollout_time_s 2,
    old_logprobs_time_s 0.5, update_time_s 1.5, and the parts add up to step_time_s 4.

    The counts (section 3's completions, N = 6): the 32 rows' new tokens are min(len + 1, 6) each
    (EOS after the text where it fits): 13 + 14 + 9 + 14 + 8 + 16 + 10 + 16 = 100 over the eight
    groups, so rollout_tokens_per_s = 100 / 2 = 50 (rollout tokens over the rollout's own time).
    The trained rows' tokens add the prompts: [BOS] p<i> (3 tokens) for seven prompts and the one
    placeholder token of the skipped one, 4 rows each: 88 + 100 = 188, tokens_per_s = 188 / 4 = 47."""
    cfg = tiny_config(f"rl.prompts_per_step={NORM_P}", f"rl.group_size={NORM_G}", f"rl.max_prompt_len={NORM_PROMPT}",
                      f"rl.max_new_tokens={NORM_N}", "rl.updates_per_rollout=2", "rl.micro_batches=1")
    clock = {"t": 100.0}
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock["t"])
    monkeypatch.setattr(rl_loop, "time", fake_time)
    monkeypatch.setattr(grpo_module, "time", fake_time)
    sample = sampler_stub(COMPLETIONS, NORM_G, NORM_N)

    def generate(*args):
        clock["t"] += 2.0
        return sample(*args)

    def old_logprobs(params, batch):
        clock["t"] += 0.5
        return np.zeros(batch["mask"].shape, np.float32)

    def update(state, ref_params, batch):
        clock["t"] += 0.75
        return state, dict.fromkeys((*grpo_module._SUM_KEYS, *grpo_module._EXTREMES, "loss", "grad_norm",
                                     "update_applied", "update_skipped"), 0.0)

    run = rl_loop._Run(cfg, FixedPrompts(), TOK, [(number_reward, 1.0)], build(cfg), None, update, generate, None,
                       old_logprobs=old_logprobs)
    _, rec = rl_loop._grpo_step(run, {"params": None}, None, 0, jax.random.key(0))
    assert (rec["rollout_time_s"], rec["old_logprobs_time_s"], rec["update_time_s"], rec["step_time_s"]) == \
        (2.0, 0.5, 1.5, 4.0)
    assert rec["rollout_tokens"] == 100 and rec["rollout_tokens_per_s"] == 50.0
    assert rec["tokens"] == 188 and rec["tokens_per_s"] == 47.0


# One-line bugs of the step's timing figures (rl/loop.py _grpo_step), each caught by the check above.
TIMING_BROKEN = {
    "rollout_rate_over_the_whole_step": ('"rollout_tokens_per_s": ds["rollout_tokens"] / t_rollout',
                                         '"rollout_tokens_per_s": ds["rollout_tokens"] / dt'),
    "update_time_holds_the_pi_old_pass": ('"update_time_s": t_update - m["old_logprobs_time_s"]',
                                          '"update_time_s": t_update'),
    "update_time_from_the_step_start": ("t1 = time.perf_counter()\n", "t1 = t0\n"),
}


@pytest.mark.parametrize("variant", list(TIMING_BROKEN))
def test_broken_timing_figures_are_caught(variant, monkeypatch):
    old, new = TIMING_BROKEN[variant]
    monkeypatch.setattr(rl_loop, "_grpo_step", mutated(rl_loop, "_grpo_step", old, new))
    with pytest.raises(AssertionError):
        check_time_split(monkeypatch)
