"""Where the documents of a batch are: the black-box check's reading of the dict a loop passes to model(**batch).

Legend: B rows, T slots, H heads.

`infer_documents(batch, doc_ids=None)` reads the documents from the first source that applies (SOURCES):
  1. `doc_ids=` given by the caller: int [B, T] (or [T] for one row), equal ids = one document, -1 padding;
  2. the batch's own `doc_ids` key, as torchtrain.hf.PackingCollator puts it there (docs/DESIGN.md §1);
  3. `cu_seq_lens_q`, else `cu_seq_lens_k` (DataCollatorWithFlattening(return_flash_attn_kwargs=True), what
     flash_attention_2 reads): one row, a document per interval;
  4. a 4-D `attention_mask` [B, 1|H, T, T] (bool / 0-1: nonzero attends; float: additive, 0 attends): by the
     earliest key each query slot sees, slot 0 left out (the anchor mask lets every slot see slot 0): a
     document starts wherever that earliest key differs from the previous slot's (slot 1 stays in slot 0's
     document where it sees slot 0). A slot that sees nothing is padding, and so is the run of slots at a
     row's end that see only themselves (§2's padding, which a per-document mask cannot tell from
     one-slot documents there);
  5. `position_ids` that restart: a new document wherever a position is not the previous one + 1 (the rule
     of transformers' masking_utils.find_packed_sequence_indices); positions that never restart say
     nothing about documents and are no source;
  6. otherwise one document per row.
The explicit sources come first: ids, offsets and a mask say where documents are, a restart of
position_ids only implies it. A 2-D `attention_mask` marks padding (0) in every case. In ids (the argument
or the key) a 0 at slot 0 is the anchor slot of the `anchor` variant (§1) and counts with the document
slot 1 opens, as a mask reads it: the oracle's anchor rule lets every slot see slot 0 whichever document
it belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from anchor_core.errors import InputError

# What a batch may hold the documents in, in the order they are read (the module docstring).
SOURCES: tuple[str, ...] = ("doc_ids", "batch_doc_ids", "cu_seq_lens_q", "cu_seq_lens_k", "attention_mask",
                            "position_ids", "rows")


def infer_documents(batch: Any, *, doc_ids: Any = None) -> dict[str, Any]:
    """Where the documents of `batch` are (the module docstring's order of sources).

    Returns {"doc_ids": int64 [B, T] (1, 2, … per row, -1 padding), "source": one of SOURCES, "counts":
    documents per row, "lengths": the documents' lengths per row, "first_slots": each document's first
    slot per row, "disagree": the other sources in the batch that put the boundaries elsewhere}.
    """
    tokens = batch_tokens(batch)
    B, T = tokens.shape
    real = np.ones((B, T), dtype=bool)
    mask = batch.get("attention_mask")
    mask = None if mask is None else as_numpy(mask)
    if mask is not None and mask.ndim == 2:
        if mask.shape != (B, T):
            raise InputError(f"batch['attention_mask']: expected [B, T] = [{B}, {T}], got {list(mask.shape)}")
        real = mask != 0
    elif mask is not None and mask.ndim != 4:
        raise InputError(f"batch['attention_mask']: expected [B, T] or [B, 1|H, T, T], got {list(mask.shape)}")
    readings: dict[str, np.ndarray] = {}
    if doc_ids is not None:
        readings["doc_ids"] = _from_ids(doc_ids, real, "doc_ids")
    if batch.get("doc_ids") is not None:
        readings["batch_doc_ids"] = _from_ids(batch["doc_ids"], real, "batch['doc_ids']")
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if batch.get(key) is not None:
            readings[key] = _from_cu(batch[key], key, T, B, real)
    if mask is not None and mask.ndim == 4:
        readings["attention_mask"] = _from_mask4(mask, B, T)
    pos = batch_positions(batch, B, T)
    if pos is not None and (np.diff(pos, axis=1)[real[:, 1:] & real[:, :-1]] != 1).any():
        readings["position_ids"] = _from_positions(pos, real)
    source = next((s for s in SOURCES if s in readings), "rows")
    chosen = readings.get(source, np.where(real, 1, -1).astype(np.int64))
    if "position_ids" in readings:  # positions cannot mark padding: held to the chosen reading on its real slots
        readings["position_ids"] = np.stack([_renumber(np.where(c >= 0, r, -1))
                                             for c, r in zip(chosen, readings["position_ids"])])
    disagree = [s for s, r in readings.items() if s != source and not np.array_equal(r, chosen)]
    lengths = [[int((row == d).sum()) for d in range(1, int(row.max(initial=0)) + 1)] for row in chosen]
    firsts = [[int(np.argmax(row == d)) for d in range(1, int(row.max(initial=0)) + 1)] for row in chosen]
    return {"doc_ids": chosen, "source": source, "counts": [len(x) for x in lengths], "lengths": lengths,
            "first_slots": firsts, "disagree": disagree}


def as_numpy(x: Any) -> np.ndarray:
    """A tensor (floating ones as float32) or array-like as numpy."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def batch_tokens(batch: Any) -> np.ndarray:
    """The batch's input_ids as int64 [B, T]; a batch that is no dict of them is an InputError."""
    if not isinstance(batch, Mapping):
        raise InputError(f"batch: expected the dict of tensors your loop passes to model(**batch), got a "
                         f"{type(batch).__name__}")
    if "input_ids" not in batch:
        raise InputError(f"batch: no input_ids (its keys: {', '.join(map(str, batch)) or 'none'}); the check holds "
                         f"the forward against the oracle on the same token ids, so the batch must carry them")
    tokens = as_numpy(batch["input_ids"])
    if tokens.ndim != 2 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise InputError(f"batch['input_ids']: expected integer token ids [B, T], got {tokens.dtype} of shape "
                         f"{list(tokens.shape)}")
    return tokens.astype(np.int64)


def batch_positions(batch: Mapping, B: int, T: int) -> np.ndarray | None:
    """The batch's position_ids as int64 [B, T] (a [T] or [1, T] one broadcast), or None."""
    if batch.get("position_ids") is None:
        return None
    pos = as_numpy(batch["position_ids"]).astype(np.int64)
    if pos.ndim == 1:
        pos = pos[None]
    if pos.ndim != 2 or pos.shape[1] != T or pos.shape[0] not in (1, B):
        raise InputError(f"batch['position_ids']: expected [B, T] = [{B}, {T}], got {list(pos.shape)}")
    return np.broadcast_to(pos, (B, T)).copy()


def _runs(starts: np.ndarray, real: np.ndarray) -> np.ndarray:
    """doc_ids of one row from a bool [T] 'a document starts here' and the real slots: 1, 2, … and -1."""
    out = np.cumsum(starts | ~np.r_[True, real[:-1]]).astype(np.int64)
    return _renumber(np.where(real, out, -1))


def _renumber(row: np.ndarray) -> np.ndarray:
    """Ids 1, 2, … in order of first appearance; -1 stays padding."""
    out = np.full(row.shape, -1, dtype=np.int64)
    real = row >= 0
    _, first, inverse = np.unique(row[real], return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))
    out[real] = rank[inverse] + 1
    return out


