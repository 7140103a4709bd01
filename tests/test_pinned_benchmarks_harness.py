"""benchmarks/harness.py, which every benchmark's timing and record go through: the interleaved
rounds' order and per-call times (a fake clock), the one-device config, the record's fields."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _harness():
    sys.path.insert(0, str(ROOT))
    import benchmarks.harness as harness

    return harness


def test_interleaved_rotates_the_order_each_round_and_times_one_call_of_reps(monkeypatch):
    """Arms a, b, c cost 1, 2, 3 s of wall (half of it CPU) a call; 3 rounds of 2 calls each: each
    round's figure is the mean of its calls (1, 2, 3), the order a b c, b c a, c a b."""
    harness = _harness()
    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(harness, "time", SimpleNamespace(perf_counter=lambda: clock["wall"],
                                                          process_time=lambda: clock["cpu"]))
    calls = []

    def arm(name, cost):
        def run():
            calls.append(name)
            clock["wall"] += cost
            clock["cpu"] += cost / 2
            return name
        return run

    got = harness.interleaved({"a": arm("a", 1.0), "b": arm("b", 2.0), "c": arm("c", 3.0)}, rounds=3, reps=2)
    assert calls[::2] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"] and calls[1::2] == calls[::2]
    assert got["a"]["wall_s"] == [1.0, 1.0, 1.0] and got["c"]["wall_s"] == [3.0, 3.0, 3.0]
    assert got["b"]["cpu_s"] == [1.0, 1.0, 1.0]


def test_one_device_config_pins_the_mesh_to_one_device_and_steps_default_to_bench_steps():
    harness = _harness()
    args, recipe, overrides, cfg, rounds = harness.one_device_config("doc\n", "gmm.py", ["recipe=tiny", "bench.steps=4"])
    assert recipe == "tiny" and overrides[:3] == ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1"]
    assert (cfg.mesh.data, cfg.mesh.fsdp) == (1, 1) and rounds == 4
    assert args.out.endswith("benchmarks/records/gmm.json")
    *_, rounds = harness.one_device_config("doc\n", "gmm.py", ["--steps", "2", "recipe=tiny", "bench.steps=4"])
    assert rounds == 2


def test_layer_case_takes_the_first_layer_of_its_kind_and_splits_each_row_at_a_third(monkeypatch):
    """Pattern [gdn, attention]: the attention block's mixer, its first (scanned) layer. seq_len 12:
    tokens 0..3 are document 1, 4..11 document 2, in every row."""
    import numpy as np

    import hybridmoe.model.params as params_module

    harness = _harness()
    blocks = [{"mixer": {"w": np.array([[1.0], [2.0]])}}, {"mixer": {"w": np.array([[3.0], [4.0]])}}]
    monkeypatch.setattr(params_module, "declare_params", lambda m: None)
    monkeypatch.setattr(params_module, "init_params", lambda specs, key: {"blocks": blocks})
    model = SimpleNamespace(layer_pattern=["gdn", "attention"], d_model=8, compute_dtype="float32")
    cfg = SimpleNamespace(model=model, train=SimpleNamespace(batch_size=2, seq_len=12))
    params, x, seg = harness.layer_case(cfg, "attention", "mixer")
    assert params["w"].tolist() == [3.0]
    assert x.shape == (2, 12, 8) and str(x.dtype) == "float32"
    assert seg.tolist() == [[1] * 4 + [2] * 8] * 2


def test_write_names_the_benchmark_adds_the_machine_and_merges_versions(tmp_path, monkeypatch):
    harness = _harness()
    import hybridmoe.tools.record as record

    monkeypatch.setattr(record, "machine_record", lambda: {"date": "d", "commit": "c", "versions": {"jax": "1"}})
    out = tmp_path / "r.json"
    got = harness.write(out, "gmm", versions={"libtpu": "2"}, rows=[1])
    assert got == {"benchmark": "gmm", "date": "d", "commit": "c", "versions": {"jax": "1", "libtpu": "2"}, "rows": [1]}
    assert json.loads(out.read_text()) == got
    assert harness.package_versions("surely-not-a-package-xyz") == {"surely-not-a-package-xyz": None}


def test_spread_is_the_median_quartiles_and_extremes(monkeypatch):
    """1, 2, 3, 4, 100: median 3, quartiles 2 and 4 (linear), min 1, max 100, n 5."""
    sys.path.insert(0, str(ROOT))
    import benchmarks.pinned as pinned

    assert pinned.spread([4.0, 100.0, 1.0, 3.0, 2.0]) == {"n": 5, "median": 3.0, "min": 1.0, "p25": 2.0, "p75": 4.0,
                                                          "max": 100.0}
    assert pinned.spread([1.0, 2.0])["median"] == 1.5


def test_cores_are_ids_and_ranges_within_this_processes_affinity(monkeypatch):
    sys.path.insert(0, str(ROOT))
    import benchmarks.pinned as pinned

    monkeypatch.setattr(pinned.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert pinned.parse_cores("0") == [0] and pinned.parse_cores("2,0") == [0, 2]
    assert pinned.parse_cores("1-3") == [1, 2, 3]
    for bad in ("4", "0-4", "x"):
        with pytest.raises(SystemExit):
            pinned.parse_cores(bad)
