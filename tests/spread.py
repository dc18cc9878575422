"""Which cases of a product of factors `make test` runs: a diagonal through the product, so that every value of
every factor is tried at least once, the other combinations marked `slow` (`make test-all` runs the whole product).

A bug tied to one value of one factor (a preset, a variant, an engine) fails `make test`; a bug that needs two
values together fails where the diagonal holds that pair, and always under `make test-all`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest


def on_the_diagonal(factors: Sequence[Sequence[Any]]) -> set[tuple[Any, ...]]:
    """The combinations k = 0, 1, ... of (factor_0[k mod n_0], factor_1[k mod n_1], ...) for as many k as the
    longest factor has values: each value of each factor appears in at least one."""
    longest = max(len(f) for f in factors)
    return {tuple(f[k % len(f)] for f in factors) for k in range(longest)}


def product_cases(*factors: Sequence[Any], ids: Callable[..., str] | None = None,
                  marks: Sequence[Any] = ()) -> list[Any]:
    """Every combination of `factors` as a `pytest.param`, those off the diagonal (`on_the_diagonal`) marked slow;
    `ids(*values)` names a case, `marks` go on every one."""
    keep = on_the_diagonal(factors)
    cases = []
    for values in itertools.product(*factors):
        extra = [] if values in keep else [pytest.mark.slow]
        cases.append(pytest.param(*values, id=ids(*values) if ids else None, marks=[*marks, *extra]))
    return cases
