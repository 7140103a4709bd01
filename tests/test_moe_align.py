"""moe.group_align_rows (docs/levers.md, hybridmoe/model/moe_align.py): the dispatch writes each local
expert's rows from a multiple of `align`, padded with zero rows. The layout (every local expert on a
multiple, every row where the inverse says, the sort's order kept), exactness against the lever off
through the grouped matmuls (xla and the Mosaic kernels interpreted, all experts local and a shard of
them, both backwards of the row moves), the validator, and the broken variants the proofs catch.

Legend: T tokens, k experts per token, E experts, G local experts, D model width, F hidden half.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from broken_variants import mutated
from helpers import tiny_config
from hybridmoe.config import ConfigError
from hybridmoe.kernels.gmm import KernelTiles, Tiling
from hybridmoe.model import moe as moe_mod
from hybridmoe.model import moe_align

T, K_, E, D, F = 40, 2, 4, 16, 16
ALIGN = 8
# Whether the dispatch computes each real row as without the lever: the output bit for bit, each
# gradient within float32 reassociation (the weight gradients sum the rows in other tiles).
CLEAN_TOL = 1e-6


def _routing(seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (T, D))
    # Uneven experts: expert 0 takes most rows, no size a multiple of ALIGN in general.
    idx = jax.random.categorical(keys[1], jnp.log(jnp.array([5.0, 1.0, 2.0, 1.5])), shape=(T, K_)).astype(jnp.int32)
    w = jax.random.uniform(keys[2], (T, K_), jnp.float32, 0.1, 1.0)
    wi = jax.random.normal(keys[3], (E, D, 2 * F)) * 0.3
    wo = jax.random.normal(keys[4], (E, F, D)) * 0.3
    cot = jax.random.normal(keys[5], (T, D))
    return x, w, idx, wi, wo, cot


def layout_problems() -> list[str]:
    """Where aligned_layout breaks its contract on _routing's rows, for all experts local and two shards."""
    x, w, idx, *_ = _routing()
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = np.asarray(jnp.bincount(flat, length=E))
    problems = []
    for offset, local in ((0, E), (1, 2), (3, 1)):
        buf, inv, padded = (np.asarray(a) for a in moe_align.aligned_layout(
            flat, order, jnp.asarray(sizes, jnp.int32), align=ALIGN, group_offset=offset, num_local=local))
        at = f"offset {offset}, {local} local"
        if (buf.shape != (moe_align.aligned_rows(T * K_, local, ALIGN),) or padded.sum() > buf.shape[0]
                or buf.shape[0] % ALIGN):
            problems.append(f"{at}: buffer {buf.shape}, sizes summing to {padded.sum()}")
            continue
        starts = np.cumsum(padded) - padded
        for e in range(E):
            rows = buf[starts[e]:starts[e] + padded[e]]
            real = rows[rows >= 0]
            # The expert's rows in the sort's order, then only padding.
            if list(real) != [int(r) for r in np.asarray(order) if int(flat[r]) == e]:
                problems.append(f"{at}: expert {e} holds rows {list(real)}")
            if not ((rows[:len(real)] >= 0).all() and (rows[len(real):] == moe_align.PAD).all()):
                problems.append(f"{at}: expert {e}'s rows are not first")
            if offset <= e < offset + local:
                if starts[e] % ALIGN or padded[e] % ALIGN or padded[e] - sizes[e] >= ALIGN:
                    problems.append(f"{at}: local expert {e} at {starts[e]}, {padded[e]} rows for {sizes[e]}")
            elif e != offset - 1 and padded[e] != sizes[e]:
                problems.append(f"{at}: foreign expert {e} padded")
        if not (buf[padded.sum():] == moe_align.PAD).all() or not (buf[inv] == np.arange(T * K_)).all():
            problems.append(f"{at}: a row is not where the inverse says")
    return problems


def test_layout_puts_every_local_expert_on_a_multiple_and_every_row_in_place():
    assert not layout_problems()


