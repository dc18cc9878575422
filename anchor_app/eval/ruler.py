"""RULER's 13 synthetic tasks, generated offline with the model's own tokenizer (issue 15, CONTRACT §9).

    tok = load_tokenizer("default")
    samples = generate("niah_single_2", 4096, tok, n_samples=50, seed=42)
    s = samples[0]
    s.prompt                     # s.input + s.answer_prefix: what the model reads
    s.answers                    # the references `anchor_app.eval.scoring.score` matches
    s.prompt_tokens + s.tokens_to_generate <= 4096

Follows NVIDIA/RULER (`scripts/synthetic.yaml`, `scripts/data/synthetic/{constants,niah,
variable_tracking,common_words_extraction,freq_words_extraction,qa}.py`): the same task configs,
templates, answer prefixes, answer budgets (`tokens_to_generate`), needle and value formats, few-shot
examples and answer sets. `TASKS` holds the 13 configs, `FAMILIES` the templates.

Lengths. As upstream, a prompt's length counts its tokens without special tokens (a BOS the caller
adds is not counted), the answer prefix included, plus the answer budget. Upstream binary-searches one
haystack size per task and length, then backs each sample off in steps of 5 to 500 units when it
overflows, so its prompts can fall short by a step. Here every sample's random draws (keys, values,
depths, chains, word lists, distractor documents) are fixed first, as a plan, and its own haystack
size is searched (a secant estimate, then galloping and bisection on the exact token count), so
`prompt_tokens + tokens_to_generate` is the largest that is <= `length`: within one haystack unit of
it. Units: essay words, noise paragraphs ("The grass is green. ..."), distractor needles, cwe list
words, fwe text words, qa documents.

Deviations from upstream, and why:
- Essay haystack (niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery): Paul Graham's
  essays are a download; the haystack is real prose from a local corpus instead. By default the
  embedded corpus (`anchor.data.corpus.default_corpus_documents`): its `prose` documents (the
  standard library's READMEs, NEWS and help pages), then its `docs` documents (the language
  reference topics `help()` shows), keeping only paragraphs of running text (at least 12 words, 80%
  of them plain words, one sentence end), about 410K characters, so prompts up to about 90K tokens
  never repeat text. `haystack=PATH` takes the user's text file, or JSONL with a "text" field, as is.
  As upstream, the haystack is a stream of words (whitespace normalised) from its start, repeated
  when a prompt needs more, split into sentences to place the needles between them; nltk's punkt is
  replaced by a regex splitter (a sentence ends at `.`, `!` or `?`, closing quotes or brackets
  allowed, before a word that starts with a capital, a digit or an opening quote).
- Words: upstream draws keys (`adjective-noun`) and cwe words from the `wonderwords` package, which
  is not installed; `anchor_app.eval.words` holds our own lists of common English adjectives (479), nouns
  (626) and verbs (485), so 300K keys. Where cwe needs more distinct words than the lists hold
  (upstream then switches to its 480K-word English dictionary; here from about 40K tokens on), it
  takes the distinct lowercase words of the whole embedded corpus as well (about 15K: English from
  its prose, docs and comments, and some standard-library identifiers), and those of a user haystack.
- qa_1/qa_2 read the SQuAD v2.0 dev JSON and the HotpotQA dev distractor JSON the user gives
  (`qa_data=`); upstream downloads them. Sample i asks question i, as upstream.
- Robustness where upstream leaves it to chance: keys of one sample are distinct and no distractor
  needle reuses a key of the sample; vt's variable names are distinct, and its few-shot example is
  renamed with one simultaneous substitution (upstream's successive `str.replace` can rename a name
  twice). Empty text between two needles at the same depth is not joined in (upstream joins an empty
  string, leaving a double space).
- Determinism: the draws of sample i come from `random.Random("ruler/<task>/<seed>/<i>")`, not from
  the length, so the samples of one seed at different lengths share keys, values and depths (paired
  comparisons across lengths); upstream's fixed-seed shuffles (needle order, cwe and fwe lists, qa
  documents) use `seed` as upstream uses `random_seed`.
"""

from __future__ import annotations

import json
import math
import numbers
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

from anchor.errors import InputError
from anchor_app.eval import words as word_lists
from anchor.tokenizer import Tok

Family = Literal["niah", "variable_tracking", "common_words_extraction", "freq_words_extraction", "qa"]
HaystackKind = Literal["essay", "noise", "needle"]
NeedleKind = Literal["words", "numbers", "uuids"]


