"""The demo's documents and what its windows hold.

The embedded corpus holds whole files: standard-library modules of about 5,000 tokens on average, so
1,024-slot windows hold one document each and anchor, intra-document and full attention compute the same
thing there. The paper packs SlimPajama, whose documents are mostly short (a median of a few hundred tokens,
a long tail of long ones), and its windows hold many documents each. `cut_corpus` cuts the corpus at the
boundaries its files have themselves: a module at each top-level function and class (a decorator goes with
what it decorates; what lies between them stays with the piece before), a text at each section heading (a
title underlined with `=`, `-`, `*`, `~` or `^`, or a Markdown `#` heading). The lengths that come out follow
the same shape: most pieces are a function or a section of a few hundred tokens, some classes run to
thousands.

`window_docs(seg)`: per window, the documents it holds; `keys_differ(doc_ids)`: per slot, whether the keys it
sees under the anchor mask differ from those under full attention (a slot of the window's first document
sees the same keys under both; a slot of a later one sees its own document and the anchor under the first,
every earlier slot under the second). `pack_windows(folder)` sums both over a packed folder.
"""

from __future__ import annotations

import ast
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from anchor_core.atomic import write_text_atomic
from anchor_core.data.mixture import MixtureSpec
from anchor_core.data.packed import PackedData
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.data.store import TokenStore
from anchor_core.outdir import rmtree, staging_prefix

# A section heading in reStructuredText: a line of text, then a line of one of these characters at least
# as long as three (pydoc's topics underline with `*` and `=`, READMEs with `=` and `-`).
_UNDERLINE = re.compile(r"^([=\-*~^])\1{2,}\s*$")
_MD_HEADING = re.compile(r"^#{1,6} \S")


def code_cuts(text: str) -> list[int]:
    """Line numbers (0-based) where a module's top-level functions and classes begin, decorators included;
    [] where it does not parse (it stays whole)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    cuts = []
    for node in tree.body:
        if isinstance(node, defs):
            cuts.append(_first_line(node))
            if isinstance(node, ast.ClassDef):  # and each of its methods (nested classes) with it
                cuts += [_first_line(n) for n in node.body if isinstance(n, defs)]
    return cuts


def _first_line(node: ast.AST) -> int:
    """The 0-based line where a function or class begins: its first decorator's, else its own."""
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1


def text_cuts(lines: list[str]) -> list[int]:
    """Line numbers (0-based) where a text's sections begin: a title line over an underline, a Markdown
    heading."""
    cuts = []
    for i, line in enumerate(lines):
        if _MD_HEADING.match(line):
            cuts.append(i)
        elif (i + 1 < len(lines) and line.strip() and not _UNDERLINE.match(line)
              and _UNDERLINE.match(lines[i + 1])):
            cuts.append(i)
    return cuts


def cut_text(text: str, domain: str) -> list[str]:
    """`text` cut at its natural boundaries (module docstring), every piece non-blank, in order; joined
    they are `text` again, less the blank pieces."""
    lines = text.splitlines(keepends=True)
    cuts = code_cuts(text) if domain == "code" else text_cuts([x.rstrip("\r\n") for x in lines])
    bounds = sorted({0, *(c for c in cuts if 0 < c < len(lines)), len(lines)})
    pieces = ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [p for p in pieces if p.strip()]


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def cut_corpus(src: Path, dest: Path, max_chars: int | None = None) -> dict[str, Any]:
    """Write `src` (a corpus JSONL file: text, domain, source) cut by `cut_text` to `dest`, each piece a
    record of its own (`source`: the file's, `#` and the piece's index), pieces over `max_chars` characters
    left out (None: none); returns the counts per domain."""
    out: list[str] = []
    domains: dict[str, dict[str, int]] = {}
    for rec in _records(src):
        domain = str(rec.get("domain", ""))
        pieces = cut_text(str(rec["text"]), domain)
        tally = domains.setdefault(domain, {"documents": 0, "pieces": 0, "left_out": 0, "left_out_chars": 0})
        tally["documents"] += 1
        for k, piece in enumerate(pieces):
            if max_chars is not None and len(piece) > max_chars:
                tally["left_out"] += 1
                tally["left_out_chars"] += len(piece)
                continue
            tally["pieces"] += 1
            out.append(json.dumps({"text": piece, "domain": domain, "source": f"{rec.get('source', '')}#{k}"},
                                  ensure_ascii=False))
    write_text_atomic(dest, "\n".join(out) + "\n")
    total = {k: sum(d[k] for d in domains.values()) for k in ("documents", "pieces", "left_out", "left_out_chars")}
    return {**total, "max_chars": max_chars, "domains": domains}


