"""Each loop's optimizer against AdamW written out by hand from the config.

The supervised loop (and the RL run's supervised warm-up) steps with train.* (learning rate,
linear warm-up over train.warmup_steps, betas, weight decay, global-norm clip); the GRPO phase with
rl.learning_rate and rl.lr_warmup_steps and the same betas, clip and decay. The optimizers are
taken where each loop hands them to its jitted step (a spy in place of the step builder; for GRPO,
where jit_grpo_step hands its optimizer to the step function), so a loop that builds the right
optimizer and passes another shows. The reference below is the AdamW update in
float64 numpy from those numbers alone (not optax), run for several steps of known gradients that
differ step to step (so the betas show) on the tiny model's parameter tree (so the decay of every
leaf shows). Adam's update is ~1 per element whatever the gradient's scale, so each step's size
reads the learning rate and the schedule directly.

Every value in the config differs from the schema's defaults and from each other (the supervised
and the GRPO learning rates, the two betas), so reading the wrong one shows.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from hybridmoe.rl import grpo as grpo_mod
from hybridmoe.rl import loop as rl_loop
from hybridmoe.rl import memory_plan as memory_plan_mod
from hybridmoe.run import setup as setup_mod
from hybridmoe.run import step as step_mod
from hybridmoe.train import loop as train_loop
from broken_variants import mutated
from helpers import TWO_LAYERS, tiny_config, tiny_params

# TWO_LAYERS: one layer of each mixer, so every kind of parameter (GDN's, attention's, the MoE
# block's, norms, embeddings) is in the tree the optimizers update, at half of tiny's leaves (each
# loop's update is a compile over the whole tree).
OVERRIDES = (*TWO_LAYERS, "train.learning_rate=2e-3", "train.warmup_steps=3", "train.weight_decay=0.5", "train.b1=0.8",
             "train.b2=0.97", "train.grad_clip=0.5", "rl.learning_rate=7e-4", "rl.lr_warmup_steps=2")
STEPS = 6
GRAD_NORMS = (2.0, 0.1, 3.0, 0.3, 1.5, 0.05)  # above and below train.grad_clip (0.5): the clip on and off
TOL = 1e-4  # float32 against float64; measured ~1e-6


def reference_adamw(params, grads_per_step, *, lr, warmup, b1, b2, weight_decay, clip, eps=1e-8):
    """Each step's update (the change to the parameters), float64, given each step's parameters
    `params[k]`: clip by global norm, Adam with bias correction, decoupled decay on every parameter,
    learning rate lr * min(k, warmup) / warmup at step k (from 0)."""
    m = v = None
    out = []
    for k, (p, grads) in enumerate(zip(params, grads_per_step)):
        p = [np.asarray(x, np.float64) for x in jax.tree.leaves(p)]
        g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
        m = m or [np.zeros_like(x) for x in p]
        v = v or [np.zeros_like(x) for x in p]
        norm = np.sqrt(sum(np.sum(x * x) for x in g))
        if clip > 0 and norm > clip:
            g = [x * clip / norm for x in g]
        rate = lr * min(k, warmup) / warmup if warmup else lr
        step = []
        for i in range(len(p)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            mhat, vhat = m[i] / (1 - b1 ** (k + 1)), v[i] / (1 - b2 ** (k + 1))
            step.append(-rate * (mhat / (np.sqrt(vhat) + eps) + weight_decay * p[i]))
        out.append(step)
    return out


def _grads(params):
    """Known gradients, a different direction and norm each step."""
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(7)
    out = []
    for norm in GRAD_NORMS:
        g = [rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
        scale = norm / np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g))
        out.append(jax.tree.unflatten(tree, [(x * scale).astype(np.float32) for x in g]))
    return out


def _run(optimizer, params, grads_per_step):
    """(the parameters each step starts from, each step's update)."""
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    starts, updates = [], []
    for g in grads_per_step:
        u, state = update(g, state, params)
        starts.append(params)
        updates.append(u)
        params = optax.apply_updates(params, u)
    return starts, updates


def _worst_step_error(got, want):
    """The largest relative L2 error of one step's update, over steps and leaves; where the
    reference update is zero (warm-up's step 0) the largest absolute one."""
    worst, where = 0.0, ""
    for k, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(jax.tree.leaves(g), w)):
            a = np.asarray(a, np.float64)
            scale = np.linalg.norm(b)
            err = np.linalg.norm(a - b) / scale if scale > 0 else np.abs(a).max()
            if err > worst:
                worst, where = err, f"step {k}, leaf {i}"
    return worst, where


