"""Attention variants of docs/DESIGN.md §2: the mask predicate first, dense masks second.

Legend: B batch, T slots. `doc_ids` is int [B, T]: 0 is the anchor (slot 0, anchor variant only),
documents are 1, 2, … in order of first appearance, -1 is padding.

`mask_predicate(doc_ids, variant)` returns `(b, h, q_idx, kv_idx) -> bool`, the single source of
truth: the dense masks of the eager/sdpa engines evaluate it on index grids, FlexAttention's block
mask is built from it, and the varlen segments of `torchtrain.attention.varlen` are tested against it.
"""

from __future__ import annotations

from typing import Callable

import torch

from anchor_core.errors import InputError
from anchor_core.variants import VARIANTS, Variant, check_variant  # noqa: F401  (re-exported)

MaskPredicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def variant_tables(doc_ids: torch.Tensor, variant: Variant) -> tuple[torch.Tensor, torch.Tensor]:
    """The variant as the two tables `mask_predicate` reads; every variant is defined here and nowhere else.

    Returns:
      group: int [B, T], a new tensor: a causal pair of real slots in one group may attend (-1: padding).
        full: every real slot in group 1; intra_doc, intra_doc_reset and anchor: the slot's document.
      to_all: bool [B, T]: key slots every later real query sees (anchor: slot 0; else none).

    Tables rather than one function per variant: the predicate's code, and with it FlexAttention's
    compiled kernel, is the same for all four variants (one compile per shape, not four).
    """
    variant = check_variant(variant)
    group = torch.where(doc_ids >= 0, torch.ones_like(doc_ids), doc_ids) if variant == "full" else doc_ids.clone()
    to_all = torch.zeros(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    if variant == "anchor":
        to_all[:, 0] = True
    return group, to_all


def check_doc_ids(doc_ids: torch.Tensor, variant: Variant) -> None:
    """Reject doc_ids that break docs/DESIGN.md §1 for this variant (one-line InputError).

    Args:
      doc_ids: int [B, T].
    """
    if doc_ids.ndim != 2 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise InputError(f"doc_ids must be an integer tensor [B, T], got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    if bool((doc_ids < -1).any()):
        raise InputError("doc_ids hold values below -1 (0 anchor, 1, 2, … documents, -1 padding)")
    if variant == "anchor":
        if not bool((doc_ids[:, 0] == 0).all()) or bool((doc_ids[:, 1:] == 0).any()):
            raise InputError("the anchor variant needs doc_ids 0 at slot 0 and nowhere else")
    elif bool((doc_ids == 0).any()):
        raise InputError(f"doc_ids 0 marks the anchor, which only the anchor variant has (variant {variant!r})")


def mask_predicate(doc_ids: torch.Tensor, variant: Variant) -> MaskPredicate:
    """docs/DESIGN.md §2 as a FlexAttention-style `mask_mod(b, h, q_idx, kv_idx) -> bool`; broadcasts.

    Query slot i sees key slot j iff j <= i, neither is padding and the variant's rule holds;
    a padding slot sees only itself.

    Args:
      doc_ids: int [B, T] (read through `variant_tables`, whose tables the predicate closes over).
      variant: one of VARIANTS.
    """
    group, to_all = variant_tables(doc_ids, variant)

    def allowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        gq = group[b, q_idx]
        gk = group[b, kv_idx]
        real = (gq >= 0) & (gk >= 0)
        return (q_idx == kv_idx) | ((kv_idx <= q_idx) & real & ((gq == gk) | to_all[b, kv_idx]))

    return allowed


def dense_mask(doc_ids: torch.Tensor, variant: Variant, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The predicate on an index grid: bool [B, R, T], `[b, i, j]` = query slot i may see key slot j.

    Args:
      doc_ids: int [B, T].
      rows: int [R] query slots (default: all T).
    """
    B, T = doc_ids.shape
    dev = doc_ids.device
    q = torch.arange(T, device=dev) if rows is None else rows.to(dev)
    b = torch.arange(B, device=dev)[:, None, None]
    h = torch.zeros((), dtype=torch.long, device=dev)
    return mask_predicate(doc_ids, variant)(b, h, q[None, :, None], torch.arange(T, device=dev)[None, None, :])
