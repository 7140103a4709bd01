"""benchmarks/tpu_gmm_uneven.py: which kernels it times at which shapes, and the figures its record
holds, from a stubbed timer (the chip run itself is a record, not a test)."""

import json
import sys
from types import SimpleNamespace

import pytest

from helpers import benchmark_script_unconfigured


@pytest.fixture(scope="module")
def script():
    return benchmark_script_unconfigured("tpu_gmm_uneven")


def test_the_six_kernels_take_the_layers_contraction_and_width(script):
    """The cell (65,536 rows, d 4096, f 1024, 128 groups): wi maps d -> 2f = 2048, wo maps f -> d;
    an input gradient (gmm_t) contracts over the forward's output width."""
    from hybridmoe.tools import chip_cases

    got = {name: (c.kind, c.m, c.k, c.n, c.groups, c.itemsize) for name, c in
           script.calls(chip_cases.GEOMETRIES["cell"]["moe_mlp"]).items()}
    assert got == {
        "wi_fwd": ("gmm", 65536, 4096, 2048, 128, 2),
        "wi_dlhs": ("gmm_t", 65536, 2048, 4096, 128, 2),
        "wi_drhs": ("tgmm", 65536, 4096, 2048, 128, 2),
        "wo_fwd": ("gmm", 65536, 1024, 4096, 128, 2),
        "wo_dlhs": ("gmm_t", 65536, 4096, 1024, 128, 2),
        "wo_drhs": ("tgmm", 65536, 1024, 4096, 128, 2),
    }


def test_useful_tflops_count_every_row_once(script):
    """2 x 65,536 x 4,096 x 2,048 = 1.0995e12 FLOPs in 10 ms: 109.95 TFLOP/s."""
    from hybridmoe.kernels.gmm.tile_table import Call

    got = script.useful_tflops(Call("gmm", 65536, 4096, 2048, 128, 2, None), 0.010)
    assert got == pytest.approx(109.951, rel=1e-4)


def test_totals_are_the_flops_of_their_kernels_over_their_summed_time(script):
    """gmm_cell is the wi triple: 3 x 2 x 8 x 16 x 32 = 24,576 FLOPs; seed 1 + 2 + 3 ms, found
    0.5 + 1 + 1.5 ms: 4.096 and 8.192 MFLOP/s = 4.096e-6 and 8.192e-6 TFLOP/s. moe_mlp needs all six
    kernels and is left out while one is missing."""
    from hybridmoe.kernels.gmm.tile_table import Call

    calls = {n: Call("gmm", 8, 16, 32, 2, 2, None) for n in ("wi_fwd", "wi_dlhs", "wi_drhs", "wo_fwd")}
    rows = {"wi_fwd": {"seed_ms": 1.0, "ms": 0.5}, "wi_dlhs": {"seed_ms": 2.0, "ms": 1.0},
            "wi_drhs": {"seed_ms": 3.0, "ms": 1.5}, "wo_fwd": {"seed_ms": 1.0, "ms": 1.0}}
    got = script.totals(rows, calls)
    assert list(got) == ["gmm_cell (wi fwd + bwd)"]
    t = got["gmm_cell (wi fwd + bwd)"]
    assert t["seed_ms"] == 6.0 and t["ms"] == 3.0
    assert t["seed_tflops"] == pytest.approx(4.096e-6) and t["tflops"] == pytest.approx(8.192e-6)