def _plan(backend, align, gather_backward):
    tiles = KernelTiles.shared(Tiling(tm=8, tk=8, tn=8)) if backend == "pallas_tpu" else None
    return moe_mod.GroupedPlan(num_experts=E, backend=backend, tiles=tiles, interpret=backend == "pallas_tpu",
                               align_rows=align, gather_backward=gather_backward, router_grad_from_wo_input=True)


def _value_and_grads(plan, offset, local, args):
    x, w, idx, wi, wo, cot = args

    def f(x, w, wi, wo):
        y, _ = moe_mod.grouped_experts(x, w, idx, wi[offset:offset + local], wo[offset:offset + local], plan,
                                       group_offset=offset)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(x, w, wi, wo)
    return np.asarray(y), [np.asarray(g) for g in grads]


def _errors(plan_on, plan_off, offset, local, args) -> dict:
    y_on, g_on = _value_and_grads(plan_on, offset, local, args)
    y_off, g_off = _value_and_grads(plan_off, offset, local, args)
    out = {"y": float(np.abs(y_on - y_off).max() / np.abs(y_off).max())}
    for name, a, b in zip(("dx", "dw", "dwi", "dwo"), g_on, g_off):
        out[name] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    return out


CASES = {  # name: (backend, offset, local experts, gather_backward)
    "xla": ("xla", 0, E, False),
    "xla_shard_gathers": ("xla", 1, 2, True),
    "pallas": ("pallas_tpu", 0, E, True),
    "pallas_shard": ("pallas_tpu", 1, 2, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_real_row_is_computed_as_without_the_lever(case):
    backend, offset, local, gather = CASES[case]
    args = _routing()
    errors = _errors(_plan(backend, ALIGN, gather), _plan(backend, 0, gather), offset, local, args)
    assert errors["y"] == 0.0 and max(errors.values()) < CLEAN_TOL, errors


def test_fp8_experts_on_the_aligned_layout_equal_off():
    """quant.fp8_gmm's grouped matmuls (per-channel fp8 weights) on the aligned layout: the padding rows
    change no real row's result."""
    args = _routing()
    on, off = (dataclasses.replace(_plan("xla", a, False), fp8=True) for a in (ALIGN, 0))
    errors = _errors(on, off, 0, E, args)
    assert errors["y"] == 0.0 and max(errors.values()) < CLEAN_TOL, errors


# One-line bugs in the aligned dispatch, each caught by the comparison with the lever off.
BROKEN = {
    # The kernels told the unpadded sizes: every expert after the first reads shifted rows.
    "sizes_unpadded": lambda: (moe_align, "aligned_layout", mutated(
        moe_align, "aligned_layout", "return buffer_A, inverse_M, padded_E", "return buffer_A, inverse_M, sizes_E")),
    # Rows placed one past their place within the expert.
    "rows_one_late": lambda: (moe_align, "aligned_layout", mutated(
        moe_align, "aligned_layout", "+ jnp.arange(M, dtype=jnp.int32) - starts_E", "+ jnp.arange(M, dtype=jnp.int32) + 1 - starts_E")),
    # The first local expert's start left where the sort put it (no padding before it).
    "no_gap_before_the_shard": lambda: (moe_align, "aligned_layout", mutated(
        moe_align, "aligned_layout", "jnp.where(experts_E == off - 1, gap, 0)", "0")),
    # The buffer's rows not rounded to a multiple of align: every kernel call pads it by a copy.
    "buffer_not_whole_tiles": lambda: (moe_align, "aligned_rows", mutated(
        moe_align, "aligned_rows", "return -(-(num_rows + (num_local + 1) * (align - 1)) // align) * align",
        "return num_rows + (num_local + 1) * (align - 1)")),
    # The routing weight read at the row's position in the sort, not at its token row.
    "weight_of_another_row": lambda: (moe_align, "row_values", mutated(
        moe_align, "row_values", "v_M[jnp.where(real_A, buffer_A, 0)]", "v_M[jnp.arange(buffer_A.shape[0]) % v_M.shape[0]]")),
}


@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variants_are_caught(variant, monkeypatch):
    module, name, broken = BROKEN[variant]()
    monkeypatch.setattr(module, name, broken)
    if layout_problems():  # a layout off its contract (rows still right, or not)
        return
    args = _routing()
    worst = {}
    for case, (backend, offset, local, gather) in CASES.items():
        if backend != "xla":
            continue  # the layout is the dispatch's, the same for every backend
        errors = _errors(_plan(backend, ALIGN, gather), _plan(backend, 0, gather), offset, local, args)
        worst[case] = max(errors.values())
    assert max(worst.values()) > 100 * CLEAN_TOL, (variant, worst)


@functools.cache
def _problems(*overrides):
    with pytest.raises(ConfigError) as e:
        tiny_config(*overrides, platform="cpu")
    return {p[0]: p[1] for p in e.value.problems}


def test_refused_off_the_dropless_sort_and_group_path():
    msg = _problems("moe.group_align_rows=12", "moe.impl=dense", "moe.capacity_factor=1.0")["moe.group_align_rows"]
    assert "multiple of 8" in msg and "moe.impl=sparse" in msg and "dropless" in msg, msg
    cfg = tiny_config("moe.group_align_rows=128", platform="cpu")
    assert moe_mod.GroupedPlan.of(cfg.model, cfg.moe, cfg.kernels).align_rows == 128
    assert not moe_mod.GroupedPlan.of(cfg.model, cfg.moe, cfg.kernels).is_default  # the grouped path runs it


def test_the_layer_on_the_mesh_through_the_ring_and_token_chunks_equals_off():
    """The production MoE layer on the 8-device mesh, the experts over the ring (mesh.expert=2: a traced
    offset per shard) in two token chunks: the lever on against off, the output and every gradient."""
    from helpers import TWO_LAYERS, tiny_params
    from hybridmoe.run.setup import build

    def run(align):
        cfg = tiny_config(*TWO_LAYERS, "kernels.gmm.xla_impl=ragged_dot", "mesh.expert=2", "moe.token_chunks=2",
                          f"moe.group_align_rows={align}", platform="cpu")
        p = jax.tree.map(lambda a: a[0], tiny_params(cfg)["blocks"][0]["moe"])
        x = jax.random.normal(jax.random.key(1), (8, 16, cfg.model.d_model))

        def f(p, x):
            y = moe_mod.moe_layer(p, x, cfg.model, cfg.moe, cfg.kernels)
            return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) % 7), y

        with build(cfg).context():
            out = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, x)
        return jax.tree.map(lambda a: np.asarray(a, np.float32), out)

    on, off = run(ALIGN), run(0)
    errors = [float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off))]
    assert max(errors) < 1e-5, errors


def test_the_chip_cases_aligned_arms_bring_their_results_back_to_the_case_layout():
    """tools/chip_cases' aligned arms (LaidOut: inputs laid out before the timed program, results brought
    back after) at the tiny geometry, interpreted: the grouped matmul's and the fused MoE MLP's
    forward and gradients equal the unaligned Pallas arm's on the case's own rows."""
    from hybridmoe.tools import chip_cases as cc

    for family, aligned, plain in (("gmm", "pallas_tpu_aligned_16", "pallas_tpu"),
                                   ("moe_mlp", "pallas_tpu_fused_aligned_16", "pallas_tpu_fused")):
        (case,) = cc.cases("tiny", interpret=True, families=[family]).values()
        inputs = case.make_inputs()
        got = {}
        for name in (aligned, plain):
            built = case.backends[name](inputs)
            fn, args = built.fwd_bwd
            got[name] = jax.tree.map(np.asarray, case.view(built.restore(fn(*args), True), backward=True))
        assert built.restore is cc.as_given  # the plain arm runs on the case's rows
        for a, b in zip(jax.tree.leaves(got[aligned]), jax.tree.leaves(got[plain])):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-2 * np.abs(b).max(), family
