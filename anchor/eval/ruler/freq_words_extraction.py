"""fwe: frequent words extraction (upstream's scripts/data/synthetic/freq_words_extraction.py): coded
words sampled from a Zipf distribution; the answer is the three most frequent (the first is noise, "...")."""

from __future__ import annotations

import math
import random
import string

import numpy as np

from anchor.eval.ruler.common import Plan, Rendered
from anchor.eval.ruler.tasks import FAMILIES, FweArgs


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin: 1000 terms and the tail's first corrections)."""
    n = 1000
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def fwe_plan(a: FweArgs, rng: random.Random, seed: int, vocab_size: int) -> Plan:
    t = FAMILIES["freq_words_extraction"]
    vocab = {"".join(rng.choices(string.ascii_lowercase, k=a.coded_wordlen)) for _ in range(vocab_size)}
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=a.coded_wordlen)))
    words = sorted(vocab)
    random.Random(seed).shuffle(words)
    words[0] = "..."  # the top ranked is noise
    weights = np.arange(1, len(words) + 1, dtype=np.float64) ** -a.alpha / zeta(a.alpha)

    def render(n: int) -> Rendered:
        counts = (n * weights).astype(int)
        text = [w for w, c in zip(words, counts) for _ in range(c)]
        random.Random(seed).shuffle(text)
        return Rendered(t.template.format(context=" ".join(text), query=""), t.answer_prefix)

    return Plan(answers=words[1:4], render=render, lo=1)
