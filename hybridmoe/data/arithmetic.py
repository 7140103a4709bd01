"""The built-in arithmetic tasks, a data source for `rl` and `train` (train.data=arithmetic).

Built-in RL tasks as data: seeded prompt streams with verifiable rewards.

A task draws `Example(prompt, reference)` pairs from a numpy Generator (same seed, same stream) and
scores a completion from the prompt alone (`reward(prompt, completion)` is a `RewardFn`): the
reference is recomputed from the prompt, so a reward never depends on bookkeeping that could go
stale across a resume. `solved_token_ids` turns an example into a supervised warm-up sequence.

Completions are the decoded text up to EOS (`Tokenizer.decode` stops there). Whether a completion
ended with EOS at all is known to the sampler, not the text: a completion that ran out of new tokens
is marked truncated and masked in `advantages.py`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.data.packing import pack_documents, split_micro_batches
from hybridmoe.data.tokenizer import Tokenizer, load_tokenizer

_OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_EXPRESSION = re.compile(r"(\d+)([+\-*])(\d+)=")
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Example:
    prompt: str
    reference: str  # the answer a solved example writes after the prompt
    fields: dict = field(default_factory=dict, hash=False, compare=False)  # a prompt set's line, for rewards


class Task(Protocol):
    name: str

    @property
    def max_completion_chars(self) -> int:
        """Longest reference answer (a floor for the sampler's max new tokens, EOS not counted)."""
        ...

    def sample(self, rng: np.random.Generator, num_examples: int) -> list[Example]: ...

    def reward(self, prompt: str, completion: str) -> float: ...


def _evaluate(prompt: str) -> int:
    """The value of the expression that a prompt ends with; ValueError when there is none (the
    reward wrapper counts that as a skipped sample rather than a zero)."""
    match = _EXPRESSION.search(prompt)
    if match is None or match.end() != len(prompt):
        raise ValueError(f"prompt {prompt!r} does not end with an 'a<op>b=' expression")
    a, op, b = match.groups()
    return _OPERATIONS[op](int(a), int(b))


@dataclass(frozen=True)
class ArithmeticTask:
    """'12+34=' -> '46'. Reward 1.0 when the completion (surrounding whitespace ignored) is an
    integer equal to the answer, else 0.0.

    Difficulty knobs: `digits` bounds each operand to [0, 10**digits); `operators` is any subset of
    '+-*' (subtraction can give negative answers, which the tokenizer writes with '-')."""

    digits: int = 2
    operators: str = "+"
    name: str = "arithmetic"
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")
        unknown = set(self.operators) - set(_OPERATIONS)
        if not self.operators or unknown:
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {self.operators!r}")

    @property
    def max_completion_chars(self) -> int:
        largest = 10**self.digits - 1
        values = [_OPERATIONS[op](largest, largest) for op in self.operators] + [-largest]
        return max(len(str(v)) for v in values)

    def sample(self, rng: np.random.Generator, num_examples: int) -> list[Example]:
        # One vectorised draw per field, in a fixed order, so a stream is a function of the seed.
        high = 10**self.digits
        a = rng.integers(0, high, size=num_examples)
        b = rng.integers(0, high, size=num_examples)
        ops = rng.integers(0, len(self.operators), size=num_examples)
        examples = []
        for ai, bi, oi in zip(a.tolist(), b.tolist(), ops.tolist()):
            op = self.operators[oi]
            examples.append(Example(f"{self.prefix}{ai}{op}{bi}=", str(_OPERATIONS[op](ai, bi))))
        return examples

    def reward(self, prompt: str, completion: str) -> float:
        answer = completion.strip()
        if _INTEGER.fullmatch(answer) is None:
            return 0.0
        return 1.0 if int(answer) == _evaluate(prompt) else 0.0


@dataclass(frozen=True)
class FormatTask:
    """The format is stated in the prompt ('answer only: 12+34='): the completion must be one
    integer and nothing else (no spaces, no words; EOS right after it, so the text up to EOS is the
    integer alone). Reward 1.0 for the format, whether or not the number is right; `correct_bonus`
    adds that much more when it is."""

    digits: int = 2
    operators: str = "+"
    correct_bonus: float = 0.0
    name: str = "format"

    @property
    def _arithmetic(self) -> ArithmeticTask:
        return ArithmeticTask(self.digits, self.operators, prefix="answer only: ")

    @property
    def max_completion_chars(self) -> int:
        return self._arithmetic.max_completion_chars

    def sample(self, rng: np.random.Generator, num_examples: int) -> list[Example]:
        return self._arithmetic.sample(rng, num_examples)

    def reward(self, prompt: str, completion: str) -> float:
        if re.fullmatch(r"-?\d+", completion) is None:
            return 0.0
        bonus = self.correct_bonus if self.correct_bonus and int(completion) == _evaluate(prompt) else 0.0
        return 1.0 + bonus


TASKS: dict[str, Callable[..., Task]] = {"arithmetic": ArithmeticTask, "format": FormatTask}


def get_task(name: str, **knobs) -> Task:
    """The built-in task called `name`, built with `knobs` (e.g. digits=3, operators='+-')."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](**knobs)


def solved_token_ids(example: Example, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """A supervised warm-up sequence `[BOS] prompt answer EOS` and its completion mask (True on the
    answer and EOS tokens: the positions a completion-only loss trains on, as targets)."""
    prompt_ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(example.prompt)
    completion_ids = tokenizer.encode(example.reference) + [tokenizer.eos_id]
    ids = prompt_ids + completion_ids
    return ids, [False] * len(prompt_ids) + [True] * len(completion_ids)


# ------------------------------------------------------------------ solved examples (the warm-up)
# `[BOS] prompt answer EOS` documents packed into the supervised trainer's rows, a pure function of
# (seed, step) like every training batch, so a resumed warm-up replays the same data. The supervised
# step trains on every in-document target, prompt included: the model learns the prompt format too.

# Stream tags: the warm-up's examples and the GRPO prompts are independent draws of one seed.
WARMUP_STREAM, PROMPT_STREAM = 1, 2


def task_from_config(cfg: Config) -> Task:
    return get_task(cfg.rl.task, digits=cfg.rl.digits, operators=cfg.rl.operators)


def solved_batch(cfg: Config, step: int, task: Task | None = None, tokenizer: Tokenizer | None = None):
    """Arrays [micro-batches, sequences per micro-batch, train.seq_len] of packed solved examples:
    train.batch_size rows packed together, then split (data/packing.split_micro_batches)."""
    t = cfg.train
    task = task_from_config(cfg) if task is None else task
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    rng = np.random.default_rng([t.seed, WARMUP_STREAM, step])
    docs, budget = [], t.batch_size * t.seq_len
    while budget > 0:
        examples = task.sample(rng, 64)
        if not examples:
            raise ValueError(f"task {task.name!r} gave no examples for the warm-up")
        for ex in examples:
            ids, _ = solved_token_ids(ex, tokenizer)
            docs.append(np.asarray(ids[: t.seq_len], np.int32))
            budget -= len(docs[-1])
            if budget <= 0:
                break
    rows = pack_documents(docs, t.batch_size, t.seq_len, pad_id=tokenizer.pad_id)
    return split_micro_batches(rows, t.fewest_micro_batches)
