"""RULER's scores on hand-made cases.

Upstream RULER's string_match_all / string_match_part (0-100, case-insensitive substring, rounded to
2 decimals) and lm-evaluation-harness's variants, including a case where their string_match_part
differ: a QA sample with two accepted answers of which the prediction holds one.
"""

from __future__ import annotations

import pytest

from anchor_core.errors import InputError
from anchor.eval.ruler import TASK_NAMES
from anchor.eval.scoring import (
    lm_eval_score,
    lm_eval_string_match_all,
    lm_eval_string_match_part,
    postprocess_pred,
    score,
    string_match_all,
    string_match_part,
    task_metric,
)

PREDS = ["The special magic numbers are 1234567 and 7654321.", "I do not know.", "paris, I think"]
REFS = [["1234567", "7654321", "1111111"], ["4242424"], ["Paris", "Lyon"]]


def test_string_match_all_counts_each_reference():
    # per sample: 2/3, 0, 1/2 of the references found
    expected = round((2 / 3 + 0 + 1 / 2) / 3 * 100, 2)
    got = string_match_all(PREDS, REFS)
    print(f"string_match_all {got} expected {expected}")
    assert got == expected == 38.89
    assert lm_eval_string_match_all(PREDS, REFS) == pytest.approx((2 / 3 + 1 / 2) / 3)


def test_string_match_part_needs_any_reference():
    # per sample: any found -> 1, 0, 1
    got = string_match_part(PREDS, REFS)
    print(f"string_match_part {got}")
    assert got == round(2 / 3 * 100, 2) == 66.67


def test_matching_is_case_insensitive_substring():
    assert string_match_all(["PARIS"], [["paris"]]) == 100.0
    assert string_match_all(["12345678"], [["1234567"]]) == 100.0  # a substring counts, as upstream
    assert string_match_all(["1234-567"], [["1234567"]]) == 0.0


def test_upstream_and_lm_eval_string_match_part_differ():
    """One QA sample, two accepted answers, the prediction holds one: RULER's string_match_part counts
    the sample (100), lm-eval's scores the fraction of answers found (0.5)."""
    preds, refs = ["Paris"], [["Paris", "Lyon"]]
    ruler_part, lm_part = string_match_part(preds, refs), lm_eval_string_match_part(preds, refs)
    print(f"RULER string_match_part {ruler_part}, lm-eval string_match_part {lm_part}")
    assert ruler_part == 100.0 and lm_part == 0.5
    assert score("qa_1", preds, refs) == 100.0 and lm_eval_score("qa_1", preds, refs) == 0.5
    # on several samples at once, lm-eval's function as written takes the best sample over N
    assert lm_eval_string_match_part(["Paris", "Rome"], [["Paris"], ["Rome"]]) == 0.5
    assert lm_eval_score("qa_1", ["Paris", "Rome"], [["Paris"], ["Rome"]]) == 1.0
    # with one reference per sample (HotpotQA) they agree
    assert score("qa_2", ["Paris", "x"], [["Paris"], ["Rome"]]) == 100 * lm_eval_score("qa_2", ["Paris", "x"],
                                                                                    [["Paris"], ["Rome"]])


def test_postprocess_as_upstream():
    assert postprocess_pred("  7654321\x00 and\tmore \n") == "7654321\n and\nmore"
    assert postprocess_pred("\n\n") == ""
    # the postprocessed prediction is what is matched: a control character can break a reference
    assert score("niah_single_1", ["12\t34"], [["12\t34"]]) == 0.0


@pytest.mark.parametrize("task", TASK_NAMES)
def test_score_picks_the_task_metric(task):
    metric = task_metric(task)
    assert metric == ("string_match_part" if task.startswith("qa_") else "string_match_all")
    refs = [["alpha", "beta"], ["gamma"]]
    assert score(task, [" alpha beta ", "GAMMA"], refs) == 100.0
    assert score(task, ["", ""], refs) == 0.0
    half = score(task, ["alpha", "gamma"], refs)
    print(f"{task}: {metric} of one of two references and one of one = {half}")
    assert half == (100.0 if metric == "string_match_part" else 75.0)
    assert lm_eval_score(task, ["alpha", "gamma"], refs) == 0.75  # lm-eval: the fraction, both metrics


def test_bad_input():
    with pytest.raises(InputError, match="one list of references per prediction"):
        string_match_all(["a", "b"], [["a"]])
    with pytest.raises(InputError, match="non-empty list of reference strings"):
        string_match_part(["a"], ["a"])
    with pytest.raises(InputError, match="at least one prediction"):
        score("vt", [], [])
    with pytest.raises(InputError, match="unknown RULER task"):
        score("ruler_vt", ["a"], [["a"]])
