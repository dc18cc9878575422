"""niah: needles in a haystack (upstream's scripts/data/synthetic/niah.py): keys and values hidden in
noise, in essay prose or among distractor needles, one or several asked for."""

from __future__ import annotations

import random
import uuid
from functools import lru_cache

from anchor.eval import words as word_lists
from anchor.eval.ruler.common import Haystack, Plan, Rendered
from anchor.eval.ruler.tasks import DEPTHS, FAMILIES, NEEDLE, NOISE, NeedleKind, NiahArgs


@lru_cache(maxsize=1)
def key_words() -> tuple[str, ...]:
    """niah's word keys: every `adjective-noun` pair of `anchor.eval.words`, sorted (upstream's from
    wonderwords' lists)."""
    adjs, nouns = word_lists.ADJECTIVES.split(), word_lists.NOUNS.split()
    return tuple(sorted({f"{a}-{n}" for a in adjs for n in nouns}))


def _random_value(kind: NeedleKind, rng: random.Random) -> str:
    """A key or value as upstream: a 7-digit number, an `adjective-noun` word, or a version-4 UUID."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(key_words())
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah_template(a: NiahArgs) -> tuple[str, str, str]:
    """(template, answer prefix, value type) with upstream's singular wording for one answer."""
    t = FAMILIES["niah"]
    template, prefix, type_v = t.template, t.answer_prefix, a.type_needle_v
    if a.num_needle_q * a.num_needle_v == 1:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = type_v[:-1]  # remove "s"
    return template, prefix, type_v


def niah_plan(a: NiahArgs, rng: random.Random, seed: int, hay: Haystack | None) -> Plan:
    num_k = max(a.num_needle_k, a.num_needle_q)
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    for _ in range(num_k):
        key = _random_value(a.type_needle_k, rng)
        while key in keys:
            key = _random_value(a.type_needle_k, rng)
        keys.append(key)
        values.append([])
        for _ in range(a.num_needle_v):
            values[-1].append(_random_value(a.type_needle_v, rng))
            needles.append(NEEDLE.format(type_needle_v=a.type_needle_v, key=key, value=values[-1][-1]))
    random.Random(seed).shuffle(needles)
    queried = rng.sample(range(num_k), a.num_needle_q)
    queries = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, type_v = _niah_template(a)
    rendered_prefix = prefix.format(type_needle_v=type_v, query=query)

    if a.type_haystack == "essay":
        assert hay is not None
        depths = rng.sample(DEPTHS, len(needles))

        def context(n: int) -> str:
            return hay.with_needles(n, depths, needles)
        lo = 1
    else:
        positions_seed = rng.getrandbits(64)
        distractors = _Distractors(a, set(keys), rng.getrandbits(64))

        def context(n: int) -> str:
            sentences = [NOISE] * n if a.type_haystack == "noise" else distractors.first(n)
            indexes = sorted(random.Random(f"{positions_seed}/{n}").sample(range(n), len(needles)), reverse=True)
            for index, needle in zip(indexes, needles):
                sentences.insert(index, needle)
            return "\n".join(sentences)
        lo = len(needles)

    def render(n: int) -> Rendered:
        return Rendered(template.format(type_needle_v=type_v, context=context(n), query=query), rendered_prefix)

    return Plan(answers=answers, render=render, lo=lo)


class _Distractors:
    """The needle haystack: needles with other keys and values, taken in order as far as needed."""

    def __init__(self, a: NiahArgs, keys: set[str], seed: int):
        self.a, self.keys, self.rng, self.made = a, keys, random.Random(seed), []

    def first(self, n: int) -> list[str]:
        while len(self.made) < n:
            key = _random_value(self.a.type_needle_k, self.rng)
            if key in self.keys:
                continue  # a distractor never answers the question
            value = _random_value(self.a.type_needle_v, self.rng)
            self.made.append(NEEDLE.format(type_needle_v=self.a.type_needle_v, key=key, value=value))
        return self.made[:n]
