"""The `varlen` engine's plan: which fused SDPA calls run a window's varlen segments (torchtrain.attention.varlen_sdpa
runs it; its docstring says how segments become calls and why).

    p = plan(segments)     # VarlenPlan: the calls, the gather index of the rows they read, the scatter back

Segments are batched by shape: whole segments (L <= CHUNK or L >= LONG) one `is_causal` call per bucket of equal
lengths (`bucket_lengths`: lengths merged greedily while the padding stays under PAD_AREA), longer ones in query
chunks of CHUNK rows.

A rank's share of the queries (context parallelism, `plan(seg, q_slots=...)`): a segment's queries are then the
last Lq of its Lk keys, the keys before them a prefix with no query of this rank. Such a segment longer than CHUNK
runs chunked whatever its length, and the chunks that hold only prefix rows are not called: the rank computes its
own queries' rows and at most CHUNK - 1 more per segment. Queries are gathered from the rank's rows (a zero row
for a prefix row), outputs go to the rank's rows, and key gradients to every slot of the window (zero for a slot
no segment of the rank holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from torchtrain.attention.varlen import VarlenSegments

CHUNK = 64  # c: query rows of a chunked call (module docstring)
LONG = 2048  # segments at least this long run whole, on the kernel's own causal skipping
PAD_AREA = 64 * 64  # padded query-key pairs worth one SDPA call



@dataclass(frozen=True)
class Call:
    """One SDPA call on strided views of the gathered rows: for segment i < n, queries are rows
    `q0 + i*stride + [0, lq)` and keys rows `k0 + i*stride + [0, lk)`; `is_causal` when
    lq == lk, else the bottom-right causal mask [lq, lk] (`j <= i + lk - lq`)."""

    n: int
    stride: int
    q0: int
    lq: int
    k0: int
    lk: int


@dataclass(eq=False)
class VarlenPlan:
    """How one batch's segments run (built once per step on the host, shared by all layers).

    rows int64 [R]: flattened slot (`b*T + t`) of each gathered row. calls: the SDPA calls.
    out_index int64 [B*T]: the gathered row holding each slot's output (under context parallelism [B*R'] for the
    rank's R' query rows, and `q_gather` int64 [R]: the query row each gathered row reads, B*R' for a zero row;
    `key_index` then names R, a zero row, for a slot whose key no segment holds). dst: per call, int64
    [n*lq] the slot each query row's output goes to (B*T for a dropped row: padding, the
    anchor's copies). key_index int64 [B*T]: one gathered row per slot whose key gradient counts; extra_rows /
    extra_slots int64: its other such rows (the anchor's copies) and their slots. mask bool
    [c, W]: base of the bottom-right masks (None without masked calls).
    For one fused CUDA kernel: square_rows int64 [Rs], cu_seqlens int32 [S+1], max_seqlen: the
    square segments packed; square_out int64 [B*T]: the packed row of each slot's output.
    square_first int64 [B*T], square_dups int64 [n, m], square_dup_slots int64 [n]: the
    deterministic backward of that gather (`_GatherRows`): each slot's first packed row, and per
    slot gathered more than once (the anchor) its other rows, padded with Rs (a zero row).
    """

    rows: torch.Tensor
    calls: tuple[Call, ...]
    out_index: torch.Tensor
    dst: tuple[torch.Tensor, ...]
    key_index: torch.Tensor
    extra_rows: torch.Tensor
    extra_slots: torch.Tensor
    mask: torch.Tensor | None
    square_rows: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    square_out: torch.Tensor
    square_first: torch.Tensor
    square_dups: torch.Tensor | None
    square_dup_slots: torch.Tensor | None
    q_gather: torch.Tensor | None = None
    _flex_mask: dict = field(default_factory=dict, repr=False)
    _additive: dict = field(default_factory=dict, repr=False)

    def bool_mask(self, c: Call) -> torch.Tensor | None:
        """The call's bottom-right causal mask bool [lq, lk], a view of `mask`; None when causal."""
        if c.lq == c.lk:
            return None
        rows, W = self.mask.shape
        return self.mask[rows - c.lq :, W - c.lk :]

    def additive_mask(self, c: Call, dtype: torch.dtype) -> torch.Tensor | None:
        """`bool_mask` as 0 / -inf in `dtype` (what the fused CPU kernel adds to the logits), a view."""
        if c.lq == c.lk:
            return None
        if dtype not in self._additive:
            self._additive[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill(
                ~self.mask, float("-inf"))
        rows, W = self.mask.shape
        return self._additive[dtype][rows - c.lq :, W - c.lk :]


def bucket_lengths(lengths: np.ndarray, pad_area: int = PAD_AREA) -> dict[int, int]:
    """Map each distinct segment length to its bucket length (>= it).

    Greedy, longest first: a length `l` (with `c` segments) joins the current bucket `L` while
    `c * (L^2 - l^2) <= pad_area`, else it opens a bucket of its own.

    Args:
      lengths: int [S] segment lengths.
    """
    values, counts = np.unique(lengths, return_counts=True)
    out: dict[int, int] = {}
    top = None
    for l, c in zip(values[::-1].tolist(), counts[::-1].tolist()):
        if top is None or c * (top * top - l * l) > pad_area:
            top = l
        out[l] = top
    return out


def plan(seg: VarlenSegments, chunk: int = CHUNK, long: int = LONG, pad_area: int = PAD_AREA,
         q_slots: np.ndarray | None = None, keys: int | None = None) -> VarlenPlan:
    """Square segments, gathered rows and calls for a batch (host work, once per step).

    q_slots: under context parallelism, the flattened window slot (`b*T + t`) of each of the rank's query rows
    (the rows `varlen.varlen_segments(rows=)` numbers), and `keys` the window's B*T slots (module docstring).
    Raises AssertionError where a segment's queries are not the last of its keys (no variant
    of `torchtrain.attention.varlen` makes such a segment).
    """
    dev = seg.q_index.device
    q_index = seg.q_index.cpu().numpy()
    kv_index = seg.kv_index.cpu().numpy()
    cq = seg.cu_seqlens_q.cpu().numpy().astype(np.int64)
    ck = seg.cu_seqlens_k.cpu().numpy().astype(np.int64)
    lq, lk = np.diff(cq), np.diff(ck)
    S = lq.shape[0]
    seg_of_q = np.repeat(np.arange(S), lq)
    square_of_q = ck[seg_of_q] + (lk - lq)[seg_of_q] + (np.arange(q_index.shape[0]) - cq[seg_of_q])
    split = q_slots is not None
    q_slot = q_index if not split else np.asarray(q_slots)[q_index]
    if (lk < lq).any() or not np.array_equal(kv_index[square_of_q], q_slot):
        raise AssertionError("a varlen segment's queries are not the last of its keys")
    n_out = q_index.shape[0]  # every slot (a rank's every query row) is one segment's query once
    square_out = np.empty_like(q_index)
    square_out[q_index] = square_of_q  # slot -> square row of its output
    # under context parallelism the prefix rows (keys only) of each segment; its first chunk holding a query
    prefix = lk - lq if split else np.zeros_like(lk)

    # Groups of segments, longest first; each segment at `base + i*stride`, padded to `stride`
    # rows by repeating its last row.
    whole = (lk <= chunk) | ((lk >= long) & (prefix == 0))
    to_bucket = bucket_lengths(lk[whole], pad_area) if whole.any() else {}
    bucket = np.array([to_bucket.get(int(l), 0) for l in lk], dtype=np.int64)
    groups = [(np.flatnonzero(whole & (bucket == L)), L, True) for L in sorted(set(bucket[whole].tolist()), reverse=True)]
    full_chunks, first_chunk = lk // chunk, prefix // chunk
    for m, j0 in sorted(set(zip(full_chunks[~whole].tolist(), first_chunk[~whole].tolist())), reverse=True):
        segs = np.flatnonzero(~whole & (full_chunks == m) & (first_chunk == j0))
        segs = segs[np.argsort(-lk[segs], kind="stable")]  # equal tails adjacent
        groups.append((segs, int(lk[segs].max()), False))

    parts, pos, calls, base = [], np.full(kv_index.shape[0], -1, dtype=np.int64), [], 0
    for segs, stride, is_whole in groups:
        n = len(segs)
        i = np.arange(stride)[None, :]
        src = ck[segs][:, None] + np.minimum(i, lk[segs][:, None] - 1)  # square rows, last one repeated
        real = i < lk[segs][:, None]
        parts.append(kv_index[src].reshape(-1))
        pos[src[real]] = (base + np.arange(n)[:, None] * stride + i)[real]
        if is_whole:
            calls.append(Call(n, stride, base, stride, base, stride))
        else:
            m, j0 = int(lk[segs[0]]) // chunk, int(first_chunk[segs[0]])  # chunks before j0: no query of this rank
            calls += [Call(n, stride, base + j * chunk, chunk, base, (j + 1) * chunk) for j in range(j0, m)]
            tails = lk[segs] - m * chunk
            for r in sorted(set(tails.tolist()), reverse=True):
                if r:
                    off = base + int(np.flatnonzero(tails == r)[0]) * stride
                    calls.append(Call(int((tails == r).sum()), stride, off + m * chunk, r, off, m * chunk + r))
        base += n * stride
    rows = np.concatenate(parts)

    out_index = pos[square_out]
    slot_of_row = np.full(base, n_out, dtype=np.int64)  # B*T: dropped
    slot_of_row[out_index] = np.arange(n_out)
    dst = [slot_of_row[c.q0 + np.arange(c.n)[:, None] * c.stride + np.arange(c.lq)[None, :]].reshape(-1) for c in calls]
    # Key gradients: padded rows get exactly none (no real query sees them, and the outputs of
    # the queries that do are dropped); a slot with several real rows (the anchor) sums them.
    real_rows = pos[pos >= 0]
    slots = rows[real_rows]
    order = np.argsort(slots, kind="stable")
    first = np.r_[True, slots[order][1:] != slots[order][:-1]]
    key_index = np.full(n_out if not split else int(keys), base, dtype=np.int64)  # base: a zero row (split only)
    key_index[slots[order][first]] = real_rows[order][first]

    masked = [c.lk for c in calls if c.lq != c.lk]
    mask = None
    if masked:
        W = max(masked)
        mask = torch.arange(W, device=dev)[None, :] <= torch.arange(chunk, device=dev)[:, None] + (W - chunk)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(dev)

    if split:  # the rank's query rows, a zero row (n_out) for the prefix and padded rows; no fused-kernel packing
        return VarlenPlan(
            rows=t(rows), calls=tuple(calls), out_index=t(out_index), dst=tuple(t(d) for d in dst),
            key_index=t(key_index), extra_rows=t(real_rows[order][~first]), extra_slots=t(slots[order][~first]),
            mask=mask, square_rows=seg.kv_index, cu_seqlens=seg.cu_seqlens_k, max_seqlen=seg.max_seqlen_k,
            square_out=t(square_out), square_first=t(np.zeros(0)), square_dups=None, square_dup_slots=None,
            q_gather=t(slot_of_row))
    sq_first, sq_dups, sq_dup_slots = _duplicates(kv_index, out_index.shape[0])
    return VarlenPlan(
        rows=t(rows), calls=tuple(calls), out_index=t(out_index), dst=tuple(t(d) for d in dst),
        key_index=t(key_index), extra_rows=t(real_rows[order][~first]), extra_slots=t(slots[order][~first]),
        mask=mask, square_rows=seg.kv_index, cu_seqlens=seg.cu_seqlens_k, max_seqlen=seg.max_seqlen_k,
        square_out=t(square_out), square_first=t(sq_first), square_dups=None if sq_dups is None else t(sq_dups),
        square_dup_slots=None if sq_dup_slots is None else t(sq_dup_slots),
    )


def _duplicates(index: np.ndarray, n_slots: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """For a gather `x[index]` of n_slots slots (each at least once): each slot's first position,
    and for the slots gathered more than once a matrix of their other positions (padded with
    len(index)) and those slots."""
    order = np.argsort(index, kind="stable")
    slots = index[order]
    start = np.r_[True, slots[1:] != slots[:-1]]
    if int(start.sum()) != n_slots:
        raise AssertionError("the packed rows do not cover every slot once or more")
    first = order[start]
    rank = np.arange(index.shape[0]) - np.maximum.accumulate(np.where(start, np.arange(index.shape[0]), 0))
    extra = rank > 0
    if not extra.any():
        return first, None, None
    dup_slots = np.unique(slots[extra])
    row_of = np.searchsorted(dup_slots, slots[extra])
    dups = np.full((dup_slots.shape[0], int(rank.max())), index.shape[0], dtype=np.int64)
    dups[row_of, rank[extra] - 1] = order[extra]
    return first, dups, dup_slots
