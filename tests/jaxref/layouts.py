"""Packed-window layouts for tests: doc_ids per docs/DESIGN.md §1 built from document lengths."""

from __future__ import annotations

import numpy as np


def doc_ids_from_lengths(lengths: list[int], T: int, variant: str) -> np.ndarray:
    """Slot 0 is the first token (the anchor, doc 0, in `anchor`; doc 1's first slot otherwise),
    then documents 1, 2, … of the given lengths (document 1 continues the first token outside
    `anchor`), cut at T; remaining slots are padding (-1)."""
    doc = np.full(T, -1, dtype=np.int32)
    doc[0] = 0 if variant == "anchor" else 1
    t = 1
    for d, n in enumerate(lengths, start=1):
        if t >= T:
            break
        n = min(n, T - t)
        doc[t : t + n] = d
        t += n
    return doc


def random_layout(rng: np.random.Generator, T: int, variant: str, *, pad: bool = True, min_len: int = 1) -> np.ndarray:
    """Several documents (some `min_len` tokens long), the last one cut at T or followed by padding."""
    lengths = []
    total = 0
    budget = T - 1 - (rng.integers(1, max(2, T // 8)) if pad else 0)
    while total < budget:
        n = int(rng.choice([min_len, min_len, min_len + 1, rng.integers(min_len + 2, max(min_len + 3, T // 3))]))
        lengths.append(n)
        total += n
    if pad:
        lengths[-1] -= total - budget
        if lengths[-1] <= 0:
            lengths.pop()
    return doc_ids_from_lengths(lengths, T, variant)
