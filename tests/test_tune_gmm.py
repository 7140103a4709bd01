"""kernels.gmm.tiling=auto and `hybridmoe tune-gmm`: the measured tile table, its lookup by chip
generation and shape, the kernels taking their tiles from it when traced, the coordinate search,
the table's merge, the shapes a step calls, and the refusal off a TPU.

Expected values come from outside the code under test: the step's grouped-matmul shapes are counted
from the config by hand; the search runs against a made-up timer whose fastest tiles are known.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.kernels import platform
from hybridmoe.kernels.gmm import pallas_tpu, tile_table
from hybridmoe.kernels.gmm.tile_table import Call
from hybridmoe.kernels.gmm.tiling import DEFAULT, Tiling
from hybridmoe.recipe import load_config
from hybridmoe.tools import tune_gmm

GEN = "v5e"


def _entry(kind="gmm", m=4096, k=1024, n=512, groups=16, itemsize=2, tm=512, tk=1024, tn=256):
    return {"kind": kind, "m": m, "k": k, "n": n, "groups": groups, "itemsize": itemsize,
            "tm": tm, "tk": tk, "tn": tn, "ms": 1.0, "default_ms": 2.0, "timed": 9}


def _table(path, entries, generation=GEN):
    path.write_text(json.dumps({"generations": {generation: {"device": "TPU v5 lite", "entries": entries}}}))
    return path


def test_lookup_matches_kind_k_n_and_size_and_the_nearest_rows_per_group(tmp_path):
    # Two entries of one shape family: 256 and 4,096 rows per group.
    path = _table(tmp_path / "t.json", [_entry(m=4096, tm=256), _entry(m=65536, tm=1024)])
    call = lambda **kw: Call(**{"kind": "gmm", "m": 4096, "k": 1024, "n": 512, "groups": 16, "itemsize": 2,  # noqa: E731
                                "generation": GEN, **kw})
    assert tile_table.lookup(call(), path) == Tiling(tm=256, tk=1024, tn=256)
    # 1,024 rows per group: 4x from the first, 4x from the second; 2,048: nearer the second.
    assert tile_table.lookup(call(m=32768), path).tm == 1024
    # 64 rows per group is 4x below the first entry: still served; 32 (8x) is not.
    assert tile_table.lookup(call(m=1024), path).tm == 256
    assert tile_table.lookup(call(m=512), path) is None
    # Any other kind, K, N, operand size or generation: no entry.
    for other in (dict(kind="gmm_t"), dict(k=2048), dict(n=1024), dict(itemsize=4), dict(generation="v6e"),
                  dict(generation=None)):
        assert tile_table.lookup(call(**other), path) is None, other
    assert tile_table.lookup(call(), tmp_path / "absent.json") is None


def _block_shapes(jaxpr) -> list[tuple]:
    eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert len(eqns) == 1
    return [tuple(getattr(d, "block_size", None) for d in b.block_shape)
            for b in eqns[0].params["grid_mapping"].block_mappings]


@pytest.mark.parametrize("kind", ["gmm", "gmm_t", "tgmm"])
def test_a_kernel_asking_the_table_runs_its_entry_tiles_and_stays_exact(tmp_path, monkeypatch, kind):
    m, k, n, groups = 64, 256, 256, 4
    # The entry's tiles differ from the heuristic 128 x 128 x 128 in every dimension.
    path = _table(tmp_path / "t.json", [_entry(kind=kind, m=m, k=k, n=n, groups=groups, itemsize=4, tm=16, tk=256, tn=256)])
    monkeypatch.setattr(tile_table, "TABLE_FILE", path)
    monkeypatch.setattr(platform, "trace_generation", lambda: GEN)
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray([10, 0, 30, 24], jnp.int32)
    common = dict(group_offset=0, sharded=False, out_dtype=jnp.float32, interpret=True)
    if kind == "tgmm":
        other = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
        run = lambda t: pallas_tpu.tgmm(lhs, other, sizes, num_local=groups, tiling=t, **common)  # noqa: E731
        bounds = np.cumsum([0, *np.asarray(sizes)])
        want = np.stack([np.asarray(lhs[a:b]).T @ np.asarray(other[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    else:
        shape = (groups, n, k) if kind == "gmm_t" else (groups, k, n)
        other = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        run = lambda t: pallas_tpu.gmm(lhs, other, sizes, transpose_rhs=kind == "gmm_t", tiling=t, **common)  # noqa: E731
        rows = np.repeat(np.arange(groups), np.asarray(sizes))
        w = np.asarray(other).transpose(0, 2, 1) if kind == "gmm_t" else np.asarray(other)
        want = np.einsum("mk,mkn->mn", np.asarray(lhs), w[rows])
    asks = Tiling(from_table=True)
    table_blocks = _block_shapes(jax.make_jaxpr(lambda: run(asks))())
    heuristic_blocks = _block_shapes(jax.make_jaxpr(lambda: run(DEFAULT))())
    assert table_blocks != heuristic_blocks
    # The lhs block is [tm, tk]: the entry's 16 x 256, not the heuristic's 128 x 128 (64 rows: tm 64).
    assert table_blocks[0] == (16, 256), table_blocks
    got = np.asarray(run(asks))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    # The config's scoped-VMEM limit travels with the table's tiles (0 would be the compiler's default).
    resolved = tile_table.resolve(Tiling(from_table=True, vmem_limit_mib=40.0), kind, m=m, k=k, n=n, groups=groups,
                                  itemsize=4)
    assert (resolved.tm, resolved.tk, resolved.tn, resolved.vmem_limit_mib) == (16, 256, 256, 40.0)
    # With no entry for the chip (another generation) the same call runs the heuristic tiles.
    monkeypatch.setattr(platform, "trace_generation", lambda: "v6e")
    assert _block_shapes(jax.make_jaxpr(lambda: run(asks))()) == heuristic_blocks


def test_the_search_finds_the_fastest_tiles_of_a_separable_timer_and_never_times_an_unfit_one():
    call = Call("gmm", 65536, 4096, 2048, 128, 2, GEN)
    best = {"tm": 256, "tk": 1024, "tn": 512}

    def seconds(c, t):
        assert tune_gmm.fits(c, t), t  # an unfit tiling is never timed
        return 1e-3 * (1 + sum(abs(math.log2(getattr(t, d) / v)) for d, v in best.items()))

    found = tune_gmm.search(call, seconds)
    t = found["tiling"]
    assert (t.tm, t.tk, t.tn) == (256, 1024, 512)
    assert found["s"] == pytest.approx(1e-3)
    # The heuristic a TPU runs, the chip's rule 512 x 2048 x 512: 1 + 1 + 0 octaves off.
    assert found["default_s"] == pytest.approx(3e-3)
    # Candidates: tm 128..1024, tk and tn the powers of two from 128 to 4,096 dividing K and N.
    assert tune_gmm.axis_candidates(call) == {"tm": [128, 256, 512, 1024], "tk": [128, 256, 512, 1024, 2048, 4096],
                                              "tn": [128, 256, 512, 1024, 2048]}
    # A 4,096 x 4,096 float32 block pair with its accumulator is far over the cap: refused.
    assert not tune_gmm.fits(call, Tiling(tm=1024, tk=4096, tn=4096))


def test_entries_replace_their_shapes_only_and_other_generations_stay(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"generations": {
        GEN: {"device": "old", "entries": [_entry(m=4096, tm=128), _entry(kind="tgmm", tm=128)]},
        "v6e": {"device": "TPU v6 lite", "entries": [_entry(tm=1024)]}}}))
    tune_gmm.write_table(GEN, [_entry(m=4096, tm=512), _entry(k=2048, tm=256)], {"device": "TPU v5 lite"}, path)
    generations = tile_table.read_table(path)
    assert generations["v6e"] == {"device": "TPU v6 lite", "entries": [_entry(tm=1024)]}
    section = generations[GEN]
    assert section["device"] == "TPU v5 lite"
    got = {(e["kind"], e["k"]): e["tm"] for e in section["entries"]}
    assert got == {("gmm", 1024): 512, ("tgmm", 1024): 128, ("gmm", 2048): 256}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


def test_the_steps_calls_are_the_moe_layers_six_grouped_matmuls():
    cfg = load_config("tiny", ["kernels.interpret=true", *tune_gmm.TUNE_OVERRIDES])
    m = cfg.model
    # 8 x 64 tokens over 8 devices, each token to top-k experts, every expert local (no expert axis).
    rows = cfg.train.batch_size * cfg.train.seq_len // 8 * m.num_experts_per_tok
    D, F = m.d_model, m.moe_intermediate_size
    want = sorted([("gmm", D, 2 * F), ("gmm_t", 2 * F, D), ("tgmm", D, 2 * F),    # wi: forward, input and weight grads
                   ("gmm", F, D), ("gmm_t", D, F), ("tgmm", F, D)])              # wo
    calls = tune_gmm.step_calls(cfg)
    assert sorted((c.kind, c.k, c.n) for c in calls) == want
    assert {(c.m, c.groups, c.itemsize) for c in calls} == {(rows, m.num_experts, 4)}


def test_tune_gmm_refuses_off_a_tpu_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hybridmoe", "tune-gmm", "recipe=tiny"], capture_output=True, text=True,
                          env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 0
    assert "tune-gmm times the Pallas TPU kernels on a TPU chip" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_heuristic_tiles_on_a_tpu_are_the_chips_rule_never_128_cubed(monkeypatch):
    """tiling=heuristic (and the table with no entry) on a TPU: 512 x 2048 x 512, each of tk and tn the
    largest lane multiple under it dividing its dimension; on every other platform the kernels' own
    128 x 128 x 128. Read from the traced kernel's blocks."""
    assert [tile_table.lane_divisor(d, 512) for d in (4096, 768, 640, 100, 512)] == [512, 384, 128, 100, 512]
    assert tile_table.lane_divisor(6144, 2048) == 2048 and tile_table.lane_divisor(1152, 2048) == 1152
    m, k, n, groups = 1000, 4096, 768, 4
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
    sizes = jnp.asarray([300, 0, 500, 200], jnp.int32)

    def blocks(tiling):
        run = lambda a, b: pallas_tpu.gmm(a, b, sizes, transpose_rhs=False, tiling=tiling, group_offset=0,  # noqa: E731
                                          sharded=False, out_dtype=jnp.bfloat16, interpret=True)
        return _block_shapes(jax.make_jaxpr(run)(lhs, rhs))

    assert blocks(None)[0] == (128, 128)  # the CPU: the kernels' DEFAULT
    monkeypatch.setattr(platform, "trace_platform", lambda: "tpu")
    monkeypatch.setattr(platform, "trace_generation", lambda: "v5e")
    on_tpu = blocks(None)
    assert on_tpu[0] == (512, 2048) and on_tpu[1] == (None, 2048, 384), on_tpu  # lhs [tm, tk], rhs [., tk, tn]
    assert blocks(Tiling(from_table=True)) == on_tpu  # the table has no v5e entry for this shape
    assert blocks(Tiling(128, 128, 128))[0] == (128, 128)  # explicit tiles stay as written


