"""The context-parallel benchmarks' figures from hand-made program facts (cp_ring, gdn_cp) and a
small numpy count (cp_attention's balance): bytes per class, bytes received per collective kind,
the spread of work over ranks, ratios to the one-device arm. Nothing compiles; the scripts' JAX
set-up on import is stubbed so this process keeps its own."""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import benchmark_script_unconfigured

_load = benchmark_script_unconfigured


def _c(kind, dtype, shape, nbytes, trip=None):
    return SimpleNamespace(kind=kind, dtype=dtype, shape=shape, bytes=nbytes, trip_count=trip,
                           in_loop=trip is not None)


def test_cp_ring_kv_bytes_are_results_times_executions_and_received_bytes_by_kind():
    """kv dims (2 heads, 64): an f32 K/V all-gather of 524288 bytes in a loop of 3 trips (1572864;
    received 3/4 of it at P = 4: 1179648), a reduce-scatter of 131072 outside (received P - 1 = 3
    shards: 393216), a permute of 131072 (received whole); ids: an s32 permute of 1024 bytes, 2
    trips = 2048; other: an f32 all-reduce [256, 64] of 65536."""
    ring = _load("cp_ring")
    prog = SimpleNamespace(temp_bytes=999, memory={"temp": 999}, compiled_collectives=[
        _c("all-gather", "f32", (1, 1024, 2, 64), 524288, trip=3),
        _c("reduce-scatter", "f32", (1, 256, 2, 64), 131072),
        _c("collective-permute", "f32", (1, 256, 2, 64), 131072),
        _c("collective-permute", "s32", (1, 256), 1024, trip=2),
        _c("all-reduce", "f32", (256, 64), 65536)])
    got = ring.facts(prog, (2, 64), 4)
    assert got["kv_bytes"] == 1572864 + 131072 + 131072
    assert got["kv_wire_bytes"] == 1179648 + 393216 + 131072
    assert got["ids_bytes"] == 2048 and got["other_bytes"] == 65536
    assert got["kv_bytes_by_kind"] == {"all-gather f32": 1572864, "reduce-scatter f32": 131072,
                                       "collective-permute f32": 131072}
    assert [r["executions"] for r in got["collectives"]] == [3, 1, 1, 2, 1]
    assert [r["class"] for r in got["collectives"]] == ["kv", "kv", "kv", "ids", "other"]
    assert got["temp_bytes"] == 999


def test_cp_ring_an_all_reduce_receives_twice_its_share():
    """A ring all-reduce of n bytes over P ranks: reduce-scatter then all-gather, 2 n (P - 1) / P."""
    ring = _load("cp_ring")
    assert ring.WIRE["all-reduce"](100, 4) == 150
    assert ring.WIRE["all-gather"](100, 4) == 75 and ring.WIRE["reduce-scatter"](100, 4) == 300
    assert ring.WIRE["collective-permute"](100, 4) == 100
    assert ring.CONTEXTS == (2, 4, 8)


def test_cp_attention_balance_of_one_document_per_row_by_hand():
    """`small`: 4 rows of 512 tokens, one document each. Context 2, natural order: rank 0 holds
    queries 0..255, each sees i + 1 keys: 256 x 257 / 2 = 32896 a row, x 4 = 131584; rank 1 the rest:
    (512 x 513 / 2 - 32896) x 4 = 393728. Load-balanced: half each, 262656. Spread = (max - min) /
    mean = 262144 / 262656 natural, 0 balanced."""
    cpa = _load("cp_attention")
    bal = cpa.balance()
    one = bal["one document per row, context 2"]
    assert one["natural"] == [131584, 393728]
    assert one["load_balanced"] == [262656, 262656]
    assert one["spread_natural"] == pytest.approx(262144 / 262656)
    assert one["spread_load_balanced"] == 0.0
    four = bal["one document per row, context 4"]
    assert sum(four["natural"]) == 4 * 512 * 513 // 2 and len(set(four["load_balanced"])) == 1
    assert set(bal) == {f"{w}, context {P}" for w in ("packed synthetic batch", "one document per row") for P in (2, 4)}


