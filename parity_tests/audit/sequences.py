"""Input sequences of the audit: windows of real text with BOS at slot 0 (docs/DESIGN.md §1).

Texts come from the embedded default corpus (`anchor_core.data.corpus`, its domains interleaved) or a
user file/folder (`anchor_core.data.readers.iter_documents`, field `text`). Each document is tokenized
with the model's tokenizer and followed by EOS; window k is BOS + the token stream that starts at
document k (documents taken in turn, wrapping around when the text runs short; with more windows
than documents, later windows start a window further on), so the windows differ even when documents
are long.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from anchor_core.data.corpus import default_corpus_documents
from anchor_core.data.readers import iter_documents
from anchor_core.errors import InputError


def load_texts(data: str | Path | None, *, max_docs: int = 64, max_chars: int | None = None) -> list[str]:
    """Up to `max_docs` non-empty texts: from `data`, or the default corpus (domains round-robin).

    `max_chars` truncates each text (the audit never needs more than a window's worth of one document).
    """
    if data is None:
        by_domain: dict[str, list[str]] = {}
        for rec in default_corpus_documents(max_docs_per_domain=max(1, max_docs // 4)):
            by_domain.setdefault(rec["domain"], []).append(rec["text"])
        texts = [t for group in itertools.zip_longest(*by_domain.values()) for t in group if t]
    else:
        texts = []
        for doc in iter_documents(data, text_field="text"):
            if doc.text.strip():
                texts.append(doc.text)
            if len(texts) >= max_docs:
                break
        if not texts:
            raise InputError("no non-empty `text` in the data file", path=data)
    texts = texts[:max_docs]
    if max_chars is not None:
        texts = [t[:max_chars] for t in texts]
    return texts


def make_windows(doc_ids: list[list[int]], *, first_token: int, eos: int, n: int, T: int) -> np.ndarray:
    """`n` windows of `T` slots: slot 0 = `first_token`, then the stream from document k (k = 0..n-1).

    Args: doc_ids: token ids of each document (no special tokens). Returns int32 [n, T].
    """
    docs = [list(d) + [eos] for d in doc_ids if len(d)]
    if not docs:
        raise InputError("the texts tokenize to nothing")
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    stream = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64)
    out = np.empty((n, T), dtype=np.int32)
    out[:, 0] = first_token
    for k in range(n):
        # past the last document, start one window further on, so that no two windows are equal
        idx = starts[k % len(docs)] + (k // len(docs)) * (T - 1) + np.arange(T - 1)
        out[k, 1:] = np.take(stream, idx, mode="wrap")
    return out