def test_record_holds_the_search_from_the_seed_tiles_at_the_uneven_split(script, monkeypatch, tmp_path):
    """A stubbed timer: (1 ms x tm / 64 + 0.1 ms x 128 / tk), twice that at uneven sizes. The tiny
    geometry (200 rows, d 256, f 128, 5 groups, seed tiles 64 x 128 x 128): the search keeps tm 64 (128
    is slower), takes the whole K where K is 256 (0.05 ms less), and keeps tn (no faster choice). wi
    forward: seed (1 + 0.1) x 2 = 2.2 ms, found (1 + 0.05) x 2 = 2.1 ms, even 1.1 and 1.05 ms."""
    from hybridmoe.tools import chip_cases, tune_gmm

    monkeypatch.setitem(sys.modules, "tpu_kernels", SimpleNamespace(matmul_ceiling_tflops=lambda size, repeats: 100.0))
    monkeypatch.setattr(script.harness, "configure", lambda *a, **k: None)
    seen = []

    def fake(call, t, *, repeats, interpret, sizes=None):
        seen.append(sizes)
        return (1e-3 * t.tm / 64 + 1e-4 * 128 / t.tk) * (2 if sizes is not None else 1)

    monkeypatch.setattr(tune_gmm, "kernel_seconds", fake)
    out = tmp_path / "r.json"
    assert script.main(["--tiny", "--out", str(out), "--repeats", "1"]) == 0
    rec = json.loads(out.read_text())
    assert rec["sizes"] == [int(s) for s in chip_cases.group_sizes(200, 5)] and sum(rec["sizes"]) == 200
    assert all(s is None or list(s) == rec["sizes"] for s in seen)
    wi = rec["kernels"]["wi_fwd"]
    assert wi["seed_tiles"] == [64, 128, 128] and wi["tiles"] == [64, 256, 128] and wi["commit"]
    assert wi["seed_ms"] == pytest.approx(2.2) and wi["ms"] == pytest.approx(2.1)
    assert wi["even_seed_ms"] == pytest.approx(1.1) and wi["even_ms"] == pytest.approx(1.05)
    assert wi["tflops"] == pytest.approx(2 * 200 * 256 * 256 / 2.1e-3 / 1e12)
    assert wi["seed_tflops"] == pytest.approx(2 * 200 * 256 * 256 / 2.2e-3 / 1e12)
    # wo forward contracts over f = 128: nothing larger to take, the seed tiles stay.
    wo = rec["kernels"]["wo_fwd"]
    assert wo["tiles"] == [64, 128, 128] and wo["ms"] == pytest.approx(2.2) and wo["ms"] == wo["seed_ms"]
    total = rec["totals"]["moe_mlp_cell (wi + wo, fwd + bwd)"]
    # wi_fwd, wi_dlhs (k 2f = 256), wi_drhs, wo_dlhs (k d = 256) at 2.1 ms; wo_fwd, wo_drhs at 2.2.
    assert total["ms"] == pytest.approx(4 * 2.1 + 2 * 2.2) and total["seed_ms"] == pytest.approx(6 * 2.2)
    assert rec["ceiling_tflops"] == 100.0


def test_a_search_from_the_record_starts_at_its_tiles_and_times_the_seed_beside(script, monkeypatch, tmp_path):
    """--start record --rounds 0: each kernel is timed at the tiles this device's record found (start_tiles),
    and at the seed's, which keep their own time; a kernel the record lacks starts at the seed's."""
    from hybridmoe.tools import tune_gmm
    from hybridmoe.tools.record import machine_record

    monkeypatch.setitem(sys.modules, "tpu_kernels", SimpleNamespace(matmul_ceiling_tflops=lambda size, repeats: 100.0))
    monkeypatch.setattr(script.harness, "configure", lambda *a, **k: None)
    timed = []

    def fake(call, t, *, repeats, interpret, sizes=None):
        timed.append((t.tm, t.tk, t.tn))
        return 1e-3 * t.tm / 64 * (2 if sizes is not None else 1)

    monkeypatch.setattr(tune_gmm, "kernel_seconds", fake)
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"device": machine_record()["device"],
                               "kernels": {"wi_fwd": {"kind": "gmm", "tiles": [128, 256, 128], "commit": "abc"}}}))
    assert script.main(["--tiny", "--out", str(out), "--repeats", "1", "--only", "wi_fwd,wo_fwd",
                        "--start", "record", "--rounds", "0"]) == 0
    got = json.loads(out.read_text())
    wi, wo = got["kernels"]["wi_fwd"], got["kernels"]["wo_fwd"]
    assert wi["start_tiles"] == wi["tiles"] == [128, 256, 128] and wi["ms"] == pytest.approx(4.0)
    assert wi["seed_tiles"] == [64, 128, 128] and wi["seed_ms"] == pytest.approx(2.0)
    assert "start_tiles" not in wo and wo["tiles"] == wo["seed_tiles"] == [64, 128, 128]
    assert "from the tiles an earlier run found" in got["method"] and "(0 rounds)" in got["method"]


def test_only_a_search_on_the_chip_writes_the_tile_table(script):
    """The table keeps a search's entries (their timings and commit): a timing at a record's tiles
    (--rounds 0) and an interpreted run leave it as it is."""
    args = SimpleNamespace
    assert script.writes_table(args(tiny=False, rounds=1))
    assert not script.writes_table(args(tiny=False, rounds=0))
    assert not script.writes_table(args(tiny=True, rounds=3))


def test_kernel_seconds_refuses_sizes_of_another_split():
    """Sizes over the wrong number of groups, or not summing to the rows, are named before anything runs."""
    from hybridmoe.kernels.gmm.tile_table import Call
    from hybridmoe.kernels.gmm.tiling import Tiling
    from hybridmoe.tools import tune_gmm

    call = Call("gmm", 64, 128, 128, 3, 2, None)
    with pytest.raises(ValueError, match="2 groups summing to 64 rows; the call has 3 groups of 64"):
        tune_gmm.kernel_seconds(call, Tiling(), sizes=[32, 32])
    with pytest.raises(ValueError, match="3 groups summing to 63 rows"):
        tune_gmm.kernel_seconds(call, Tiling(), sizes=[21, 21, 21])


