"""The supervised loss mask over packed rows (the rows themselves come from hybridmoe/data)."""

from __future__ import annotations


def loss_mask(segment_ids_BT, token_mask_BT=None):
    """Targets t+1 that continue the document of token t (no loss across documents or on padding)
    and, with rows' `loss_mask` (data.loss_on), that are trained tokens."""
    mask = (segment_ids_BT[:, 1:] == segment_ids_BT[:, :-1]) & (segment_ids_BT[:, 1:] > 0)
    return mask if token_mask_BT is None else mask & (token_mask_BT[:, 1:] > 0)


def batch_loss_mask(batch):
    """loss_mask of a micro-batch: rows from files carry `loss_mask`; synthetic and arithmetic rows
    train every target."""
    return loss_mask(batch["segment_ids"], batch["loss_mask"] if "loss_mask" in batch else None)