def window_docs(seg: np.ndarray) -> np.ndarray:
    """Documents per window: those of slots 1 to T-1 (slot 0 is the anchor). seg int [n, T] as the packer
    writes it (0 at slot 0, documents 1, 2, ... by first appearance, -1 padding) -> int64 [n]."""
    return np.maximum(np.asarray(seg)[:, 1:].max(axis=1), 0).astype(np.int64)


def keys_differ(doc_ids: np.ndarray) -> np.ndarray:
    """Per slot, whether the anchor mask shows it other keys than full attention does. doc_ids int [B, T] as
    the model receives them (-1: padding; slot 0 the anchor, document 0) -> bool [B, T].

    Full attention shows slot i every non-padding slot up to i; the anchor mask shows the slots of i's own
    document up to i and slot 0. They differ exactly where some earlier non-padding slot is in another
    document than i's and is not slot 0."""
    doc = np.asarray(doc_ids, dtype=np.int64)
    real = doc >= 0
    seen_full = np.cumsum(real, axis=1)  # non-padding keys up to and including i
    same = np.zeros(doc.shape, dtype=np.int64)  # keys of i's document up to and including i
    for b in range(doc.shape[0]):
        row = doc[b]
        start = np.r_[0, np.flatnonzero(row[1:] != row[:-1]) + 1]
        run = np.diff(np.r_[start, row.size])
        same[b] = np.arange(row.size) - np.repeat(start, run) + 1
    anchor = (doc[:, :1] >= 0) & (doc != doc[:, :1])  # slot 0, where i is not in its document
    return real & (seen_full != same + anchor)


def spread(x: np.ndarray) -> dict[str, float]:
    """Median, quartiles, mean and range of a count per window."""
    x = np.asarray(x, dtype=np.float64)
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    return {"median": float(med), "q1": float(q1), "q3": float(q3), "mean": float(x.mean()),
            "min": int(x.min()), "max": int(x.max())}


def pack_windows(folder: Path) -> dict[str, Any]:
    """Over every window of a packed folder: documents per window (`spread`) and the share of non-padding
    slots whose visible keys differ between the anchor mask and full attention."""
    data = PackedData.open(folder)
    docs, differ, real = [], 0, 0
    for a in range(0, data.num_windows, 64):
        idx = list(range(a, min(a + 64, data.num_windows)))
        d = np.asarray(data.batch(idx, "anchor").doc_ids)  # the packer's seg, slot 0 the anchor
        docs.append(window_docs(d))
        differ += int(keys_differ(d).sum())
        real += int((d >= 0).sum())
    return {"docs_per_window": spread(np.concatenate(docs)), "keys_differ_share": differ / real if real else 0.0}


PIECES_FILE = "pieces.jsonl"  # in the pack job's folder, beside the windows packed from it
# Pieces longer than this many characters per window slot (about four and a half windows of tokens at the
# default tokenizer's 3.5 characters a token) are left out: data tables (encodings' charmaps, HTML entities,
# pydoc's topics module), some 30 of about 19,000 pieces holding an eighth of the corpus's text, each of which
# would fill windows alone.
MAX_CHARS_PER_SLOT = 16


def pack_pieces(model: str, corpus: Path, out: Path, seq_len: int, budget: int, *,
                progress: bool = False) -> dict[str, Any]:
    """The pack job on pieces: `corpus/corpus.jsonl` cut (`cut_corpus`) into pieces, the first `budget`
    tokens of them in each domain's share (the `original` mixture: upsampling long pieces would undo the cut)
    packed into windows of `seq_len` in `out`, and the pieces kept as `out/pieces.jsonl`. Returns the job's
    summary: the windows, the pieces (counts, tokens per piece) and `pack_windows`.

    The pieces are written beside `out` while it is packed and moved into it after: the corpus job's folder
    holds what that job wrote and nothing a later job cut from it (the demo reuses a job only while its
    folder is unchanged)."""
    work = Path(tempfile.mkdtemp(prefix=staging_prefix(out), dir=out.parent))
    try:
        cut = cut_corpus(corpus / "corpus.jsonl", work / PIECES_FILE, max_chars=MAX_CHARS_PER_SLOT * seq_len)
        cfg = PackConfig(seq_len=seq_len, mixture=MixtureSpec(kind="original", budget=budget))
        stats = pack_corpus(model, work / PIECES_FILE, out, cfg, progress=progress, data_name=str(out / PIECES_FILE))
        os.replace(work / PIECES_FILE, out / PIECES_FILE)
    finally:
        rmtree(work)
    length = TokenStore.open(out / "store").length
    cut.update(tokens_per_piece={**spread(length), "p90": float(np.percentile(length, 90))},
               selected=stats["mixture"]["selected_docs"], mixture="original")
    return {"windows": stats["windows"], "documents": cut, **pack_windows(out)}
