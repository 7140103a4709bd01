"""Reward functions named on the command line: `rl.reward=path/to/file.py:function` or `module:function`.

Each is called as `function(prompt, completion, example) -> float`, `example` being the fields of
the prompt's line in the prompt set (e.g. `answer`). Several combine by `rl.reward_weights`.
A name that does not import or is not callable is one RewardSpecError at start-up, before anything
is written; a reward that raises or returns NaN during the run is counted by `score_completions`
and never ends the run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


class RewardSpecError(ValueError):
    """An rl.reward entry that cannot be loaded; the message names it and the fix."""


class ExampleReward:
    """A (prompt, completion, example) reward, marked so `score_completions` passes the example."""

    takes_example = True

    def __init__(self, fn: Callable, name: str):
        self.fn, self.__qualname__ = fn, name

    def __call__(self, prompt: str, completion: str, example: dict) -> float:
        return self.fn(prompt, completion, example)


def _import_file(path: Path, spec: str):
    if not path.is_file():
        raise RewardSpecError(f"rl.reward={spec}: no file {path}; give path/to/file.py:function or module:function")
    name = f"hybridmoe_user_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- any failure of user code at import is the user's to fix
        raise RewardSpecError(f"rl.reward={spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    sys.modules[name] = module
    return module


def load_reward(spec: str) -> ExampleReward:
    """One `file.py:function` or `module:function` as a reward."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise RewardSpecError(f"rl.reward={spec}: expected path/to/file.py:function or module:function")
    if where.endswith(".py"):
        module = _import_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001
            raise RewardSpecError(f"rl.reward={spec}: cannot import module {where!r} ({type(e).__name__}: {e}); "
                                  "for a file give its path ending in .py") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardSpecError(f"rl.reward={spec}: {where} has no {attr!r}")
    if not callable(fn):
        raise RewardSpecError(f"rl.reward={spec}: {where}:{attr} is a {type(fn).__name__}, not a function")
    return ExampleReward(fn, spec)


def load_rewards(specs: Sequence[str], weights: Sequence[float] = ()) -> list[tuple[ExampleReward, float]]:
    weights = list(weights) or [1.0] * len(specs)
    return [(load_reward(s), float(w)) for s, w in zip(specs, weights, strict=True)]
