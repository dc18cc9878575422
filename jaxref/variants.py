"""Attention variants of docs/DESIGN.md §2: mask predicates first, dense masks and positions second.

Legend: T slots; `doc_ids` int [T] or [B, T] with 0 = the anchor (slot 0, anchor variant only),
1, 2, … documents in order of first appearance, -1 padding.

The predicate is the single source of truth: `allowed(i, j)` for query slot i and key slot j.
Dense masks evaluate it on index grids; the online attention evaluates it per key block.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from anchor_core.variants import VARIANTS, Variant, check_variant  # noqa: F401  (re-exported)


def allowed(doc_q, doc_k, i, j, variant: Variant, xp=jnp):
    """docs/DESIGN.md §2 for query slots `i` (doc `doc_q`) and key slots `j` (doc `doc_k`); broadcasts.

    Query i sees key j iff j <= i, neither is padding and the variant's rule holds; a padding
    slot sees only itself. `xp` is `jnp` (traced) or `np` (brute force and data checks).
    """
    causal = j <= i
    real = (doc_q >= 0) & (doc_k >= 0)
    if variant == "full":
        rule = xp.ones_like(causal)
    elif variant in ("intra_doc", "intra_doc_reset"):
        rule = doc_q == doc_k
    elif variant == "anchor":
        rule = (doc_q == doc_k) | (j == 0)
    else:
        raise AssertionError(variant)
    return (i == j) | (causal & real & rule)


def attention_mask(doc_ids, variant: str):
    """Dense boolean mask. Args: doc_ids int [T] or [B, T]. Returns bool [T, T] or [B, T, T], `[.., i, j]`."""
    variant = check_variant(variant)
    xp = np if isinstance(doc_ids, np.ndarray) else jnp
    doc_ids = xp.asarray(doc_ids)
    T = doc_ids.shape[-1]
    i = xp.arange(T)[:, None]
    j = xp.arange(T)[None, :]
    return allowed(doc_ids[..., :, None], doc_ids[..., None, :], i, j, variant, xp=xp)


def positions(doc_ids, variant: str, shift: int = 0) -> np.ndarray:
    """RoPE position ids. Args: doc_ids int [T] or [B, T]. Returns int64 [T] or [B, T].

    `full`, `intra_doc`, `anchor`: the slot index (the anchor at slot 0 has position 0).
    `intra_doc_reset`: 0 at each document's first slot (`t - first_slot(doc)`, which also keeps
    interleaved chunks of one document on one axis); padding keeps the slot index.
    A shift `Δ` is added to every position.
    """
    variant = check_variant(variant)
    doc_ids = np.asarray(doc_ids)
    if doc_ids.ndim == 2:
        return np.stack([positions(d, variant, shift) for d in doc_ids])
    T = doc_ids.shape[0]
    slot = np.arange(T, dtype=np.int64)
    if variant != "intra_doc_reset":
        return slot + shift
    out = slot.copy()
    real = doc_ids >= 0
    ids, first = np.unique(doc_ids[real], return_index=True)
    first_slot = slot[real][first]
    lookup = np.zeros(int(ids.max()) + 1 if ids.size else 1, dtype=np.int64)
    lookup[ids] = first_slot
    out[real] = slot[real] - lookup[doc_ids[real]]
    return out + shift
