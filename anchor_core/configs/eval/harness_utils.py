"""Helpers of the local lm-eval task YAMLs in this folder (`!function harness_utils.<name>`).

They reuse lm-eval's own code where it imports without extras (HellaSwag's preprocessing, LongBench's
prompts) and copy LongBench's QA F1, so a local file scores as lm-eval's hub task does.
"""

from __future__ import annotations

from pathlib import Path

LONGBENCH_QA = ("hotpotqa", "2wikimqa", "musique")  # multi-document QA: QA F1, 32 tokens


def hellaswag_process_docs(dataset):
    """lm-eval's HellaSwag preprocessing: query, choices, gold from activity_label, ctx_a/b, endings, label."""
    from lm_eval.tasks.hellaswag.utils import process_docs

    return process_docs(dataset)


def _longbench_prompt(subset: str) -> str:
    """The doc_to_text Jinja template of lm-eval's `longbench_<subset>` task."""
    import lm_eval
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    text = (Path(lm_eval.__file__).parent / "tasks" / "longbench" / f"{subset}.yaml").read_text(encoding="utf-8")
    return yaml.load(text, Loader=_Loader)["doc_to_text"]


def longbench_process_docs(dataset):
    """THUDM/LongBench rows (input, context, answers, dataset) -> + `prompt`, lm-eval's prompt of the subset."""
    import jinja2

    bad = sorted(set(dataset["dataset"]) - set(LONGBENCH_QA))
    if bad:
        raise ValueError(f"longbench_local runs the subsets {', '.join(LONGBENCH_QA)}; the file holds {', '.join(bad)}")
    templates = {s: jinja2.Template(_longbench_prompt(s)) for s in LONGBENCH_QA}
    return dataset.map(lambda d: {"prompt": templates[d["dataset"]].render(question=d["input"], context=d["context"])})


def _normalize_answer(s: str) -> str:
    """LongBench's normalize_answer: lower case, no punctuation, no articles, single spaces."""
    import re
    import string

    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _qa_f1(prediction: str, ground_truth: str) -> float:
    """LongBench's qa_f1_score: token-level F1 of the normalised strings."""
    from collections import Counter

    pred, truth = _normalize_answer(prediction).split(), _normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def longbench_process_results(doc, results):
    """LongBench's QA F1 (`score`, 0-1): the best over the row's answers of the prediction's F1.

    A copy of lm_eval/tasks/longbench/metrics.py `get_qa_f1_with_score` (from THUDM/LongBench), whose
    module imports jieba, fuzzywuzzy and rouge (lm-eval's `longbench` extra) even for English QA."""
    prediction = results[0].strip()
    return {"score": max([_qa_f1(prediction, a) for a in doc["answers"]] + [0.0])}
