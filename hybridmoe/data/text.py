"""train.data=files: documents from JSONL/Parquet files, tokenized and packed into training rows.

A document is a record's `data.text_field` string (then EOS), or its `messages` rendered with the
chat template (the template ends each turn itself). Each document carries a loss mask over its
tokens: a text document trains every token; a conversation trains its assistant turns
(data.loss_on=assistant, the default; data/chat.py says which tokens) or every token
(data.loss_on=all). The mask is packed beside the tokens (rows' `loss_mask`, with the segment ids)
and, like them, a pure function of the document, so a resume rebuilds it exactly. Host h of n
keeps records h, h + n, ... and packs its share of the rows of every batch; nothing is gathered
across hosts.

The stream position is a cursor: how many of this host's documents have been consumed, across
epochs (epoch e visits the host's documents in an order drawn from (train.seed, e) when
data.shuffle is on). A step packs documents from the cursor, first fit, until the next one fits in
no row; that one opens the next step. So the cursor after a step, saved in the checkpoint, resumes
the stream at the exact document. A document longer than train.seq_len keeps its first
train.seq_len tokens.
"""

from __future__ import annotations

import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.data import chat
from hybridmoe.data.packing import pack_documents
from hybridmoe.data.records import DataError, read_records, text_or_messages
from hybridmoe.data.tokenizer import Tokenizer

DATA_STREAM = 3  # the epoch-order draws of train.seed (1 and 2 are the arithmetic warm-up and prompts)


def tokenize_document(fields: dict, tokenizer: Tokenizer, text_field: str,
                      loss_on: str = "assistant") -> tuple[list[int], list[int]]:
    """(token ids, 1 per token whose prediction is trained) of one record."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    if isinstance(fields.get(text_field), str):
        ids = bos + tokenizer.encode(fields[text_field]) + [tokenizer.eos_id]
        return ids, [1] * len(ids)
    messages = fields["messages"]
    if loss_on == "all":
        ids = bos + tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=False))
        return ids, [1] * len(ids)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant turn to train on (data.loss_on=assistant); "
                         "pass data.loss_on=all to train on every token")
    ids, mask = chat.encode_with_spans(tokenizer, *chat.assistant_spans(tokenizer, messages))
    return bos + ids, [0] * len(bos) + mask


class TextSource:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, host_index: int = 0, host_count: int = 1):
        d, t = cfg.data, cfg.train
        if t.batch_size % host_count:
            raise DataError(f"train.batch_size={t.batch_size} does not split over {host_count} hosts")
        records, self.bad_lines = read_records(d.path, "data.path", text_or_messages(d.text_field), d.on_bad_line)
        self.docs: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []  # per document, 1 where the token is a trained target
        for rec in records[host_index::host_count]:
            try:
                ids, mask = tokenize_document(rec.fields, tokenizer, d.text_field, d.loss_on)
            except ValueError as e:  # text outside the tokenizer's alphabet, no chat template, ...
                if d.on_bad_line == "stop":
                    raise DataError(f"{rec.file}:{rec.line}: {e}. Fix the line, or pass data.on_bad_line=skip") from None
                self.bad_lines.add(rec.file, rec.line, str(e))
                continue
            ids, mask = ids[: t.seq_len], mask[: t.seq_len]
            if len(ids) >= 2 and any(mask[1:]):  # a one-token document has no next-token target
                self.docs.append(np.asarray(ids, np.int32))
                self.masks.append(np.asarray(mask, np.int32))
        if not self.docs:
            raise DataError(f"data.path={d.path}: no document with two or more tokens for host {host_index} of {host_count}")
        self.seed, self.shuffle, self.pad_id = t.seed, d.shuffle, tokenizer.pad_id
        self.micro_batches, self.rows, self.seq_len = t.micro_batches, t.batch_size // host_count, t.seq_len
        self._orders: dict[int, np.ndarray] = {}

    def document(self, cursor: int) -> np.ndarray:
        return self.docs[self._index(cursor)]

    def document_mask(self, cursor: int) -> np.ndarray:
        return self.masks[self._index(cursor)]

    def _index(self, cursor: int) -> int:
        epoch, i = divmod(cursor, len(self.docs))
        if epoch not in self._orders:
            self._orders = {epoch: (np.random.default_rng([self.seed, DATA_STREAM, epoch]).permutation(len(self.docs))
                                    if self.shuffle else np.arange(len(self.docs)))}
        return int(self._orders[epoch][i])

    def batch(self, cursor: int) -> tuple[dict[str, np.ndarray], int]:
        """This host's rows [micro_batches, batch_size / hosts, seq_len] from `cursor`, and the cursor after them."""
        out = []
        for _ in range(self.micro_batches):
            fill, docs, masks = np.zeros(self.rows, np.int64), [], []
            while True:
                doc = self.document(cursor)
                free = np.flatnonzero(fill + len(doc) <= self.seq_len)
                if not free.size:
                    break
                fill[free[0]] += len(doc)  # the row pack_documents' first fit will choose
                docs.append(doc)
                masks.append(self.document_mask(cursor))
                cursor += 1
            out.append(pack_documents(docs, self.rows, self.seq_len, pad_id=self.pad_id, masks=masks))
        return {k: np.stack([o[k] for o in out]) for k in out[0]}, cursor
