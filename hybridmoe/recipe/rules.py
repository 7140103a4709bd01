"""The validator's registry: each rule states the requirements of some config keys (recipe/validate.py
runs them all at load; rl/ runs the rl command's own). A rule only reads the config and returns the
unmet requirements it finds as (dotted key, message)."""

from __future__ import annotations

from collections.abc import Callable

from hybridmoe.config.errors import Problem
from hybridmoe.config.schema import Config
from hybridmoe.recipe.facts import Facts

Rule = Callable[[Config, Facts], list[Problem]]
# Every rule of the validation pass (check_requirements), and those only the rl command runs
# (check_rl_requirements). Both lists are the whole validator: tests/test_refusals.py holds a
# refusal case for each rule and reaches every problem each one can report.
RULES: list[Rule] = []
RL_RULES: list[Rule] = []


def rule(*keys: str, rules: list[Rule] = RULES) -> Callable[[Rule], Rule]:
    """Register a rule that states the requirements of `keys` (dotted config keys, or a section).

    A rule is named after the key it checks (`_quant_fp8_gmm` checks `quant.fp8_gmm`); one that
    checks several lists them here, so a search for a key finds its rule. `rule.keys` holds them."""
    def register(fn: Rule) -> Rule:
        fn.keys = keys
        rules.append(fn)
        return fn
    return register


def rl_rule(*keys: str) -> Callable[[Rule], Rule]:
    """Register a rule of the rl command only (check_rl_requirements), as `rule` does."""
    return rule(*keys, rules=RL_RULES)
