"""Packing documents into windows of T slots (docs/DESIGN.md §1), with domain tags and interleaving.

Legend: W windows, T slots per window, C = T - 1 stream slots per window, S selected documents.

The stream is the selected documents back to back, each as `[tag tokens] + tokens + [EOS]`.
Window `w` holds the first token (BOS, or EOS without BOS) at slot 0 and stream slots
`[w C, (w + 1) C)` at slots 1..T-1; a document cut at a window's end continues as a new document
in the next window; the last window is padded. Per slot the packer keeps three arrays, from which
`anchor_core.data.batch.make_batch` derives every variant's `doc_ids`, `positions` and `loss_mask`:

  tokens  uint32 [W, T]  token ids
  seg     int32  [W, T]  0 at slot 0, then 1, 2, ... per document in order of first appearance, -1 padding
  tag     uint8  [W, T]  1 on domain-tag slots

Interleaving (`Layout.interleave`) works inside each window. Every document (its slots in the
window: tag, tokens, EOS) of `chunk_doc_min`..`chunk_doc_max` slots is cut into k chunks, k uniform
in 2..`chunks_max`, at k - 1 distinct points chosen uniformly between `chunk_cut_lo` and
`chunk_cut_hi` of its length (the authors' code: 64-2048 tokens, 2-3 chunks, 20-80%); other
documents stay whole. (`mean_chunk` > 0 selects the per-slot scheme instead: a cut before each slot
with probability 1 / mean_chunk.) The chunks are shuffled so that each document's chunks keep their
order (every chunk draws a uniform key; each document's sorted keys go to its chunks in order; chunks
are sorted by key), and documents are renumbered by first appearance. Padding stays at the end.

Everything is vectorised over blocks of windows, so memory is bounded by the block size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from anchor_core.data.store import TokenStore
from anchor_core.errors import InputError

BLOCK_SLOTS = 1 << 22  # stream slots per packing block (bounds memory: ~100 bytes per slot)


@dataclass(frozen=True)
class Layout:
    """The data layouts of docs/DESIGN.md §2; they combine with every attention variant.

    The chunking keys are read only with `interleave` (module docstring)."""

    tags: bool = False
    interleave: bool = False
    chunk_doc_min: int = 64  # documents of chunk_doc_min..chunk_doc_max slots in a window are cut
    chunk_doc_max: int = 2048
    chunks_max: int = 3  # into 2..chunks_max chunks
    chunk_cut_lo: float = 0.2  # at points between these fractions of the document's length
    chunk_cut_hi: float = 0.8
    mean_chunk: int = 0  # > 0: instead, a cut before each slot with probability 1 / mean_chunk

    def cut_range(self, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The offsets (from a document's first slot) where a document of `length` slots may be cut:
        [lo, hi], both int64 like `length`."""
        length = np.asarray(length, dtype=np.int64)
        lo = np.maximum(1, np.ceil(self.chunk_cut_lo * length - 1e-9).astype(np.int64))
        hi = np.minimum(length - 1, np.floor(self.chunk_cut_hi * length + 1e-9).astype(np.int64))
        return lo, hi

    def check(self) -> None:
        """InputError where the chunking keys contradict each other (a document in range must have room
        for chunks_max - 1 distinct cuts)."""
        if self.chunk_doc_min < 2 or self.chunk_doc_max < self.chunk_doc_min:
            raise InputError(f"chunk_doc_min {self.chunk_doc_min} / chunk_doc_max {self.chunk_doc_max}: "
                             "want 2 <= chunk_doc_min <= chunk_doc_max")
        if not 0.0 <= self.chunk_cut_lo <= self.chunk_cut_hi <= 1.0:
            raise InputError(f"chunk_cut_lo {self.chunk_cut_lo} / chunk_cut_hi {self.chunk_cut_hi}: "
                             "want 0 <= chunk_cut_lo <= chunk_cut_hi <= 1")
        if self.mean_chunk < 0:
            raise InputError(f"mean_chunk {self.mean_chunk}: want 0 or more")
        if self.chunks_max < 2:
            raise InputError(f"chunks_max {self.chunks_max}: want at least 2")
        lo, hi = self.cut_range(np.array([self.chunk_doc_min]))
        if int(hi[0] - lo[0] + 1) < self.chunks_max - 1:
            raise InputError(f"a document of chunk_doc_min = {self.chunk_doc_min} slots has {max(0, int(hi[0] - lo[0] + 1))} "
                             f"cut points between chunk_cut_lo and chunk_cut_hi, fewer than chunks_max - 1 = "
                             f"{self.chunks_max - 1}")


