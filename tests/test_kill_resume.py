"""kill -9 at random moments (and during a checkpoint write and an export), then --resume: the run
ends as if never interrupted (tests/kill_harness.py says what is checked)."""

import pytest

from kill_harness import run_trials


# The default suite kills each command once, at an exact moment of its own: train in its first
# checkpoint write, rl in the middle of its export (its resume reads rl's checkpoint, the sampler's
# and the data's state included). rl killed in a checkpoint write repeats train's trial of the same
# checkpoint code (test_three_kills_lose_nothing[rl], slow, with the random moments).
EXACT_MOMENT = {"train": (0, "checkpoint 1"), "rl": (1, "export")}  # (index in kill_harness.MOMENTS, moment)


@pytest.mark.parametrize("command", ["train", "rl"])
def test_kills_at_the_exact_moments_lose_nothing(command, tmp_path):
    first, moment = EXACT_MOMENT[command]
    summary = run_trials(command, 1, tmp_path, first=first)
    assert [e["moment"] for e in summary["events"]] == [moment], summary
    assert summary["passed"] == 1 and all(e["killed"] and e["hit"] for e in summary["events"]), summary


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
