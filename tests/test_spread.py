"""tests/spread.py: the diagonal `make test` runs through a product of factors holds every value of every factor."""

import itertools

import pytest

from tests.spread import on_the_diagonal, product_cases


@pytest.mark.parametrize("sizes", [(1,), (4, 10), (10, 4), (3, 5, 2), (1, 4, 10)])
def test_every_value_of_every_factor_is_on_the_diagonal(sizes):
    factors = [[f"{i}.{j}" for j in range(n)] for i, n in enumerate(sizes)]
    keep = on_the_diagonal(factors)
    assert len(keep) == max(sizes)
    for i, values in enumerate(factors):
        assert {combo[i] for combo in keep} == set(values)


def test_the_cases_are_the_whole_product_and_only_the_diagonal_is_fast():
    cases = product_cases(["m"], ["a", "b"], [1, 2, 3], ids=lambda m, v, p: f"{v}{p}")
    assert [c.values for c in cases] == list(itertools.product(["m"], ["a", "b"], [1, 2, 3]))
    fast = {c.id for c in cases if not any(m.name == "slow" for m in c.marks)}
    assert fast == {"a1", "b2", "a3"}