def test_cp_attention_arms_add_each_key_on_top_of_the_last():
    cpa = _load("cp_attention")
    got = dict(cpa.arms())
    assert got["cp2"] == ["mesh.context=2"]
    assert got["cp4-lb"] == ["mesh.context=4", "attention.cp_load_balance=true"]
    assert got["cp4-lb-hoist"] == ["mesh.context=4", "attention.cp_load_balance=true",
                                   "attention.cp_load_balance_hoist_ids=true"]
    assert len(got) == 6


def test_cp_attention_backward_loop_is_the_loop_with_most_collectives_per_iteration():
    cpa = _load("cp_attention")
    """5 collectives of one kind outnumber 4 of two kinds."""
    prog = {"lowered_collectives_per_loop_iteration": {"while#0": {"all-gather": 5}, "while#1": {"all-gather": 2,
                                                                                                 "permute": 2}}}
    assert cpa.backward_loop(prog) == "while#0"


def test_gdn_cp_ratios_are_to_the_one_device_arm():
    """P=1: 40 ms; P=2 all_gather 60 ms -> 1.5; P=2 ppermute 20 ms -> 0.5."""
    gcp = _load("gdn_cp")
    arm = lambda r, p: {"ranks": r, "prefix": p, "temp_bytes": 10 * r, "collective_bytes": 7 * r,  # noqa: E731
                        "collectives": {"all-gather": r}}
    arms = {"P=2 all_gather": arm(2, "all_gather"), "P=1 none": arm(1, "none"), "P=2 ppermute": arm(2, "ppermute")}
    rows = {r["arm"]: r for r in gcp.layer_rows(arms, {"P=1 none": 40.0, "P=2 all_gather": 60.0, "P=2 ppermute": 20.0})}
    assert rows["P=2 all_gather"]["time_ratio_to_1_device"] == pytest.approx(1.5)
    assert rows["P=2 ppermute"]["time_ratio_to_1_device"] == pytest.approx(0.5)
    assert rows["P=1 none"]["time_ratio_to_1_device"] == 1.0
    assert (rows["P=2 ppermute"]["mean_ms"], rows["P=2 ppermute"]["temp_bytes"],
            rows["P=2 ppermute"]["collective_bytes"]) == (20.0, 20, 14)


def test_gdn_cp_scan_error_is_relative_to_the_trees_largest_magnitude():
    """Tree [2, -4], scan [2.5, -5]: max difference 1 over max |tree| 4 = 0.25 (not over the scan's 5)."""
    gcp = _load("gdn_cp")
    results = {"cp_m_tree": np.array([2.0, -4.0]), "cp_m_scan": np.array([2.5, -5.0])}
    assert gcp.error_vs_tree(results, "cp_m_scan") == pytest.approx(0.25)
    assert gcp.error_vs_tree(results, "cp_m_tree") == 0.0


def test_cp_ring_each_arm_is_one_row_per_context_group_and_kv_is_classed_by_smalls_heads(monkeypatch):
    """8 devices: context 2, 4, 8 leave 4, 2, 1 rows; `small`'s kv heads 2 of dim 64 mark a K/V
    collective [.., 2, 64] (a [.., 64, 2] one is other)."""
    ring = _load("cp_ring")
    seen = []

    def layer_program(cfg, tokens, rows):
        seen.append((cfg.mesh.context, rows, tokens, cfg.train.batch_size))
        return SimpleNamespace(temp_bytes=1, memory={}, compiled_collectives=[
            _c("all-gather", "f32", (1, 64, 2, 64), 1000), _c("all-gather", "f32", (1, 64, 64, 2), 10)])

    records = []
    monkeypatch.setattr(ring, "layer_program", layer_program)
    monkeypatch.setattr(ring.harness, "write", lambda out, name, **f: records.append(f))
    monkeypatch.setattr(sys, "argv", ["cp_ring.py", "--tokens", "512"])
    ring.main()
    assert sorted(set(seen)) == [(2, 4, 512, 4), (4, 2, 512, 2), (8, 1, 512, 1)]
    arms = records[0]["arms"]
    assert len(arms) == 9 and arms["context4 ring"]["context"] == 4
    assert arms["context4 ring"]["kv_bytes"] == 1000 and arms["context4 ring"]["other_bytes"] == 10
    assert arms["context2 all_gather"]["kv_wire_bytes"] == 500  # (P - 1) / P of 1000 at P = 2
    assert records[0]["tokens"] == 512
