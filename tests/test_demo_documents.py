"""The demo's documents: the corpus cut at its files' own boundaries, documents per window, and the slots
whose visible keys differ between the anchor mask and full attention (against masks built slot by slot)."""

from __future__ import annotations

import json

import numpy as np
from anchor_core.data.batch import make_batch
from anchor.demo.documents import cut_corpus, cut_text, keys_differ, spread, window_docs

MODULE = '''"""A module."""

import os

X = 1


@decorator
def first(a):
    return a


class Thing:
    """A class."""

    size = 2

    def method(self):
        return 1

    @property
    def other(self):
        return 2


def last():
    pass
'''

TEXT = """Title
*****

Intro paragraph.

Section one
===========

Body one.

# A Markdown heading

Body two.

----
"""


def test_a_module_is_cut_at_its_functions_classes_and_methods():
    pieces = cut_text(MODULE, "code")
    assert [p.splitlines()[0] for p in pieces] == ['"""A module."""', "@decorator", "class Thing:",
                                                   "    def method(self):", "    @property", "def last():"]
    assert "".join(pieces) == MODULE  # nothing lost, nothing repeated
    assert "X = 1" in pieces[0] and "size = 2" in pieces[2]


def test_a_module_that_does_not_parse_stays_whole():
    assert cut_text("def broken(:\n    pass\n", "code") == ["def broken(:\n    pass\n"]


def test_a_text_is_cut_at_its_section_headings():
    pieces = cut_text(TEXT, "docs")
    assert [p.splitlines()[0] for p in pieces] == ["Title", "Section one", "# A Markdown heading"]
    assert "".join(pieces) == TEXT
    assert "----" in pieces[-1]  # a rule under a blank line is no heading


def test_cut_corpus_leaves_out_pieces_over_max_chars(tmp_path):
    src = tmp_path / "corpus.jsonl"
    big = "def table():\n    return " + "1, " * 400 + "\n"
    src.write_text("\n".join(json.dumps(r) for r in [{"text": MODULE + big, "domain": "code", "source": "m.py"},
                                                     {"text": TEXT, "domain": "docs", "source": "t"}]) + "\n")
    report = cut_corpus(src, tmp_path / "pieces.jsonl", max_chars=1000)
    rows = [json.loads(x) for x in (tmp_path / "pieces.jsonl").read_text().splitlines()]
    assert report["pieces"] == len(rows) == 9 and report["left_out"] == 1
    assert report["domains"]["code"] == {"documents": 1, "pieces": 6, "left_out": 1, "left_out_chars": len(big)}
    assert [r["source"] for r in rows[:2]] == ["m.py#0", "m.py#1"] and rows[-1]["domain"] == "docs"


def _masks(doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The anchor and full masks [T, T] of one window, slot by slot (key j <= query i)."""
    T = doc.size
    anchor, full = np.zeros((T, T), bool), np.zeros((T, T), bool)
    for i in range(T):
        for j in range(i + 1):
            if doc[i] < 0 or doc[j] < 0:
                continue
            full[i, j] = True
            anchor[i, j] = doc[j] == doc[i] or j == 0
    return anchor, full


def test_keys_differ_matches_the_masks():
    rng = np.random.default_rng(0)
    for _ in range(30):
        T = int(rng.integers(2, 40))
        lengths = rng.integers(1, 12, size=20)
        seg = np.repeat(np.arange(1, 21), lengths)[:T - 1]
        pad = int(rng.integers(0, 4))
        seg = np.r_[0, seg[:T - 1 - pad], -np.ones(pad, int)][:T]
        seg = np.pad(seg, (0, T - seg.size), constant_values=-1)[None]
        doc = make_batch(np.zeros_like(seg), seg, np.zeros_like(seg), "anchor").doc_ids
        anchor, full = _masks(doc[0])
        want = (anchor != full).any(axis=1)
        np.testing.assert_array_equal(keys_differ(doc)[0], want)
        assert window_docs(seg)[0] == len(set(seg[0, 1:]) - {-1})


def test_one_document_a_window_differs_nowhere():
    seg = np.r_[0, np.ones(15, int)][None]
    assert not keys_differ(seg).any() and window_docs(seg).tolist() == [1]


def test_spread():
    assert spread(np.array([1, 3, 3, 7])) == {"median": 3.0, "q1": 2.5, "q3": 4.0, "mean": 3.5, "min": 1, "max": 7}
