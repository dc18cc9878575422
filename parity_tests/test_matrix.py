"""The parity matrix: each case passes the rule at every layer and tap (parity_tests.core).

The fast subset runs in `make test`; the whole matrix is marked `parity_full` and `slow`.
"""

from __future__ import annotations

import pytest

from parity_tests.cases import FAST_CASES, Case, full_matrix
from parity_tests.conftest import needs_smollm2
from parity_tests.suite import describe, run_case


def _param(case: Case, *marks) -> pytest.param:
    group = "-".join(str(k) for k in case.data_key)
    model = [pytest.mark.model, needs_smollm2] if not case.is_random else []
    return pytest.param(case, id=case.id.replace("/", "-"), marks=[pytest.mark.xdist_group(group), *model, *marks])


def _check(case: Case) -> None:
    result = run_case(case)
    print(describe(result))
    assert result["pass"], f"{case.id}: first divergence {result['first_divergence']}"


@pytest.mark.parametrize("case", [_param(c) for c in FAST_CASES])
def test_fast_case(case):
    _check(case)


@pytest.mark.parametrize("case", [_param(c, pytest.mark.slow, pytest.mark.parity_full) for c in full_matrix()])
def test_full_matrix(case):
    _check(case)
