"""The FLOP model: how many query-key pairs each variant's mask allows, and what they cost (`anchor bench`'s
model, and `anchor train`'s per-step `flops` and `mfu`: torchtrain.training.throughput).

Legend: B windows, T slots, N query heads, K kv heads, D head dim, L layers, P parameters.

Pairs. docs/DESIGN.md §2's mask, counted row by row without building it: a padding slot sees itself; in
`full` a slot sees every non-padding slot up to it; in `intra_doc(_reset)` the earlier slots of its
own document (`make_batch` gives the first slot to document 1); in `anchor` those plus the anchor at slot 0
(which sees only itself). `pairs` gives the per-window sums; tests hold them against the dense mask.

Cost. Attention forward: two matmuls over the allowed pairs, 4 N D FLOPs per pair (q k^T and p v);
forward + backward 3.5x that (the backward recomputes q k^T and runs four more matmuls: dq, dk,
dv, dp), FlashAttention's own accounting. A training step adds 6 FLOPs per parameter-token for
every matmul weight (2 forward, 4 backward), embeddings excepted, the lm-head included.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anchor_core.variants import VARIANTS

BWD_FACTOR = 3.5  # forward + backward attention FLOPs over forward (FlashAttention-2's accounting)


def _rank_in_doc(doc: np.ndarray) -> np.ndarray:
    """Per slot of each row, how many earlier slots carry the same document id. doc int [B, T]."""
    B, T = doc.shape
    out = np.empty((B, T), dtype=np.int64)
    for b in range(B):
        d = doc[b]
        order = np.argsort(d, kind="stable")  # slots grouped by document, in slot order within one
        sd = d[order]
        start = np.r_[0, np.flatnonzero(sd[1:] != sd[:-1]) + 1]
        first = np.repeat(start, np.diff(np.r_[start, T]))
        out[b, order] = np.arange(T) - first
    return out


def pairs(doc_ids: np.ndarray, variant: str) -> np.ndarray:
    """Allowed (query, key) pairs per window, key <= query, diagonal included. doc_ids int [B, T] -> int64 [B].

    doc_ids as the model receives them (docs/DESIGN.md §1: -1 padding; in `anchor` slot 0 is document 0).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    doc = np.asarray(doc_ids, dtype=np.int64)
    if doc.ndim != 2:
        raise ValueError(f"doc_ids must be [B, T], got shape {doc.shape}")
    pad = doc < 0
    if variant == "full":
        seen = np.cumsum(~pad, axis=1)  # non-padding slots up to and including this one
        per_slot = np.where(pad, 1, seen)
    else:
        d = doc.copy()
        d[pad] = -1 - np.nonzero(pad)[1]  # each padding slot a document of its own
        per_slot = _rank_in_doc(d) + 1
        if variant == "anchor":
            per_slot += ((d > 0) & ~pad).astype(np.int64) * (doc[:, :1] == 0)  # the anchor key
    return per_slot.sum(axis=1)


def full_pairs(T: int) -> int:
    """Pairs of causal attention over T slots."""
    return T * (T + 1) // 2


def attention_flops(n_pairs: np.ndarray | int, heads: int, head_dim: int, backward: bool = True) -> np.ndarray | float:
    """FLOPs of one layer's attention over `n_pairs` allowed pairs."""
    f = 4.0 * np.asarray(n_pairs, dtype=np.float64) * heads * head_dim
    return f * (BWD_FACTOR if backward else 1.0)


def matmul_params(spec: Any) -> int:
    """Parameters that multiply every token in a step: attention and MLP weights of every layer and the lm-head."""
    H, N, K, D, I = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    per_layer = H * N * D + 2 * H * K * D + N * D * H + 3 * H * I
    return spec.num_layers * per_layer + spec.vocab_size * H


def step_flops(spec: Any, n_pairs: np.ndarray | int, tokens: int) -> dict[str, float]:
    """Training FLOPs (forward + backward) of `tokens` slots whose masks allow `n_pairs` pairs in total.

    Returns {"dense": 6 P tokens, "attention": L layers of attention, "total"}.
    """
    dense = 6.0 * matmul_params(spec) * tokens
    attn = float(np.sum(attention_flops(n_pairs, spec.num_heads, spec.head_dim))) * spec.num_layers
    return {"dense": dense, "attention": attn, "total": dense + attn}
