"""kill -9 at random moments (and during a checkpoint write and an export), then --resume: the run
ends as if never interrupted (tests/kill_harness.py says what is checked)."""

import pytest

from kill_harness import run_trials


# The default suite kills each command at its exact moments only: train in its first checkpoint write;
# rl there and in the middle of its export. The random moments repeat them (slow).
EXACT_TRIALS = {"train": 1, "rl": 2}


@pytest.mark.parametrize("command", ["train", "rl"])
def test_kills_at_the_exact_moments_lose_nothing(command, tmp_path):
    trials = EXACT_TRIALS[command]
    summary = run_trials(command, trials, tmp_path)
    moments = [e["moment"] for e in summary["events"]]
    assert moments == ["checkpoint 1", "export"][:trials], summary
    assert summary["passed"] == trials and all(e["killed"] and e["hit"] for e in summary["events"]), summary


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "rl"])
def test_three_kills_lose_nothing(command, tmp_path):
    summary = run_trials(command, 3, tmp_path)
    exact = [e for e in summary["events"] if e["moment"] != "random"]
    assert summary["passed"] == 3 and summary["events"][0]["hit"], summary
    assert all(e["killed"] for e in exact) and (command != "rl" or exact[1]["moment"] == "export"), summary


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "rl"])
def test_twenty_kills_lose_nothing(command, tmp_path):
    summary = run_trials(command, 20, tmp_path, seed=1)
    assert summary["passed"] == 20 and summary["killed"] >= 10, summary
