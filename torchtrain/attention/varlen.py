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
Under context parallelism (`rows`: a rank's query slots) each run of the rank's slots consecutive in a
group is a segment of its own, its keys the group's slots up to the run's last (and the anchor).
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


def _runs(group: np.ndarray, asked: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """The asked slots of a group (slots ascending) as runs consecutive in the group: (run, end) where
    `group[:end]` are the keys whose last the run's last query is."""
    at = np.flatnonzero(asked[group])
    if at.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(at) != 1) + 1
    return [(group[run], int(run[-1]) + 1) for run in np.split(at, cuts)]


def _row_segments(doc: np.ndarray, variant: Variant, asked: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(query slots, key slots) per segment of one row. doc: int [T]; asked: bool [T], the query slots.

    With every slot asked a group (the real slots, or one document) is one segment; with some (context
    parallelism) each run of asked slots consecutive in the group is one, its keys the group up to the
    run's last slot: bottom-right alignment then lets each query see its group's slots up to itself."""
    slots = np.arange(doc.shape[0])
    real = doc >= 0
    segs: list[tuple[np.ndarray, np.ndarray]] = []
    if variant == "full":
        if real.any():
            segs.extend((q, slots[real][:end]) for q, end in _runs(slots[real], asked))
    else:
        anchor = variant == "anchor"
        for d in np.unique(doc[real]):  # sorted: the anchor (0) comes first
            group = slots[doc == d]
            for q, end in _runs(group, asked):
                k = np.concatenate([[0], group[:end]]) if anchor and d != 0 else group[:end]
                segs.append((q, k))
    segs.extend((slots[p : p + 1], slots[p : p + 1]) for p in np.flatnonzero(~real & asked))
    return segs


def varlen_segments(doc_ids: torch.Tensor, variant: Variant, rows: torch.Tensor | None = None) -> VarlenSegments:
    """Build the segments of a batch (on the host, once per step).

    Args:
      doc_ids: int [B, T].
      rows: int [R] ascending query slots (context parallelism), or None for all T. Query rows are then
        numbered `b*R + i` for the i-th of `rows` (`q_index` a permutation of 0..B*R-1), key rows `b*T + t`.
    """
    variant = check_variant(variant)
    B, T = doc_ids.shape
    wanted = np.arange(T) if rows is None else rows.detach().cpu().numpy().astype(np.int64)
    R = wanted.shape[0]
    asked = np.zeros(T, dtype=bool)
    asked[wanted] = True
    local = np.full(T, -1, dtype=np.int64)
    local[wanted] = np.arange(R)
    q_parts, k_parts, q_lens, k_lens = [], [], [], []
    for b, doc in enumerate(doc_ids.detach().cpu().numpy()):
        for q, k in _row_segments(doc, variant, asked):
            q_parts.append(local[q] + b * R)
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


def segment_mask(seg: VarlenSegments, B: int, T: int, R: int | None = None) -> torch.Tensor:
    """The mask the segments imply under bottom-right causal alignment: bool [B, R, T], `[b, i, j]`: the i-th
    query row (the i-th of `varlen_segments`' rows; R = T and slot i without them) sees key slot j."""
    R = T if R is None else R
    out = torch.zeros(B * R, B * T, dtype=torch.bool)
    cq, ck = seg.cu_seqlens_q.tolist(), seg.cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs = seg.q_index[cq[s] : cq[s + 1]].cpu()
        ks = seg.kv_index[ck[s] : ck[s + 1]].cpu()
        lq, lk = len(qs), len(ks)
        see = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[qs[:, None].expand(lq, lk)[see], ks[None, :].expand(lq, lk)[see]] = True
    blocks = out.view(B, R, B, T)
    cross = blocks.sum() - sum(blocks[b, :, b, :].sum() for b in range(B))
    if cross:
        raise AssertionError(f"{int(cross)} segment pairs cross batch rows")
    return torch.stack([blocks[b, :, b, :] for b in range(B)])
