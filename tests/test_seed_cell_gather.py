"""benchmarks/seed_cell.py gathers the per-arm records into seed_cell.json: an arm compiled alone
(--arms NAME) joins the arms recorded before, never replaces them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import seed_cell  # noqa: E402


def _arm_record(gib: float) -> dict:
    memory = {"argument": 2**30, "temp": int(gib * 2**30), "total": int((gib + 1) * 2**30), "default_space": gib * 2**30,
              "fits": True}
    return {"commit": "c0ffee", "date": "2026-12-06", "program": "train",
            "programs": {"base": {"overrides": [], "memory": memory, "compile_s": 1.0}}}


def _recorded_arms(tmp_path, monkeypatch, recorded: dict, compiled_gib: float):
    """Arms already recorded in seed_cell/ (name: GiB), and run_inspect stubbed to record each arm it
    is asked to compile at compiled_gib: (the record's path, the names compiled, in order)."""
    folder = tmp_path / "seed_cell"
    folder.mkdir()
    for name, gib in recorded.items():
        (folder / f"{name}.json").write_text(json.dumps(_arm_record(gib)))
    compiled = []

    def run_inspect(name, overrides, program, path):
        compiled.append(name)
        path.write_text(json.dumps(_arm_record(compiled_gib)))
        return _arm_record(compiled_gib)

    monkeypatch.setattr(seed_cell, "run_inspect", run_inspect)
    return tmp_path / "seed_cell.json", compiled


def test_an_arm_compiled_alone_joins_the_arms_recorded_before(tmp_path, monkeypatch):
    out, compiled = _recorded_arms(tmp_path, monkeypatch, {"before": 90.0, "default": 80.0, "sample": 40.0}, 60.0)
    last = seed_cell.ORDER[-1]
    assert seed_cell.main(["--arms", last, "--redo", last, "--out", str(out)]) == 0
    assert compiled == [last]
    arms = {a["arm"]: a["memory"]["default_space"] / 2**30 for a in json.loads(out.read_text())["arms"]}
    assert arms == {"before": 90.0, "default": 80.0, last: 60.0, "sample": 40.0}
    assert list(arms) == ["before", "default", last, "sample"]  # the seed's order
    with pytest.raises(SystemExit, match="unknown arm"):
        seed_cell.main(["--arms", "no_such_arm", "--out", str(out)])


def test_redo_compiles_a_recorded_arm_again(tmp_path, monkeypatch):
    """--redo names an arm already recorded: it is compiled again and its new figures replace the old;
    an arm recorded and not named keeps its record."""
    out, compiled = _recorded_arms(tmp_path, monkeypatch, {"before": 90.0, "default": 80.0}, 70.0)
    assert seed_cell.main(["--arms", "before,default", "--redo", "default", "--out", str(out)]) == 0
    assert compiled == ["default"]
    arms = {a["arm"]: a["memory"]["default_space"] / 2**30 for a in json.loads(out.read_text())["arms"]}
    assert arms == {"before": 90.0, "default": 70.0}


def test_an_arm_turns_off_only_the_levers_after_it():
    """Each arm keeps its own lever on and turns off every lever after it, the last lever's keys
    first: the last lever's arm is the recipe itself (no override)."""
    assert seed_cell.ORDER[-3:] == ["sublayer", "expert_grad_barrier", "gather_backward"]
    assert seed_cell.arm_overrides("gather_backward") == []
    assert seed_cell.arm_overrides("expert_grad_barrier") == ["moe.gather_backward=false"]
    assert seed_cell.arm_overrides("sublayer") == ["moe.gather_backward=false", "remat.expert_grad_barrier=false"]
    default = seed_cell.arm_overrides("default")
    assert default[:3] == ["moe.gather_backward=false", "remat.expert_grad_barrier=false", "remat.unit=layer"]
    assert "kernels.gmm.backend=xla" in default