# ---------------------------------------------------------------------------------------------
# Upstream's templates (scripts/data/synthetic/constants.py) and task configs (scripts/synthetic.yaml)


@dataclass(frozen=True)
class FamilyTemplate:
    """A task family's prompt template, answer prefix and answer budget, as upstream's `TASKS`."""

    tokens_to_generate: int
    template: str
    answer_prefix: str


FAMILIES: dict[Family, FamilyTemplate] = {
    "niah": FamilyTemplate(
        tokens_to_generate=128,
        template="""Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?""",
        answer_prefix=""" The special magic {type_needle_v} for {query} mentioned in the provided text are""",
    ),
    "variable_tracking": FamilyTemplate(
        tokens_to_generate=30,
        template="""Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.""",
        # upstream's typo "assgined" kept: the prompt is RULER's, byte for byte
        answer_prefix=""" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined the value {query}, they are: """,
    ),
    "common_words_extraction": FamilyTemplate(
        tokens_to_generate=120,
        template="""Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?""",
        answer_prefix=""" Answer: The top 10 words that appear most often in the list are:""",
    ),
    "freq_words_extraction": FamilyTemplate(
        tokens_to_generate=50,
        template="""Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?""",
        answer_prefix=""" Answer: According to the coded text above, the three most frequently appeared words are:""",
    ),
    "qa": FamilyTemplate(
        tokens_to_generate=32,
        template="""Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}""",
        answer_prefix=""" Answer:""",
    ),
}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT_PROMPT = "Document {i}:\n{document}"
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


@dataclass(frozen=True)
class NiahArgs:
    type_haystack: HaystackKind
    type_needle_k: NeedleKind
    type_needle_v: NeedleKind
    num_needle_k: int
    num_needle_v: int
    num_needle_q: int


@dataclass(frozen=True)
class VtArgs:
    num_chains: int
    num_hops: int
    type_haystack: Literal["noise"] = "noise"


@dataclass(frozen=True)
class CweArgs:
    freq_cw: int
    freq_ucw: int
    num_cw: int
    num_fewshot: int = 1  # upstream's default


@dataclass(frozen=True)
class FweArgs:
    alpha: float
    coded_wordlen: int = 6  # upstream's defaults
    vocab_size: int = -1  # -1: (length - tokens_to_generate) // 50


@dataclass(frozen=True)
class QaArgs:
    dataset: Literal["squad", "hotpotqa"]


@dataclass(frozen=True)
class TaskConfig:
    """One entry of upstream's `synthetic.yaml`: a family and its arguments."""

    family: Family
    args: NiahArgs | VtArgs | CweArgs | FweArgs | QaArgs

    @property
    def template(self) -> FamilyTemplate:
        return FAMILIES[self.family]


