"""Figures and record fields of the tools and loops, pinned by hand: each test states its
expectation as literals or simple arithmetic on its own small fixture (no model compiles)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import benchmark_script


# ---------------------------------------------------------------------------------------------
# benchmarks/step_estimate.py: every field its record keeps of an estimate


def _estimate(step_s=2.0, overlapped_s=1.0):
    """An estimate whose every field read by the record holds a distinct value."""
    return {"hardware": {"name": "tpu7x", "grid_step_s": 3e-6, "measured": {"chip": "v7x"}},
            "serial": {"step_s": step_s, "tokens_per_s_per_chip": 4096 / step_s, "mfu": 0.21},
            "overlapped": {"step_s": overlapped_s, "tokens_per_s_per_chip": 4096 / overlapped_s, "mfu": 0.42},
            "categories": {"gmm": {"s": 0.25}, "attention": {"s": 0.5}},
            "collectives": {"all-reduce": 7}, "kernels": {"gmm": 2},
            "kernels_without_cost_estimate": ["k1"], "loops_with_unknown_trip_count": ["l1", "l2", "l3"],
            "hlo_flops_per_device": 11.0, "model_flops_per_device": 13.0, "designed_flops_per_device": 17.0,
            "tokens_per_step": 4096, "chips": 4, "devices": 8}


def test_step_estimate_summary_takes_each_field_from_its_own_source():
    """Distinct values per field: a field read from a neighbour's key shows; the unknown loops are
    counted (3), the categories' seconds listed apart."""
    out = benchmark_script("step_estimate")._summary(_estimate())
    assert out["hardware"] == "tpu7x" and out["grid_step_s"] == 3e-6
    assert out["calibration"] == {"chip": "v7x"}
    assert (out["step_s"], out["overlapped_step_s"]) == (2.0, 1.0)
    assert (out["tokens_per_s_per_chip"], out["overlapped_tokens_per_s_per_chip"]) == (2048.0, 4096.0)
    assert (out["mfu"], out["overlapped_mfu"]) == (0.21, 0.42)
    assert out["category_s"] == {"gmm": 0.25, "attention": 0.5}
    assert out["collectives"] == {"all-reduce": 7} and out["kernels"] == {"gmm": 2}
    assert out["kernels_without_cost_estimate"] == ["k1"]
    assert out["loops_with_unknown_trip_count"] == 3
    assert (out["hlo_flops_per_device"], out["model_flops_per_device"], out["designed_flops_per_device"]) == (
        11.0, 13.0, 17.0)
    assert (out["tokens_per_step"], out["chips"], out["devices"]) == (4096, 4, 8)


def test_step_estimate_summary_of_an_estimate_without_design_count_or_calibration():
    """designed_flops_per_device and the calibration are optional: None when absent."""
    est = _estimate()
    del est["designed_flops_per_device"], est["hardware"]["measured"]
    out = benchmark_script("step_estimate")._summary(est)
    assert out["designed_flops_per_device"] is None and out["calibration"] is None


def test_step_estimate_arm_parses_name_and_overrides():
    """NAME=a,b gives (NAME, [a, b]); NAME= the recipe as it is; no '=' is refused."""
    module = benchmark_script("step_estimate")
    assert module._arm("tiles=kernels.gmm.tm=512,gdn.cp_m_scan=false") == (
        "tiles", ["kernels.gmm.tm=512", "gdn.cp_m_scan=false"])
    assert module._arm("cell=") == ("cell", [])
    with pytest.raises(SystemExit, match="NAME="):
        module._arm("cell")


def _inspect_record(with_extrapolated: bool):
    def program(layers, seconds, step_s):
        return {"config": {"model": {"num_layers": layers}}, "recipe": "small", "compile_s": seconds,
                "overrides": [f"model.num_layers={layers}"], "step_estimate": _estimate(step_s, step_s / 2)}

    # The deeper program first: the base is the one with the fewest layers, not the first listed.
    rec = {"programs": {"deep": program(12, 5.0, 6.0), "base": program(8, 3.25, 4.0)}, "target": "tpu7x:2x2x1"}
    if with_extrapolated:
        rec["step_estimate"] = _estimate(10.0, 8.0)
    return rec


def _run_from_inspect(module, tmp_path, monkeypatch, rec, previous=None):
    from hybridmoe.analysis import step_estimate as se

    monkeypatch.setattr(se, "format_estimate", lambda *a, **k: "")
    written = []
    monkeypatch.setattr(module.harness, "write", lambda out, name, **fields: written.append(fields))
    path = tmp_path / "inspect.json"
    path.write_text(json.dumps(rec))
    assert module._from_inspect(path, {"cell": []}, tmp_path / "out.json", previous or {}) == 0
    return written[0]["arms"]


