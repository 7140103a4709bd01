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
the stream at the exact document.

A document longer than train.seq_len (data.long_documents):
- split (the default): it becomes pieces of at most train.seq_len tokens, piece k starting at token
  k * (seq_len - 1), so each piece begins with the previous piece's last token. A token is trained
  as the target of the one before it, so the pieces' targets tile the document's exactly: every
  trained token is trained once, with its own loss mask. A piece is a document of its own (fresh
  positions; it does not see the earlier pieces' tokens), so a turn cut in two trains its second
  part without the first as context: the honest price of a row length that does not hold the
  document. A piece with no trained target (a long prompt's head) is left out, as a document
  without one is.
- truncate: its first train.seq_len tokens; the targets cut off are counted.
The counts (documents split or truncated, targets cut, the longest document) are logged here and
reported by `long_documents`. When no document keeps a trained target the source stops with an
error naming train.seq_len and the longest document's length.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from hybridmoe.config.schema import Config
from hybridmoe.data import chat
from hybridmoe.data.packing import pack_documents, split_micro_batches
from hybridmoe.data.records import DataError, read_records, text_or_messages
from hybridmoe.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

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


@dataclasses.dataclass
class LongDocuments:
    """What this host's documents longer than train.seq_len became (data.long_documents)."""
    documents: int = 0          # documents read (with a trained target, before any cut)
    split: int = 0              # documents split into pieces
    pieces: int = 0             # pieces the split documents became (those with a trained target)
    truncated: int = 0          # documents truncated
    targets_cut: int = 0        # next-token targets a truncation dropped
    trained_targets_cut: int = 0  # of which trained ones (the loss mask)
    longest: int = 0            # the longest document, in tokens

    def metrics(self) -> dict[str, int]:
        return {"data_docs_split": self.split, "data_split_pieces": self.pieces, "data_docs_truncated": self.truncated,
                "data_targets_cut": self.targets_cut, "data_trained_targets_cut": self.trained_targets_cut,
                "data_longest_doc": self.longest}


def fit_document(ids: np.ndarray, mask: np.ndarray, seq_len: int, how: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (tokens, mask) rows a document becomes under data.long_documents=`how` (itself if it fits)."""
    if len(ids) <= seq_len:
        return [(ids, mask)]
    if how == "truncate":
        return [(ids[:seq_len], mask[:seq_len])]
    # Piece k holds tokens [k (seq_len - 1), k (seq_len - 1) + seq_len): its targets are the next
    # seq_len - 1 tokens after the previous piece's, so together they are the document's targets, once each.
    step = seq_len - 1
    return [(ids[s:s + seq_len], mask[s:s + seq_len]) for s in range(0, len(ids) - 1, step)]


def has_target(ids, mask) -> bool:
    """Whether a document trains anything: a token after the first (a target) with the mask on."""
    return len(ids) >= 2 and bool(np.any(mask[1:]))


class TextSource:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, host_index: int = 0, host_count: int = 1):
        d, t = cfg.data, cfg.train
        if t.rows_per_micro_batch % host_count:
            raise DataError(f"train.batch_size={t.batch_size} ({t.rows_per_micro_batch} per micro-batch) does not split "
                            f"over {host_count} hosts")
        records, self.bad_lines = read_records(d.path, "data.path", text_or_messages(d.text_field), d.on_bad_line)
        self.docs: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []  # per document, 1 where the token is a trained target
        self.long_documents = LongDocuments()
        for rec in records[host_index::host_count]:
            try:
                ids, mask = tokenize_document(rec.fields, tokenizer, d.text_field, d.loss_on)
            except ValueError as e:  # text outside the tokenizer's alphabet, no chat template, ...
                if d.on_bad_line == "stop":
                    raise DataError(f"{rec.file}:{rec.line}: {e}. Fix the line, or pass data.on_bad_line=skip") from None
                self.bad_lines.add(rec.file, rec.line, str(e))
                continue
            self._add(np.asarray(ids, np.int32), np.asarray(mask, np.int32), t.seq_len, d.long_documents)
        self._check_and_log(cfg, host_index, host_count)
        self.seed, self.shuffle, self.pad_id = t.seed, d.shuffle, tokenizer.pad_id
        self.micro_batches, self.rows, self.seq_len = t.fewest_micro_batches, t.rows_per_micro_batch // host_count, t.seq_len
        self._orders: dict[int, np.ndarray] = {}

    def _add(self, ids: np.ndarray, mask: np.ndarray, seq_len: int, how: str) -> None:
        """One tokenized document: its rows (one, or its pieces), counted in self.long_documents."""
        n = self.long_documents
        n.longest = max(n.longest, len(ids))
        if not has_target(ids, mask):  # a one-token document, or one without a trained token
            return
        n.documents += 1
        rows = [(i, m) for i, m in fit_document(ids, mask, seq_len, how) if has_target(i, m)]
        if len(ids) > seq_len:
            if how == "truncate":
                n.truncated += 1
                n.targets_cut += len(ids) - seq_len
                n.trained_targets_cut += int(mask[seq_len:].sum())
            else:
                n.split += 1
                n.pieces += len(rows)
        self.docs += [i for i, _ in rows]
        self.masks += [m for _, m in rows]

    def _check_and_log(self, cfg: Config, host_index: int, host_count: int) -> None:
        d, t, n = cfg.data, cfg.train, self.long_documents
        where = f"host {host_index} of {host_count}: " if host_count > 1 else ""
        if n.split:
            log.warning("data.path: %s%d of %d documents are longer than train.seq_len=%d tokens (the longest has %d); "
                        "data.long_documents=split made them %d rows, every trained token kept", where, n.split,
                        n.documents, t.seq_len, n.longest, n.pieces)
        if n.truncated:
            log.warning("data.path: %s%d of %d documents are longer than train.seq_len=%d tokens (the longest has %d); "
                        "data.long_documents=truncate cut %d targets past the limit, %d of them trained. Raise "
                        "train.seq_len or pass data.long_documents=split to keep them", where, n.truncated, n.documents,
                        t.seq_len, n.longest, n.targets_cut, n.trained_targets_cut)
        if not self.docs:
            cut = (f"; data.long_documents=truncate cut every trained token of the {n.truncated} documents longer than "
                   f"train.seq_len: raise train.seq_len to at least {n.longest} or pass data.long_documents=split"
                   if n.truncated else "")
            raise DataError(f"data.path={d.path}: {where}no document has a trained token "
                            f"(train.seq_len={t.seq_len}, the longest document has {n.longest} tokens, "
                            f"data.loss_on={d.loss_on}){cut}")

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
        rows = self.micro_batches * self.rows  # packed together, then split: the same rows at any count
        fill, docs, masks = np.zeros(rows, np.int64), [], []
        while True:
            doc = self.document(cursor)
            free = np.flatnonzero(fill + len(doc) <= self.seq_len)
            if not free.size:
                break
            fill[free[0]] += len(doc)  # the row pack_documents' first fit will choose
            docs.append(doc)
            masks.append(self.document_mask(cursor))
            cursor += 1
        packed = pack_documents(docs, rows, self.seq_len, pad_id=self.pad_id, masks=masks)
        return split_micro_batches(packed, self.micro_batches), cursor
