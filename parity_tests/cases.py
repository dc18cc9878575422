"""Parity cases: what is compared (model, variant, layout, policy, engine, length) and its inputs.

Legend: B windows, T slots, R tapped query rows.

A `Case` is a frozen value naming one cell of the matrix. `case_inputs(case)` builds its packed
batch with the real data pipeline (`anchor_core.data.Packer` and `make_batch`), from real text (the
`json` package's source, tokenized by the model's own tokenizer), so the data layouts the trainer
sees in training are the ones compared here:

  plain       documents back to back, cut at the window's end, the last window padded
  tags        each document preceded by its domain tag (docs/DESIGN.md §2 "domain tags")
  interleave  documents cut into chunks and shuffled, chunks keeping their document's id (a cut before
              each slot with probability 8 / T: `anchor_core.data.packing.Layout.mean_chunk`)

Random presets get short documents too (one and two tokens: masks break there). A pretrained
model (SmolLM2) gets documents of realistic length (>= 64 tokens): on random ids or very short
documents it is so ill-conditioned that transformers' own fp32 is 1e-5 from fp64 truth
(tests/jaxref/test_decoder_parity.py).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from anchor_core.data import Packer, TokenStore, make_batch, tag_text
from anchor_core.data.packing import Layout as PackLayout
from anchor_core.errors import InputError
from anchor_core.tokenizer import load_tokenizer
from anchor_core.variants import VARIANTS
from anchor_core.weights import load_spec as read_spec

Layout = Literal["plain", "tags", "interleave"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
RANDOM_MODELS: tuple[str, ...] = ("random:llama", "random:qwen2", "random:mistral", "random:qwen3")
DEFAULT_MODEL = "default"
SIZES: tuple[int, ...] = (97, 515, 1025)
# "bf16" in a case's policy means the oracle's emulation of the engine's own bf16 stack.
BF16 = "bf16"
DOMAINS: tuple[str, ...] = ("RedPajamaWikipedia", "RedPajamaGithub", "RedPajamaBook")


@dataclass(frozen=True)
class Case:
    """One parity case.

    model: a model name of docs/DESIGN.md §6 ("default", "random:llama", a folder, a .gguf file).
    variant: one of VARIANTS; layout: one of LAYOUTS.
    policy: "fp32" (trainer in float32) or the oracle bf16 preset the trainer in bfloat16 is held
      against ("hf_bf16", "fa2_bf16", "paper_bf16"), or "bf16": the engine runner's own emulation.
    engine: a runner name (every torchtrain engine, plus whatever `parity_tests.runners.register`
      added: sequence-parallel layouts, other kernels).
    seq_len: T; windows: B; seed: the document lengths and the interleaving.
    data: the model whose parity inputs (tokenizer, documents) the case is fed; default `model` (another
      name where `model` names no loadable model: a user's module, parity_tests.hf_stack).
    """

    model: str
    variant: str
    layout: str = "plain"
    policy: str = "fp32"
    engine: str = "eager"
    seq_len: int = 97
    windows: int = 0  # 0: 2 windows (the second padded) for random presets, 1 for pretrained models
    seed: int = 0
    data: str = ""

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise InputError(f"unknown attention variant {self.variant!r} (known: {', '.join(VARIANTS)})")
        if self.layout not in LAYOUTS:
            raise InputError(f"unknown data layout {self.layout!r} (known: {', '.join(LAYOUTS)})")
        if self.seq_len < 8:
            raise InputError(f"--seq-len must be at least 8, got {self.seq_len}")

    @property
    def is_random(self) -> bool:
        return (self.data or self.model).startswith("random:")

    @property
    def num_windows(self) -> int:
        return self.windows or (2 if self.is_random else 1)

    @property
    def data_key(self) -> tuple:
        """Cases with equal keys share their inputs (and the oracle's runs on them)."""
        return (self.data or self.model, self.variant, self.layout, self.seq_len, self.num_windows, self.seed)

    @property
    def id(self) -> str:
        variant = self.variant if self.layout == "plain" else f"{self.variant}+{self.layout}"
        return f"{self.model}/{variant}/{self.policy}/{self.engine}/T{self.seq_len}"


@dataclass(frozen=True)
class CaseInputs:
    """The packed batch of a case, int64 numpy [B, T] each (docs/DESIGN.md §1), and the tapped rows.

    real: bool [B, T], the non-padding slots (errors are measured there: a padding slot only
    attends to itself and is never trained on).
    rows: int [R] query slots whose attention logits and probabilities are compared.
    """

    tokens: np.ndarray
    doc_ids: np.ndarray
    positions: np.ndarray
    loss_mask: np.ndarray
    rows: tuple[int, ...] = field(default=())

    @property
    def real(self) -> np.ndarray:
        return self.doc_ids >= 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape  # type: ignore[return-value]


@functools.lru_cache(maxsize=4)
def _text_tokens(model: str) -> np.ndarray:
    """The json package's source, tokenized by the model's tokenizer: int64 [N]."""
    import json
    from pathlib import Path


    text = "".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    return np.asarray(load_tokenizer(model).encode_batch([text])[0], dtype=np.int64)


@functools.lru_cache(maxsize=8)
def load_spec(model: str):
    """The model's ModelSpec (reading a GGUF header takes seconds: once per model)."""
    return read_spec(model)


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    return load_tokenizer(model)


def _document_lengths(rng: np.random.Generator, total: int, short: bool) -> list[int]:
    """Lengths adding up to at least `total`: one- and two-token documents early (random presets),
    or >= 64 tokens each (pretrained models)."""
    lengths = [1, 2, int(rng.integers(3, 12)), 1] if short else []
    lo = 1 if short else 64
    hi = max(lo + 2, total // 3)
    while sum(lengths) < total:
        lengths.append(int(rng.integers(lo, hi)))
    return lengths


def tap_rows(doc_ids: np.ndarray, count: int = 8) -> tuple[int, ...]:
    """Query slots whose attention rows are compared: slots 0, 1 and T-1, first and last slots of
    documents of the first window (where masks and resets bite), spread over the window.

    Args: doc_ids int [B, T]. Returns up to `count` sorted slots.
    """
    doc = doc_ids[0]
    T = doc.shape[0]
    chosen = {0, 1, T - 1}
    starts = np.flatnonzero(np.r_[False, doc[1:] != doc[:-1]])
    for group in (starts, starts - 1):  # documents' first slots first, then the slots before them
        group = sorted({int(s) for s in group} - chosen)
        room = max(0, count - len(chosen))
        if len(group) > room:
            group = [group[int(i)] for i in np.linspace(0, len(group) - 1, room).round()] if room else []
        chosen |= set(group)
    chosen = sorted(chosen)
    for x in np.linspace(0, T - 1, count + 2)[1:-1].astype(int):
        if len(chosen) >= count:
            break
        chosen = sorted(set(chosen) | {int(x)})
    return tuple(chosen)


@functools.lru_cache(maxsize=16)
def case_inputs(case: Case) -> CaseInputs:
    """The packed batch of `case`, built by the real packer and batch maker. Cached per data key."""
    return _inputs(case.data_key)


@functools.lru_cache(maxsize=16)
def _inputs(key: tuple) -> CaseInputs:
    model, variant, layout, T, B, seed = key
    spec = load_spec(model)
    tok = _tokenizer(model)
    text = _text_tokens(model)
    rng = np.random.default_rng([seed, T, B])
    C = T - 1
    tags = layout == "tags"
    random_model = model.startswith("random:")
    tag_tokens = [tok.encode_batch([tag_text(d)])[0] for d in DOMAINS] if tags else None
    tag_len = max(len(t) for t in tag_tokens) if tag_tokens else 0
    # B windows, the last one about 3/4 full when B > 1 (padding at its end); one full window otherwise
    stream = (B - 1) * C + (int(0.75 * C) if B > 1 else C + 1)
    docs, domains, used = [], [], 0
    for n in _document_lengths(rng, stream, short=random_model):
        start = int(rng.integers(0, max(1, text.shape[0] - n)))
        docs.append(text[start:start + n] % spec.vocab_size)
        domains.append(int(rng.integers(0, len(DOMAINS))))
        used += n + 1 + (tag_len if tags else 0)
        if used >= stream:
            break
    if B > 1:  # trim the last document so the stream ends inside the last window
        over = used - stream
        if over > 0 and len(docs[-1]) > over:
            docs[-1] = docs[-1][: len(docs[-1]) - over]
    store = TokenStore.from_docs(docs, domains, list(DOMAINS))
    # interleave: the per-slot scheme (mean chunk T // 8 slots), not the default authors' chunking, which
    # cuts only documents of 64+ slots and would leave T = 97 nearly plain
    chunking = PackLayout(interleave=layout == "interleave", mean_chunk=max(2, T // 8))
    packer = Packer(store, np.arange(len(docs)), T, first_token=spec.first_token_id, eos=spec.eos_token_id,
                    tag_tokens=tag_tokens, layout=chunking, seed=seed)
    blocks = list(itertools.islice(packer.blocks(), 1))[0]
    tokens, seg, tag = blocks.tokens[:B], blocks.seg[:B], blocks.tag[:B]
    if tokens.shape[0] < B:
        raise AssertionError(f"packed {tokens.shape[0]} windows, wanted {B}")
    batch = make_batch(tokens, seg, tag, variant)
    doc_ids = batch.doc_ids.astype(np.int64)
    return CaseInputs(
        tokens=batch.tokens.astype(np.int64), doc_ids=doc_ids, positions=batch.positions.astype(np.int64),
        loss_mask=batch.loss_mask.astype(np.int64), rows=tap_rows(doc_ids),
    )


# The fast subset (`make test`): each variant, layout, policy kind, family and CPU engine at least once.
FAST_CASES: tuple[Case, ...] = (
    Case("random:llama", "full", "plain", "fp32", "eager", 97),
    Case("random:llama", "anchor", "tags", BF16, "sdpa", 97),
    Case("random:qwen2", "intra_doc", "interleave", "fp32", "flash_varlen_emulated", 97),
    Case("random:qwen2", "anchor", "interleave", BF16, "flash_varlen_emulated", 97),
    Case("random:mistral", "intra_doc_reset", "plain", BF16, "eager", 97),
    Case("random:mistral", "intra_doc_reset", "tags", "fp32", "sdpa", 97),
    Case("random:llama", "anchor", "interleave", BF16, "varlen", 97),
    Case("random:qwen2", "intra_doc", "plain", "fp32", "varlen", 97),
    Case("random:qwen3", "anchor", "tags", "fp32", "eager", 97),
    Case("random:qwen3", "intra_doc_reset", "interleave", BF16, "sdpa", 97),
)


def full_matrix() -> list[Case]:
    """The whole matrix (its own make target).

    Random presets at T=97: variant x layout x {fp32, bf16} x {eager, sdpa, flash_varlen_emulated}, plus
    flex and varlen on the plain layout. At T=515 and 1025: anchor with every layout and the other variants plain,
    x {fp32, bf16} x {sdpa, flash_varlen_emulated}. SmolLM2 ("default"): every variant at T=97 on eager
    and flash_varlen_emulated, anchor with tags/interleave, and fp32/bf16 cases at 515 and 1025 (its
    bf16 forward at 1025 takes minutes on a CPU without bf16 matmuls).
    """
    cases: list[Case] = []
    cpu = ("eager", "sdpa", "flash_varlen_emulated")
    for m in RANDOM_MODELS:
        for v in VARIANTS:
            for lay in LAYOUTS:
                cases += [Case(m, v, lay, p, e, 97) for p in ("fp32", BF16) for e in cpu]
            cases += [Case(m, v, "plain", p, e, 97) for p in ("fp32", BF16) for e in ("flex", "varlen")]
        for T in (515, 1025):
            for v, lay in [(v, "plain") for v in VARIANTS] + [("anchor", "tags"), ("anchor", "interleave")]:
                cases += [Case(m, v, lay, p, e, T) for p in ("fp32", BF16) for e in ("sdpa", "flash_varlen_emulated")]
    d = DEFAULT_MODEL
    for v in VARIANTS:
        cases += [Case(d, v, "plain", p, e, 97) for p in ("fp32", BF16) for e in ("eager", "flash_varlen_emulated")]
    cases += [Case(d, "anchor", lay, p, "sdpa", 97) for lay in ("tags", "interleave") for p in ("fp32", BF16)]
    cases += [Case(d, v, "plain", "fp32", "sdpa", 515) for v in VARIANTS]
    cases += [Case(d, "anchor", "plain", BF16, e, 515) for e in ("sdpa", "flash_varlen_emulated", "varlen")]
    cases += [Case(d, v, "plain", "fp32", "sdpa", 1025) for v in ("intra_doc_reset", "anchor")]
    cases += [Case(d, "anchor", "plain", BF16, "sdpa", 1025)]
    return cases
