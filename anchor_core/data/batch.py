"""Batches of packed windows for one attention variant (docs/DESIGN.md §1-§2).

Legend: B windows per batch, T slots per window.

One packed store serves every variant: the packer keeps `tokens`, `seg` (0 at slot 0, documents
1, 2, ... by first appearance, -1 padding) and `tag` per slot, and `make_batch` derives

  doc_ids    `anchor`: seg as is (slot 0 is the anchor, document 0); other variants: slot 0
             belongs to document 1
  positions  the slot index; `intra_doc_reset`: slot - first slot of the slot's document
             (0 at each document's first slot; interleaved chunks of one document stay on one
             axis); padding keeps the slot index
  loss_mask  1 where the prediction made at slot t (of tokens[t+1]) is trained on; 0 at the last
             slot, at padding and tag slots and where the target is padding or a tag slot, and,
             except in `full` without `mask_cross_doc_loss`, where the target lies in another
             document (the last slot of each document, and the anchor)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anchor_core.variants import VARIANTS, Variant, check_variant  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Batch:
    """int32 numpy arrays [B, T] each (docs/DESIGN.md §1)."""

    tokens: np.ndarray
    doc_ids: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray

    def as_dict(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "doc_ids": self.doc_ids, "positions": self.positions,
                "loss_mask": self.loss_mask}


def reset_positions(doc_ids: np.ndarray) -> np.ndarray:
    """`slot - first slot of its document`, padding (-1) keeps the slot index.

    Args: doc_ids int [B, T], documents numbered by first appearance. Returns int64 [B, T].
    """
    B, T = doc_ids.shape
    slot = np.arange(T, dtype=np.int64)
    doc = doc_ids.astype(np.int64)
    prev_max = np.empty_like(doc)
    prev_max[:, 0] = -2
    np.maximum.accumulate(doc[:, :-1], axis=1, out=prev_max[:, 1:])
    r, t = np.nonzero(doc > prev_max)  # the first slot of each document
    first = np.zeros((B, T + 1), dtype=np.int64)
    first[r, doc[r, t]] = t
    rows = np.arange(B)[:, None]
    return np.where(doc >= 0, slot - first[rows, np.maximum(doc, 0)], slot)


def make_batch(tokens: np.ndarray, seg: np.ndarray, tag: np.ndarray, variant: Variant, *,
               mask_cross_doc_loss: bool = False) -> Batch:
    """The four arrays of docs/DESIGN.md §1 for `variant` from packed windows.

    Args:
      tokens: int [B, T] token ids (slot 0: the first token).
      seg: int [B, T] 0 at slot 0, documents 1, 2, ... by first appearance, -1 padding.
      tag: int/bool [B, T] 1 on domain-tag slots.
      variant: one of VARIANTS.
      mask_cross_doc_loss: in `full`, also mask predictions whose target is in another document.
    Returns: Batch of int32 [B, T] arrays.
    """
    variant = check_variant(variant)
    seg = np.asarray(seg)
    doc = seg.astype(np.int32, copy=True)
    if variant != "anchor":
        doc[:, 0] = 1
    if variant == "intra_doc_reset":
        pos = reset_positions(doc).astype(np.int32)
    else:
        pos = np.broadcast_to(np.arange(doc.shape[1], dtype=np.int32), doc.shape).copy()
    pad = doc < 0
    skip = pad | np.asarray(tag, dtype=bool)  # slots never trained on, nor as targets
    loss = ~skip
    loss[:, :-1] &= ~skip[:, 1:]
    if variant != "full" or mask_cross_doc_loss:
        loss[:, :-1] &= doc[:, 1:] == doc[:, :-1]
    loss[:, -1] = False
    return Batch(np.asarray(tokens).astype(np.int32), doc, pos, loss.astype(np.int32))