def test_missing_times_only_the_shapes_the_table_lacks_and_the_table_keeps_both(tmp_path, monkeypatch):
    """tune-gmm --missing (a run the budget cut short, continued): the two shapes the table holds for
    this generation are not timed again; the other four are, and the merged section holds all six,
    each with the commit it was measured at."""
    cfg = load_config("tiny", ["kernels.interpret=true", *tune_gmm.TUNE_OVERRIDES])
    monkeypatch.setattr(platform, "generation_of_device", lambda device: GEN)
    calls = tune_gmm.step_calls(cfg)
    assert len(calls) == 6
    earlier = [{**c.key(), "tm": 128, "tk": 128, "tn": 128, "ms": 1.0, "default_ms": 1.0, "timed": 1,
                "commit": "earlier"} for c in calls[:2]]
    path = _table(tmp_path / "t.json", earlier)
    timed = []
    result = tune_gmm.tune(cfg, seconds=lambda c, t: timed.append(c.key()) or 1e-3, missing_only=True, path=path)
    assert {tune_gmm.shape_key(k) for k in timed} == {tune_gmm.shape_key(c.key()) for c in calls[2:]}
    assert result["already_tuned"] == [c.key() for c in calls[:2]] and result["skipped"] == []
    tune_gmm.write_table(GEN, result["entries"], {"device": "TPU v5 lite", "commit": "now"}, path)
    entries = tile_table.read_table(path)[GEN]["entries"]
    by_shape = {tune_gmm.shape_key(e): e["commit"] for e in entries}
    assert by_shape == {**{tune_gmm.shape_key(c.key()): "earlier" for c in calls[:2]},
                        **{tune_gmm.shape_key(c.key()): "now" for c in calls[2:]}}
    # Without --missing every shape is timed again.
    timed.clear()
    tune_gmm.tune(cfg, seconds=lambda c, t: timed.append(c.key()) or 1e-3, path=path)
    assert {tune_gmm.shape_key(k) for k in timed} == {tune_gmm.shape_key(c.key()) for c in calls}
