"""The supervised warm-up before GRPO: packed rows of the task's solved examples.

`[BOS] prompt answer EOS` documents (`tasks.solved_token_ids`) packed into the supervised trainer's
[micro_batches, batch_size, seq_len] rows; a pure function of (seed, step) like every training batch,
so a resumed warm-up replays the same data. The supervised step (train/step.py) trains on every
in-document target, prompt included: the model learns the prompt format along with the answers.
"""

from __future__ import annotations

import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.rl.tasks import Task, get_task, solved_token_ids
from hybridmoe.rl.tokenizer import Tokenizer, load_tokenizer
from hybridmoe.train.data import pack_documents

# Stream tags: the warm-up's examples and the GRPO prompts are independent draws of one seed.
WARMUP_STREAM, PROMPT_STREAM = 1, 2


def task_from_config(cfg: Config) -> Task:
    return get_task(cfg.rl.task, digits=cfg.rl.digits, operators=cfg.rl.operators)


def solved_batch(cfg: Config, step: int, task: Task | None = None, tokenizer: Tokenizer | None = None):
    """Arrays [train.micro_batches, train.batch_size, train.seq_len] of packed solved examples."""
    t = cfg.train
    task = task_from_config(cfg) if task is None else task
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    rng = np.random.default_rng([t.seed, WARMUP_STREAM, step])
    out = []
    for _ in range(t.micro_batches):
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
        out.append(pack_documents(docs, t.batch_size, t.seq_len, pad_id=tokenizer.pad_id))
    return {k: np.stack([o[k] for o in out]) for k in out[0]}
