"""The built-in tasks moved to the data layer (hybridmoe/data/arithmetic.py); this name stays importable."""

from hybridmoe.data.arithmetic import (  # noqa: F401
    TASKS, ArithmeticTask, Example, FormatTask, Task, get_task, solved_token_ids)
