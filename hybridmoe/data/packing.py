"""Packing documents into fixed-length training rows.

A row packs whole documents back to back: segment ids 1, 2, ... per document, 0 for padding;
positions restart at each document. With per-document masks, `loss_mask` carries them to the same
places (1 where the token is a trained target; 0 on padding).
"""

from __future__ import annotations

import numpy as np


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
