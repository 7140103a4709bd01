"""The one error a config raises: every unmet requirement, each with its dotted key and the fix."""

from __future__ import annotations

Problem = tuple[str, str]


class ConfigError(ValueError):
    """One error naming every unmet requirement, each with its dotted key."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  {k}: {m}" for k, m in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")
