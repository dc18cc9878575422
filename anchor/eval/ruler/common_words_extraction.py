"""cwe: common words extraction (upstream's scripts/data/synthetic/common_words_extraction.py): a numbered
list of words where ten appear more often than the rest, after a few-shot example."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

from anchor.eval import words as word_lists
from anchor.eval.ruler.common import Plan, Rendered, load_haystack
from anchor.eval.ruler.tasks import FAMILIES, CweArgs
from anchor_core.data.corpus import default_corpus_documents


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """cwe's words: the nouns, adjectives and verbs of `anchor.eval.words`, sorted and distinct."""
    return tuple(sorted(set(word_lists.NOUNS.split() + word_lists.ADJECTIVES.split()
                            + word_lists.VERBS.split())))


def cwe_planner(a: CweArgs, length: int, seed: int, count: Callable[[str], int],
                 haystack: str | Path | None) -> Callable[[random.Random, int], Plan]:
    """Samples draw from `cwe_words()`; where the first sample needs more words than that holds
    (upstream: `num_words > len(words)`), every sample draws from the haystack's vocabulary too."""
    small = cwe_words()
    t = FAMILIES["common_words_extraction"]
    limit = length - t.tokens_to_generate
    probe = _cwe_plan(a, length, seed, random.Random(f"ruler/cwe/{seed}/0"), small)
    full = probe.render(len(small))
    pool = small
    if count(full.input + full.answer_prefix) <= limit:
        extra = set(_corpus_vocabulary())
        if haystack is not None:
            extra |= set(load_haystack(haystack).vocabulary())
        pool = tuple(sorted(set(small) | extra))
    return lambda rng, i: _cwe_plan(a, length, seed, rng, pool)


@lru_cache(maxsize=1)
def _corpus_vocabulary() -> tuple[str, ...]:
    """The distinct lowercase words (3-12 letters) of the whole embedded corpus, sorted: English from
    its prose, docs and comments, and some identifiers of the standard library (about 19K words)."""
    found: set[str] = set()
    for doc in default_corpus_documents():
        found.update(re.findall(r"\b[a-z]{3,12}\b", doc["text"]))
    return tuple(sorted(found))


def _cwe_example(words: Sequence[str], common_repeats: int, uncommon_repeats: int, num_cw: int,
                 seed: int) -> tuple[str, list[str]]:
    """Upstream's get_example on sampled words: the numbered list and its `num_cw` common words."""
    common, uncommon = list(words[:num_cw]), list(words[num_cw:])
    word_list = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(word_list)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common


def _cwe_plan(a: CweArgs, length: int, seed: int, rng: random.Random, pool: Sequence[str]) -> Plan:
    t = FAMILIES["common_words_extraction"]
    full_template = t.template + t.answer_prefix
    if length < 4096:
        fs_size, fs_reps, main_reps = 20, (3, 1), (6, 1)
    else:
        fs_size, fs_reps, main_reps = 40, (10, 3), (a.freq_cw, a.freq_ucw)
    shots = []
    for _ in range(a.num_fewshot):
        ctx, common = _cwe_example(rng.sample(cwe_words(), fs_size), *fs_reps, a.num_cw, seed)
        shots.append(full_template.format(num_cw=a.num_cw, context=ctx, query="") + " "
                     + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common)))
    few_shots = "\n".join(shots)
    order = rng.sample(list(pool), len(pool))  # the first n are a uniform sample of n words
    answers = order[:a.num_cw]

    def render(n: int) -> Rendered:
        ctx, _ = _cwe_example(order[:n], *main_reps, a.num_cw, seed)
        return Rendered(few_shots + "\n" + t.template.format(num_cw=a.num_cw, context=ctx, query=""),
                         t.answer_prefix)

    return Plan(answers=answers, render=render, lo=a.num_cw, hi=len(pool))
