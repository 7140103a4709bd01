"""The training-row source a config asks for, behind one interface for the train loop.

`batch(step, position) -> (rows, position)`: synthetic and arithmetic rows are pure functions of
the step (every host builds the same global batch; the position is unused); file rows depend on
the per-host cursor, which the checkpoint keeps (`position_record` / `start_position`).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.data.packing import BATCH_FIELDS
from hybridmoe.data.tokenizer import Tokenizer, load_tokenizer


def config_tokenizer(cfg: Config) -> Tokenizer:
    """data.tokenizer (set by recipe=hf:DIR when the checkpoint has tokenizer.json), else the built-in one."""
    return load_tokenizer(Path(cfg.data.tokenizer) if cfg.data.tokenizer else None)


class StepSource:
    """Rows that are a pure function of (seed, step): the same global batch on every host."""

    host_local = False
    fields = BATCH_FIELDS  # the batch's arrays (every token a target)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def batch(self, step: int, position: int):
        cfg, t = self.cfg, self.cfg.train
        if t.data == "synthetic":
            from hybridmoe.data.synthetic import synthetic_batch
            return synthetic_batch(t.seed, step, t.fewest_micro_batches, t.rows_per_micro_batch, t.seq_len,
                                   cfg.model.vocab_size), position
        from hybridmoe.data.arithmetic import solved_batch
        return solved_batch(cfg, step), position


class FileSource:
    """JSONL/Parquet documents, this host's share (hybridmoe/data/text.py)."""

    host_local = True
    fields = (*BATCH_FIELDS, "loss_mask")  # a document's untrained tokens masked

    def __init__(self, cfg: Config):
        from hybridmoe.data.text import TextSource
        tokenizer = config_tokenizer(cfg)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            from hybridmoe.data.records import DataError
            raise DataError(f"the tokenizer ({cfg.data.tokenizer or 'built-in'}) has {tokenizer.vocab_size} ids but "
                            f"model.vocab_size={cfg.model.vocab_size}")
        self.text = TextSource(cfg, tokenizer, jax.process_index(), jax.process_count())

    def batch(self, step: int, position: int):
        return self.text.batch(position)


def long_document_metrics(source) -> dict[str, int]:
    """What data.long_documents did to the files' documents, summed over hosts (the longest: their
    maximum), for the run's first metrics record; {} for rows built from the step."""
    counts = getattr(getattr(source, "text", None), "long_documents", None)
    if counts is None:
        return {}
    m = counts.metrics()
    if jax.process_count() == 1:
        return m
    from jax.experimental import multihost_utils
    every = np.asarray(multihost_utils.process_allgather(np.asarray(list(m.values()), np.int64)))
    return {k: int(every[:, i].max() if k == "data_longest_doc" else every[:, i].sum()) for i, k in enumerate(m)}


def training_source(cfg: Config):
    return FileSource(cfg) if cfg.train.data == "files" else StepSource(cfg)


def position_record(position: int) -> list[int]:
    """Every host's cursor (index = process index), for the checkpoint's metadata."""
    if jax.process_count() == 1:
        return [int(position)]
    from jax.experimental import multihost_utils
    return [int(p) for p in np.asarray(multihost_utils.process_allgather(np.int64(position)))]


def start_position(meta: dict | None, host_local: bool = True) -> int:
    """This host's cursor from a checkpoint's metadata (0 for a fresh run or a step-derived source,
    host_local False). A file's cursors count documents of each host's own share (records h, h + n,
    ...), so they resume on as many hosts as wrote them: on any other count a cursor would point
    into another share (or none), and the run would silently train on other documents."""
    positions = (meta or {}).get("data_position") or []
    if not host_local or not isinstance(positions, list) or not positions:
        return 0
    if len(positions) != jax.process_count():
        from hybridmoe.data.records import DataError
        raise DataError(f"--resume: the checkpoint's data cursors (data_position {positions}) are those of "
                        f"{len(positions)} host(s), each reading its own share of data.path, but this run has "
                        f"{jax.process_count()} process(es); resume it on {len(positions)} host(s)")
    return int(positions[jax.process_index()])
