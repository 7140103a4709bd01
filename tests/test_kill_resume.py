"""kill -9 at random moments (and during a checkpoint write and an export), then --resume: the run
ends as if never interrupted (tests/kill_harness.py says what is checked)."""

import pytest

from kill_harness import run_trials


# Found by this harness (benchmarks/robustness.json): an rl run killed during its first checkpoint
# write and resumed gave metrics that differ from the uninterrupted run's; not yet explained.
RL_KILL_DIFFERS = pytest.mark.xfail(reason="rl metrics differed after a kill during a checkpoint write", strict=False)


@pytest.mark.parametrize("command", ["train", pytest.param("rl", marks=RL_KILL_DIFFERS)])
def test_three_kills_lose_nothing(command, tmp_path):
    summary = run_trials(command, 3, tmp_path)
    assert summary["passed"] == 3 and summary["killed"] >= 1, summary


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", pytest.param("rl", marks=RL_KILL_DIFFERS)])
def test_twenty_kills_lose_nothing(command, tmp_path):
    summary = run_trials(command, 20, tmp_path, seed=1)
    assert summary["passed"] == 20 and summary["killed"] >= 10, summary
