"""kill -9 at random moments (and during a checkpoint write and an export), then --resume: the run
ends as if never interrupted (tests/kill_harness.py says what is checked)."""

import pytest

from kill_harness import run_trials


@pytest.mark.parametrize("command", ["train", "rl"])
def test_three_kills_lose_nothing(command, tmp_path):
    summary = run_trials(command, 3, tmp_path)
    # The exact kills land: the first trial during the first checkpoint write, and for rl the second
    # in the middle of the export.
    exact = [e for e in summary["events"] if e["moment"] != "random"]
    assert summary["passed"] == 3 and summary["events"][0]["hit"], summary
    assert all(e["killed"] for e in exact) and (command != "rl" or exact[1]["moment"] == "export"), summary


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "rl"])
def test_twenty_kills_lose_nothing(command, tmp_path):
    summary = run_trials(command, 20, tmp_path, seed=1)
    assert summary["passed"] == 20 and summary["killed"] >= 10, summary
