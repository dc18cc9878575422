"""Document mixtures to a token budget: `original`, `upsample_long` (sampling, as the paper's UpSampledMix
after Fu et al. 2024) and `upsample_repeat` (copies).

    sel = select_documents(store.length, store.domain, MixtureSpec("upsample_long", budget=2_000_000_000))

A document counts `length + 1` tokens (its EOS); "long" means longer than `long_threshold` tokens.

`upsample_long` changes the mixture by sampling: every long document is kept and each short one with
probability q = 1 / `upsample_factor`, within each source (of each domain's short documents a random
round(q n) are kept). That sample, shuffled, comes first; then the short documents left out, shuffled;
only when the whole pool is used do documents repeat (a new pass, sampled the same way). The selection is
the first `budget` tokens of that order, or the sample alone when no budget is given. The long share of a
domain's tokens rises from L / (L + S) to about L / (L + q S) (L, S: its long and short tokens), and
the domains' shares move with it, towards the domains richer in long documents (the paper's table:
CommonCrawl 53 -> 58%, C4 26.5 -> 19.5%).

`original` and `upsample_repeat` keep each domain's share of tokens as in the source: domain `d` gets a
quota `budget * tokens_d / tokens`. Within a domain, documents are taken in passes; a pass holds every
document once, in a fresh random order, and under `upsample_repeat` a long document `upsample_factor`
times (a fractional factor adds the last copy with that probability): long documents repeat within a
pass, short ones may be left out. The long share rises to about r L / (r L + S).
The selection is shuffled as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from anchor_core.errors import InputError

Mixture = Literal["original", "upsample_long", "upsample_repeat"]
MIXTURES: tuple[str, ...] = get_args(Mixture)


@dataclass(frozen=True)
class MixtureSpec:
    kind: Mixture = "original"
    budget: int | None = None  # tokens incl. one EOS per document; None: the source's size
    long_threshold: int = 4096  # tokens; documents longer than this are "long"
    upsample_factor: float = 4.0  # upsample_long: short documents kept with 1 / factor; upsample_repeat: copies
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MIXTURES:
            raise InputError(f"unknown mixture {self.kind!r} (known: {', '.join(MIXTURES)})")
        if self.budget is not None and self.budget <= 0:
            raise InputError(f"--budget must be positive, got {self.budget}")
        if self.long_threshold < 1:
            raise InputError(f"the long-document threshold must be >= 1, got {self.long_threshold}")
        if not self.upsample_factor >= 1.0:
            raise InputError(f"the upsample factor must be >= 1, got {self.upsample_factor}")


def _take_domain(idx: np.ndarray, cost: np.ndarray, long: np.ndarray, quota: int, factor: float,
                 rng: np.random.Generator) -> np.ndarray:
    """Documents of one domain (global indices), pass after pass, until `quota` tokens are reached."""
    whole, frac = int(np.floor(factor)), factor - np.floor(factor)
    taken: list[np.ndarray] = []
    have = 0
    while have < quota:
        copies = np.where(long, whole + (rng.random(idx.size) < frac), 1)
        one_pass = np.repeat(idx, copies)
        one_pass = one_pass[rng.permutation(one_pass.size)]
        cum = np.cumsum(cost[one_pass]) + have
        # documents while the running total before them is below the quota
        n = int(np.searchsorted(cum - cost[one_pass], quota, side="left"))
        taken.append(one_pass[:n])
        have = int(cum[n - 1]) if n else have
        if n < one_pass.size:
            break
    return np.concatenate(taken) if taken else np.zeros(0, np.int64)


def _sampling_order(domain: np.ndarray, long: np.ndarray, keep: float, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One pass over the whole pool in upsample_long's order, and the size of its first part: the long
    documents with a share `keep` of each domain's short ones (shuffled together), then the other short
    ones (shuffled)."""
    first, rest = [], []
    for d in np.unique(domain):
        idx = np.flatnonzero(domain == d)
        short = rng.permutation(idx[~long[idx]])
        k = int(round(keep * short.size))
        first += [idx[long[idx]], short[:k]]
        rest.append(short[k:])
    head = np.concatenate(first)
    return np.concatenate([rng.permutation(head), rng.permutation(np.concatenate(rest))]), head.size


def _sample_long(cost: np.ndarray, domain: np.ndarray, long: np.ndarray, budget: int | None, factor: float,
                 rng: np.random.Generator) -> np.ndarray:
    """upsample_long: the first `budget` tokens of the sampling order, pass after pass (the sample alone
    when `budget` is None)."""
    order, head = _sampling_order(domain, long, 1.0 / factor, rng)
    if budget is None:
        return order[:head]
    taken: list[np.ndarray] = []
    have = 0
    while have < budget:
        cum = np.cumsum(cost[order]) + have
        n = int(np.searchsorted(cum - cost[order], budget, side="left"))
        taken.append(order[:n])
        have = int(cum[n - 1]) if n else have
        if n < order.size:
            break
        order, _ = _sampling_order(domain, long, 1.0 / factor, rng)
    return np.concatenate(taken)


