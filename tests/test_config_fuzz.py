"""Config fuzzing: random override sets either validate and build the step's abstract shapes, or
fail with a ConfigError naming an overridden key; never another exception."""

import pytest
from hypothesis import HealthCheck, given, settings

from config_fuzz import check, override_sets

FUZZ = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


# 60 draws in the default suite (each valid one traces the step's shapes); the slow test repeats with 3,000.
@settings(max_examples=60, **FUZZ)
@given(override_sets())
def test_random_overrides_validate_or_name_the_key(overrides):
    check(overrides)


@pytest.mark.slow
@settings(max_examples=3000, **FUZZ)
@given(override_sets())
def test_random_overrides_validate_or_name_the_key_3000(overrides):
    check(overrides)
