"""Durations in the hand-written prose: each must come from a record or be labelled an estimate or a limit."""

from __future__ import annotations

import re
from pathlib import Path

from . import ROOT
from .records import GENERATED, README_END, README_START


# A duration: a number and a unit of time ("20 minutes", "about 3 min", "110 s", "1.5 hours", "50 ms").
DURATION = re.compile(r"(?<![\w.,–-])\d[\d,]*(?:\.\d+)?(?:\s?[–-]\s?\d[\d,]*(?:\.\d+)?)?\s?"
                      r"(?:minutes?|mins?|hours?|hrs?|h|seconds?|secs?|s|ms|days?)(?![\w/])")
# What makes a duration in prose trustworthy without a record: it says it is an estimate (and from what), or
# it is a limit the code or a machine sets, not a measurement.
LABELLED = re.compile(r"(?i)\bestimat(?:e|es|ed)\b|\b(?:limit|limits|timeout|time-out)\b")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(*\[])|\n\s*\n")


def unlabelled_durations(text: str) -> list[str]:
    """Each duration in `text` whose sentence labels it neither an estimate nor a limit, with its sentence."""
    ends = [0] + [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]
    out = []
    for m in DURATION.finditer(text):
        start = max(e for e in ends if e <= m.start())
        end = min(e for e in ends if e > m.start())
        sentence = " ".join(text[start:end].split())
        if not LABELLED.search(sentence):
            out.append(f"{m.group(0)!r} in: {sentence[:200]}")
    return out


def prose(root: Path = ROOT) -> dict[str, str]:
    """The hand-written Markdown a reader takes for fact: docs/**/*.md without the generated pages, and
    README.md without its generated table."""
    out = {}
    for p in sorted((root / "docs").rglob("*.md")):
        text = p.read_text(encoding="utf-8")
        if GENERATED not in text:
            out[p.relative_to(root).as_posix()] = text
    readme = root / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8")
        if README_START in text and README_END in text:
            head, rest = text.split(README_START, 1)
            text = head + rest.split(README_END, 1)[1]
        out["README.md"] = text
    return out
