"""Shared helpers for the torchtrain tests, and a stand-in for the packed-batch maker.

The real batch maker lives in anchor_core/data (another engineer's work); `packed_batch` builds the
same four arrays of docs/DESIGN.md §1 for a given variant (§2), with the layouts that break masks:
several documents, one-token documents, a last document cut by the window, padding at the end,
and (optionally) interleaved chunks of documents.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from anchor_core.paths import default_model_path

# Two xdist workers on two shared cores: one intra-op thread each (two threads per process under
# contention make a small matmul hundreds of times slower).
torch.set_num_threads(1)
# The engine matrix compiles FlexAttention for many (shape, dtype) pairs in one process; the
# default limit (8) would silently fall back to uncompiled flex.
torch._dynamo.config.recompile_limit = 64

EOS = 2
LAYOUTS = ("cut", "padded", "interleaved")


@dataclass(frozen=True)
class PackedBatch:
    """One packed batch: tokens, doc_ids, positions, loss_mask, each int64 [B, T]."""

    variant: str
    tokens: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor
    loss_mask: torch.Tensor

    def model_inputs(self) -> dict:
        return {"input_ids": self.tokens, "position_ids": self.positions, "doc_ids": self.doc_ids, "variant": self.variant}


def _doc_lengths(rng: np.random.Generator, n: int) -> list[int]:
    """Lengths filling n slots: two one-token documents early, then random lengths (the last may run over)."""
    lengths = [1, max(1, n // 10), 1]
    while sum(lengths) < n:
        lengths.append(int(rng.integers(1, max(2, n // 3))))
    return lengths


def _row(rng: np.random.Generator, T: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Document index per slot (1, 2, … from slot 1 on; -1 padding) and whether each document is complete.

    Slot 0 is left as 0 (the first token); the variant decides which document it belongs to.
    """
    n_pad = T // 7 if layout == "padded" else 0
    n = T - 1 - n_pad
    lengths = _doc_lengths(rng, n)
    if layout == "padded":
        lengths[-1] -= sum(lengths) - n  # the last document ends right before the padding
        if lengths[-1] == 0:
            lengths.pop()
    chunks = [(d + 1, L) for d, L in enumerate(lengths)]
    if layout == "interleaved":
        # cut documents into chunks and shuffle them, keeping each document's chunks in order
        per_doc = []
        for d, L in chunks:
            cuts = sorted(rng.choice(np.arange(1, L), size=min(2, L - 1), replace=False)) if L > 2 else []
            bounds = [0, *cuts, L]
            per_doc.append([(d, b - a) for a, b in zip(bounds, bounds[1:])])
        order = [d for d, pieces in enumerate(per_doc) for _ in pieces]
        rng.shuffle(order)
        chunks = [per_doc[d].pop(0) for d in order]
    doc = np.concatenate([[0]] + [np.full(L, d) for d, L in chunks] + [np.full(n_pad, -1)])[:T]
    # documents in order of first appearance (interleaving may reorder them)
    first = {}
    for d in doc[1:]:
        if d > 0 and d not in first:
            first[d] = len(first) + 1
    doc = np.array([first.get(d, d) for d in doc])
    return doc.astype(np.int64), n_pad


def packed_batch(variant: str, T: int, *, vocab: int = 331, first_token: int = 1, seed: int = 0,
                 layouts: tuple[str, ...] = ("cut", "padded")) -> PackedBatch:
    """A batch of len(layouts) windows laid out per docs/DESIGN.md §1–§2 for `variant`."""
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in ("tokens", "doc_ids", "positions", "loss_mask")}
    for layout in layouts:
        doc, n_pad = _row(rng, T, layout)
        doc[0] = 0 if variant == "anchor" else 1
        real = doc >= 0
        tokens = rng.integers(3, vocab, size=T)
        tokens[0] = first_token
        last = np.r_[doc[1:] != doc[:-1], True] & real  # last slot of each document run
        complete = last.copy()
        complete[T - 1 - n_pad] = layout == "padded"  # the last real document is cut unless padding follows
        tokens[complete & (np.arange(T) > 0)] = EOS
        tokens[~real] = EOS
        slot = np.arange(T)
        positions = slot.copy()
        if variant == "intra_doc_reset":
            for d in np.unique(doc[real]):
                where = doc == d
                positions[where] = slot[where] - slot[where][0]
        nxt = np.r_[doc[1:], -1]
        same = (doc == nxt) | (variant == "full")
        loss_mask = (real & (nxt >= 0) & same & (slot < T - 1)).astype(np.int64)
        for k, v in zip(rows, (tokens, doc, positions, loss_mask)):
            rows[k].append(v)
    t = {k: torch.from_numpy(np.stack(v)).long() for k, v in rows.items()}
    return PackedBatch(variant, t["tokens"], t["doc_ids"], t["positions"], t["loss_mask"])


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ‖x − ref‖ / ‖ref‖ in float64."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


@functools.cache
def smollm2_weights():
    from anchor_core.weights import load_weights

    return load_weights("default")


def have_smollm2() -> bool:
    try:
        return Path(default_model_path()).is_file()
    except Exception:
        return False


needs_smollm2 = pytest.mark.skipif(not have_smollm2(), reason="the embedded SmolLM2 GGUF is not cached (make install)")
