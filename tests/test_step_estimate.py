"""The step-time cost model (analysis/hlo_cost.py per op, analysis/step_estimate.py per step) and
the cost estimates our Pallas kernels state.

- Trip counts: a tiny jitted scan around a fori_loop; the count read from XLA's annotation and,
  with the annotation removed, from the loop condition's compare; FLOPs multiply through both.
- Bytes: a loop filling a stack row by row moves a row per iteration (slices and in-place updates
  at the bytes they touch), not the stack.
- Kernels: each Pallas kernel's stated CostEstimate FLOPs equal the count of its reference
  (the dots XLA compiles for the same math, counted by the model's own HLO reader) at a small
  shape; a cost estimate off by 2x fails.
- The compiled `small` step on the 8-device CPU mesh: its FLOPs (trip counts applied) within 10%
  of the analytic count (tools/flops.designed_step_flops); ignoring trip counts fails.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ATTENTION_LAYERS, counted_loop_hlo
from hybridmoe.analysis import hlo_cost as hc
from hybridmoe.analysis import step_estimate as se
from hybridmoe.analysis.program import iter_eqns


def _compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _stated(fn, *args) -> dict[str, int]:
    """{kernel name: stated FLOPs} of every pallas_call fn traces (summed per name)."""
    out: dict[str, int] = {}
    for eqn in iter_eqns(jax.make_jaxpr(fn)(*args)):
        if eqn.primitive.name == "pallas_call":
            name = eqn.params.get("name") or eqn.params["name_and_src_info"].name
            est = eqn.params.get("cost_estimate")
            assert est is not None, f"the Pallas kernel {name} states no cost estimate"
            out[name] = out.get(name, 0) + est.flops
    return out


# ---------------------------------------------------------------------------------------------
# Trip counts

INNER, OUTER, N = 5, 3, 16


def _nested(x, w):
    def inner(i, acc):
        return jnp.tanh(acc @ w)

    def outer(acc, _):
        return jax.lax.fori_loop(0, INNER, inner, acc), None

    return jax.lax.scan(outer, x, None, length=OUTER)[0]


@pytest.fixture(scope="module")
def nested_text():
    x = jnp.ones((N, N), jnp.float32)
    return _compiled_text(_nested, x, x)


def test_trip_counts_from_the_annotation_and_from_the_condition(nested_text):
    assert sorted(n for n in hc.while_trip_counts(nested_text).values()) == sorted([INNER, OUTER])
    # Without XLA's annotation (what a TPU compile prints), the condition's `i < N` says the same.
    bare = nested_text.replace('"known_trip_count"', '"unknown_trip_count"')
    assert '"known_trip_count"' not in bare
    assert sorted(hc.while_trip_counts(bare).values()) == sorted([INNER, OUTER])


def test_loop_flops_multiply_through_nested_loops(nested_text):
    one = 2 * N**3
    want = one * INNER * OUTER
    for text in (nested_text, nested_text.replace('"known_trip_count"', '"unknown_trip_count"')):
        got = hc.hlo_flops(text)
        assert got == want, (got, want)
    assert hc.hlo_flops(nested_text, apply_trip_counts=False) == one


# ---------------------------------------------------------------------------------------------
# Bytes of ops that touch part of a buffer

ROWS, WIDTH = 256, 1024


def _fill_rows(x):
    """out[i] = 2 x[i], one row per iteration: each iteration slices one row of x and updates one
    row of out in place."""
    def body(i, out):
        row = jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(out, 2.0 * row, i, 0)

    return jax.lax.fori_loop(0, x.shape[0], body, jnp.zeros_like(x))


def test_a_loop_filling_a_stack_row_by_row_moves_rows_not_the_stack():
    text = _compiled_text(_fill_rows, jnp.ones((ROWS, WIDTH), jnp.float32))
    est = hc.Estimator(text)
    moved = sum(c.bytes * k for c, k in est.ops())
    buffer = ROWS * WIDTH * 4
    # the zeros written once, then per iteration one row read and one row written: 3 buffers' worth
    assert moved == pytest.approx(3 * buffer, rel=0.01), moved / buffer
    # Sabotage: every op charged its whole operands and result (the stack read and written each iteration).
    whole = sum((sum(hc.type_bytes(est.types[comp].get(o, "")) for o in i.operands) + hc.type_bytes(i.type_text))
                * est_k for comp, i, est_k in _walk_instrs(est))
    assert whole > 100 * buffer, whole / buffer


def _walk_instrs(est):
    """(computation, instruction, times run) of the loop body's fusions and slices, by trip count."""
    loop = next(i for i in est.comps[est.entry] if i.opcode == "while")
    body = re.search(r"\bbody=%?([\w.\-]+)", loop.attrs).group(1)
    n = hc.trip_count(loop, est.comps, est.comps[est.entry])
    return [(body, i, n) for i in est.comps[body] if i.opcode in ("fusion", "dynamic-slice", "dynamic-update-slice")]


# ---------------------------------------------------------------------------------------------
# Kernels' stated FLOPs against their references

M, K, NN, E = 256, 128, 256, 4
SIZES = jnp.array([40, 0, 150, 66], jnp.int32)  # an empty group, groups straddling row tiles


