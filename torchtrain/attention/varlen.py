"""Variable-length segments for `flash_attn_varlen_func`: every variant without extra query tokens.

Legend: B batch, T slots, Nq = B*T query rows (every slot once), Nk key rows, S segments.

Queries and keys are gathered from the flattened batch ([B*T] rows, row `b*T + t`) into segments;
FlashAttention applies a causal mask per segment aligned to the bottom-right corner (query `i` of a
segment with `Lq` queries and `Lk` keys sees keys `j <= i + Lk - Lq`). Per row of the batch:

  full              one segment of all real slots                         q = k = [real slots]
  intra_doc(_reset) one segment per document                              q = k = [doc d]
  anchor            [anchor] alone, then per document d                   q = [doc d], k = [anchor] + [doc d]
  padding           one segment per padding slot (it sees only itself)    q = k = [p]

The anchor's k/v are gathered once more in front of every document, so a document of `L` queries
has `L + 1` keys and bottom-right alignment lets its query `i` see the anchor and doc slots `<= i`.
A document's slots are gathered in slot order, so interleaved chunks of one document (§2) work too.
Which slots are grouped is the variant's rule of `torchtrain.attention.variants`; `segment_mask` gives the
mask the segments imply so tests hold it against `variants.dense_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from torchtrain.attention.variants import Variant, check_variant


@dataclass(frozen=True)
class VarlenSegments:
    """Gather indices and `flash_attn_varlen_func` arguments for one batch.

    q_index int64 [Nq]: flattened slot of each query row (a permutation of 0..B*T-1).
    q_inverse int64 [Nq]: `q_index`'s inverse (segment row of each flattened slot).
    kv_index int64 [Nk]: flattened slot of each key row (the anchor repeats).
    cu_seqlens_q, cu_seqlens_k int32 [S+1]; max_seqlen_q, max_seqlen_k: the longest segments.
    """

    q_index: torch.Tensor
    q_inverse: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _row_segments(doc: np.ndarray, variant: Variant) -> list[tuple[np.ndarray, np.ndarray]]:
    """(query slots, key slots) per segment of one row. doc: int [T]."""
    slots = np.arange(doc.shape[0])
    real = doc >= 0
    segs: list[tuple[np.ndarray, np.ndarray]] = []
    if variant == "full":
        if real.any():
            segs.append((slots[real], slots[real]))
    else:
        anchor = variant == "anchor"
        for d in np.unique(doc[real]):  # sorted: the anchor (0) comes first
            q = slots[doc == d]
            k = np.concatenate([[0], q]) if anchor and d != 0 else q
            segs.append((q, k))
    segs.extend((slots[p : p + 1], slots[p : p + 1]) for p in np.flatnonzero(~real))
    return segs


def varlen_segments(doc_ids: torch.Tensor, variant: Variant) -> VarlenSegments:
    """Build the segments of a batch (on the host, once per step). Args: doc_ids int [B, T]."""
    variant = check_variant(variant)
    B, T = doc_ids.shape
    q_parts, k_parts, q_lens, k_lens = [], [], [], []
    for b, doc in enumerate(doc_ids.detach().cpu().numpy()):
        for q, k in _row_segments(doc, variant):
            q_parts.append(q + b * T)
            k_parts.append(k + b * T)
            q_lens.append(len(q))
            k_lens.append(len(k))
    dev = doc_ids.device
    q_index = np.concatenate(q_parts)
    q_inverse = np.empty_like(q_index)
    q_inverse[q_index] = np.arange(q_index.shape[0])

    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)

    return VarlenSegments(
        q_index=torch.from_numpy(q_index).to(dev),
        q_inverse=torch.from_numpy(q_inverse).to(dev),
        kv_index=torch.from_numpy(np.concatenate(k_parts)).to(dev),
        cu_seqlens_q=cu(q_lens),
        cu_seqlens_k=cu(k_lens),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
    )


def segment_mask(seg: VarlenSegments, B: int, T: int) -> torch.Tensor:
    """The mask the segments imply under bottom-right causal alignment: bool [B, T, T], `[b, i, j]`."""
    out = torch.zeros(B * T, B * T, dtype=torch.bool)
    cq, ck = seg.cu_seqlens_q.tolist(), seg.cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs = seg.q_index[cq[s] : cq[s + 1]].cpu()
        ks = seg.kv_index[ck[s] : ck[s + 1]].cpu()
        lq, lk = len(qs), len(ks)
        see = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[qs[:, None].expand(lq, lk)[see], ks[None, :].expand(lq, lk)[see]] = True
    blocks = out.view(B, T, B, T)
    cross = blocks.sum() - sum(blocks[b, :, b, :].sum() for b in range(B))
    if cross:
        raise AssertionError(f"{int(cross)} segment pairs cross batch rows")
    return torch.stack([blocks[b, :, b, :] for b in range(B)])
