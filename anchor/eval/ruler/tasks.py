"""RULER's task registry: upstream's templates (scripts/data/synthetic/constants.py) and its 13 task
configs (scripts/synthetic.yaml), as `FAMILIES` and `TASKS`; `task_config` looks a task up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from anchor_core.errors import InputError

Family = Literal["niah", "variable_tracking", "common_words_extraction", "freq_words_extraction", "qa"]
HaystackKind = Literal["essay", "noise", "needle"]
NeedleKind = Literal["words", "numbers", "uuids"]


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