# Sabotages: (module, function, fragment, replacement); the loops' optimizers are built by
# run.setup.build (supervised) and rl.grpo.rl_optimizer (GRPO), both through make_optimizer.
BROKEN = {
    "grpo_at_train_learning_rate": (grpo_mod, "rl_optimizer", '"learning_rate": cfg.rl.learning_rate',
                                    '"learning_rate": cfg.train.learning_rate'),
    "grpo_warmup_from_train": (grpo_mod, "rl_optimizer", '"warmup_steps": cfg.rl.lr_warmup_steps',
                               '"warmup_steps": cfg.train.warmup_steps'),
    "betas_swapped": (step_mod, "make_optimizer", "b1=t.b1, b2=t.b2", "b1=t.b2, b2=t.b1"),
    "warmup_off_by_one": (step_mod, "make_optimizer", "t.learning_rate, t.warmup_steps)",
                          "t.learning_rate, t.warmup_steps + 1)"),
    "weight_decay_dropped": (step_mod, "make_optimizer", "weight_decay=t.weight_decay", "weight_decay=0.0"),
    "weight_decay_not_on_norms": (
        step_mod, "make_optimizer", "weight_decay=t.weight_decay",
        "weight_decay=t.weight_decay, mask=lambda p: jax.tree_util.tree_map_with_path("
        "lambda k, x: 'norm' not in jax.tree_util.keystr(k), p)"),
    "clip_dropped": (step_mod, "make_optimizer", "if t.grad_clip > 0 else []", "if False else []"),
    # the GRPO step handed the supervised optimizer of its set-up
    "grpo_step_given_the_supervised_optimizer": (grpo_mod, "jit_grpo_step", "grpo_step(setup.cfg, rl_optimizer(setup.cfg))",
                                                 "grpo_step(setup.cfg, setup.optimizer)"),
}


class _Captured(Exception):
    """Raised by the spies once a loop has handed its step the optimizer (nothing is compiled)."""


def loop_optimizers(cfg, monkeypatch, patch=None) -> dict:
    """The optimizers the loops give their jitted steps: the supervised loop's, the RL warm-up's
    and the GRPO phase's, taken where each loop builds its step. `patch` applies a broken variant
    after the spies are in place (a mutated loop reads its module's names as they are then)."""
    got = {}

    def sft_step(setup):
        got["supervised"] = setup.optimizer
        raise _Captured

    def warmup_step(setup):
        got["rl_warmup"] = setup.optimizer
        raise _Captured

    def grpo_step(cfg, optimizer):
        got["grpo"] = optimizer
        return lambda *args: None  # never traced: the memory plan below compiles nothing

    def memory_plan(cfg, setup, tokenizer, with_reference, budget):
        """The RL loop's plan builds its GRPO step first (then the warm-up's): the step is made as
        the loop makes it (rl.grpo.jit_grpo_step, read from its module: a broken variant patches it),
        and no count is planned."""
        grpo_mod.jit_grpo_step(setup, with_reference)
        return None, None, None

    monkeypatch.setattr(train_loop, "jit_train_step", sft_step)
    monkeypatch.setattr(rl_loop, "jit_train_step", warmup_step)
    monkeypatch.setattr(grpo_mod, "grpo_step", grpo_step)
    monkeypatch.setattr(rl_loop, "_memory_plan", memory_plan)
    if patch is not None:
        patch()
    setup_mod.forget_setups()  # set-ups built with the code as it is now (a patched make_optimizer)
    with pytest.raises(_Captured):
        train_loop.train(cfg, None, progress=False)
    with pytest.raises(_Captured):
        rl_loop.run_rl(cfg, None, progress=False)
    return got


@pytest.fixture(scope="module")
def case():
    cfg = tiny_config(*OVERRIDES)
    params = tiny_params(cfg)
    return cfg, params, _grads(params)


