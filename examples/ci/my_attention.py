"""A team's own attention function for transformers (the `AttentionInterface` signature), as examples/ci's
tests hold it against the oracle. RoPE is applied by the model (transformers' convention); the function
builds the packing mask of the variant from the `doc_ids` and `variant` keywords the harness passes (the
packed format of the toolkit: doc_ids int [B, T], -1 padding, 0 the anchor slot under `anchor`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _mask(doc_ids: torch.Tensor, variant: str, documents: bool) -> torch.Tensor:
    """bool [B, 1, T, T]: causal, within a document (and the anchor at slot 0 under `anchor`)."""
    T = doc_ids.shape[1]
    i = torch.arange(T, device=doc_ids.device)[:, None]
    j = torch.arange(T, device=doc_ids.device)[None, :]
    dq, dk = doc_ids[:, :, None], doc_ids[:, None, :]
    keep = (j <= i) & (dq >= 0) & (dk >= 0)
    if documents and variant != "full":
        keep &= (dq == dk) | ((j == 0) if variant == "anchor" else torch.zeros_like(keep))
    return (keep | (i == j))[:, None]


def _sdpa(query, key, value, mask, scaling):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def packed_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                     doc_ids=None, variant="full", **kwargs):
    """query [B, N, T, D], key/value [B, K, T, D] -> ([B, T, N, D], None)."""
    return _sdpa(query, key, value, _mask(doc_ids, variant, documents=True), scaling)


def packed_attention_with_a_bug(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0,
                                doc_ids=None, variant="full", **kwargs):
    """The same with the bug planted: the document mask forgotten (plain causal attention across documents)."""
    return _sdpa(query, key, value, _mask(doc_ids, variant, documents=False), scaling)