def _from_ids(ids: Any, real: np.ndarray, what: str) -> np.ndarray:
    B, T = real.shape
    given = as_numpy(ids)
    if given.ndim == 1 and B == 1:
        given = given[None]
    if given.shape != (B, T) or given.dtype.kind not in "iu" or (given < -1).any():
        raise InputError(f"{what}: expected integer ids [B, T] = [{B}, {T}] (equal ids one document, -1 padding), "
                         f"got {given.dtype} of shape {list(given.shape)}"
                         + (" with ids below -1" if given.size and given.dtype.kind in "iu" and (given < -1).any()
                            else ""))
    given = np.where(real, given, -1).astype(np.int64)
    if T > 1:  # the anchor slot (0 at slot 0) counts with the document slot 1 opens
        anchor = (given[:, 0] == 0) & (given[:, 1] > 0)
        given[anchor, 0] = given[anchor, 1]
    return np.stack([_renumber(row) for row in given])


def _from_cu(value: Any, key: str, T: int, B: int, real: np.ndarray) -> np.ndarray:
    cu = as_numpy(value).astype(np.int64).ravel()
    if B != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) <= 0) or cu[-1] > T:
        raise InputError(f"batch['{key}']: expected increasing offsets from 0 to at most T={T} for one row, "
                         f"got {cu.tolist()[:8]} for {B} row(s)")
    starts = np.zeros(T, dtype=bool)
    starts[cu[:-1]] = True
    return _runs(starts, real[0] & (np.arange(T) < cu[-1]))[None]


def _from_mask4(mask: np.ndarray, B: int, T: int) -> np.ndarray:
    """Documents of a 4-D mask by the earliest key each slot sees (module docstring, source 4)."""
    if mask.shape[0] not in (1, B) or mask.shape[-2:] != (T, T):
        raise InputError(f"batch['attention_mask']: a 4-D mask must be [B, 1|H, T, T] = [{B}, ., {T}, {T}], got "
                         f"{list(mask.shape)}")
    sees = (mask != 0) if mask.dtype.kind in "biu" else (mask >= 0)
    sees = np.broadcast_to(sees.any(axis=1), (B, T, T))
    slots = np.arange(T)
    out = np.empty((B, T), dtype=np.int64)
    for b in range(B):
        real = sees[b].any(axis=1)
        alone = sees[b].sum(axis=1) == (sees[b, slots, slots])  # sees itself at most
        tail = T - int(np.argmax(~alone[::-1])) if not alone.all() else 1  # slot 0 is a row's first token
        real[max(tail, 1):] = False
        later = sees[b, :, 1:]
        earliest = np.where(later.any(axis=1), later.argmax(axis=1) + 1, -1)
        starts = np.r_[True, earliest[1:] != earliest[:-1]]
        if T > 1:
            starts[1] = not sees[b, 1, 0]
        out[b] = _runs(starts, real)
    return out


def _from_positions(pos: np.ndarray, real: np.ndarray) -> np.ndarray:
    return np.stack([_runs(np.r_[True, np.diff(p) != 1], r) for p, r in zip(pos, real)])