def _patch(monkeypatch, variant):
    module, name, old, new = BROKEN[variant]
    fn = mutated(module, name, old, new)
    monkeypatch.setattr(module, name, fn)
    if name == "make_optimizer":  # imported by name where the loops build their optimizers
        monkeypatch.setattr(setup_mod, "make_optimizer", fn)
        monkeypatch.setattr(grpo_mod, "make_optimizer", fn)
    if name == "rl_optimizer":
        monkeypatch.setattr(rl_loop, "rl_optimizer", fn)
    if name == "jit_grpo_step":  # imported by name where the memory plan compiles the update
        monkeypatch.setattr(memory_plan_mod, "jit_grpo_step", fn)


@pytest.mark.parametrize("variant", [None, *BROKEN])
def test_each_loops_optimizer_is_adamw_from_its_config(variant, case, monkeypatch):
    cfg, params, grads = case
    t, r = cfg.train, cfg.rl
    common = dict(b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, clip=t.grad_clip)
    own = {"supervised": dict(lr=t.learning_rate, warmup=t.warmup_steps),
           "rl_warmup": dict(lr=t.learning_rate, warmup=t.warmup_steps),  # the RL warm-up steps with train.*
           "grpo": dict(lr=r.learning_rate, warmup=r.lr_warmup_steps)}
    optimizers = loop_optimizers(cfg, monkeypatch, None if variant is None else lambda: _patch(monkeypatch, variant))
    assert set(optimizers) == set(own)
    errors = {}
    for loop, optimizer in optimizers.items():
        starts, updates = _run(optimizer, params, grads)
        errors[loop] = _worst_step_error(updates, reference_adamw(starts, grads, **own[loop], **common))
    print(f"{variant or 'clean'}: worst relative step error {errors} (tolerance {TOL:.0e})")
    worst = max(e for e, _ in errors.values())
    if variant is None:
        assert worst < TOL, errors
    else:
        assert worst > 10 * TOL, errors


def test_one_step_moves_each_parameter_by_the_learning_rate(case):
    """One update's size: after step 0 of a run without warm-up, Adam's bias-corrected update is
    g / (|g| + eps), about sign(g) per element, so each parameter moves by about the learning rate
    whatever its gradient's scale (plus the decay, learning_rate * weight_decay * p)."""
    cfg, params, grads = case
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"warmup_steps": 0, "grad_clip": 0.0})})
    _, (update,) = _run(setup_mod.build(cfg).optimizer, params, grads[:1])
    after = optax.apply_updates(params, update)
    lr, wd = cfg.train.learning_rate, cfg.train.weight_decay
    for p0, p1, g in zip(jax.tree.leaves(params), jax.tree.leaves(after), jax.tree.leaves(grads[0])):
        p0, p1, g = (np.asarray(x, np.float64) for x in (p0, p1, g))
        want = -lr * (g / (np.abs(g) + 1e-8) + wd * p0)
        np.testing.assert_allclose(p1 - p0, want, rtol=0, atol=lr * 1e-3)


def test_a_one_step_warm_up_holds_step_0_and_runs_step_1_at_the_full_rate():
    """train.warmup_steps=1: step 0 runs at rate 0 (the weights stay), step 1 at the full rate.
    A gradient of 2.0 twice: Adam's bias-corrected update at step 1 is g / |g| = 1, so the weight
    moves 1.0 -> 1.0 -> 1.0 - 0.1."""
    from hybridmoe.config.schema import TrainConfig

    t = TrainConfig(learning_rate=0.1, warmup_steps=1, grad_clip=0.0, weight_decay=0.0)
    optimizer = step_mod.make_optimizer(t)
    params = {"w": np.ones(3, np.float32)}
    grads = {"w": np.full(3, 2.0, np.float32)}
    state = optimizer.init(params)
    moved = []
    for _ in range(2):
        update, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, update)
        moved.append(np.asarray(params["w"]).tolist())
    np.testing.assert_allclose(moved[0], [1.0] * 3, rtol=0, atol=1e-7)
    np.testing.assert_allclose(moved[1], [0.9] * 3, rtol=0, atol=1e-6)
