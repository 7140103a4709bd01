"""The supervised loss mask over packed rows (the rows themselves come from hybridmoe/data)."""

from __future__ import annotations


def loss_mask(segment_ids_BT):
    """Targets t+1 that continue the document of token t (no loss across documents or on padding)."""
    return (segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]) & (segment_ids_BT[:, 1:] > 0)
