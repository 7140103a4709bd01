"""The warm-up's solved examples moved to the data layer (hybridmoe/data/arithmetic.py); this name stays importable."""

from hybridmoe.data.arithmetic import PROMPT_STREAM, WARMUP_STREAM, solved_batch, task_from_config  # noqa: F401
