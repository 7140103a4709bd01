"""Synthetic training documents: a pure function of (seed, step), so resuming at step s replays step s."""

from __future__ import annotations

import numpy as np

from hybridmoe.data.packing import pack_documents, split_micro_batches


def synthetic_batch(seed: int, step: int, micro_batches: int, batch_size: int, seq_len: int, vocab: int,
                    successors: int = 4):
    """Documents from a fixed sparse Markov chain (each token has `successors` likely next tokens,
    the table drawn from `seed` alone): learnable structure, so the loss falls from ln(vocab)
    towards ln(successors).

    Returns arrays [micro_batches, batch_size, seq_len]: the step's rows packed together, then split
    (the same rows in the same order at any micro_batches x batch_size).
    """
    table = np.random.default_rng([seed, 2**31 - 1]).integers(1, vocab, size=(vocab, successors))
    rng = np.random.default_rng([seed, step])
    docs, budget = [], micro_batches * batch_size * seq_len
    while budget > 0:
        n = int(rng.integers(4, seq_len + 1))
        doc = np.empty(n, np.int64)
        doc[0] = rng.integers(1, vocab)
        choice = rng.integers(0, successors, size=n)
        for i in range(1, n):
            doc[i] = table[doc[i - 1], choice[i]]
        docs.append(doc)
        budget -= n
    return split_micro_batches(pack_documents(docs, micro_batches * batch_size, seq_len), micro_batches)
