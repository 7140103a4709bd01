"""The memory peak itemised by what made each buffer, and `inspect --layers` (memory against
depth), on tiny CPU programs (8 devices)."""

from __future__ import annotations

import json

import pytest

from helpers import TWO_LAYERS
from hybridmoe.cli import main
from hybridmoe.recipe import load_config
from hybridmoe.analysis import peak_memory
from hybridmoe.analysis.flops import model_flops_per_device
from hybridmoe.tools import depth
from hybridmoe.tools import train_program as tp

# Two planted programs. Rows: tiny (narrow experts, 128-row tiles): the MoE block's token-row
# buffers fill the peak. Weights: experts 16x wider and 8-row tiles: the routed experts' weights
# gathered per row tile [tiles, d_model, 2 x moe_intermediate] and their gradients fill it.
# One layer of each mixer (tiny's four compiled in twice the time; the planted buffers are the MoE
# block's, in every layer).
PLANTED = {"rows": ([*TWO_LAYERS, "train.batch_size=8"], peak_memory.MOE_ROWS),
           "weights": ([*TWO_LAYERS, "train.batch_size=8", "model.moe_intermediate_size=512", "kernels.gmm.xla_tile_rows=8"],
                       peak_memory.EXPERT_WEIGHTS)}
# A planted buffer of each: a row tile [tiles, 128 rows, d_model 64]; a wi gathered per row tile
# [tiles, d_model 64, 2 x 512].
PLANTED_BUFFER = {"rows": (",128,64]", peak_memory.MOE_ROWS), "weights": (",64,1024]", peak_memory.EXPERT_WEIGHTS)}


@pytest.fixture(scope="module")
def planted():
    return {name: tp.compile_step(load_config("tiny", words), tp.host_target(), with_residuals=False)
            for name, (words, _) in PLANTED.items()}


def problems(steps: dict) -> list[str]:
    """What is wrong with the itemised peaks of the planted programs (empty when right)."""
    out = []
    for name, step in steps.items():
        peak = tp.peak_by_category(step, tp.memory_facts(step.program, None))
        cats = {r["category"]: r["bytes"] for r in peak["categories"]}
        if not 0.9 <= peak["share"] <= 1.0:
            out.append(f"{name}: the categories sum to {peak['share']:.3f} of the temporaries' figure")
        if peak["heap_share"] is None or not 0.9 <= peak["heap_share"] <= 1.0:
            out.append(f"{name}: the categories sum to {peak['heap_share']} of the default space's heap")
        expected = PLANTED[name][1]
        largest = max(cats, key=cats.get)
        if largest != expected:
            out.append(f"{name}: the largest category is {largest!r}, planted {expected!r}: {cats}")
        if cats.get(peak_memory.OTHER, 0) > 0.1 * peak["itemised"]:
            out.append(f"{name}: 'other' holds {cats[peak_memory.OTHER] / peak['itemised']:.2f} of the peak")
    # The planted buffers themselves, wherever the MoE block made them.
    for name, (suffix, expected) in PLANTED_BUFFER.items():
        step = steps[name]
        found = [b for b in step.peak_buffers if b.shape.endswith(suffix) and b.storage == "temp"
                 and peak_memory.innermost_scope(b.op_name) == "moe"]
        if not found:
            out.append(f"{name}: no [..{suffix} buffer of the MoE block at the peak")
        for b in found:
            got = peak_memory.category(b, step.shapes)
            if got != expected:
                out.append(f"{name}: {b.value} {b.shape} ({b.op_name}) counted to {got!r}, not {expected!r}")
    return out


def _everything_other(buf, shapes):
    return peak_memory.OTHER


_ORIGINAL_CATEGORY = peak_memory.category


def _rows_and_weights_swapped(buf, shapes):
    c = _ORIGINAL_CATEGORY(buf, shapes)
    return {peak_memory.MOE_ROWS: peak_memory.EXPERT_WEIGHTS, peak_memory.EXPERT_WEIGHTS: peak_memory.MOE_ROWS}.get(c, c)


