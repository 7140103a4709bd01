"""Packing documents into fixed-length training rows.

A row packs whole documents back to back: segment ids 1, 2, ... per document, 0 for padding;
positions restart at each document. With per-document masks, `loss_mask` carries them to the same
places (1 where the token is a trained target; 0 on padding).
"""

from __future__ import annotations

import numpy as np


# The arrays of a packed batch; with per-document masks, loss_mask too (1 where a token is a trained target).
BATCH_FIELDS = ("tokens", "segment_ids", "positions")


def pack_documents(docs: list[np.ndarray], rows: int, seq_len: int, pad_id: int = 0, masks=None):
    """Greedy first-fit packing of documents (each at most seq_len) into rows."""
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    loss = np.zeros((rows, seq_len), np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    fill = np.zeros(rows, np.int64)
    nseg = np.zeros(rows, np.int64)
    for k, d in enumerate(docs):
        d = np.asarray(d)[:seq_len]
        r = int(np.argmax(fill + len(d) <= seq_len)) if np.any(fill + len(d) <= seq_len) else -1
        if r < 0:
            continue
        s = fill[r]
        nseg[r] += 1
        tokens[r, s:s + len(d)] = d
        seg[r, s:s + len(d)] = nseg[r]
        pos[r, s:s + len(d)] = np.arange(len(d))
        if masks is not None:
            loss[r, s:s + len(d)] = np.asarray(masks[k])[:len(d)]
        fill[r] += len(d)
    out = {"tokens": tokens, "segment_ids": seg, "positions": pos}
    return out if masks is None else {**out, "loss_mask": loss}


def split_micro_batches(rows: dict[str, np.ndarray], micro_batches: int) -> dict[str, np.ndarray]:
    """A step's packed rows [rows, seq_len] (or already split [m, rows / m, seq_len]) as
    [micro_batches, rows / micro_batches, seq_len], in order: the step's rows are packed together
    and split after, so the data a step trains on does not depend on how many micro-batches it
    takes (train.micro_batches, chosen under auto by the device's memory)."""
    out = {}
    for k, v in rows.items():
        flat = v.reshape((-1,) + v.shape[-1:])
        if flat.shape[0] % micro_batches:
            raise ValueError(f"{flat.shape[0]} rows do not split into {micro_batches} equal micro-batches")
        out[k] = flat.reshape((micro_batches, flat.shape[0] // micro_batches) + v.shape[-1:])
    return out