TASKS: dict[str, TaskConfig] = {
    "niah_single_1": TaskConfig("niah", NiahArgs("noise", "words", "numbers", 1, 1, 1)),
    "niah_single_2": TaskConfig("niah", NiahArgs("essay", "words", "numbers", 1, 1, 1)),
    "niah_single_3": TaskConfig("niah", NiahArgs("essay", "words", "uuids", 1, 1, 1)),
    "niah_multikey_1": TaskConfig("niah", NiahArgs("essay", "words", "numbers", 4, 1, 1)),
    "niah_multikey_2": TaskConfig("niah", NiahArgs("needle", "words", "numbers", 1, 1, 1)),
    "niah_multikey_3": TaskConfig("niah", NiahArgs("needle", "uuids", "uuids", 1, 1, 1)),
    "niah_multivalue": TaskConfig("niah", NiahArgs("essay", "words", "numbers", 1, 4, 1)),
    "niah_multiquery": TaskConfig("niah", NiahArgs("essay", "words", "numbers", 1, 1, 4)),
    "vt": TaskConfig("variable_tracking", VtArgs(num_chains=1, num_hops=4)),
    "cwe": TaskConfig("common_words_extraction", CweArgs(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": TaskConfig("freq_words_extraction", FweArgs(alpha=2.0)),
    "qa_1": TaskConfig("qa", QaArgs("squad")),
    "qa_2": TaskConfig("qa", QaArgs("hotpotqa")),
}
TASK_NAMES = tuple(TASKS)


@dataclass(frozen=True)
class QaSource:
    """What a QA task reads, for the message when it is missing."""

    dataset: str
    file: str  # the file's usual name
    option: str  # the `anchor eval` option that names it


QA_SOURCES: dict[str, QaSource] = {
    "qa_1": QaSource("SQuAD v2.0 dev", "dev-v2.0.json", "--squad"),
    "qa_2": QaSource("HotpotQA dev distractor", "hotpot_dev_distractor_v1.json", "--hotpotqa"),
}


def task_config(task: str) -> TaskConfig:
    """The config of a RULER task; an unknown name is an InputError listing the valid ones."""
    try:
        return TASKS[task]
    except (KeyError, TypeError):
        raise InputError(f"unknown RULER task {task!r} (valid: {', '.join(TASK_NAMES)})") from None


# ---------------------------------------------------------------------------------------------
# Samples


@dataclass(frozen=True)
class Sample:
    """One RULER prompt: the model reads `input + answer_prefix` and may write `tokens_to_generate`.

    `prompt_tokens` counts the tokens of `input + answer_prefix` (no special tokens);
    `haystack_size` is the number of haystack units the prompt holds (see the module docstring).
    """

    task: str
    length: int
    index: int
    input: str
    answer_prefix: str
    answers: list[str]
    tokens_to_generate: int
    prompt_tokens: int
    haystack_size: int

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix

    def record(self) -> dict:
        """The sample as a JSON-able dict (the fields `samples.jsonl` holds, CONTRACT §9, and more)."""
        return asdict(self)


@dataclass(frozen=True)
class _Rendered:
    input: str
    answer_prefix: str


@dataclass
class _Plan:
    """A sample's random draws; `render(n)` builds its prompt with n haystack units."""

    answers: list[str]
    render: Callable[[int], _Rendered]
    lo: int  # the fewest units a prompt can hold
    hi: int | None = None  # the most (None: unbounded)


def generate(task: str, length: int, tokenizer: Tok, n_samples: int, seed: int = 42,
             haystack: str | Path | None = None, qa_data: str | Path | None = None) -> list[Sample]:
    """`n_samples` prompts of a RULER task that fill `length` tokens, answer budget included.

    Args:
      task: one of `TASK_NAMES`.
      length: the target length in tokens (prompt + answer budget).
      tokenizer: the model's tokenizer (`anchor.tokenizer.load_tokenizer`).
      n_samples: how many samples.
      seed: the random seed; the same arguments give the same samples.
      haystack: the essay tasks' prose: a text file or JSONL with a "text" field; None: the embedded
        corpus' prose. cwe adds its words when it needs more than `anchor_app.eval.words` holds.
      qa_data: qa_1: SQuAD v2.0 dev JSON; qa_2: HotpotQA dev distractor JSON.

    Returns one `Sample` per index, each with `prompt_tokens + tokens_to_generate <= length` and as
    large as its haystack allows (within one haystack unit of `length`).
    """
    cfg = task_config(task)
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length <= 0:
        raise InputError(f"a RULER length must be a positive integer, got {length!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 0:
        raise InputError(f"the number of samples must be a non-negative integer, got {n_samples!r}")
    length, n_samples = int(length), int(n_samples)
    budget = cfg.template.tokens_to_generate
    limit = length - budget

    def count(text: str) -> int:
        return len(tokenizer.encode_batch([text])[0])

    planner = _planner(task, cfg, length, seed, count, haystack, qa_data, n_samples)
    samples: list[Sample] = []
    start: int | None = None
    for i in range(n_samples):
        plan = planner(random.Random(f"ruler/{task}/{seed}/{i}"), i)
        memo: dict[int, int] = {}

        def tokens(n: int, plan: _Plan = plan, memo: dict[int, int] = memo) -> int:
            if n not in memo:
                r = plan.render(n)
                memo[n] = count(r.input + r.answer_prefix)
            return memo[n]

        n = _fit(tokens, limit, plan.lo, plan.hi, start)
        if n is None:
            raise InputError(f"RULER task {task} does not fit in {length} tokens: its prompt with the "
                             f"least haystack takes {tokens(plan.lo)} tokens and its answer {budget}")
        start = n
        r = plan.render(n)
        samples.append(Sample(task=task, length=length, index=i, input=r.input,
                              answer_prefix=r.answer_prefix, answers=list(plan.answers),
                              tokens_to_generate=budget, prompt_tokens=tokens(n), haystack_size=n))
    return samples


def _fit(tokens: Callable[[int], int], limit: int, lo: int, hi: int | None, start: int | None) -> int | None:
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


def _planner(task: str, cfg: TaskConfig, length: int, seed: int, count: Callable[[str], int],
             haystack: str | Path | None, qa_data: str | Path | None,
             n_samples: int) -> Callable[[random.Random, int], _Plan]:
    """`plan(rng, index)` for a task: the family's draws for one sample."""
    a = cfg.args
    if isinstance(a, NiahArgs):
        hay = load_haystack(haystack) if a.type_haystack == "essay" else None
        return lambda rng, i: _niah_plan(a, rng, seed, hay)
    if isinstance(a, VtArgs):
        icl = _vt_icl_example(a, random.Random(f"ruler/{task}/{seed}/icl"), count)
        return lambda rng, i: _vt_plan(a, rng, icl)
    if isinstance(a, CweArgs):
        return _cwe_planner(a, length, seed, count, haystack)
    if isinstance(a, FweArgs):
        vocab_size = (length - cfg.template.tokens_to_generate) // 50 if a.vocab_size == -1 else a.vocab_size
        return lambda rng, i: _fwe_plan(a, rng, seed, vocab_size)
    qas, docs = load_qa(task, qa_data)
    if n_samples > len(qas):
        raise InputError(f"{task}: the file holds {len(qas)} answerable questions, {n_samples} samples "
                         "were asked for", path=qa_data)
    return lambda rng, i: _qa_plan(qas[i], docs, rng, seed)


# ---------------------------------------------------------------------------------------------
# Keys, values and words


@lru_cache(maxsize=1)
def key_words() -> tuple[str, ...]:
    """niah's word keys: every `adjective-noun` pair of `anchor_app.eval.words`, sorted (upstream's from
    wonderwords' lists)."""
    adjs, nouns = word_lists.ADJECTIVES.split(), word_lists.NOUNS.split()
    return tuple(sorted({f"{a}-{n}" for a in adjs for n in nouns}))


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """cwe's words: the nouns, adjectives and verbs of `anchor_app.eval.words`, sorted and distinct."""
    return tuple(sorted(set(word_lists.NOUNS.split() + word_lists.ADJECTIVES.split()
                            + word_lists.VERBS.split())))


def _random_value(kind: NeedleKind, rng: random.Random) -> str:
    """A key or value as upstream: a 7-digit number, an `adjective-noun` word, or a version-4 UUID."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(key_words())
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# ---------------------------------------------------------------------------------------------
# Haystacks

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
    from anchor.data.corpus import default_corpus_documents

    by_domain: dict[str, list[str]] = {d: [] for d in HAYSTACK_DOMAINS}
    for doc in default_corpus_documents():
        if doc["domain"] in by_domain:
            by_domain[doc["domain"]] += [p for p in re.split(r"\n\s*\n", doc["text"]) if _is_running_text(p)]
    paragraphs = [p for d in HAYSTACK_DOMAINS for p in by_domain[d]]
    return Haystack.from_text("\n\n".join(paragraphs), "the embedded corpus' prose")


@lru_cache(maxsize=4)
def _file_haystack(path: str, mtime_ns: int, size: int) -> Haystack:
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"unreadable haystack: {e}", path=p) from None
    if p.suffix.lower() == ".jsonl":
        texts = []
        for k, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise InputError(f"line {k} is not JSON: {e}", path=p) from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise InputError(f"line {k} has no string field \"text\"", path=p)
            texts.append(rec["text"])
        raw = "\n\n".join(texts)
    return Haystack.from_text(raw, str(p))


def load_haystack(path: str | Path | None = None) -> Haystack:
    """The essay haystack: the embedded corpus' prose (None), or a text / JSONL ("text") file."""
    if path is None:
        return _default_haystack()
    p = Path(path)
    if not p.is_file():
        raise InputError("no such haystack file (a text file, or JSONL with a \"text\" field)", path=p)
    st = p.stat()
    return _file_haystack(str(p.resolve()), st.st_mtime_ns, st.st_size)


# ---------------------------------------------------------------------------------------------
# niah (scripts/data/synthetic/niah.py)


def _niah_template(a: NiahArgs) -> tuple[str, str, str]:
    """(template, answer prefix, value type) with upstream's singular wording for one answer."""
    t = FAMILIES["niah"]
    template, prefix, type_v = t.template, t.answer_prefix, a.type_needle_v
    if a.num_needle_q * a.num_needle_v == 1:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = type_v[:-1]  # remove "s"
    return template, prefix, type_v


def _niah_plan(a: NiahArgs, rng: random.Random, seed: int, hay: Haystack | None) -> _Plan:
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

    def render(n: int) -> _Rendered:
        return _Rendered(template.format(type_needle_v=type_v, context=context(n), query=query), rendered_prefix)

    return _Plan(answers=answers, render=render, lo=lo)


class _Distractors:
    """The needle haystack: needles with other keys and values, drawn in order as far as needed."""

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


# ---------------------------------------------------------------------------------------------
# vt (scripts/data/synthetic/variable_tracking.py)


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


def _vt_render(chains: list[list[str]], num_hops: int, positions_seed: int, n: int) -> _Rendered:
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
    return _Rendered(t.template.format(context=context, query=value, num_v=num_hops + 1),
                     t.answer_prefix.format(num_v=num_hops + 1, query=value))


def _vt_icl_example(a: VtArgs, rng: random.Random, count: Callable[[str], int]) -> str:
    """Upstream's few-shot example: a vt prompt of at most 500 tokens (3-letter names, value 12345),
    its answer prefix and its answer, then a newline."""
    num_hops = min(10, a.num_hops)
    variables, chains = _vt_chains(a.num_chains, a.num_hops, rng, is_icl=True)
    positions_seed = rng.getrandbits(64)

    def text(n: int) -> str:
        r = _vt_render(chains, num_hops, positions_seed, n)
        return r.input + r.answer_prefix

    lo = (num_hops + 1) * a.num_chains
    n = _fit(lambda n: count(text(n)), 500, lo, None, None)
    n = lo if n is None else n  # as upstream: the least haystack when none fits (byte-level tokenizers)
    return text(n) + " " + " ".join(variables[0]) + "\n"


def _vt_plan(a: VtArgs, rng: random.Random, icl: str) -> _Plan:
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

    def render(n: int) -> _Rendered:
        r = _vt_render(chains, a.num_hops, positions_seed, n)
        return _Rendered(example + "\n" + r.input, r.answer_prefix)

    return _Plan(answers=list(variables[0]), render=render, lo=(a.num_hops + 1) * a.num_chains)


# ---------------------------------------------------------------------------------------------
# cwe (scripts/data/synthetic/common_words_extraction.py)


def _cwe_planner(a: CweArgs, length: int, seed: int, count: Callable[[str], int],
                 haystack: str | Path | None) -> Callable[[random.Random, int], _Plan]:
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
    from anchor.data.corpus import default_corpus_documents

    found: set[str] = set()
    for doc in default_corpus_documents():
        found.update(re.findall(r"\b[a-z]{3,12}\b", doc["text"]))
    return tuple(sorted(found))


def _cwe_example(words: Sequence[str], common_repeats: int, uncommon_repeats: int, num_cw: int,
                 seed: int) -> tuple[str, list[str]]:
    """Upstream's get_example on drawn words: the numbered list and its `num_cw` common words."""
    common, uncommon = list(words[:num_cw]), list(words[num_cw:])
    word_list = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(word_list)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common


def _cwe_plan(a: CweArgs, length: int, seed: int, rng: random.Random, pool: Sequence[str]) -> _Plan:
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

    def render(n: int) -> _Rendered:
        ctx, _ = _cwe_example(order[:n], *main_reps, a.num_cw, seed)
        return _Rendered(few_shots + "\n" + t.template.format(num_cw=a.num_cw, context=ctx, query=""),
                         t.answer_prefix)

    return _Plan(answers=answers, render=render, lo=a.num_cw, hi=len(pool))


# ---------------------------------------------------------------------------------------------
# fwe (scripts/data/synthetic/freq_words_extraction.py)


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin: 1000 terms and the tail's first corrections)."""
    n = 1000
    head = math.fsum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def _fwe_plan(a: FweArgs, rng: random.Random, seed: int, vocab_size: int) -> _Plan:
    t = FAMILIES["freq_words_extraction"]
    vocab = {"".join(rng.choices(string.ascii_lowercase, k=a.coded_wordlen)) for _ in range(vocab_size)}
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=a.coded_wordlen)))
    words = sorted(vocab)
    random.Random(seed).shuffle(words)
    words[0] = "..."  # the top ranked is noise
    weights = np.arange(1, len(words) + 1, dtype=np.float64) ** -a.alpha / zeta(a.alpha)

    def render(n: int) -> _Rendered:
        counts = (n * weights).astype(int)
        text = [w for w, c in zip(words, counts) for _ in range(c)]
        random.Random(seed).shuffle(text)
        return _Rendered(t.template.format(context=" ".join(text), query=""), t.answer_prefix)

    return _Plan(answers=words[1:4], render=render, lo=1)