BROKEN_CATEGORY = {"everything_other": _everything_other, "rows_and_weights_swapped": _rows_and_weights_swapped}


def test_the_peak_is_itemised_by_what_made_each_buffer(planted):
    """Each planted program's temporaries at the peak sum to the compiler's figure and to the default
    memory space's heap within 10%, the
    planted part is the largest category, 'other' holds under 10%, and the gathered expert weights
    count to the expert weights."""
    found = problems(planted)
    assert not found, found
    for name, step in planted.items():
        print(name, {r["category"]: r["bytes"] for r in tp.peak_by_category(step, tp.memory_facts(step.program, None))["categories"]})


def test_heap_share_divides_by_the_default_space_less_the_arguments():
    """The share of the default memory space's heap: the itemised bytes over the report's default
    space without the arguments (the arguments left in: 0.3, not 0.5); None without the report."""
    assert peak_memory.heap_share({"itemised": 3}, {"default_space": 10, "argument": 4}) == 0.5
    assert peak_memory.heap_share({"itemised": 3}, {"default_space": None, "argument": 4}) is None


@pytest.mark.parametrize("variant", sorted(BROKEN_CATEGORY))
def test_a_broken_attribution_is_caught(planted, variant, monkeypatch):
    monkeypatch.setattr(peak_memory, "category", BROKEN_CATEGORY[variant])
    assert problems(planted), variant