def select_documents(length: np.ndarray, domain: np.ndarray, spec: MixtureSpec) -> np.ndarray:
    """Indices of the selected documents (repeats for upsampled copies), in stream order.

    Args:
      length: int [D] tokens per document (without EOS).
      domain: int [D] domain index per document.
    Returns: int64 [S] document indices.
    """
    length = np.asarray(length, dtype=np.int64)
    domain = np.asarray(domain)
    if length.size == 0:
        raise InputError("no documents to select from")
    rng = np.random.default_rng(spec.seed)
    cost = length + 1
    if spec.kind == "upsample_long":
        sel = _sample_long(cost, domain, length > spec.long_threshold, spec.budget, spec.upsample_factor, rng)
        if sel.size == 0:  # only without a budget: no long document, and too few short ones to keep any
            raise InputError(f"upsample_long selects no documents: none of the {length.size} is longer than "
                             f"long_threshold {spec.long_threshold}, and a share 1/{spec.upsample_factor:g} of "
                             f"each domain's short ones rounds to none")
        return sel[rng.permutation(sel.size)].astype(np.int64)
    total = int(cost.sum())
    budget = total if spec.budget is None else int(spec.budget)
    factor = spec.upsample_factor if spec.kind == "upsample_repeat" else 1.0
    parts = []
    for d in np.unique(domain):
        idx = np.flatnonzero(domain == d)
        dom_cost = int(cost[idx].sum())
        quota = int(round(budget * dom_cost / total))
        if quota <= 0:
            continue
        parts.append(_take_domain(idx, cost, length[idx] > spec.long_threshold, quota, factor, rng))
    sel = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if sel.size == 0:
        raise InputError(f"the budget of {budget} tokens selects no documents")
    return sel[rng.permutation(sel.size)].astype(np.int64)


def mixture_table(length: np.ndarray, domain: np.ndarray, domains: list[str], selection: np.ndarray,
                  spec: MixtureSpec) -> dict[str, dict[str, Any]]:
    """Per domain: documents and tokens (incl. EOS) in the source and the selection, their shares
    ("mixture ratio" = share of documents, "token ratio" = share of tokens, as in the paper's
    appendix: the source's shares are the shares before, the selection's after), the documents selected
    more than once (`repeated_docs`: the extra copies), and the long documents' share of the domain's
    tokens (source, selected, expected)."""
    length = np.asarray(length, dtype=np.int64)
    cost = length + 1
    long = length > spec.long_threshold
    nd = len(domains)
    src_docs = np.bincount(domain, minlength=nd)
    src_tok = np.bincount(domain, weights=cost, minlength=nd)
    src_long = np.bincount(domain, weights=cost * long, minlength=nd)
    sd = domain[selection]
    sel_docs = np.bincount(sd, minlength=nd)
    sel_tok = np.bincount(sd, weights=cost[selection], minlength=nd)
    sel_long = np.bincount(sd, weights=(cost * long)[selection], minlength=nd)
    copies = np.bincount(selection, minlength=length.size)
    repeated = np.bincount(domain, weights=np.maximum(copies - 1, 0), minlength=nd)
    out = {}
    for i, name in enumerate(domains):
        L, S = src_long[i], src_tok[i] - src_long[i]
        if spec.kind == "upsample_long":
            expected = float(L / (L + S / spec.upsample_factor)) if (L + S) else 0.0
        else:
            factor = spec.upsample_factor if spec.kind == "upsample_repeat" else 1.0
            expected = float(factor * L / (factor * L + S)) if (L + S) else 0.0
        out[name] = {
            "source_docs": int(src_docs[i]),
            "source_tokens": int(src_tok[i]),
            "source_mixture_ratio": float(src_docs[i] / max(1, src_docs.sum())),
            "source_token_ratio": float(src_tok[i] / max(1.0, src_tok.sum())),
            "docs": int(sel_docs[i]),
            "tokens": int(sel_tok[i]),
            "mixture_ratio": float(sel_docs[i] / max(1, sel_docs.sum())),
            "token_ratio": float(sel_tok[i] / max(1.0, sel_tok.sum())),
            "source_long_share": float(L / src_tok[i]) if src_tok[i] else 0.0,
            "repeated_docs": int(repeated[i]),
            "long_share": float(sel_long[i] / sel_tok[i]) if sel_tok[i] else 0.0,
            "expected_long_share": expected,
        }
    return out