def tag_text(domain: str) -> str:
    """The domain tag that precedes a document: SlimPajama's `RedPajamaWikipedia` -> `Wikipedia: `."""
    name = domain[len("RedPajama"):] if domain.startswith("RedPajama") and len(domain) > 9 else domain
    return f"{name}: "


@dataclass
class WindowBlock:
    tokens: np.ndarray  # uint32 [n, T]
    seg: np.ndarray  # int32 [n, T]
    tag: np.ndarray  # uint8 [n, T]


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape[0], dtype=np.int64)
    if x.shape[0] > 1:
        np.cumsum(x[:-1], out=out[1:])
    return out


class Packer:
    """Cuts the stream of `selection` into windows; `blocks()` yields them in order.

    Args:
      store: the token store (memory-mapped tokens, document index).
      selection: int64 [S] document indices in stream order (repeats allowed).
      seq_len: T >= 2.
      first_token, eos: the ids at slot 0 and at the end of each document.
      tag_tokens: per domain of the store, the tag's token ids (None: no tags).
      layout: interleave and its chunking (the tags come as `tag_tokens`); seed: the interleaving's
        random stream.

    After `blocks()`, `chunks` holds what the interleaving did (a ChunkTally).
    """

    def __init__(self, store: TokenStore, selection: np.ndarray, seq_len: int, *, first_token: int, eos: int,
                 tag_tokens: list[list[int]] | None = None, layout: Layout = Layout(), seed: int = 0):
        if seq_len < 2:
            raise InputError(f"--seq-len must be at least 2, got {seq_len}")
        self.store = store
        self.sel = np.asarray(selection, dtype=np.int64)
        if self.sel.size == 0:
            raise InputError("no documents selected to pack")
        self.T = int(seq_len)
        self.C = self.T - 1
        self.first_token = int(first_token)
        self.eos = int(eos)
        layout.check()
        self.layout = layout
        self.chunks = ChunkTally()
        self.seed = seed
        ndom = max(1, len(store.domains))
        if tag_tokens is None:
            tag_tokens = [[] for _ in range(ndom)]
        glen = np.array([len(t) for t in tag_tokens], dtype=np.int64)
        self.tagmat = np.zeros((ndom, max(1, int(glen.max(initial=0)))), dtype=np.uint32)
        for i, t in enumerate(tag_tokens):
            self.tagmat[i, :len(t)] = t
        self.dom = store.domain[self.sel].astype(np.int64)  # [S]
        self.g = glen[self.dom]  # [S] tag length per piece
        self.n = store.length[self.sel].astype(np.int64)  # [S]
        self.off = store.offset[self.sel].astype(np.int64)  # [S]
        size = self.g + self.n + 1
        self.start = _excl_cumsum(size)
        self.end = self.start + size
        self.length = int(self.end[-1])
        self.num_windows = -(-self.length // self.C)

    def blocks(self, block_slots: int = BLOCK_SLOTS) -> Iterator[WindowBlock]:
        per = max(1, block_slots // self.C)
        rng = np.random.default_rng([self.seed, 0x1EAF])
        for w0 in range(0, self.num_windows, per):
            w1 = min(self.num_windows, w0 + per)
            flat = self.stream_block(w0, w1)
            if self.layout.interleave:
                flat = interleave_flat(*flat, self.C, self.layout, rng, self.chunks)
            yield self.assemble(*flat)

    def block(self, w0: int, w1: int) -> WindowBlock:
        """Windows `[w0, w1)` without interleaving."""
        return self.assemble(*self.stream_block(w0, w1))

    def assemble(self, tok: np.ndarray, seg: np.ndarray, tag: np.ndarray) -> WindowBlock:
        """[n C] stream slots -> [n, T] windows with the first token at slot 0."""
        nw = tok.shape[0] // self.C
        out_tok = np.empty((nw, self.T), dtype=np.uint32)
        out_tok[:, 0] = self.first_token
        out_tok[:, 1:] = tok.reshape(nw, self.C)
        out_seg = np.empty((nw, self.T), dtype=np.int32)
        out_seg[:, 0] = 0
        out_seg[:, 1:] = seg.reshape(nw, self.C)
        out_tag = np.zeros((nw, self.T), dtype=np.uint8)
        out_tag[:, 1:] = tag.reshape(nw, self.C)
        return WindowBlock(out_tok, out_seg, out_tag)

    def stream_block(self, w0: int, w1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stream slots of windows `[w0, w1)`: tokens uint32, seg int32 (1, 2, ... per window,
        -1 padding) and tag uint8, each flat [n C]."""
        C, nw = self.C, w1 - w0
        p0, p1 = w0 * C, min(w1 * C, self.length)
        k_lo = int(np.searchsorted(self.end, p0, side="right"))
        k_hi = int(np.searchsorted(self.start, p1, side="left"))
        ks = np.arange(k_lo, k_hi)
        a = np.maximum(self.start[ks], p0)
        c = np.minimum(self.end[ks], p1) - a
        m = p1 - p0
        # store index of stream slot p: off + (p - start - g); tag and EOS slots are overwritten below
        src = np.repeat(self.off[ks] - self.g[ks] - self.start[ks], c)
        src += np.arange(p0, p1, dtype=np.int64)
        np.clip(src, 0, max(0, self.store.tokens.shape[0] - 1), out=src)
        tok = np.zeros(nw * C, dtype=np.uint32)
        np.take(self.store.tokens, src, out=tok[:m])
        eos_at = self.end[ks] - 1 - p0  # the EOS of a piece, if inside this block
        tok[eos_at[eos_at < m]] = self.eos
        tag = np.zeros(nw * C, dtype=np.uint8)
        if self.g[k_lo:k_hi].any():
            gk = self.g[ks]
            rel = np.arange(int(gk.sum())) - np.repeat(_excl_cumsum(gk), gk)  # slot within the tag
            pos = np.repeat(self.start[ks], gk) + rel - p0
            inside = (pos >= 0) & (pos < m)
            tok[pos[inside]] = self.tagmat[np.repeat(self.dom[ks], gk)[inside], rel[inside]]
            tag[pos[inside]] = 1
        # window-local document numbers: piece index minus the window's first piece, plus 1
        piece = np.repeat(np.arange(1, ks.size + 1, dtype=np.int32), c)
        row_first = piece[np.arange(0, m, C)] - 1
        seg = np.full(nw * C, -1, dtype=np.int32)
        seg[:m] = piece
        seg2 = seg.reshape(nw, C)
        np.subtract(seg2, row_first[:, None], out=seg2, where=seg2 >= 0)
        return tok, seg, tag


@dataclass
class ChunkTally:
    """What interleaving did, summed over blocks (stats.json's `interleave`): documents (their pieces in
    windows), those of chunk_doc_min..chunk_doc_max slots, and per chunk count k >= 2 the documents cut
    into k chunks (all of them, and those in that range)."""

    docs: int = 0
    docs_in_range: int = 0
    cut: dict[int, int] = field(default_factory=dict)
    cut_in_range: dict[int, int] = field(default_factory=dict)

    def add(self, chunks: np.ndarray, in_range: np.ndarray) -> None:
        self.docs += int(chunks.size)
        self.docs_in_range += int(in_range.sum())
        for into, sel in ((self.cut, chunks >= 2), (self.cut_in_range, (chunks >= 2) & in_range)):
            k, n = np.unique(chunks[sel], return_counts=True)
            for ki, ni in zip(k.tolist(), n.tolist()):
                into[ki] = into.get(ki, 0) + ni

    def to_dict(self, layout: Layout) -> dict[str, Any]:
        docs_cut = sum(self.cut_in_range.values())
        return {"scheme": "mean_chunk" if layout.mean_chunk > 0 else "chunk_docs", "docs": self.docs,
                "docs_cut": sum(self.cut.values()), "chunks": {str(k): v for k, v in sorted(self.cut.items())},
                "docs_in_range": self.docs_in_range, "docs_in_range_cut": docs_cut,
                "chunks_in_range": {str(k): v for k, v in sorted(self.cut_in_range.items())},
                "in_range_cut_share": docs_cut / self.docs_in_range if self.docs_in_range else 0.0}


def interleave_block(block: WindowBlock, layout: Layout, rng: np.random.Generator) -> WindowBlock:
    """`interleave_flat` on assembled windows (slot 0 stays in place)."""
    nw, T = block.seg.shape
    tok, seg, tag = (np.ascontiguousarray(x[:, 1:]).ravel() for x in (block.tokens, block.seg, block.tag))
    tok, seg, tag = interleave_flat(tok, seg, tag, T - 1, layout, rng)
    out = WindowBlock(block.tokens.copy(), block.seg.copy(), block.tag.copy())
    out.tokens[:, 1:], out.seg[:, 1:], out.tag[:, 1:] = (x.reshape(nw, T - 1) for x in (tok, seg, tag))
    return out


def chunk_cuts(new_doc: np.ndarray, seg: np.ndarray, layout: Layout, rng: np.random.Generator,
               tally: ChunkTally | None = None) -> np.ndarray:
    """Where chunks start (bool, flat [n C]): every document start (`new_doc`) plus the layout's cuts
    (module docstring). `tally` counts the documents and their chunks."""
    n = seg.shape[0]
    cut = new_doc.copy()
    starts = np.flatnonzero(new_doc)
    length = np.diff(np.append(starts, n))
    real = seg[starts] >= 0
    in_range = real & (length >= layout.chunk_doc_min) & (length <= layout.chunk_doc_max)
    if layout.mean_chunk > 0:
        cut[rng.integers(0, n, rng.binomial(n, 1.0 / layout.mean_chunk))] = True
    else:
        pick = np.flatnonzero(in_range)
        lo, hi = layout.cut_range(length[pick])
        k = rng.integers(2, layout.chunks_max + 1, size=pick.size)
        points = np.zeros((pick.size, layout.chunks_max - 1), dtype=np.int64)
        for j in range(layout.chunks_max - 1):  # distinct points: draw among the rest, step over earlier ones
            v = rng.integers(0, hi - lo + 1 - j)
            for prev in np.sort(points[:, :j], axis=1).T:
                v += v >= prev
            points[:, j] = v
        use = np.arange(layout.chunks_max - 1)[None, :] < (k - 1)[:, None]
        cut[(starts[pick][:, None] + lo[:, None] + points)[use]] = True
    if tally is not None:
        chunks = np.add.reduceat(cut.astype(np.int64), starts) if starts.size else np.zeros(0, np.int64)
        tally.add(chunks[real], in_range[real])
    return cut


def interleave_flat(tok: np.ndarray, seg: np.ndarray, tag: np.ndarray, C: int, layout: Layout,
                    rng: np.random.Generator, tally: ChunkTally | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each window's documents (stream slots, flat [n C]) into chunks (`chunk_cuts`) and shuffle them,
    keeping each document's chunk order; documents are renumbered by first appearance (module docstring)."""
    n = seg.shape[0]
    nw = n // C
    new_doc = np.ones(n, dtype=bool)
    np.not_equal(seg[1:], seg[:-1], out=new_doc[1:])
    new_doc[::C] = True  # each window's slot 1
    cut = chunk_cuts(new_doc, seg, layout, rng, tally)
    starts = np.flatnonzero(cut)  # chunk start (flat slot index)
    lens = np.diff(np.append(starts, n))
    row = starts // C
    doc = seg[starts].astype(np.int64)
    first_chunk = new_doc[starts] & (doc >= 0)
    keys = rng.random(starts.size)
    by_pos = np.lexsort((starts, doc, row))  # chunks grouped by (row, doc), in slot order
    by_key = np.lexsort((keys, doc, row))  # same groups, in key order
    assigned = np.empty_like(keys)
    assigned[by_pos] = keys[by_key]
    assigned[doc < 0] = 2.0 + starts[doc < 0] / n  # padding stays last, in order
    order = np.lexsort((assigned, row))
    olens = lens[order]
    src = np.repeat(starts[order] - _excl_cumsum(olens), olens)
    src += np.arange(n, dtype=np.int64)
    # renumber documents by first appearance in the new order (per chunk, then per slot)
    firsts = order[first_chunk[order]]
    frow = row[firsts]
    rank = np.arange(firsts.size) - np.searchsorted(frow, frow, side="left") + 1
    lut = np.full(nw * (C + 1), -1, dtype=np.int32)
    lut[frow * (C + 1) + doc[firsts]] = rank
    chunk_new = np.where(doc >= 0, lut[row * (C + 1) + np.maximum(doc, 0)], -1).astype(np.int32)
    out_tag = tag[src] if tag.any() else tag
    return tok[src], np.repeat(chunk_new[order], olens), out_tag


def window_stats(seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per window: documents (slots 1..T-1) and sum over documents of (slots + 1)^2 (the anchor's
    attention cost against T^2 for full attention). Args: seg int [n, T]. Returns int64 [n], float64 [n]."""
    n, T = seg.shape
    docs = seg[:, 1:].max(axis=1).astype(np.int64)
    flat = (np.arange(n)[:, None] * (T + 1) + seg[:, 1:]).ravel()
    real = seg[:, 1:].ravel() >= 0
    counts = np.bincount(flat[real], minlength=n * (T + 1)).reshape(n, T + 1).astype(np.float64)
    cost = ((counts + 1.0) ** 2 * (counts > 0)).sum(axis=1)
    return docs, cost