def _gmm_cases(sizes=SIZES, num_local=E, group_offset=0):
    """kernel: (its call, the reference: the local groups' rows through one dense matmul). With
    num_local < E (expert parallelism) the local rows are the balanced share M num_local / E, which
    `sizes` must then hold exactly."""
    from hybridmoe.kernels.gmm import pallas_tpu as gp
    from hybridmoe.kernels.gmm.tiling import Tiling

    t = Tiling(tm=128, tk=128, tn=128)
    rows = M * num_local // E
    x = jnp.ones((M, K), jnp.bfloat16)
    w = jnp.ones((num_local, K, NN), jnp.bfloat16)
    g = jnp.ones((M, NN), jnp.bfloat16)
    wo = jnp.ones((num_local, NN // 2, K), jnp.bfloat16)  # [G, F, D], F = NN / 2
    pre = jnp.ones((M, NN), jnp.bfloat16)
    common = dict(group_offset=group_offset, sharded=False, tiling=t, interpret=True)
    return {
        "gmm": (lambda: gp.gmm(x, w, sizes, transpose_rhs=False, out_dtype=jnp.float32, **common),
                lambda: _dense_flops((rows, K), (K, NN))),
        "tgmm": (lambda: gp.tgmm(x, g, sizes, num_local=num_local, out_dtype=jnp.float32, **common),
                 lambda: _dense_flops((K, rows), (rows, NN))),
        "wi_fused_swiglu_fwd": (lambda: gp.wi_fused_swiglu(x, w, sizes, tile_n_per_half=128, mode="float32", **common),
                                lambda: _dense_flops((rows, K), (K, NN))),
        "wo_fused_dswiglu_dlhs": (lambda: gp.wo_fused_dswiglu_dlhs(
            jnp.ones((M, K), jnp.bfloat16), wo, sizes, pre, preact_tile_n_per_half=128, row_scale_M=None,
            out_tile_n_per_half=128, mode="float32", **common), lambda: _dense_flops((rows, K), (K, NN // 2))),
    }


def _dense_flops(a, b) -> float:
    return hc.hlo_flops(_compiled_text(lambda x, y: x @ y, jnp.ones(a, jnp.float32), jnp.ones(b, jnp.float32)))


@pytest.mark.parametrize("kernel", ["gmm", "tgmm", "wi_fused_swiglu_fwd", "wo_fused_dswiglu_dlhs"])
def test_gmm_kernels_state_their_reference_flops(kernel):
    call, reference = _gmm_cases()[kernel]
    stated = _stated(call)
    assert set(stated) == {kernel}
    assert stated[kernel] == reference(), (stated, reference())


@pytest.mark.parametrize("kernel", ["gmm", "tgmm", "wi_fused_swiglu_fwd", "wo_fused_dswiglu_dlhs"])
def test_gmm_kernels_state_only_their_local_groups_rows(kernel):
    """Under expert parallelism (2 local groups of 4, balanced routing) a kernel visits only the
    local groups' tiles: its stated FLOPs are those rows' (half of M), not every row's."""
    balanced = jnp.full((E,), M // E, jnp.int32)
    call, reference = _gmm_cases(balanced, num_local=2, group_offset=2)[kernel]
    stated = _stated(call)
    assert stated[kernel] == reference(), (stated, reference())


B, T, NH, G, A = 1, 256, 4, 2, 64


def _attention_inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, NH, A)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, G, A)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return q, k, k, pos, jnp.ones((B, T), jnp.int32)


def _reference_attention_flops(block_q: int, block_k: int):
    """(forward, backward) dot FLOPs of the dense reference, scaled to the blocks a causal flash
    schedule visits (blocks holding any visible query-key pair, counted from the mask itself)."""
    from hybridmoe.kernels.attention.xla import attention

    q, k, v, pos, seg = _attention_inputs()
    fwd = lambda q, k, v: attention(q, k, v, q_pos_BT=pos, kv_pos_BS=pos, q_seg_BT=seg, kv_seg_BS=seg, scale=0.1)  # noqa: E731
    f = hc.hlo_flops(_compiled_text(fwd, q, k, v))
    both = hc.hlo_flops(_compiled_text(lambda q, k, v: jax.vjp(fwd, q, k, v)[1](jnp.ones_like(q)), q, k, v))
    mask = np.tril(np.ones((T, T), bool))
    blocks = mask.reshape(T // block_q, block_q, T // block_k, block_k).any(axis=(1, 3))
    share = blocks.sum() / blocks.size
    # The vjp replays the scores q k^T but not p v (its output is unused): its backward is what
    # the vjp adds beyond half the forward.
    return f * share, (both - f / 2) * share


@pytest.mark.parametrize("blocks", [(256, 256), (128, 128), (128, 256)])
def test_flash_attention_kernels_state_their_reference_flops(blocks):
    from hybridmoe.kernels.attention import ops

    block_q, block_k = blocks
    q, k, v, pos, seg = _attention_inputs()
    opts = dict(q_pos=pos, kv_pos=pos, q_seg=seg, kv_seg=seg, scale=0.1, backend="pallas_tpu",
                block_q=block_q, block_k=block_k, interpret=True)
    fwd = _stated(lambda: ops.attention_fwd(q, k, v, **opts))
    o, lse = jax.eval_shape(lambda: ops.attention_fwd(q, k, v, **opts))
    bwd = _stated(lambda: ops.attention_bwd(q, k, v, jnp.ones(o.shape, o.dtype), jnp.ones(lse.shape, lse.dtype),
                                            q, **opts))
    ref_fwd, ref_bwd = _reference_attention_flops(block_q, block_k)
    assert fwd["flash_attention_forward"] == pytest.approx(ref_fwd, rel=1e-9), (fwd, ref_fwd)
    # The kernels' backward recomputes the scores in both passes and do v^T in both (3 matmuls a
    # block beyond the reference's 4: 1.5 forwards).
    got = bwd["flash_attention_dq"] + bwd["flash_attention_dkv"]
    assert got == pytest.approx(ref_bwd + 1.5 * ref_fwd, rel=1e-9), (bwd, ref_bwd, ref_fwd)


CP, CP_T, CP_BQ, CP_BK = 4, 64, 16, 32  # context ranks, queries per rank, blocks


def _rank_positions(rank: int, load_balanced: bool) -> np.ndarray:
    """A context rank's query positions among CP x CP_T keys: half-chunks r and 2P-1-r, or its shard."""
    half = CP_T // 2
    if load_balanced:
        return np.concatenate([np.arange(rank * half, (rank + 1) * half),
                               np.arange((2 * CP - 1 - rank) * half, (2 * CP - rank) * half)])
    return np.arange(rank * CP_T, (rank + 1) * CP_T)


@pytest.mark.parametrize("load_balanced", [True, False])
def test_flash_kernels_under_context_parallelism_state_the_causal_blocks_of_their_layout(load_balanced):
    """A rank's queries against every rank's keys (S = P t): the stated FLOPs count the blocks
    holding a causal pair for the layout the model built (load-balanced: every rank the same;
    natural order: the last rank's, the slowest), counted here from the positions themselves."""
    from hybridmoe.kernels.attention import ops
    from hybridmoe.parallel.context import rank_query_runs

    S = CP * CP_T
    per_block = 2 * 2 * CP_BQ * CP_BK * A  # forward: q k^T and p v per block, one head
    counts = []
    for rank in range(CP):
        qp = _rank_positions(rank, load_balanced)
        visible = qp[:, None] >= np.arange(S)[None, :]
        counts.append(int(visible.reshape(CP_T // CP_BQ, CP_BQ, S // CP_BK, CP_BK).any(axis=(1, 3)).sum()))
    expected = counts[0] if load_balanced else max(counts)
    assert not load_balanced or len(set(counts)) == 1, counts

    q = jnp.ones((1, CP_T, 1, A), jnp.float32)
    k = jnp.ones((1, S, 1, A), jnp.float32)
    qpos = jnp.asarray(_rank_positions(CP - 1, load_balanced), jnp.int32)[None]
    kpos = jnp.arange(S, dtype=jnp.int32)[None]
    opts = dict(q_pos=qpos, kv_pos=kpos, scale=0.1, backend="pallas_tpu", block_q=CP_BQ, block_k=CP_BK,
                interpret=True, query_runs=rank_query_runs(CP_T, S, load_balanced))
    stated = _stated(lambda: ops.attention_fwd(q, k, k, **opts))["flash_attention_forward"]
    assert stated == expected * per_block, (stated / per_block, expected)
    # Without the layout every block counts (the static bound): 2x the load-balanced work here.
    every = _stated(lambda: ops.attention_fwd(q, k, k, **{**opts, "query_runs": None}))["flash_attention_forward"]
    assert every == (CP_T // CP_BQ) * (S // CP_BK) * per_block


def _gdn_chunk_inputs(batch=1, chunks=3, heads=2, C=16, Kd=32, Vd=48):
    from hybridmoe.kernels.gdn.xla import ChunkInputs

    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    x = ChunkInputs(f(batch, chunks, heads, C, Kd), f(batch, chunks, heads, C, Kd), f(batch, chunks, heads, C, Vd),
                    -jnp.abs(f(batch, chunks, heads, C)), jax.nn.sigmoid(f(batch, chunks, heads, C)))
    starts = jnp.zeros((batch, chunks, C), jnp.int32).at[:, 0, 0].set(1)
    return x, starts, jnp.zeros((batch, heads, Kd, Vd), jnp.float32)


def test_gdn_kernels_state_the_flops_their_chunk_math_compiles_to():
    """The GDN kernels' reference is their own per-chunk math (pallas_chunk.chunk_step): run in
    interpret mode the grid is an XLA loop, and the dots it compiles to, loops applied, are the
    work the stated count must name."""
    from hybridmoe.kernels.gdn import pallas

    x, starts, init = _gdn_chunk_inputs()
    fwd = lambda x: pallas.core_forward(x, starts, init, backend="pallas_tpu", interpret=True)  # noqa: E731
    (o, final), res = jax.eval_shape(fwd, x)
    bwd = lambda x, res: pallas.core_backward(  # noqa: E731
        res, jnp.ones(o.shape, o.dtype), jnp.ones(final.shape, final.dtype), backend="pallas_tpu", interpret=True)
    res = fwd(x)[1]
    stated_fwd = _stated(fwd, x)["gdn_chunk_forward"]
    stated_bwd = _stated(bwd, x, res)["gdn_chunk_backward"]
    compiled_fwd = hc.hlo_flops(_compiled_text(fwd, x))
    compiled_bwd = hc.hlo_flops(_compiled_text(bwd, x, res))
    assert stated_fwd == compiled_fwd, (stated_fwd, compiled_fwd)
    assert stated_bwd == compiled_bwd, (stated_bwd, compiled_bwd)


# ---------------------------------------------------------------------------------------------
# Sabotage: a kernel's cost estimate off by 2x


def test_a_cost_estimate_off_by_2x_is_caught(monkeypatch):
    from hybridmoe.kernels.gdn import pallas_chunk, pallas_tpu as gdn_tpu

    honest = pallas_chunk.chunk_macs
    monkeypatch.setattr(gdn_tpu, "chunk_macs", lambda *a: 2 * honest(*a))
    with pytest.raises(AssertionError):
        test_gdn_kernels_state_the_flops_their_chunk_math_compiles_to()
    from hybridmoe.kernels.gmm import tpu_steps

    honest_cost = tpu_steps.cost
    monkeypatch.setattr(tpu_steps, "cost", lambda flops, *a: honest_cost(2 * flops, *a))
    with pytest.raises(AssertionError):
        test_gmm_kernels_state_their_reference_flops("gmm")


# ---------------------------------------------------------------------------------------------
# The compiled `small` step against the analytic count

# Two micro-batches (a loop of 2) and full remat (the layer stack's forward replayed): the two
# multipliers the analytic count must see and the compiled count must read from the program.
SMALL = ["recipe=small", "train.batch_size=16", "train.micro_batches=2", "remat.policy=full"]
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def small_step():
    from hybridmoe.cli import _inspect_config
    from hybridmoe.tools import train_program as tp

    _, _, cfg = _inspect_config(SMALL, "cpu", 8)
    step = tp.compile_step(cfg, tp.host_target(), with_residuals=False)
    return cfg, step.program.compiled_text


def _analytic(cfg) -> float:
    """The design count inspect prints beside the compiled one (analysis/flops.designed_flops_per_device)."""
    from hybridmoe.analysis.flops import designed_flops_per_device

    return designed_flops_per_device(cfg, 8, "cpu")


def test_small_step_flops_match_the_analytic_count(small_step):
    cfg, text = small_step
    compiled, analytic = hc.hlo_flops(text), _analytic(cfg)
    ignored = hc.hlo_flops(text, apply_trip_counts=False)
    err, broken_err = abs(compiled / analytic - 1), abs(ignored / analytic - 1)
    print(f"compiled {compiled:.4e} analytic {analytic:.4e}: off by {err:.3f}; trip counts ignored: {broken_err:.3f}")
    assert err < TOLERANCE, (compiled, analytic, err)
    # Sabotage: trip counts ignored (XLA's own cost analysis counts a loop body once).
    assert broken_err > TOLERANCE, (ignored, analytic, broken_err)


def test_the_design_count_follows_the_remat_policys_replay():
    """full and custom (which saves only the names it lists: the levers' ids, no matmul output)
    replay the layer stack's forward in the backward, none and minimal do not, auto has no count
    (resolved at trace time): the cell's recipe is custom, so counting it as none would put its
    FLOP check a quarter off."""
    from hybridmoe.analysis.flops import designed_flops_per_device
    from hybridmoe.recipe import load_config

    count = {p: designed_flops_per_device(load_config("small", [f"remat.policy={p}"]), 8, "cpu")
             for p in ("full", "custom", "none", "minimal", "auto")}
    assert count["custom"] == count["full"] > count["none"] == count["minimal"], count
    assert count["auto"] is None


def test_small_step_estimate_prints_every_category(small_step):
    cfg, text = small_step
    est = se.estimate(text, se.HARDWARE["tpu7x"], tokens_per_step=8 * 512 * 2, chips=4, devices=8,
                      model_flops_per_device=_analytic(cfg))
    for cat in ("grouped matmuls", "attention", "GDN", "dense matmuls"):
        assert est["categories"][cat]["flops"] > 0, cat
    assert est["collectives"], "the 8-device step gathers and reduces"
    assert est["serial"]["step_s"] >= est["overlapped"]["step_s"] > 0
    est["designed_flops_per_device"] = _analytic(cfg)
    text_out = se.format_estimate(est, {"label": "reference", "step_s": 1.0, "tokens_per_s_per_chip": 1.0})
    for word in ("grouped matmuls", "attention", "GDN", "dense matmuls", "collectives", "the rest",
                 "not overlapped", "hidden under compute", "MFU", "designed ("):
        assert word in text_out


def test_inspect_prints_and_records_the_estimate(tmp_path, capsys):
    import json

    from hybridmoe.cli import main

    out = tmp_path / "inspect.json"
    # The step tests/test_inspect_gates.py's inspect runs compile (attention layers only): one compile
    # in a cold run, the other read from the cache.
    rc = main(["inspect", "recipe=tiny", *ATTENTION_LAYERS, "train.batch_size=8", "--target", "cpu:8",
               "--estimate-for", "h200", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "step time estimate on h200" in text and "tokens/s per chip" in text
    est = json.loads(out.read_text())["programs"]["base"]["step_estimate"]
    assert est["hardware"]["name"] == "h200" and est["chips"] == 8
    assert est["serial"]["step_s"] >= est["overlapped"]["step_s"] > 0
    assert est["tokens_per_step"] == 8 * 64


def test_a_batched_dot_written_as_a_dilated_convolution_counts_its_real_taps():
    """XLA's TPU form of a batched dot [G, K, M]^T x [G, K, N]: the batch G as a spatial dim with
    window G and lhs_dilate G, so one tap of the window lands on real input; counting the whole
    window would count G times the work."""
    G, K, M, N = 16, 64, 8, 32
    text = f"""HloModule batched_dot

ENTRY %main (a: f32[{G},{K},{M}], b: f32[{G},{K},{N}]) -> f32[{G},{M},{N}] {{
  %a = f32[{G},{K},{M}]{{2,1,0}} parameter(0)
  %b = f32[{G},{K},{N}]{{2,1,0}} parameter(1)
  ROOT %conv = f32[{G},{M},{N}]{{2,1,0}} convolution(%a, %b), window={{size={G} stride={G - 1} lhs_dilate={G}}}, dim_labels=0fb_0io->0bf
}}
"""
    assert hc.hlo_flops(text) == 2 * G * M * N * K


def _offloaded_gather(n: int, rows: int, width: int, *, negate_first: bool = False) -> str:
    """A program as the TPU7x compiler offloads an all-gather over n devices: an async call-start of a
    computation holding the collective (the SparseCore), of x or of -x (some compute before it)."""
    neg = f"  %neg = bf16[{rows},{width}]{{1,0}} negate(%x)\n" if negate_first else ""
    return f"""HloModule offloaded

%gather (p: bf16[{rows},{width}]) -> bf16[{n * rows},{width}] {{
  %p = bf16[{rows},{width}]{{1,0}} parameter(0)
  ROOT %ag = bf16[{n * rows},{width}]{{1,0}} all-gather(%p), channel_id=1, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}
}}

ENTRY %main (x: bf16[{rows},{width}]) -> bf16[{n * rows},{width}] {{
  %x = bf16[{rows},{width}]{{1,0}} parameter(0)
{neg}  %start = ((bf16[{rows},{width}]{{1,0}}), bf16[{n * rows},{width}]{{1,0}}, u32[]) call-start(%{"neg" if negate_first else "x"}), async_execution_thread="sparsecore", to_apply=%gather
  ROOT %done = bf16[{n * rows},{width}]{{1,0}} call-done(%start)
}}
"""


def test_a_collective_offloaded_to_an_async_call_is_counted():
    """The TPU7x compiler runs the weights' all-gathers and the gradients' reduce-scatters on the
    SparseCore, each as an async call-start of a computation holding the collective: it is a
    collective of the step (ring bytes over the links), not a memory op of its call's size."""
    n, rows, width = 4, 1024, 512
    est = se.estimate(_offloaded_gather(n, rows, width), se.HARDWARE["tpu7x"], tokens_per_step=1, chips=2, devices=n)
    gathered = n * rows * width * 2
    assert est["collectives"]["all-gather"]["wire_bytes"] == pytest.approx(gathered * (n - 1) / n)
    assert est["categories"]["the rest"]["bytes"] == 0, est["categories"]["the rest"]


def test_a_dot_written_as_a_padded_convolution_counts_its_real_taps():
    """XLA's TPU form of [B, K] x [K, W, O] (the GDN output projection's backward at the cell): the
    lhs gets a unit spatial dim padded by W - 1 on each side and the weight's W is the window, so
    each output takes the one tap that lands on the real point; the whole window counts W times."""
    B, K, W, O = 32, 64, 16, 8
    text = f"""HloModule padded_dot

ENTRY %main (a: bf16[{B},{K},1], b: bf16[{W},{O},{K}]) -> bf16[{B},{W},{O}] {{
  %a = bf16[{B},{K},1]{{1,0,2}} parameter(0)
  %b = bf16[{W},{O},{K}]{{1,2,0}} parameter(1)
  ROOT %conv = bf16[{B},{W},{O}]{{2,0,1}} convolution(%a, %b), window={{size={W} pad={W - 1}_{W - 1} rhs_reversal=1}}, dim_labels=bf0_0oi->b0f
}}
"""
    assert hc.hlo_flops(text) == 2 * B * K * W * O


def test_a_grpo_steps_estimate_per_chip_and_its_overlap_by_hand():
    """A GRPO update on 8 TPU7x devices (2 a chip: 4 chips) trains one mini-batch's rows; the
    overlapped total hides the compute (a negate) under a longer collective (an offloaded all-gather)."""
    from types import SimpleNamespace

    from hybridmoe.recipe import load_config

    cfg = load_config("tiny", ["rl.prompts_per_step=4", "rl.group_size=4", "rl.updates_per_rollout=4",
                               "rl.epochs_per_rollout=2"])
    tokens = 16 // 2 * cfg.rl.sequence_len  # 16 rows in 2 mini-batches (4 updates over 2 epochs)
    assert se.tokens_per_step(cfg, "grpo") == tokens
    text = _offloaded_gather(4, 1024, 512, negate_first=True)
    step = SimpleNamespace(cfg=cfg, program_name="grpo", program=SimpleNamespace(compiled_text=text),
                           target=SimpleNamespace(name="tpu7x:2x2x1", num_devices=8, devices=[], platform="tpu"))
    est = se.estimate_step(step)
    assert est["hardware"]["name"] == "tpu7x" and est["chips"] == 4 and est["tokens_per_step"] == tokens
    collective_s = est["categories"]["collectives"]["s"]
    compute_s = sum(v["s"] for c, v in est["categories"].items() if c != "collectives")
    assert collective_s > compute_s > 0
    assert est["overlapped"]["step_s"] == collective_s
    assert est["serial"]["step_s"] == compute_s + collective_s
    assert est["serial"]["tokens_per_s_per_chip"] == tokens / (compute_s + collective_s) / 4
    # The schedule: the negate runs before the gather starts, so nothing hides it.
    assert est["scheduled"]["step_s"] == pytest.approx(compute_s + collective_s)


def test_a_prefetch_in_slices_moves_its_slices_once_and_the_concatenation_moves_nothing():
    """The TPU compiler's memory-space assignment brings a [2, 2048, 128] bf16 buffer into the
    alternate memory as two asynchronous slices, joined by a ConcatBitcast custom call, beside an
    AllocateBuffer: each slice-start reads and writes its own 2048 x 128 slice (not the operand in
    its tuple type), the concatenation is a bitcast of adjacent pieces and the allocation moves
    nothing; the consumer (a negate) reads and writes the whole buffer. Hand count: 2 slices x 2 x
    512 KiB + 2 x 1 MiB = 4 MiB. (Charging the tuple and the custom calls their operands and result:
    2 x (1 MiB + 512 KiB + 512 KiB) + 2 MiB + 1 MiB + 2 MiB = 9 MiB.)"""
    text = """HloModule prefetch

ENTRY %main (p: bf16[2,2048,128]) -> bf16[2,2048,128] {
  %p = bf16[2,2048,128]{2,1,0} parameter(0)
  %slice-start.1 = ((bf16[2,2048,128]{2,1,0}), bf16[1,2048,128]{2,1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:1], [0:2048], [0:128]}
  %slice-start.2 = ((bf16[2,2048,128]{2,1,0}), bf16[1,2048,128]{2,1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[1:2], [0:2048], [0:128]}
  %slice-done.1 = bf16[1,2048,128]{2,1,0:S(1)} slice-done(%slice-start.1)
  %slice-done.2 = bf16[1,2048,128]{2,1,0:S(1)} slice-done(%slice-start.2)
  %custom-call.1 = bf16[2,2048,128]{2,1,0:S(1)} custom-call(%slice-done.1, %slice-done.2), custom_call_target="ConcatBitcast"
  %custom-call.2 = bf16[2,2048,128]{2,1,0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %negate.1 = bf16[2,2048,128]{2,1,0} negate(%custom-call.1)
}
"""
    moved = {op: c.bytes * k for op, c, k in hc.Estimator(text).named_ops()}
    slice_bytes = 2048 * 128 * 2
    assert moved == {"slice-start.1": 2 * slice_bytes, "slice-start.2": 2 * slice_bytes, "negate.1": 4 * slice_bytes}
    assert sum(moved.values()) == 4 * 2**20


def test_a_loop_to_its_limit_inclusive_runs_the_limit_too():
    """`i <= 4` from 1 runs i = 1, 2, 3, 4: 4 trips, each a 2 x 8^3 = 1024-FLOP dot; `4 <= i` from 1
    (the constant first: i >= 4) runs none."""
    text = counted_loop_hlo(1, 4, "%i, %limit", "LE")
    assert hc.while_trip_counts(text) == {"loop": 4}
    assert hc.hlo_flops(text) == 4 * 1024
    assert hc.while_trip_counts(counted_loop_hlo(1, 4, "%limit, %i", "LE")) == {"loop": 0}
    assert hc.while_trip_counts(counted_loop_hlo(0, 0, "%i, %limit", "LE")) == {"loop": 1}


def _collective(kind: str, groups: str, elements: int) -> str:
    return f"""HloModule one_collective

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

ENTRY %main (x: f32[4096]) -> f32[{elements}] {{
  %x = f32[4096]{{0}} parameter(0)
  ROOT %c = f32[{elements}]{{0}} {kind}(%x), channel_id=1, replica_groups={groups}, dimensions={{0}}, to_apply=%add
}}
"""


def test_a_collectives_wire_bytes_by_hand_for_each_spelling_of_its_groups():
    """Ring bytes a device sends, 4 devices a group: an all-reduce of 16 KiB sends 2 x 3/4 of it; the
    same with its 8 devices printed as 2 groups of 4 (`[2,4]<=[8]`: the group is 4, not 2); a
    reduce-scatter to a 4 KiB shard sends 3 shards."""
    def sent(kind, groups, elements):
        est = se.estimate(_collective(kind, groups, elements), se.HARDWARE["v5e"], tokens_per_step=1, chips=8, devices=8)
        return est["collectives"][kind]["wire_bytes"]

    assert sent("all-reduce", "{{0,1,2,3},{4,5,6,7}}", 4096) == 2 * 16384 * 3 / 4
    assert sent("all-reduce", "[2,4]<=[8]", 4096) == 2 * 16384 * 3 / 4
    assert sent("all-reduce", "[4,2]<=[8]", 4096) == 2 * 16384 * 1 / 2
    assert sent("reduce-scatter", "[2,4]<=[8]", 1024) == 4096 * 3


# ---------------------------------------------------------------------------------------------
# The schedule: what the compute between an async start and its done hides

_SCHEDULED = """HloModule scheduled, is_scheduled=true

%gather (p: f32[256,1024]) -> f32[1024,1024] {
  %p = f32[256,1024]{1,0} parameter(0)
  ROOT %ag = f32[1024,1024]{1,0} all-gather(%p), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}
}

%cond (c: (s32[], f32[256,1024])) -> pred[] {
  %c = (s32[], f32[256,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(2)
  ROOT %cmp = pred[] compare(%i, %limit), direction=LT
}

%body (b: (s32[], f32[256,1024])) -> (s32[], f32[256,1024]) {
  %b = (s32[], f32[256,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %x = f32[256,1024]{1,0} get-tuple-element(%b), index=1
  %ag-start.4 = (f32[256,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%x), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}
  %neg.4 = f32[256,1024]{1,0} negate(%x)
  %ag-done.4 = f32[1024,1024]{1,0} all-gather-done(%ag-start.4)
  ROOT %t = (s32[], f32[256,1024]{1,0}) tuple(%next, %neg.4)
}

ENTRY %main (x: f32[256,1024], y: f32[1024,1024]) -> f32[256,1024] {
  %x = f32[256,1024]{1,0} parameter(0)
  %y = f32[1024,1024]{1,0} parameter(1)
  %ag-start.1 = (f32[256,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %neg.1 = f32[1024,1024]{1,0} negate(%y)
  %ag-done.1 = f32[1024,1024]{1,0} all-gather-done(%ag-start.1)
  %ag-start.2 = (f32[256,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%x), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %ag-start.3 = (f32[256,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start(%x), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %neg.2 = f32[256,1024]{1,0} negate(%x)
  %ag-done.2 = f32[1024,1024]{1,0} all-gather-done(%ag-start.2)
  %ag-done.3 = f32[1024,1024]{1,0} all-gather-done(%ag-start.3)
  %cs = ((f32[256,1024]{1,0}), f32[1024,1024]{1,0}, u32[]) call-start(%x), async_execution_thread="sparsecore", to_apply=%gather
  %cd = f32[1024,1024]{1,0} call-done(%cs)
  %ar = f32[256,1024]{1,0} all-reduce(%x), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%gather
  %start = s32[] constant(0)
  %init = (s32[], f32[256,1024]{1,0}) tuple(%start, %x)
  %loop = (s32[], f32[256,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[256,1024]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_the_schedule_exposes_what_the_compute_between_start_and_done_leaves():
    """One second per MiB moved (a collective's wire bytes, an op's bytes), 4 devices. An all-gather
    to 4 MiB sends 3 MiB (3 s); a negate of 4 MiB moves 8 MiB (8 s), of 1 MiB 2 MiB (2 s).
    - ag.1 with a 4 MiB negate between start and done: hidden (exposed 0);
    - ag.2 and ag.3 in flight together over a 1 MiB negate: they take turns, so ag.2 gets the 2 s
      (1 s exposed) and ag.3 none (3 s exposed); run side by side each would expose 1 s;
    - the offloaded gather (call-start, call-done) with nothing between: 3 s exposed;
    - the synchronous all-reduce of 1 MiB (2 x 3/4 of it: 1.5 s): exposed whole;
    - the loop, 2 trips of ag.4 over a 1 MiB negate: 2 s hide of its 3 s, 1 s exposed per trip, so
      the loop takes 2 x (2 + 1) s on the compute stream's clock.
    Busy: 8 + 2 + 2 x 2 = 14 s; exposed: 1 + 3 + 3 + 1.5 + 2 x 1 = 10.5 s."""
    mib = 2**20
    est = hc.Estimator(_SCHEDULED)
    busy, exposed = est.timeline(lambda c: (c.wire_bytes if c.collective else c.bytes) / mib)
    # (the loop counter's add moves 12 bytes a trip: within abs 1e-3)
    assert busy == pytest.approx(8 + 2 + 2 * 2, abs=1e-3)
    assert exposed == pytest.approx(1 + 3 + 3 + 1.5 + 2 * 1, abs=1e-3)
    # Each start's exposed seconds over the step: the loop's ag.4 twice.
    exposures = {}
    est.timeline(lambda c: (c.wire_bytes if c.collective else c.bytes) / mib, exposures)
    assert exposures == pytest.approx({"ag-start.2": 1, "ag-start.3": 3, "cs": 3, "ar": 1.5, "ag-start.4": 2}, abs=1e-3)
    # Serial: every op and collective added; the schedule's figure lies at or below it.
    serial = sum(((c.wire_bytes if c.collective else c.bytes) / mib) * k for c, k in est.ops())
    assert serial == pytest.approx(8 + 2 + 2 * 2 + 3 * 3 + 3 + 1.5 + 2 * 3, abs=1e-3)
    assert busy + exposed < serial


def test_the_scheduled_total_is_the_estimates_third_figure():
    """On a chip's row: the estimate's third total is the schedule's walk at the estimate's own op
    seconds, its exposed seconds are the walk's, itemised by start in top_exposed (every exposed
    start of the program listed); on these rates it lies strictly between the other two."""
    hw = se.HARDWARE["v5e"]
    est = se.estimate(_SCHEDULED, hw, tokens_per_step=1, chips=4, devices=4)
    exposures = {}
    busy, exposed = hc.Estimator(_SCHEDULED).timeline(
        lambda c: c.wire_bytes / hw.link_bytes_per_s if c.collective else se.op_seconds(c, hw)[0], exposures)
    assert est["scheduled"]["step_s"] == pytest.approx(busy + exposed)
    assert est["exposed_async_s"] == pytest.approx(exposed)
    # At these rates (links far slower than HBM) even ag.1 outlasts its negate: all six starts wait.
    assert set(exposures) == {"ag-start.1", "ag-start.2", "ag-start.3", "cs", "ar", "ag-start.4"}
    assert {r["name"]: r["exposed_s"] for r in est["top_exposed"]} == pytest.approx(exposures)
    assert sum(exposures.values()) == pytest.approx(exposed)
    assert est["overlapped"]["step_s"] < est["scheduled"]["step_s"] < est["serial"]["step_s"]


def _timeline_variant(old: str, new: str):
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(hc.Estimator._timeline))
    assert source.count(old) == 1, f"the fragment {old!r} is not in Estimator._timeline once: update the variant"
    namespace = dict(vars(hc))
    exec(compile(source.replace(old, new), "<Estimator._timeline, broken>", "exec"), namespace)  # noqa: S102
    return namespace["_timeline"]


# One-line bugs in the schedule's walk, each caught by the hand figures above.
BROKEN_TIMELINE = {
    # Pieces of async work in flight together each progress at the full rate (no turns on the links).
    "side_by_side": ("t -= done", "t -= 0"),
    # What is left at a done is dropped, not exposed.
    "done_hides_the_rest": ("expose(i.operands[0], pending.pop(i.operands[0]))", "pending.pop(i.operands[0])"),
    # A loop's body timed once, not per trip.
    "loop_once": ("run(n * (b + e), n * e)", "run(b + e, e)"),
    # An async start exposed at once, as if synchronous.
    "start_waits": ("pending[i.name] = sum(seconds(c) * k for c, k in ops)",
                    "exposed += sum(seconds(c) * k for c, k in ops)"),
}


@pytest.mark.parametrize("variant", list(BROKEN_TIMELINE))
def test_broken_schedule_walks_are_caught(variant, monkeypatch):
    monkeypatch.setattr(hc.Estimator, "_timeline", _timeline_variant(*BROKEN_TIMELINE[variant]))
    busy, exposed = hc.Estimator(_SCHEDULED).timeline(lambda c: (c.wire_bytes if c.collective else c.bytes) / 2**20)
    clean = (8 + 2 + 2 * 2, 1 + 3 + 3 + 1.5 + 2 * 1)
    assert max(abs(busy - clean[0]), abs(exposed - clean[1])) > 0.5, (variant, busy, exposed)


def test_the_schedules_walk_notes_no_unreadable_loop_twice():
    """A loop whose trip count is unreadable, inside a conditional's branch, is listed once by the
    estimate, though the schedule's walk visits the branch again."""
    loop = counted_loop_hlo(0, 4, "%i, %limit", "LT").replace("%limit = s32[] constant(4)",
                                                               "%limit = s32[] parameter(1)")
    entry = loop.index("ENTRY")
    text = loop[:entry] + """%branch (b: f32[8,8]) -> f32[8,8] {
  %b = f32[8,8]{1,0} parameter(0)
  %start = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%start, %b)
  %loop = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,8]{1,0} get-tuple-element(%loop), index=1
}

%other (o: f32[8,8]) -> f32[8,8] {
  %o = f32[8,8]{1,0} parameter(0)
  ROOT %n = f32[8,8]{1,0} negate(%o)
}

ENTRY %main (x: f32[8,8], p: pred[]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %p = pred[] parameter(1)
  ROOT %r = f32[8,8]{1,0} conditional(%p, %x, %x), true_computation=%branch, false_computation=%other
}
"""
    est = se.estimate(text, se.HARDWARE["v5e"], tokens_per_step=1, chips=1, devices=1)
    assert est["loops_with_unknown_trip_count"] == ["loop"]


# A Pallas call whose weight operand's producer the compiler fused into the kernel's reads
# (allow_input_fusion): a kCustom fusion around the Mosaic call, whose backend config the
# compiler prints over several lines inside the fused computation (its cost estimate as indented
# JSON, then a line starting "}," that does not close the computation), as the TPU compiler printed it.
_FUSED_KERNEL = """HloModule fused_kernel

%dequant (param_0: f8e4m3fn[4,512,256], param_1: bf16[4,256]) -> bf16[4,512,256] {
  %param_0 = f8e4m3fn[4,512,256]{2,1,0} parameter(0)
  %param_1 = bf16[4,256]{1,0} parameter(1)
  %convert.1 = bf16[4,512,256]{2,1,0} convert(%param_0)
  %broadcast.1 = bf16[4,512,256]{2,1,0} broadcast(%param_1), dimensions={0,2}
  ROOT %multiply.1 = bf16[4,512,256]{2,1,0} multiply(%convert.1, %broadcast.1)
}

%kernel_with_fused_weight (param_0.1: s32[], param_1.1: bf16[1024,256], param_2.1: f8e4m3fn[4,512,256], param_3.1: bf16[4,256]) -> bf16[1024,512] {
  %param_0.1 = s32[] parameter(0)
  %param_1.1 = bf16[1024,256]{1,0} parameter(1)
  %param_2.1 = f8e4m3fn[4,512,256]{2,1,0} parameter(2)
  %param_3.1 = bf16[4,256]{1,0} parameter(3)
  %fusion.2 = bf16[4,512,256]{2,1,0} fusion(%param_2.1, %param_3.1), kind=kLoop, calls=%dequant
  %gmm_t.3 = bf16[1024,512]{1,0} custom-call(%param_0.1, %param_1.1, %fusion.2), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"cost_estimate": {
"bytes_accessed":5767168,
"flops":268435456,
"transcendentals":0
}, "serialization_format": 1, "allow_input_fusion": [false,false,true]}}
  ROOT %copy.4 = bf16[1024,512]{1,0} copy(%gmm_t.3)
}

%sparse_core_add (x.5: bf16[], y.5: bf16[]) -> bf16[] {
  %x.5 = bf16[] parameter(0)
  %y.5 = bf16[] parameter(1), backend_config={"flag_configs":[]}
  ROOT %add.5 = bf16[] add(%x.5, %y.5), backend_config={"flag_configs":[],"window_config":{"kernel_window_bounds":[]}}
}, execution_thread="sparsecore"

ENTRY %main (steps: s32[], g: bf16[1024,256], codes: f8e4m3fn[4,512,256], scale: bf16[4,256]) -> bf16[1024,512] {
  %steps = s32[] parameter(0)
  %g = bf16[1024,256]{1,0} parameter(1)
  %codes = f8e4m3fn[4,512,256]{2,1,0} parameter(2)
  %scale = bf16[4,256]{1,0} parameter(3)
  ROOT %gmm_t.2 = bf16[1024,512]{1,0} fusion(%steps, %g, %codes, %scale), kind=kCustom, calls=%kernel_with_fused_weight, metadata={op_name="jit(loss)/transpose(jvp(gmm_t))/pallas_call"}
}
"""


def _fused_kernel_cost():
    est = hc.Estimator(_FUSED_KERNEL)
    (name, cost, runs), = [op for op in est.named_ops()]
    return est, name, cost


def test_a_fusion_around_a_mosaic_call_is_the_kernel_at_its_stated_cost():
    est, name, cost = _fused_kernel_cost()
    assert name == "gmm_t.2" and cost.kernel == "gmm_t.3" and cost.category == "grouped matmuls"
    # The kernel's statement (the weight at its 1-byte codes), not the fusion's operand bytes nor 0 FLOPs.
    assert cost.flops == 268435456 and cost.bytes == 5767168
    # The instruction after the multi-line one is still in its computation (the "}," line closed nothing),
    # and a computation closed by "}, execution_thread=..." keeps its ROOT (and the entry after it is read).
    assert [i.name for i in est.comps["kernel_with_fused_weight"]][-2:] == ["gmm_t.3", "copy.4"]
    assert [i.name for i in est.comps["sparse_core_add"]] == ["x.5", "y.5", "add.5"]
    assert est.entry == "main" and [i.name for i in est.comps["main"]][-1] == "gmm_t.2"


@pytest.mark.parametrize("sabotage", ["fusion_read_as_plain", "continuation_ends_the_computation",
                                      "closing_line_with_attributes_continues"])
def test_the_fused_kernel_reading_catches_its_broken_variants(sabotage, monkeypatch):
    from hybridmoe.analysis import program

    if sabotage == "fusion_read_as_plain":
        monkeypatch.setattr(hc.Estimator, "_mosaic_call", lambda self, i, comp: (
            (i, self.types[comp]) if hc._custom_call_target(i) == "tpu_custom_call" else None))
    elif sabotage == "continuation_ends_the_computation":
        original = program.hlo_computations

        def closes_at_any_brace(text):  # the reading before: a line starting with "}" ends the computation
            return original("\n".join("}" if line.startswith("}") else line for line in text.splitlines()))
        monkeypatch.setattr(program, "hlo_computations", closes_at_any_brace)
        monkeypatch.setattr(hc, "hlo_computations", closes_at_any_brace)
    else:  # only a "}" alone closes a computation, and a new one's header drops the instruction pending:
        # "}, execution_thread=..." closes nothing and the computation's ROOT is lost (the cell's
        # SparseCore computations: every collective of the step went missing from the estimate)
        import inspect
        import textwrap

        source = textwrap.dedent(inspect.getsource(program.hlo_computations))
        for old, new in [('elif line.startswith("}"):', 'elif line.rstrip() == "}":'),
                         ("            flush()\n            ops, pending = [], None", "            ops, pending = [], None")]:
            assert source.count(old) == 1, old
            source = source.replace(old, new)
        namespace = dict(vars(program))
        exec(compile(source, "<hlo_computations, broken>", "exec"), namespace)  # noqa: S102
        monkeypatch.setattr(program, "hlo_computations", namespace["hlo_computations"])
        monkeypatch.setattr(hc, "hlo_computations", namespace["hlo_computations"])
    with pytest.raises(AssertionError):
        test_a_fusion_around_a_mosaic_call_is_the_kernel_at_its_stated_cost()