def test_extrapolation_is_the_line_through_two_depths():
    """Memory affine in blocks (100 + 10 per block of 4 layers, arguments 7 per block, XLA's default
    space 90 + 12 per block): compiled at 8 and 12 layers, the 60-layer value is 100 + 10 x 15 (an
    extrapolation in layers instead of blocks, or from the wrong point, misses it). The verdict reads
    the default space where the compile reported one (270 fits 300, where total's 355 would not),
    else total."""
    mem = {layers: {"argument": 7 * (layers // 4), "temp": 100 + 10 * (layers // 4),
                    "total": 100 + 17 * (layers // 4), "default_space": 90 + 12 * (layers // 4)}
           for layers in (8, 12)}
    d = depth.extrapolate(mem, 4, 60, hbm=260)
    assert d["per_block"] == {"argument": 7, "temp": 10, "total": 17, "default_space": 12}
    assert d["extrapolated"] == {"layers": 60, "blocks": 15, "argument": 105, "temp": 250, "total": 355,
                                 "default_space": 270}
    assert d["fits"] is False and depth.extrapolate(mem, 4, 60, hbm=300)["fits"] is True
    unreported = {k: {**m, "default_space": None} for k, m in mem.items()}
    assert depth.extrapolate(unreported, 4, 60, hbm=300)["fits"] is False
    assert depth.extrapolate(unreported, 4, 60, hbm=355)["fits"] is True
    assert "EXTRAPOLATED" in depth.format_depth(d) and "default space" in depth.format_depth(d)


@pytest.mark.parametrize("flag", [["--layers", "4"], ["--compare", "train.batch_size=4"]])
def test_memory_only_takes_one_program(flag, capsys):
    """--memory-only leaves its compile running until the command exits, so it reads one program:
    with --layers or --compare it is refused before anything compiles, naming both flags."""
    assert main(["inspect", "recipe=tiny", "--memory-only", *flag]) == 2
    err = capsys.readouterr().err
    assert "--memory-only" in err and "--layers or --compare" in err


@pytest.mark.parametrize("alive", [True, False])
def test_the_program_ends_at_once_while_a_compile_goes_on(alive, monkeypatch):
    """cli.entry: with a compile thread still alive after the command (inspect --memory-only), the
    process ends by os._exit with the command's code, stdout flushed (a thread inside XLA at the
    interpreter's exit aborts it); without one, by sys.exit."""
    import os
    import threading

    from hybridmoe import cli
    from hybridmoe.analysis.program import COMPILE_THREAD

    release = threading.Event()
    compile_thread = threading.Thread(target=release.wait, name=COMPILE_THREAD, daemon=True)
    exits = []

    def command():
        if alive:
            compile_thread.start()
        return 3

    monkeypatch.setattr(cli, "main", command)
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(("os._exit", code)))
    try:
        with pytest.raises(SystemExit) as stopped:  # (the patched os._exit returns: sys.exit follows)
            cli.entry()
        assert exits == ([("os._exit", 3)] if alive else []) and stopped.value.code == 3
    finally:
        release.set()
        if alive:
            compile_thread.join()


def test_layers_must_be_whole_blocks_of_at_least_two():
    cfg = load_config("tiny", ["model.num_layers=16"])
    assert depth.depths(cfg, 8) == (8, 12)
    with pytest.raises(ValueError, match="not a whole number of layer blocks .*4 layers"):
        depth.depths(cfg, 6)
    with pytest.raises(ValueError, match="at least two blocks"):
        depth.depths(cfg, 4)
    with pytest.raises(ValueError, match="has 16 layers"):
        depth.depths(cfg, 16)


def test_layers_at_the_cell_recipe():
    """The 397B cell (60 layers, blocks of 4) takes --layers 8: its recipe loads at 8 and 12 layers
    for the TPU target (nothing compiled here)."""
    cell = load_config("qwen3.5-397b-a17b-v7x-128", ["mesh.cpu_devices=0"], platform="tpu")
    assert cell.model.num_layers == 60 and depth.depths(cell, 8) == (8, 12)
    for n in (8, 12):
        assert load_config("qwen3.5-397b-a17b-v7x-128", ["mesh.cpu_devices=0", f"model.num_layers={n}"],
                           platform="tpu").model.num_blocks == n // 4


DEPTH_MODEL = [*TWO_LAYERS, "model.num_layers=8", "train.batch_size=8"]  # four blocks of two layers


def test_inspect_layers_compiles_two_depths_and_extrapolates(tmp_path, capsys):
    """`inspect --layers 4` of an 8-layer model of two-layer blocks: the step at 4 and 6 layers,
    per-block memory their difference, the 8-layer figure extrapolated; the layer loop's saved
    residuals grow with the blocks it stacks."""
    out = tmp_path / "depth.json"
    assert main(["inspect", "recipe=tiny", *DEPTH_MODEL, "--layers", "4",
                 "--target", "cpu:8", "--estimate-for", "h200", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "memory against depth" in text and "EXTRAPOLATED" in text
    assert "EXTRAPOLATED to 8 layers from 4 and 6: step time estimate on h200" in text
    rec = json.loads(out.read_text())
    d = rec["depth"]
    m4, m6 = (rec["programs"][f"{n} layers"]["memory"] for n in (4, 6))
    assert [c["layers"] for c in d["compiled"]] == [4, 6] and d["extrapolated"]["layers"] == 8
    assert d["per_block"]["temp"] == m6["temp"] - m4["temp"] > 0
    assert d["extrapolated"]["temp"] == m4["temp"] + 2 * d["per_block"]["temp"]
    residuals = {n: {r["category"]: r["bytes"] for r in rec["programs"][f"{n} layers"]["peak_by_category"]["categories"]}
                 .get(peak_memory.RESIDUALS, 0) for n in (4, 6)}
    assert residuals[6] > residuals[4] > 0, residuals
    # The step estimate along the same line: each category's seconds at 8 = at 4 + 2 x (6 - 4); the
    # layers' categories grow by a block, the totals are the categories' sums, MFU at the 8-layer FLOPs.
    e4, e6 = (rec["programs"][f"{n} layers"]["step_estimate"] for n in (4, 6))
    e8 = rec["step_estimate"]
    assert e8["layers"] == 8 and e8["extrapolated_from_layers"] == [4, 6]
    for cat, row in e8["categories"].items():
        for key in ("s", "flops", "bytes"):
            want = e4["categories"][cat][key] + 2 * (e6["categories"][cat][key] - e4["categories"][cat][key])
            assert row[key] == pytest.approx(want, rel=1e-12, abs=1e-15), (cat, key)
    for cat in ("GDN", "attention"):
        assert e8["categories"][cat]["s"] > e6["categories"][cat]["s"] > e4["categories"][cat]["s"] > 0, cat
    assert e8["serial"]["step_s"] == pytest.approx(sum(r["s"] for r in e8["categories"].values()), rel=1e-12)
    assert e8["model_flops_per_device"] == pytest.approx(
        model_flops_per_device(load_config("tiny", [*DEPTH_MODEL, "mesh.cpu_devices=8"]), 8), rel=1e-12)
    assert e8["model_flops_per_device"] > e6["model_flops_per_device"]


def test_a_stack_the_tpu_compiler_allocates_counts_to_the_layer_loop():
    """The TPU compiler allocates the layer loop's stacks itself (custom-calls named after the call
    around the loop, no model scope): a buffer led by the number of blocks counts to the saved
    residuals, or to the gradients when shaped like a stacked parameter; led by anything else, other."""
    from hybridmoe.analysis.program import LiveBuffer

    shapes = peak_memory.ModelShapes(256, 128, 16, frozenset({(2, 16, 256, 256)}), num_blocks=2)
    made = lambda shape: LiveBuffer("custom-call.1", 1, shape, "jit(step)/micro_batches/while/body/closed_call",  # noqa: E731
                                    "main", None)
    assert peak_memory.category(made("f32[2,2048,256]"), shapes) == peak_memory.RESIDUALS
    assert peak_memory.category(made("f32[2,1,512,4,64]"), shapes) == peak_memory.RESIDUALS
    assert peak_memory.category(made("f32[2,16,256,256]"), shapes) == peak_memory.GRADIENTS
    assert peak_memory.category(made("f32[3,2048,256]"), shapes) == peak_memory.OTHER


def test_the_fit_verdict_reads_the_default_space_where_reported():
    """A TPU step whose memory_analysis temporaries over-count the heap (the 397B cell's: 122.68 GiB
    against the 90.38 GiB XLA's report gives the default space): fits by the report, as the compiler
    judged it; without a report the verdict falls back to args + outs - aliased + temps."""
    from types import SimpleNamespace

    gib = 2**30
    memory = {"argument": 9 * gib, "output": 9 * gib, "alias": 9 * gib, "temp": 123 * gib}
    reported = tp.memory_facts(SimpleNamespace(memory={**memory, "default_space": 90 * gib}), 96 * gib)
    assert reported["total"] == 132 * gib and reported["fits"] is True
    assert tp.memory_facts(SimpleNamespace(memory=memory), 96 * gib)["fits"] is False
    assert tp.memory_facts(SimpleNamespace(memory={**memory, "default_space": 97 * gib}), 96 * gib)["fits"] is False


def _cells(text: str, label: str) -> list[str]:
    """The cells of the printed row whose label starts the line (the label itself left out)."""
    (line,) = [x for x in text.splitlines() if x.startswith(label)]
    return line[len(label):].split()


def test_the_printed_table_shows_each_figure_in_its_unit():
    """inspect's table (format_facts) from figures written here in bytes: a column whose need reaches
    a GiB prints GiB (2^30), a smaller one MiB (2^20); collectives and residuals in MiB; FLOPs in
    TFLOP (1e12)."""
    G, M = 2**30, 2**20

    def column(scale, flops):
        memory = {"argument": 3 * scale, "output": scale, "alias": scale, "temp": 10 * scale, "generated_code": 0,
                  "total": 13 * scale, "default_space": 12.5 * scale, "hbm": None, "fits": None}
        return {"memory": memory, "flops": flops, "model_flops": flops / 2, "compile_s": 3.0, "compile_cached": False,
                "collectives": [{"where": "outside loops", "kind": "all-gather", "dtype": "bf16", "ops": 2,
                                 "bytes": 3 * M}],
                "saved_residuals": [{"name": "wi_out", "count": 2, "shape": [8, 64], "dtype": "bf16", "bytes": 5 * M}],
                "saved_residual_bytes_per_block": 7 * M, "peak_buffers": [], "peak_by_category": None}

    big = tp.format_facts({"a": column(G, 2.5e12), "b": column(G // 4, 5e11)})
    assert _cells(big, "arguments GiB") == ["3.00", "0.75"]
    assert _cells(big, "total (args+outs-aliased+temps) GiB") == ["13.00", "3.25"]
    assert _cells(big, "default space (XLA report) GiB") == ["12.50", "3.12"]
    assert _cells(big, "TFLOPs per device (XLA)") == ["2.5000", "0.5000"]
    assert _cells(big, "TFLOPs per device (model shape)") == ["1.2500", "0.2500"]
    assert _cells(big, "  outside loops: all-gather bf16") == ["2", "/", "3.00"] * 2
    assert _cells(big, "  wi_out") == ["2x", "5.00"] * 2
    assert _cells(big, "  all residuals (named or not)") == ["7.00"] * 2
    small = tp.format_facts({"a": column(M, 1e9)})
    assert _cells(small, "arguments MiB") == ["3.00"] and _cells(small, "temporaries MiB") == ["10.00"]


def test_the_count_search_of_a_compiled_step_by_hand(monkeypatch):
    """train.micro_batches=auto against 8 GiB a device, 2 GiB of state held: count 1 needs 20 GiB, so
    2 (2 + 18 / 2 = 11 GiB at the least) is passed over; 4 needs 7 GiB and is chosen; 8 is never
    tried. The printed line names each count's outcome and marks the one over the budget."""
    from types import SimpleNamespace

    import hybridmoe.run.memory_fit as memory_fit
    import hybridmoe.run.setup as run_setup
    import hybridmoe.run.step_plan as step_plan

    GIB = 2**30
    needs, compiled = {1: 20 * GIB, 4: 7 * GIB}, []

    def compile_one(cfg, target, **kw):
        count = cfg.train.micro_batches
        compiled.append(count)
        return SimpleNamespace(program=SimpleNamespace(need=needs[count]), out_of_memory=None, count_search=None)

    monkeypatch.setattr(run_setup, "build", lambda cfg, devices: SimpleNamespace(abstract_state=lambda: None))
    monkeypatch.setattr(step_plan, "train_counts", lambda setup: [1, 2, 4, 8])
    monkeypatch.setattr(memory_fit, "per_device_bytes", lambda tree: 2 * GIB)
    monkeypatch.setattr(tp, "compile_one", compile_one)
    monkeypatch.setattr(tp, "memory_facts", lambda prog, budget: {"total": prog.need})
    cfg = load_config("tiny", ["train.micro_batches=auto"])
    step = tp.compile_step(cfg, tp.Target("tpu7x:2x2x1", "tpu", (), 8 * GIB))
    assert compiled == [1, 4] and step.program.need == 7 * GIB
    search = step.count_search
    assert search == {"key": "train.micro_batches", "setting": "auto", "counts": [1, 2, 4, 8], "budget": 8 * GIB,
                      "held": 2 * GIB, "chosen": 4, "tried": [
                          {"count": 1, "compiled": True, "need": 20 * GIB, "refused_temp": None, "fits": False},
                          {"count": 2, "compiled": False, "need": None, "refused_temp": None, "fits": False},
                          {"count": 4, "compiled": True, "need": 7 * GIB, "refused_temp": None, "fits": True}]}
    assert tp.format_count_search(search) == (
        "train.micro_batches=auto: 4 chosen against 8.00 GiB per device (held state 2.00 GiB): 1 needs 20.00 GiB "
        "(over); 2 passed over (ruled out by the first count's figure); 4 needs 7.00 GiB")


def test_a_refused_steps_memory_counts_its_arguments_and_temporaries():
    facts = tp.refused_memory_facts({"argument": 3 * 2**30, "temp": 9 * 2**30, "message": "over"}, 8 * 2**30)
    assert facts["total"] == 12 * 2**30 and facts["fits"] is False and facts["refused"] == "over"