def test_table_entries_carry_the_found_tiles_and_the_seed_time_as_before(script):
    """A searched kernel becomes a tile-table entry at its own shape, marked uneven; one that failed or
    was left out by the budget gives none."""
    rows = {"wi_fwd": {"kind": "gmm", "m": 65536, "k": 4096, "n": 2048, "groups": 128, "itemsize": 2,
                       "tiles": [256, 4096, 1024], "ms": 9.5, "seed_ms": 14.3, "timed": 17},
            "wo_fwd": {"kind": "gmm", "error": "past the 330 s budget"}}
    assert script.table_entries(rows) == [
        {"kind": "gmm", "m": 65536, "k": 4096, "n": 2048, "groups": 128, "itemsize": 2, "tm": 256, "tk": 4096,
         "tn": 1024, "ms": 9.5, "default_ms": 14.3, "timed": 17, "split": "uneven"}]


def test_a_rerun_of_some_kernels_keeps_the_others_of_the_same_device_only(script, monkeypatch, tmp_path):
    """--only wi_fwd over a record of this device keeps its wo_fwd row (left out by an earlier run's
    budget) with the commit it was written at and stamps the new row with this commit; over another
    device's record nothing old is kept."""
    from hybridmoe.tools import tune_gmm
    from hybridmoe.tools.record import machine_record, source_commit

    monkeypatch.setitem(sys.modules, "tpu_kernels", SimpleNamespace(matmul_ceiling_tflops=lambda size, repeats: 100.0))
    monkeypatch.setattr(script.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(tune_gmm, "kernel_seconds", lambda call, t, *, repeats, interpret, sizes=None: 1e-3)
    out = tmp_path / "r.json"
    for device, kept in ((machine_record()["device"], True), ("TPU v6 lite x 1", False)):
        out.write_text(json.dumps({"device": device, "kernels": {"wo_fwd": {"kind": "gmm", "error": "past the 330 s budget", "commit": "abc"}}}))
        assert script.main(["--tiny", "--out", str(out), "--repeats", "1", "--only", "wi_fwd"]) == 0
        got = json.loads(out.read_text())["kernels"]
        assert got["wi_fwd"]["commit"] == source_commit() and got["wi_fwd"]["ms"] == pytest.approx(1.0)
        assert (got.get("wo_fwd", {}).get("commit") == "abc") is kept and (len(got) == 2) is kept


def test_seed_recipe_runs_the_tiles_the_chip_found_for_its_plain_kernels():
    """The seed cell's four plain grouped matmuls (its wi forward and wo input gradient are the fused
    kernels, with their own tiles) run the tiles the v5e measured fastest at the cell's shapes and
    uneven groups: the tile table's v5e entries marked "split": "uneven" (written by tpu_gmm_uneven.py
    and tpu_gmm_prefetch.py --write-table); a rerun that finds others must move the recipe with it."""
    from hybridmoe.kernels.gmm import kernel_tiles, tile_table
    from hybridmoe.recipe import load_config

    entries = {(e["kind"], e["k"], e["n"]): [e["tm"], e["tk"], e["tn"]]
               for e in tile_table.read_table()["v5e"]["entries"] if e.get("split") == "uneven"}
    tiles = kernel_tiles(load_config("qwen3.5-397b-a17b-v7x-128", [], platform="tpu").kernels.gmm.model_dump())
    d, f = 4096, 1024
    shapes = {"wi_dlhs": ("gmm_t", 2 * f, d), "wi_drhs": ("tgmm", d, 2 * f), "wo_fwd": ("gmm", f, d),
              "wo_drhs": ("tgmm", f, d)}
    for name, shape in shapes.items():
        t = getattr(tiles, name)
        assert [t.tm, t.tk, t.tn] == entries[shape], name


def test_the_search_takes_the_row_tiles_it_is_given(script):
    """tune-gmm's own row tiles start at 128; the uneven search adds 64. Each list is cut at the rows
    (rounded up to 8: 200 rows keep 64 and 128, not 256)."""
    from hybridmoe.kernels.gmm.tile_table import Call
    from hybridmoe.tools import tune_gmm

    call = Call("gmm", 200, 256, 256, 5, 2, None)
    assert tune_gmm.axis_candidates(call)["tm"] == [128]
    assert tune_gmm.axis_candidates(call, script.ROW_TILES)["tm"] == [64, 128]


def test_aligned_layout_is_timed_on_padded_groups_and_counted_by_the_real_rows(script, monkeypatch, tmp_path):
    """--aligned 64: each kernel timed at row tile 64 (the found tk, tn) on the sizes moe.group_align_rows=64
    gives (every group rounded up to a multiple of 64, the call's rows their sum), its useful TFLOP/s by
    the real 200 rows; the aligned totals sum the kernels' times."""
    from hybridmoe.tools import chip_cases, tune_gmm

    monkeypatch.setitem(sys.modules, "tpu_kernels", SimpleNamespace(matmul_ceiling_tflops=lambda size, repeats: 100.0))
    monkeypatch.setattr(script.harness, "configure", lambda *a, **k: None)
    seen = []

    def fake(call, t, *, repeats, interpret, sizes=None):
        seen.append((call.m, t.tm, None if sizes is None else list(sizes)))
        return 1e-3 * (3 if t.tm == 64 and sizes is not None and sum(sizes) == call.m != 200 else 1)

    monkeypatch.setattr(tune_gmm, "kernel_seconds", fake)
    out = tmp_path / "r.json"
    assert script.main(["--tiny", "--out", str(out), "--repeats", "1", "--rounds", "0", "--only", "wi_fwd,wi_dlhs,wi_drhs",
                        "--aligned", "64"]) == 0
    rec = json.loads(out.read_text())
    sizes = [int(s) for s in chip_cases.group_sizes(200, 5)]
    padded = [-(-s // 64) * 64 for s in sizes]
    assert script.aligned_sizes(sizes, 64) == padded and sum(padded) > 200 and all(p % 64 == 0 for p in padded)
    assert (sum(padded), 64, padded) in seen
    wi = rec["kernels"]["wi_fwd"]["aligned"]["64"]
    assert wi["rows"] == sum(padded) and wi["ms"] == pytest.approx(3.0)
    assert wi["tflops"] == pytest.approx(2 * 200 * 256 * 256 / 3e-3 / 1e12)
    total = rec["aligned_totals"]["gmm_cell (wi fwd + bwd)"]["64"]
    assert total["ms"] == pytest.approx(9.0)


def test_the_kernel_cases_table_arms_read_the_tables_v5e_entries_at_the_cell(monkeypatch):
    """On a v5e, chip_cases' fused-pair table arm and aligned arms take the tile table's entries for the
    cell's shapes (the fused up projection the wi forward's, both halves in its N tile; the fused input
    gradient the wo input gradient's), the aligned ones at their own row tile; another chip, the
    heuristic tiles."""
    import hybridmoe.kernels.platform as platform
    from hybridmoe.kernels.gmm import tile_table
    from hybridmoe.tools import chip_cases as cc
    from hybridmoe.tools import chip_layouts as cl

    g = cc.GEOMETRIES["cell"]["moe_mlp"]
    monkeypatch.setattr(platform, "generation_of_device", lambda device: "v5e")
    entries = {(e["kind"], e["k"], e["n"]): (e["tm"], e["tk"], e["tn"])
               for e in tile_table.read_table()["v5e"]["entries"] if e.get("split") == "uneven"}
    fused, per_half = cl.fused_table_tiles(g)
    wi, wo_dlhs = entries[("gmm", 4096, 2048)], entries[("gmm_t", 4096, 1024)]
    assert (fused.wi_fwd.tm, fused.wi_fwd.tk, fused.wi_fwd.tn) == wi and per_half == wi[2] // 2
    # The fused input gradient borrows the plain gmm_t entry's tiles, its row tile halved until it fits
    # VMEM by the model with auto's margin (chip_layouts.fitting_rows; a v5e refused it at the entry's 512).
    assert fused.wo_dlhs.tk == wo_dlhs[1] and fused.wi_drhs.from_table
    assert fused.wo_dlhs.tm == (256 if wo_dlhs[0] == 512 else wo_dlhs[0]), (fused.wo_dlhs, wo_dlhs)
    aligned = cl.aligned_moe_plan(g, 64, interpret=True).tiles
    assert (aligned.wo_drhs.tm, aligned.wo_drhs.tk, aligned.wo_drhs.tn) == (64, *entries[("tgmm", 1024, 4096)][1:])
    monkeypatch.setattr(platform, "generation_of_device", lambda device: "v6e")
    rule = tile_table.tpu_rule(4096, 2048)
    t = cl.table_tiling("gmm", 4096, 2048, m=g["rows"], groups=g["groups"])
    assert (t.tm, t.tk, t.tn) == (rule.tm, rule.tk, rule.tn)
