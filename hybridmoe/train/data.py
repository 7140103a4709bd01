"""Packed training batches, a pure function of (seed, step): resuming at step s replays step s.

A row packs whole documents back to back: segment ids 1, 2, ... per document, 0 for padding;
positions restart at each document.
"""

from __future__ import annotations

import numpy as np


def pack_documents(docs: list[np.ndarray], rows: int, seq_len: int, pad_id: int = 0):
    """Greedy first-fit packing of documents (each at most seq_len) into rows."""
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    fill = np.zeros(rows, np.int64)
    nseg = np.zeros(rows, np.int64)
    for d in docs:
        d = np.asarray(d)[:seq_len]
        r = int(np.argmax(fill + len(d) <= seq_len)) if np.any(fill + len(d) <= seq_len) else -1
        if r < 0:
            continue
        s = fill[r]
        nseg[r] += 1
        tokens[r, s:s + len(d)] = d
        seg[r, s:s + len(d)] = nseg[r]
        pos[r, s:s + len(d)] = np.arange(len(d))
        fill[r] += len(d)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def synthetic_batch(seed: int, step: int, micro_batches: int, batch_size: int, seq_len: int, vocab: int,
                    successors: int = 4):
    """Documents from a fixed sparse Markov chain (each token has `successors` likely next tokens,
    the table drawn from `seed` alone): learnable structure, so the loss falls from ln(vocab)
    towards ln(successors).

    Returns arrays [micro_batches, batch_size, seq_len].
    """
    table = np.random.default_rng([seed, 2**31 - 1]).integers(1, vocab, size=(vocab, successors))
    rng = np.random.default_rng([seed, step])
    out = []
    for _ in range(micro_batches):
        docs = []
        budget = batch_size * seq_len
        while budget > 0:
            n = int(rng.integers(4, seq_len + 1))
            doc = np.empty(n, np.int64)
            doc[0] = rng.integers(1, vocab)
            choice = rng.integers(0, successors, size=n)
            for i in range(1, n):
                doc[i] = table[doc[i - 1], choice[i]]
            docs.append(doc)
            budget -= n
        out.append(pack_documents(docs, batch_size, seq_len))
    return {k: np.stack([o[k] for o in out]) for k in out[0]}


def loss_mask(segment_ids_BT):
    """Targets t+1 that continue the document of token t (no loss across documents or on padding)."""
    return (segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]) & (segment_ids_BT[:, 1:] > 0)
