"""Figures of the run-level benchmarks from hand-made inputs: bf16_gaps' log-prob, output and
sampler gaps, robustness's carried-over sections, inspect_depth's extrapolation errors,
compile_cache's ratio and counts, demo_curves' summary, moe_tiles' and attention_cpu_backend's
ratios. Nothing compiles or runs a model; the scripts' JAX set-up on import is stubbed."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import benchmark_script_unconfigured

_load = benchmark_script_unconfigured


def test_bf16_gaps_logprob_gap_counts_targets_inside_documents_only():
    """Rows [1 1 1 1] and [1 1 2 2]: targets 1..3 inside a document are row 0's three and row 1's
    first and third (the second starts a document): 5. Differences there 0.1, -0.2, 0 and 0.3, -0.4
    (the 5.0 at the document start is not a target): mean |d| 1.0 / 5 = 0.2, max 0.4, row maxima
    0.2 and 0.4; the one-device log-probs there -1 -2 -3 -4 -6: mean -3.2. Routing: a reordered
    pair is no flip; token (1, 2) flips in one layer, token (1, 3) in both: 3 flips, 2 tokens, of
    2 x 4 x 2 = 16 routings."""
    gaps = _load("bf16_gaps")
    seg = np.array([[1, 1, 1, 1], [1, 1, 2, 2]])
    logp_1 = np.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    d = np.array([[0.1, -0.2, 0.0], [0.3, 5.0, -0.4]])
    routing_1 = np.tile(np.array([0, 1]), (2, 4, 2, 1))
    routing_cp = routing_1.copy()
    routing_cp[0, 0, 0] = [1, 0]
    routing_cp[1, 2, 1] = [0, 3]
    routing_cp[1, 3] = [2, 3]
    got = gaps.logprob_gap(logp_1, logp_1 - d, routing_1, routing_cp, seg)
    assert got["targets"] == 5
    assert got["gap_mean"] == pytest.approx(0.2) and got["gap_max"] == pytest.approx(0.4)
    assert got["gap_max_row0_one_document"] == pytest.approx(0.2) and got["gap_max_row1_packed"] == pytest.approx(0.4)
    kept = [0.1, -0.2, 0.0, 0.3, -0.4]
    assert got["kl_k3_mean"] == pytest.approx(sum(math.exp(-x) + x - 1 for x in kept) / 5)
    assert got["logp_mean"] == pytest.approx(-3.2)
    assert (got["routing_flips"], got["tokens_with_a_flip"], got["routings"]) == (3, 2, 16)


def test_bf16_gaps_output_gap_and_the_grpo_steps_sampler_gap():
    """Output [3, 4] (norm 5) against [3, 4.5]: relative L2 0.5 / 5 = 0.1, max 0.5 / 4 = 0.125.
    Sampler gap over the GRPO steps (phase 1) only: means 0.1, 0.3 -> 0.2; maxima 0.5, 0.4 -> 0.5
    (the warm-up step's 9 is not one)."""
    gaps = _load("bf16_gaps")
    got = gaps.output_gap(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
    assert got["rel_l2"] == pytest.approx(0.1) and got["rel_max"] == pytest.approx(0.125)
    step = lambda i, phase, mean, mx: {"step": i, "phase": phase, "sampler_gap_mean": mean,  # noqa: E731
                                       "sampler_gap_max": mx, "reward_mean": 0.5, "kl": 0.0, "entropy": 1.0}
    g = gaps.grpo_gap([step(0, 0, 9.0, 9.0), step(1, 1, 0.1, 0.5), step(2, 1, 0.3, 0.4)])
    assert g["sampler_gap_mean"] == pytest.approx(0.2) and g["sampler_gap_max"] == pytest.approx(0.5)
    assert [s["step"] for s in g["steps"]] == [1, 2]


def test_bf16_gaps_packed_row_documents_start_on_and_across_shard_edges():
    """1024 tokens over 4 ranks: shards of 256; row 1's documents start at 0, int(71.68) = 71, 256,
    int(630.78) = 630, int(955.39) = 955, positions restarting at each."""
    gaps = _load("bf16_gaps")
    rows = gaps.packed_rows(1024, 100)
    assert rows["doc_starts_row1"] == [0, 71, 256, 630, 955]
    assert rows["shard_edges"] == [256, 512, 768]
    seg, pos = rows["segment_ids"], rows["positions"]
    assert (seg[0] == 1).all() and list(pos[0, :3]) == [0, 1, 2]
    assert (seg[1, 70], seg[1, 71], seg[1, 255], seg[1, 256], seg[1, 1023]) == (1, 2, 2, 3, 5)
    assert (pos[1, 70], pos[1, 71], pos[1, 630], pos[1, 1023]) == (70, 0, 0, 1023 - 955)
    assert rows["tokens"].shape == (2, 1024) and rows["tokens"].min() >= 3


def test_robustness_a_section_not_run_is_carried_over_with_its_records_date_and_commit(tmp_path, monkeypatch):
    """No section run: the earlier record's fuzz is kept, marked with that record's date and commit;
    its kill section, itself carried over, keeps the record it came from; no multihost appears."""
    rob = _load("robustness")
    import hybridmoe.tools.record as record_module

    out = tmp_path / "robustness.json"
    out.write_text(json.dumps({"date": "d1", "commit": "c1", "fuzz": {"draws": 5},
                               "kill": {"train": {"trials": 2}, "from_record": {"date": "d0", "commit": "c0"}}}))
    monkeypatch.setattr(record_module, "machine_record", lambda: {"date": "d2", "commit": "c2"})
    monkeypatch.setattr(sys, "argv", ["robustness.py", "--fuzz-draws", "0", "--kill-trials", "0", "--out", str(out)])
    rob.main()
    got = json.loads(out.read_text())
    assert got["benchmark"] == "robustness" and (got["date"], got["commit"]) == ("d2", "c2")
    assert got["fuzz"] == {"draws": 5, "from_record": {"date": "d1", "commit": "c1"}}
    assert got["kill"]["from_record"] == {"date": "d0", "commit": "c0"} and got["kill"]["train"] == {"trials": 2}
    assert "multihost" not in got


@pytest.mark.parametrize("reports_default_space", [True, False])
def test_inspect_depth_errors_are_the_extrapolation_against_the_full_compile(reports_default_space, tmp_path,
                                                                             monkeypatch):
    """`small`, blocks of 4 layers; compiled at 8, 12 and the full 20. Memory at L layers: arguments
    100 L, temporaries 10 L (at 20: 220, 10% over the line), default space total + 1000. From 8 and
    12 (blocks 2 and 3) to block 5: arguments 800 + 400 x 3 = 2000 (error 0), temporaries 80 + 40 x 3
    = 200 against 220 (-20 / 220), total 2200 against 2220, default space 3200 against 3220; the pair
    compiled in 8 + 12 s. 12 + 4 = 16 is not compiled: one extrapolation. A compile without a
    default-space report (a CPU target's) has no error for it."""
    depth_script = _load("inspect_depth")

    def fake_run(argv, **kw):
        layers = int(next(a for a in argv if a.startswith("model.num_layers="))[len("model.num_layers="):])
        temp = 220 if layers == 20 else 10 * layers
        memory = {"argument": 100 * layers, "temp": temp, "total": 100 * layers + temp}
        if reports_default_space:
            memory["default_space"] = 100 * layers + temp + 1000
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(json.dumps({"programs": {"base": {"compile_s": float(layers), "memory": memory,
                                                         "step_estimate": None}}}))
        return SimpleNamespace(returncode=0, stderr="")

    records = []
    monkeypatch.setattr(depth_script.subprocess, "run", fake_run)
    monkeypatch.setattr(depth_script.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(depth_script.harness, "write", lambda out, name, **f: records.append(f))
    depth_script.main(["--layers", "8,12", "--full", "20", "--out", str(tmp_path / "d.json")])
    (rec,) = records
    assert rec["block_layers"] == 4 and rec["full_layers"] == 20
    (e,) = rec["extrapolations"]
    assert e["layers_flag"] == 8 and e["compiled"] == [8, 12] and e["compile_s"] == 20.0
    err = e["relative_error"]
    assert err["argument"] == 0
    assert err["temp"] == pytest.approx(-20 / 220) and err["total"] == pytest.approx(-20 / 2220)
    if reports_default_space:
        assert err["default_space"] == pytest.approx(-20 / 3220)
    else:
        assert set(err) == {"argument", "temp", "total"}
    assert [d["layers"] for d in rec["depths"]] == [8, 12, 20]
    assert rec["depths"][2]["temp"] == 220 and rec["depths"][0]["argument"] == 800
    assert rec["depths"][0]["step_s"] is None


def test_compile_cache_row_is_the_second_runs_time_over_the_firsts_and_what_the_cache_holds(monkeypatch):
    """First run 10 s (stores 3 programs and 2 compiles' facts), second 2.5 s: 0.25."""
    cc = _load("compile_cache")
    monkeypatch.setattr(cc, "COMMANDS", {"demo": ["demo"]})
    seconds = iter([10.0, 2.5])

    def fake_timed(words, cwd):
        cache = Path(words[-1].split("=", 1)[1])
        (cache / "program-facts").mkdir(parents=True, exist_ok=True)
        for i in range(3):
            (cache / f"p{i}-cache").write_text("x")
        for i in range(2):
            (cache / "program-facts" / f"f{i}.json.gz").write_text("x")
        (cache / "other-file").write_text("x")
        return next(seconds)

    records = []
    monkeypatch.setattr(cc, "timed", fake_timed)
    monkeypatch.setattr(cc.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(cc.harness, "write", lambda out, name, **f: records.append(f))
    cc.main([])
    (row,) = records[0]["runs"]
    assert row["command"] == "hybridmoe demo"
    assert (row["first_s"], row["second_s"], row["second_over_first"]) == (10.0, 2.5, 0.25)
    assert (row["programs_stored"], row["facts_kept"]) == (3, 2)


def test_demo_curves_summary_of_the_grpo_phase_and_its_ten_step_means():
    """Warm-up losses 3, 2; GRPO steps 10..21 with rewards 0..11: first 0, last 11, 10-step means
    4.5 (0..9) and 10.5 (10, 11); pg_clipfrac 0.1 i: mean 0.55."""
    dc = _load("demo_curves")
    history = [{"phase": 0, "step": s, "warmup_loss": loss} for s, loss in ((0, 3.0), (1, 2.0))]
    keys = ("ratio_min", "ratio_max", "sampler_gap_mean", "is_weight_mean")
    history += [{"phase": 1, "step": 10 + i, "reward_mean": float(i), "pg_clipfrac": 0.1 * i, **{k: 1.0 for k in keys}}
                for i in range(12)]
    got = dc.summary(history)
    assert got["grpo_steps"] == 12 and (got["reward_first"], got["reward_last"]) == (0.0, 11.0)
    assert got["reward_mean_per_10_steps"] == pytest.approx([4.5, 10.5])
    assert (got["warmup_loss_first"], got["warmup_loss_last"]) == (3.0, 2.0)
    assert got["pg_clipfrac_mean"] == pytest.approx(0.55) and got["ratio_max_mean"] == 1.0
    assert got["steps"] == list(range(10, 22))


def test_moe_tiles_ratios_are_tiles_over_sorted_per_round():
    """(CPU, wall) per round: sorted (2, 4), (4, 8); tiles (1, 1), (3, 4): CPU ratios 0.5, 0.75
    (median 0.625), wall 0.25, 0.5 (median 0.375); sorted's medians CPU 3, wall 6."""
    mt = _load("moe_tiles")
    res, ratio_cpu, ratio_wall = mt.figures({"sorted": [(2.0, 4.0), (4.0, 8.0)], "tiles": [(1.0, 1.0), (3.0, 4.0)]})
    assert ratio_cpu["median"] == pytest.approx(0.625) and ratio_wall["median"] == pytest.approx(0.375)
    assert res["sorted"]["cpu_s"]["median"] == 3.0 and res["sorted"]["wall_s"]["median"] == 6.0


def test_attention_cpu_backend_medians_and_ratios_to_blocked_and_agreement_with_masked():
    """Medians blocked 2, masked 4, xla-b64 1 s: ratios 1, 2, 0.5. Agreement: outputs [2, -3.5] and
    [1, 1.1] against masked [2, -4] and [1, 1]: 0.5 / 4 and 0.1 / 1, the larger 0.125."""
    acb = _load("attention_cpu_backend")
    median, ratio = acb.medians({"blocked": [1.0, 3.0, 2.0], "masked": [4.0, 4.0, 10.0], "xla-b64": [1.0, 1.0, 1.0]})
    assert median == {"blocked": 2.0, "masked": 4.0, "xla-b64": 1.0}
    assert ratio == {"blocked": 1.0, "masked": 2.0, "xla-b64": 0.5}
    import jax.numpy as jnp

    outs = {"masked": (jnp.array([2.0, -4.0]), jnp.array([1.0, 1.0])),
            "blocked": (jnp.array([2.0, -3.5]), jnp.array([1.0, 1.1]))}
    got = acb.agreement_with(outs)
    assert got["blocked"] == pytest.approx(0.125) and got["masked"] == 0.0


def test_bf16_gaps_refuses_tokens_not_in_whole_chunks_per_rank_and_writes_twice(monkeypatch):
    """--tokens must be a multiple of 4 ranks x 64: 1000 is refused before anything runs, 512 runs.
    Parts 1 and 2 are written first (complete: false), then everything (complete: true). Each part's
    three arms: float32, bfloat16, bfloat16 with the broken chain."""
    gaps = _load("bf16_gaps")
    arms = []
    monkeypatch.setattr(gaps, "context_parallel_gap", lambda tokens, dtype, bf16_chain=False: arms.append(
        ("cp", tokens, dtype, bf16_chain)) or {"dtype": dtype, "cross_rank_chain": "x", "targets": 1, "gap_mean": 0.0,
                                              "gap_max": 0.0, "gap_max_row0_one_document": 0.0,
                                              "gap_max_row1_packed": 0.0, "kl_k3_mean": 0.0, "routing_flips": 0,
                                              "routings": 1})
    monkeypatch.setattr(gaps, "layer_chain_gap", lambda tokens, dtype, bf16_chain=False: arms.append(
        ("layer", tokens, dtype, bf16_chain)) or {"dtype": dtype, "cross_rank_chain": "x", "rel_l2": 0.0, "rel_max": 0.0})
    monkeypatch.setattr(gaps, "sampler_gap", lambda dtype, warmup, steps: arms.append(("sampler", dtype, warmup, steps))
                        or {"dtype": dtype, "sampler_gap_mean": 0.0, "sampler_gap_max": 0.0, "steps": []})
    records = []
    monkeypatch.setattr(gaps.harness, "write", lambda out, name, **f: records.append(f))
    monkeypatch.setattr(sys, "argv", ["bf16_gaps.py", "--tokens", "1000"])
    with pytest.raises(SystemExit):
        gaps.main()
    assert arms == [] and records == []
    monkeypatch.setattr(sys, "argv", ["bf16_gaps.py", "--tokens", "512", "--warmup-steps", "7", "--grpo-steps", "2"])
    gaps.main()
    assert [r["complete"] for r in records] == [False, True]
    assert records[0]["sampler"] is None and len(records[1]["sampler"]) == 2
    assert arms[:3] == [("cp", 512, "float32", False), ("cp", 512, "bfloat16", False), ("cp", 512, "bfloat16", True)]
    assert arms[3:6] == [("layer", 512, "float32", False), ("layer", 512, "bfloat16", False),
                         ("layer", 512, "bfloat16", True)]
    assert arms[6:] == [("sampler", "float32", 7, 2), ("sampler", "bfloat16", 7, 2)]
    assert records[1]["shard_edges"] == [128, 256, 384] and records[1]["ranks"] == 4


def test_inspect_depth_step_estimate_error_is_against_the_full_compiles_own(tmp_path, monkeypatch):
    """The line's estimate 1.1 s against the full compile's 1.0 s: +10%; categories: matmul 0.55
    against 0.5 (+10%), collectives 0.2 against 0.25 (-20%), one the full compile gives 0 s is left out."""
    depth_script = _load("inspect_depth")
    import hybridmoe.tools.depth as depth

    full_estimate = {"serial": {"step_s": 1.0}, "model_flops_per_device": 7.0,
                     "categories": {"matmul": {"s": 0.5}, "collectives": {"s": 0.25}, "idle": {"s": 0.0}}}

    def fake_run(argv, **kw):
        layers = int(next(a for a in argv if a.startswith("model.num_layers="))[len("model.num_layers="):])
        out = Path(argv[argv.index("--out") + 1])
        memory = {"argument": layers, "temp": layers, "total": 2 * layers}
        out.write_text(json.dumps({"programs": {"base": {"compile_s": 1.0, "memory": memory, "step_estimate": (
            full_estimate if layers == 20 else {"serial": {"step_s": 0.1 * layers}})}}}))
        return SimpleNamespace(returncode=0, stderr="")

    flops_asked = []
    monkeypatch.setattr(depth, "extrapolate_estimate", lambda est, block, n, flops: flops_asked.append(flops) or {
        "serial": {"step_s": 1.1}, "categories": {"matmul": {"s": 0.55}, "collectives": {"s": 0.2}, "idle": {"s": 0.1}}})
    records = []
    monkeypatch.setattr(depth_script.subprocess, "run", fake_run)
    monkeypatch.setattr(depth_script.harness, "configure", lambda *a, **k: None)
    monkeypatch.setattr(depth_script.harness, "write", lambda out, name, **f: records.append(f))
    depth_script.main(["--layers", "8,12", "--full", "20", "--out", str(tmp_path / "d.json")])
    est = records[0]["extrapolations"][0]["step_estimate"]
    assert flops_asked == [7.0]
    assert (est["step_s"], est["full_step_s"]) == (1.1, 1.0) and est["relative_error"] == pytest.approx(0.1)
    assert est["category_relative_error"] == pytest.approx({"matmul": 0.1, "collectives": -0.2})
    assert [d["step_s"] for d in records[0]["depths"]] == pytest.approx([0.8, 1.2, 1.0])


def test_attention_cpu_backend_arms_shapes_scale_and_documents_per_row(monkeypatch):
    """Rows with segments [1 1 2 2 0 0] and [1 1 1 1 1 1]: 2 and 1 documents (padding is none); q
    and the cotangent [B, T, 4 heads, 8], k and v [B, T, 2 kv heads, 8]; scale 8 ** -0.5; a flash
    arm per block size."""
    import numpy as np

    acb = _load("attention_cpu_backend")
    seg = np.array([[[1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1]]])
    monkeypatch.setattr(acb, "synthetic_batch", lambda *a: {"positions": np.zeros_like(seg), "segment_ids": seg})
    cfg = SimpleNamespace(train=SimpleNamespace(seed=0, batch_size=2, seq_len=6),
                          model=SimpleNamespace(vocab_size=10, num_heads=4, num_kv_heads=2, head_dim=8))
    cores, inputs, shape = acb.arms(cfg)
    assert shape == {"batch": 2, "tokens": 6, "query_heads": 4, "kv_heads": 2, "head_dim": 8, "dtype": "float32",
                     "documents_per_row": [2, 1]}
    assert [x.shape for x in inputs] == [(2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8), (2, 6, 4, 8)]
    assert cores["blocked"].keywords["scale"] == pytest.approx(8 ** -0.5)
    assert list(cores) == ["masked", "blocked", "xla-b32", "xla-b64", "xla-b128", "xla-b256"]
    assert cores["xla-b64"].keywords["block_q"] == cores["xla-b64"].keywords["block_k"] == 64
