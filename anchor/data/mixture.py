"""Document mixtures to a token budget: `original` and `upsample_long` (Fu et al. 2024).

    sel = select_documents(store.length, store.domain, MixtureSpec("upsample_long", budget=2_000_000_000))

Both keep each domain's share of tokens as in the source: domain `d` gets a quota
`budget * tokens_d / tokens`, where a document counts `length + 1` tokens (its EOS). Within a
domain, documents are drawn in passes; a pass holds every document once, in a fresh random
order, and under `upsample_long` a document longer than `long_threshold` tokens `upsample_factor`
times (a fractional factor adds the last copy with that probability). Passes are taken until the
quota is reached, so the long documents' share of a domain's tokens rises from `L / (L + S)` to
about `r L / (r L + S)` (L, S: tokens in long and short documents, r: the factor), while the
domain's share of the whole stays put. The selection is then shuffled as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from anchor.errors import InputError

Mixture = Literal["original", "upsample_long"]
MIXTURES: tuple[str, ...] = get_args(Mixture)


@dataclass(frozen=True)
class MixtureSpec:
    kind: Mixture = "original"
    budget: int | None = None  # tokens incl. one EOS per document; None: the source's size
    long_threshold: int = 4096  # tokens; documents longer than this are "long"
    upsample_factor: float = 4.0  # copies of a long document per pass (upsample_long only)
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
    total = int(cost.sum())
    budget = total if spec.budget is None else int(spec.budget)
    factor = spec.upsample_factor if spec.kind == "upsample_long" else 1.0
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
    appendix), and the long documents' share of the domain's tokens (source, selected, expected)."""
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
    factor = spec.upsample_factor if spec.kind == "upsample_long" else 1.0
    out = {}
    for i, name in enumerate(domains):
        L, S = src_long[i], src_tok[i] - src_long[i]
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
            "long_share": float(sel_long[i] / sel_tok[i]) if sel_tok[i] else 0.0,
            "expected_long_share": float(factor * L / (factor * L + S)) if (L + S) else 0.0,
        }
    return out
