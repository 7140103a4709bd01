"""What a run does after steps whose loss or gradient norm was not finite.

The jitted step has already kept the old weights for such a step (run/step.py; the GRPO step
does the same); the run counts them here and, by train.on_nonfinite and train.max_nonfinite_skips,
stops: the caller checkpoints the last good state and metrics, then raises the error returned.
Under train.on_nonfinite=off the step has no guard: nothing is skipped, and nothing stops here.
"""

from __future__ import annotations

from hybridmoe.config.schema import TrainConfig
from hybridmoe.run.run_dir import RunError


class NonFiniteStop(RunError):
    """The run stopped on non-finite steps; its last good state is checkpointed."""


class NonFiniteGuard:
    def __init__(self, t: TrainConfig):
        self.policy, self.limit = t.on_nonfinite, t.max_nonfinite_skips
        self.in_a_row = 0

    def observe(self, step: int, nonfinite: bool) -> NonFiniteStop | None:
        """The error to stop with after this step, or None to go on."""
        self.in_a_row = self.in_a_row + 1 if nonfinite else 0
        if not nonfinite or self.policy == "off":
            return None
        if self.policy == "stop":
            return NonFiniteStop(f"step {step}: the loss or gradient norm is not finite (train.on_nonfinite=stop); "
                                 "the update was not applied; stopped with the last good state checkpointed")
        if self.limit and self.in_a_row >= self.limit:
            return NonFiniteStop(f"steps {step - self.in_a_row + 1}..{step}: {self.in_a_row} consecutive steps with a "
                                 f"non-finite loss or gradient norm (train.max_nonfinite_skips={self.limit}); their "
                                 "updates were skipped; stopped with the last good state checkpointed (lower the "
                                 "learning rate or check the data, then --resume)")
        return None
