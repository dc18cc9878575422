"""qa_1 / qa_2: question answering over documents (upstream's scripts/data/synthetic/qa.py): SQuAD v2.0
dev or HotpotQA dev distractor, the gold documents among others from the same file."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from anchor_core.errors import InputError
from anchor.eval.ruler.common import Plan, Rendered
from anchor.eval.ruler.tasks import DOCUMENT_PROMPT, FAMILIES, QA_SOURCES, QaArgs, task_config


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


def qa_plan(qa: QA, docs: Sequence[str], rng: random.Random, seed: int) -> Plan:
    t = FAMILIES["qa"]
    more = rng.sample(qa.more_context, len(qa.more_context))
    taken = set(qa.context) | set(qa.more_context)
    extra: list[int] = []  # distinct other documents, taken in order as far as needed

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

    def render(n: int) -> Rendered:
        chosen = documents(n)
        random.Random(seed).shuffle(chosen)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
        return Rendered(t.template.format(context=context, query=qa.query), t.answer_prefix)

    return Plan(answers=list(qa.outputs), render=render, lo=len(qa.context))