def test_from_inspect_without_layers_takes_the_base_programs_estimate(tmp_path, monkeypatch):
    """No extrapolated estimate: the arm's figures are the fewest-layer program's (4 s, overlapped
    2 s), compile_s the sum 3.25 + 5 = 8.2 (rounded to 0.1), no extrapolated_from; earlier arms kept."""
    module = benchmark_script("step_estimate")
    arms = _run_from_inspect(module, tmp_path, monkeypatch, _inspect_record(False), previous={"old": {"step_s": 1}})
    assert arms["old"] == {"step_s": 1}
    arm = arms["cell"]
    assert (arm["step_s"], arm["overlapped_step_s"]) == (4.0, 2.0)
    assert arm["compile_s"] == 8.2
    assert arm["overrides"] == [] and arm["commit"] == ""
    assert "extrapolated_from" not in arm


def test_from_inspect_with_layers_records_each_depths_own_figures(tmp_path, monkeypatch):
    """The extrapolated estimate (10 s) is the arm's; each depth's own step_s under its layer count."""
    module = benchmark_script("step_estimate")
    arm = _run_from_inspect(module, tmp_path, monkeypatch, _inspect_record(True))["cell"]
    assert arm["step_s"] == 10.0
    assert {k: v["step_s"] for k, v in arm["extrapolated_from"].items()} == {"8": 4.0, "12": 6.0}


def test_from_inspect_refuses_overrides_more_arms_and_a_foreign_record(tmp_path):
    module = benchmark_script("step_estimate")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"programs": {}}))
    with pytest.raises(SystemExit, match="one arm"):
        module._from_inspect(path, {"cell": ["a=1"]}, tmp_path / "o.json", {})
    with pytest.raises(SystemExit, match="one arm"):
        module._from_inspect(path, {"a": [], "b": []}, tmp_path / "o.json", {})
    path.write_text(json.dumps({"arms": {}}))
    with pytest.raises(SystemExit, match="not a `hybridmoe inspect --out` record"):
        module._from_inspect(path, {"cell": []}, tmp_path / "o.json", {})


# ---------------------------------------------------------------------------------------------
# tools/score.py: the token checks at their bounds


def test_score_token_checks_at_their_bounds():
    """Length 2 accepted, 1 refused; ids vocab-1 and 0 accepted, vocab and -1 refused; floats refused."""
    from hybridmoe.tools.score import check_tokens

    assert check_tokens(np.array([[0, 7]]), 8, "t").shape == (1, 2)
    with pytest.raises(ValueError, match="length >= 2"):
        check_tokens(np.array([[3]]), 8, "t")
    with pytest.raises(ValueError, match="length >= 2"):
        check_tokens(np.array([3, 4]), 8, "t")
    with pytest.raises(ValueError, match="integers"):
        check_tokens(np.array([[0.0, 1.0]]), 8, "t")
    with pytest.raises(ValueError, match=r"\[0, 8\); found 0\.\.8"):
        check_tokens(np.array([[0, 8]]), 8, "t")


def test_score_token_file_refusals(tmp_path):
    from hybridmoe.tools.score import load_token_file

    with pytest.raises(ValueError, match="no such file"):
        load_token_file(tmp_path / "missing.npy")
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="the file is empty"):
        load_token_file(empty)
    text = tmp_path / "t.npy"
    text.write_text("1 2 3")
    with pytest.raises(ValueError, match="NumPy header"):
        load_token_file(text)
    good = tmp_path / "g.npy"
    np.save(good, np.array([[1, 2]], np.int32))
    assert load_token_file(good).tolist() == [[1, 2]]


# ---------------------------------------------------------------------------------------------
# run/step.py: the per-micro-batch counts folded


def test_fold_counts_sums_and_reduces_in_micro_batch_order():
    """Counts [3, 1, 4] sum to 8; a max reducer from 0 gives 4; an int count stays int."""
    from hybridmoe.run.step import _fold_counts

    counts = {"tokens": jnp.array([3, 1, 4], jnp.int32), "gap_max": jnp.array([0.5, 2.5, 1.5], jnp.float32)}
    out = _fold_counts(counts, {"gap_max": (jnp.maximum, 0.0)})
    assert int(out["tokens"]) == 8 and out["tokens"].dtype == jnp.int32
    assert float(out["gap_max"]) == 2.5
    assert int(_fold_counts(jnp.array([2, 5], jnp.int32), {})) == 7


def test_skip_if_nonfinite_keeps_the_old_state_on_a_nan_loss_or_inf_norm():
    from hybridmoe.run.step import skip_if_nonfinite

    new, old = jnp.float32(1.0), jnp.float32(0.0)
    kept, skipped = skip_if_nonfinite(jnp.float32(2.0), jnp.float32(3.0), new, old)
    assert (float(kept), int(skipped)) == (1.0, 0)
    kept, skipped = skip_if_nonfinite(jnp.float32(jnp.nan), jnp.float32(3.0), new, old)
    assert (float(kept), int(skipped)) == (0.0, 1)
    kept, skipped = skip_if_nonfinite(jnp.float32(2.0), jnp.float32(jnp.inf), new, old)
    assert (float(kept), int(skipped)) == (0.0, 1)
