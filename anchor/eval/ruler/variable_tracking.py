"""vt: variable tracking (upstream's scripts/data/synthetic/variable_tracking.py): chains of variable
assignments hidden in noise, after a few-shot example; the answer is every variable of the first chain."""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable

from anchor.eval.ruler.common import Plan, Rendered, fit
from anchor.eval.ruler.tasks import FAMILIES, NOISE, VtArgs


def _vt_chains(num_chains: int, num_hops: int, rng: random.Random,
               is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
    """(variables, assignment lines) per chain: `VAR A = 12345`, then `VAR B = VAR A ` per hop."""
    k = 3 if is_icl else 5
    num_hops = min(10, num_hops) if is_icl else num_hops
    names: list[str] = []
    while len(names) < (num_hops + 1) * num_chains:
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names and name != "VAR":  # "VAR" would be renamed with the keyword
            names.append(name)
    variables, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        vs = names[i:i + num_hops + 1]
        value = "12345" if is_icl else str(rng.randint(10000, 99998))
        chain = [f"VAR {vs[0]} = {value}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        variables.append(vs)
        chains.append(chain)
    return variables, chains


def _vt_render(chains: list[list[str]], num_hops: int, positions_seed: int, n: int) -> Rendered:
    """Upstream's noise haystack with the chains inserted in order at random lines."""
    t = FAMILIES["variable_tracking"]
    sentences = [NOISE] * n
    pos_rng = random.Random(f"{positions_seed}/{n}")
    for chain in chains:
        positions = sorted(pos_rng.sample(range(len(sentences)), len(chain)))
        for j, (p, line) in enumerate(zip(positions, chain)):
            sentences.insert(p + j, line)
    context = "\n".join(sentences).replace(". \n", ".\n")
    value = chains[0][0].split("=")[-1].strip()
    return Rendered(t.template.format(context=context, query=value, num_v=num_hops + 1),
                     t.answer_prefix.format(num_v=num_hops + 1, query=value))


def vt_icl_example(a: VtArgs, rng: random.Random, count: Callable[[str], int]) -> str:
    """Upstream's few-shot example: a vt prompt of at most 500 tokens (3-letter names, value 12345),
    its answer prefix and its answer, then a newline."""
    num_hops = min(10, a.num_hops)
    variables, chains = _vt_chains(a.num_chains, a.num_hops, rng, is_icl=True)
    positions_seed = rng.getrandbits(64)

    def text(n: int) -> str:
        r = _vt_render(chains, num_hops, positions_seed, n)
        return r.input + r.answer_prefix

    lo = (num_hops + 1) * a.num_chains
    n = fit(lambda n: count(text(n)), 500, lo, None, None)
    n = lo if n is None else n  # as upstream: the least haystack when none fits (byte-level tokenizers)
    return text(n) + " " + " ".join(variables[0]) + "\n"


def vt_plan(a: VtArgs, rng: random.Random, icl: str) -> Plan:
    # upstream's randomize_icl: new names for the example's answer variables and a new value
    old = icl.strip().split()[-(min(10, a.num_hops) + 1):]
    new: list[str] = []
    while len(new) < len(old):
        name = "".join(rng.choices(string.ascii_uppercase, k=len(old[len(new)])))
        if name not in new and name not in old:
            new.append(name)
    rename = dict(zip(old, new))
    example = re.sub(r"\b(" + "|".join(map(re.escape, old)) + r")\b", lambda m: rename[m.group(1)], icl)
    example = example.replace("12345", str(rng.randint(10000, 99998)))

    variables, chains = _vt_chains(a.num_chains, a.num_hops, rng, is_icl=False)
    positions_seed = rng.getrandbits(64)

    def render(n: int) -> Rendered:
        r = _vt_render(chains, a.num_hops, positions_seed, n)
        return Rendered(example + "\n" + r.input, r.answer_prefix)

    return Plan(answers=list(variables[0]), render=render, lo=(a.num_hops + 1) * a.num_chains)