# ---------------------------------------------------------------------------------------------
# qa (scripts/data/synthetic/qa.py)


@dataclass(frozen=True)
class QA:
    query: str
    outputs: list[str]
    context: list[int]  # indices into the documents: the gold ones
    more_context: list[int] = field(default_factory=list)  # SQuAD: the article's other paragraphs


def _read_squad(data: object, path: Path) -> tuple[list[QA], list[str]]:
    try:
        articles = data["data"]  # type: ignore[index]
        docs = sorted({p["context"] for d in articles for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in articles:
            more = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                gold = index[p["context"]]
                for q in p["qas"]:
                    if not q["is_impossible"]:
                        qas.append(QA(q["question"], [x["text"] for x in q["answers"]], [gold],
                                      [i for i in more if i != gold]))
    except (KeyError, TypeError) as e:
        raise InputError(f"not SQuAD v2.0 JSON (data / paragraphs / context / qas / question / "
                         f"answers / is_impossible): missing {e}", path=path) from None
    return qas, docs


def _read_hotpotqa(data: object, path: Path) -> tuple[list[QA], list[str]]:
    try:
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})  # type: ignore[union-attr]
        index = {c: i for i, c in enumerate(docs)}
        qas = [QA(d["question"], [d["answer"]], [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]])
               for d in data]  # type: ignore[union-attr]
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"not HotpotQA JSON (a list of question / answer / context [title, sentences]): "
                         f"{type(e).__name__} {e}", path=path) from None
    return qas, docs


