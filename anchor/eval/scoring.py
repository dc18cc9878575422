"""RULER's scores (docs/DESIGN.md §9): string-match-all for every task but QA, string-match-part for QA.

    score("niah_single_1", ["... is 1234567."], [["1234567"]])      # 100.0
    score("qa_1", ["Paris"], [["Paris", "Lyon"]])                    # 100.0 (any accepted answer)

Upstream RULER (scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py), per task, over N
samples with prediction p_i and references R_i, matching case-insensitively as substrings:

    string_match_all  = round(100 / N * sum_i |{r in R_i : r in p_i}| / |R_i|, 2)
    string_match_part = round(100 / N * sum_i max_{r in R_i} [r in p_i], 2)

after `postprocess_pred` (strip; control characters become newlines; strip). RULER's evaluation does
nothing else to a prediction (no cut after the answer): the generation budget bounds it.

lm-evaluation-harness (lm_eval/tasks/ruler/common_utils.py) keeps string_match_all (on a 0-1 scale)
but its string_match_part is another function:

    lm_eval_string_match_part = max_i (|{r in R_i : r in p_i}| / |R_i|) / N     (0-1)

It is called once per sample (N = 1) and the per-sample values are averaged, so a sample scores the
fraction of its references found, not 1 when any is found: for the references ["Paris", "Lyon"] and
the prediction "Paris", RULER's string_match_part gives 100 and lm-eval's 0.5. The two agree when
every sample has one reference (HotpotQA) and differ on SQuAD questions with several accepted answers
that are not substrings of one another.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from anchor_core.errors import InputError
from anchor.eval.ruler import task_config

Metric = Literal["string_match_all", "string_match_part"]
_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """RULER's `postprocess_pred`: strip, control characters (\\x00-\\x1f) to newlines, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _found(prediction: str, refs: Sequence[str]) -> list[float]:
    p = prediction.lower()
    return [1.0 if r.lower() in p else 0.0 for r in refs]


def _check(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if isinstance(preds, str) or len(preds) != len(refs):
        raise InputError(f"scoring needs one list of references per prediction, got {len(refs)} for "
                         f"{1 if isinstance(preds, str) else len(preds)} predictions")
    if not preds:
        raise InputError("scoring needs at least one prediction")
    if any(isinstance(r, str) or len(r) == 0 for r in refs):
        raise InputError("every prediction needs a non-empty list of reference strings")


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_all (0-100, rounded to 2 decimals): the mean over samples of the fraction
    of references found in the prediction."""
    _check(preds, refs)
    score = sum(sum(_found(p, r)) / len(r) for p, r in zip(preds, refs)) / len(preds) * 100
    return round(score, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_part (0-100, rounded to 2 decimals): the share of samples where any
    reference is found in the prediction."""
    _check(preds, refs)
    score = sum(max(_found(p, r)) for p, r in zip(preds, refs)) / len(preds) * 100
    return round(score, 2)


def lm_eval_string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """lm-eval's string_match_all: RULER's on a 0-1 scale, unrounded."""
    _check(preds, refs)
    return sum(sum(_found(p, r)) / len(r) for p, r in zip(preds, refs)) / len(preds)


def lm_eval_string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """lm-eval's string_match_part, as written there (0-1): the largest fraction of references found
    over the samples, divided by the number of samples. lm-eval calls it with one sample at a time,
    where it is that sample's fraction of references found."""
    _check(preds, refs)
    return max(sum(_found(p, r)) / len(r) for p, r in zip(preds, refs)) / len(preds)


def lm_eval_score(task: str, predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """A task's score as lm-eval computes it (0-1): postprocessed, each sample scored alone with its
    metric (`process_results` / `process_results_part`), then averaged."""
    metric = lm_eval_string_match_part if task_metric(task) == "string_match_part" else lm_eval_string_match_all
    _check(predictions, answers)
    per = [metric([postprocess_pred(p)], [a]) for p, a in zip(predictions, answers)]
    return sum(per) / len(per)


def task_metric(task: str) -> Metric:
    """The metric of a RULER task: string_match_part for QA, string_match_all otherwise."""
    return "string_match_part" if task_config(task).family == "qa" else "string_match_all"


def score(task: str, predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """A task's RULER score (0-100) over samples, as upstream's evaluate.py: predictions postprocessed,
    then the task's metric (`task_metric`)."""
    metric = string_match_part if task_metric(task) == "string_match_part" else string_match_all
    return metric([postprocess_pred(p) for p in predictions], answers)


__all__ = [
    "lm_eval_score", "lm_eval_string_match_all", "lm_eval_string_match_part", "postprocess_pred",
    "score", "string_match_all", "string_match_part", "task_metric",
]
