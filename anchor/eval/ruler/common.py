"""What every RULER task family shares: a sample's plan and its rendering, the fit of a plan's
haystack to the length (`fit`), and the essay haystack (`Haystack`, `load_haystack`).

See `anchor.eval.ruler` for how lengths are fitted and where the haystack comes from.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from anchor_core.data.corpus import corpus_folder_file, default_corpus_documents
from anchor_core.data.readers import iter_documents, recognized_corpus_file
from anchor_core.errors import InputError


@dataclass(frozen=True)
class Rendered:
    """A sample's prompt at one haystack size: what the model reads is `input + answer_prefix`."""

    input: str
    answer_prefix: str


@dataclass
class Plan:
    """A sample's random draws; `render(n)` builds its prompt with n haystack units."""

    answers: list[str]
    render: Callable[[int], Rendered]
    lo: int  # the fewest units a prompt can hold
    hi: int | None = None  # the most (None: unbounded)


def fit(tokens: Callable[[int], int], limit: int, lo: int, hi: int | None, start: int | None) -> int | None:
    """The largest n in [lo, hi] with tokens(n) <= limit, None when even `lo` overflows.

    `tokens` grows with n, nearly linearly: secant steps from two probes (`lo` and `lo + 64`, or
    `start`, the previous sample's answer, and a point near it) estimate the answer, then galloping
    brackets it and bisection ends on n with tokens(n) <= limit < tokens(n + 1) (or n = hi).
    """
    clamp = (lambda n: max(lo, n)) if hi is None else (lambda n: min(max(lo, n), hi))
    if start is None:
        x0, x1 = lo, clamp(lo + 64)
    else:
        x0 = clamp(start)
        x1 = clamp(x0 + max(1, x0 // 64))
    for _ in range(4):  # secant steps on tokens(n) - limit
        f0, f1 = tokens(x0), tokens(x1)
        if f1 == f0 or x1 == x0:
            break
        x2 = clamp(int(x1 + (limit - f1) * (x1 - x0) / (f1 - f0)))
        if abs(x2 - x1) <= 1:
            x1 = x2
            break
        x0, x1 = x1, x2
    n = x1
    if tokens(n) <= limit:
        good, step = n, 1
        while True:
            m = clamp(good + step)
            if m == good:
                return good  # n = hi fits
            if tokens(m) > limit:
                bad = m
                break
            good, step = m, step * 2
    else:
        bad, step = n, 1
        while True:
            m = clamp(bad - step)
            if m == bad:
                return None  # lo overflows
            if tokens(m) <= limit:
                good = m
                break
            bad, step = m, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if tokens(mid) <= limit:
            good = mid
        else:
            bad = mid
    return good


_WORD = re.compile(r"""^[("'“]?[A-Za-z][A-Za-z'’-]*[.,;:!?"')”]*$""")
_SENTENCE_END = re.compile(r"""[.!?]["')\]”’]*$""")
_SENTENCE_START = re.compile(r"""^["'(\[“‘]?[A-Z0-9]""")
HAYSTACK_DOMAINS = ("prose", "docs")  # the embedded corpus' domains of running text, in this order


@dataclass(frozen=True, eq=False)
class Haystack:
    """Prose as one stream of words (whitespace-normalised), repeated when a prompt needs more.

    `ends` lists the words that end a sentence: a word ending in `.`, `!` or `?` (closing quotes or
    brackets allowed) before a word starting with a capital, a digit or an opening quote; the last
    word is followed by word 0, where the stream repeats.
    """

    source: str
    words: tuple[str, ...]
    text: str = field(repr=False)  # " ".join(words)
    starts: np.ndarray = field(repr=False)  # [W] char offset of each word in `text`
    ends: np.ndarray = field(repr=False)  # [E] word indices in [0, W) that end a sentence

    @classmethod
    def from_text(cls, text: str, source: str) -> Haystack:
        words = tuple(text.split())
        if not words:
            raise InputError("the haystack has no words", path=source)
        lengths = np.fromiter((len(w) + 1 for w in words), dtype=np.int64, count=len(words))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        ends = np.array([i for i, w in enumerate(words)
                         if _SENTENCE_END.search(w) and _SENTENCE_START.match(words[(i + 1) % len(words)])],
                        dtype=np.int64)
        return cls(source=source, words=words, text=" ".join(words), starts=starts, ends=ends)

    def vocabulary(self) -> tuple[str, ...]:
        """Its distinct lowercase words (3-12 letters), sorted."""
        return tuple(sorted(set(re.findall(r"\b[a-z]{3,12}\b", self.text))))

    def _span(self, a: int, b: int) -> str:
        """Words a..b-1 of the repeated stream, joined by spaces."""
        W = len(self.words)
        block = len(self.text) + 1
        reps = -(-b // W)
        stream = (self.text + " ") * reps
        s = (a // W) * block + int(self.starts[a % W])
        last = b - 1
        e = (last // W) * block + int(self.starts[last % W]) + len(self.words[last % W])
        return stream[s:e]

    def sentence_starts(self, n: int) -> np.ndarray:
        """[P + 1] the word index where each sentence of the first n words starts, and n."""
        W = len(self.words)
        reps = -(-n // W)
        ends = (self.ends[None, :] + W * np.arange(reps)[:, None]).ravel()
        ends = ends[ends < n - 1]
        return np.concatenate([[0], ends + 1, [n]])

    def with_needles(self, n: int, depths: Sequence[int], needles: Sequence[str]) -> str:
        """The first n words with needle i placed between sentences at `depths[i]` percent (sorted
        depths take the needles in order), as upstream's essay haystack."""
        starts = self.sentence_starts(n)
        n_sents = len(starts) - 1
        cuts = [0] + sorted(int(n_sents * (d / 100)) for d in depths) + [n_sents]
        pieces = []
        for i in range(1, len(cuts)):
            a, b = int(starts[cuts[i - 1]]), int(starts[cuts[i]])
            if b > a:
                pieces.append(self._span(a, b))
            if i - 1 < len(needles):
                pieces.append(needles[i - 1])
        return " ".join(pieces)


def _is_running_text(paragraph: str) -> bool:
    words = paragraph.split()
    if len(words) < 12:
        return False
    plain = sum(bool(_WORD.match(w)) for w in words)
    return plain >= 0.8 * len(words) and re.search(r"[a-z][.!?]", paragraph) is not None


@lru_cache(maxsize=1)
def _default_haystack() -> Haystack:
    by_domain: dict[str, list[str]] = {d: [] for d in HAYSTACK_DOMAINS}
    for doc in default_corpus_documents():
        if doc["domain"] in by_domain:
            by_domain[doc["domain"]] += [p for p in re.split(r"\n\s*\n", doc["text"]) if _is_running_text(p)]
    paragraphs = [p for d in HAYSTACK_DOMAINS for p in by_domain[d]]
    return Haystack.from_text("\n\n".join(paragraphs), "the embedded corpus' prose")


@lru_cache(maxsize=4)
def _file_haystack(path: str, mtime_ns: int, size: int) -> Haystack:
    """A text file as it is; a JSONL or Parquet file (any name the corpus readers take) through
    `iter_documents`, its documents' texts joined by blank lines (the readers' errors name the line)."""
    p = Path(path)
    if recognized_corpus_file(p):
        return Haystack.from_text("\n\n".join(d.text for d in iter_documents(p)), str(p))
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"unreadable haystack: {e}", path=p) from None
    return Haystack.from_text(raw, str(p))


def load_haystack(path: str | Path | None = None) -> Haystack:
    """The essay haystack: the embedded corpus' prose (None), a text / JSONL ("text") file, or a folder written
    by `anchor corpus` (its declared JSONL)."""
    if path is None:
        return _default_haystack()
    p = Path(path)
    declared = corpus_folder_file(p) if p.is_dir() else None
    if declared is not None:
        p = declared
    if not p.is_file():
        raise InputError("no such haystack file (a text file, or JSONL with a \"text\" field)", path=p)
    st = p.stat()
    return _file_haystack(str(p.resolve()), st.st_mtime_ns, st.st_size)