@lru_cache(maxsize=4)
def _load_qa_file(dataset: str, path: str, mtime_ns: int, size: int) -> tuple[list[QA], list[str]]:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"unreadable QA file: {e}", path=p) from None
    qas, docs = _read_squad(data, p) if dataset == "squad" else _read_hotpotqa(data, p)
    if not qas:
        raise InputError("the QA file holds no answerable question", path=p)
    return qas, docs


def load_qa(task: str, path: str | Path | None) -> tuple[list[QA], list[str]]:
    """(questions, documents) of qa_1 (SQuAD v2.0 dev) or qa_2 (HotpotQA dev distractor), read as
    upstream: documents distinct and sorted, SQuAD's unanswerable questions left out."""
    a = task_config(task).args
    assert isinstance(a, QaArgs), task
    src = QA_SOURCES[task]
    if path is None:
        raise InputError(f"{task} needs the {src.dataset} JSON ({src.file}): pass its path with {src.option} "
                         "(qa_data= in Python)")
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{task} needs the {src.dataset} JSON ({src.file}); no such file", path=p)
    st = p.stat()
    return _load_qa_file(a.dataset, str(p.resolve()), st.st_mtime_ns, st.st_size)


def _qa_plan(qa: QA, docs: Sequence[str], rng: random.Random, seed: int) -> _Plan:
    t = FAMILIES["qa"]
    more = rng.sample(qa.more_context, len(qa.more_context))
    taken = set(qa.context) | set(qa.more_context)
    extra: list[int] = []  # distinct other documents, drawn in order as far as needed

    def documents(n: int) -> list[str]:
        if n >= len(docs):
            return [docs[i % len(docs)] for i in range(n)]  # upstream repeats all documents
        if n - len(qa.context) > len(more):
            while len(extra) < n - len(qa.context) - len(more):
                i = rng_extra.randrange(len(docs))
                if i not in taken:
                    taken.add(i)
                    extra.append(i)
            chosen = qa.context + more + extra[:n - len(qa.context) - len(more)]
        else:
            chosen = qa.context + more[:n - len(qa.context)]
        return [docs[i] for i in chosen]

    rng_extra = random.Random(rng.getrandbits(64))

    def render(n: int) -> _Rendered:
        chosen = documents(n)
        random.Random(seed).shuffle(chosen)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        return _Rendered(t.template.format(context=context, query=qa.query), t.answer_prefix)

    return _Plan(answers=list(qa.outputs), render=render, lo=len(qa.context))


__all__ = [
    "DEPTHS", "FAMILIES", "NEEDLE", "NOISE", "QA_SOURCES", "TASKS", "TASK_NAMES", "FamilyTemplate",
    "Haystack", "Sample", "TaskConfig", "cwe_words", "generate", "key_words", "load_haystack", "load_qa",
    "task_config",
]

