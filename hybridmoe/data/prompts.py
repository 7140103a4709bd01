"""rl.task=prompts: a JSONL/Parquet prompt set as an RL task.

Each line holds `prompt` (text given to the model as is) or `messages` (rendered with the
checkpoint's chat template, ending with the assistant's turn opened), plus any fields the rewards
read (e.g. `answer`); the whole line reaches every reward as `example`. The rewards come from
rl.reward (the set has no reward of its own).

Every host reads the whole set (prompt sets are small, and the RL step builds the same global
rollout batch on every host). A step's prompts are drawn without replacement by the step's own
generator (a pure function of (train.seed, step)), so a resumed run asks the same prompts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.data.arithmetic import Example
from hybridmoe.data.records import DataError, prompt_or_messages, read_records
from hybridmoe.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSetTask:
    examples: tuple[Example, ...]
    name: str = "prompts"
    max_completion_chars: int = 0

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Tokenizer) -> PromptSetTask:
        """The prompt set of data.prompts; a DataError when no prompt fits rl.max_prompt_len (a
        longer prompt is a counted skip at run time: a set of only such prompts could not train)."""
        examples = read_prompt_set(cfg.data.prompts, tokenizer, cfg.data.on_bad_line)
        bos = 1 if tokenizer.bos_id is not None else 0
        lengths = [bos + len(tokenizer.encode(e.prompt)) for e in examples]
        too_long = sum(n > cfg.rl.max_prompt_len for n in lengths)
        if too_long == len(lengths):
            raise DataError(f"data.prompts={cfg.data.prompts}: every prompt is longer than rl.max_prompt_len="
                            f"{cfg.rl.max_prompt_len} tokens (shortest {min(lengths)}, longest {max(lengths)}); "
                            f"raise rl.max_prompt_len to at least {max(lengths)}")
        if too_long:
            log.warning("data.prompts: %d of %d prompts exceed rl.max_prompt_len=%d tokens (longest %d) and will be "
                        "skipped when drawn", too_long, len(lengths), cfg.rl.max_prompt_len, max(lengths))
        return cls(tuple(examples))

    def sample(self, rng: np.random.Generator, num_examples: int) -> list[Example]:
        n = len(self.examples)
        picks = rng.choice(n, size=num_examples, replace=num_examples > n)
        return [self.examples[i] for i in picks.tolist()]

    def reward(self, prompt: str, completion: str) -> float:
        raise RuntimeError("a prompt set has no reward of its own: set rl.reward")


def read_prompt_set(path, tokenizer: Tokenizer, on_bad_line: str = "stop", what: str = "data.prompts") -> list[Example]:
    """The examples of a prompt set: the prompt text (`prompt`, or `messages` through the chat
    template) and the line's fields."""
    records, _ = read_records(path, what, prompt_or_messages, on_bad_line)
    examples = []
    for rec in records:
        f = rec.fields
        try:
            text = f["prompt"] if isinstance(f.get("prompt"), str) else tokenizer.render_chat(f["messages"])
        except ValueError as e:
            raise DataError(f"{rec.file}:{rec.line}: {e}") from None
        examples.append(Example(text, str(f.get("answer", "")), fields=dict(f)))
    return examples

