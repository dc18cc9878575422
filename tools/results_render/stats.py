"""The statistics every page shows (a sample's size, mean, median and range; ratios by mean and by
median) and how a page writes numbers and tables."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, NamedTuple

# ---- statistics from samples ------------------------------------------------------------------------

class Stats(NamedTuple):
    """A sample's size, mean, median and range (a NamedTuple: tests load this file as a module of no package)."""

    n: int
    mean: float
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, samples: Iterable[float]) -> Stats:
        xs = [float(x) for x in samples]
        return cls(len(xs), statistics.fmean(xs), statistics.median(xs), min(xs), max(xs))

    def cells(self) -> list[str]:
        return [num(self.n), num(self.mean), num(self.median), spread(self.lo, self.hi)]


STATS_HEAD = ["mean", "median", "min–max"]


def steps_word(n: int) -> str:
    return "step" if n == 1 else f"{num(n)} steps"


def spread(lo: float, hi: float) -> str:
    return f"{num(lo)}–{num(hi)}"


def ratio_cells(top: Stats, bottom: Stats) -> list[str]:
    """`top` over `bottom` by mean and by median."""
    return [ratio(top.mean / bottom.mean), ratio(top.median / bottom.median)]


def ratio(x: float | None, digits: int = 3) -> str:
    """A ratio as `num` writes it, with more digits where rounding would carry it to the other side of 1 or
    onto it (1.004 is "1.004", not "1"): a ratio written as 1 is one."""
    text = num(x, digits)
    if x is None or not isinstance(x, float) or x == 1 or math.isnan(x):
        return text
    while (float(text.replace(",", "")) >= 1) != (x >= 1) or float(text.replace(",", "")) == 1:
        digits += 1
        if digits > 9:
            break
        text = num(x, digits)
    return text


def ratio_spread(lo: float, hi: float) -> str:
    """The range of a set of ratios, each end written by `ratio`."""
    return f"{ratio(lo)}–{ratio(hi)}"


# ---- formatting -------------------------------------------------------------------------------------

# Every figure `num` writes, while a test collects them (`collect`): what a page shows and no record gives
# must be one of these, computed, never a number typed into the page's prose.
_WRITTEN: list[set[str]] = []


class collect:
    """`with collect() as figures:` every figure `num` writes in the block is added to `figures`."""

    def __enter__(self) -> set[str]:
        _WRITTEN.append(set())
        return _WRITTEN[-1]

    def __exit__(self, *exc: object) -> None:
        _WRITTEN.pop()


def num(x: Any, digits: int = 3) -> str:
    """A number with `digits` significant digits (no exponent between 1e-3 and 1e6); '—' for none."""
    text = _num(x, digits)
    if _WRITTEN:
        _WRITTEN[-1].add(text)
    return text


def _num(x: Any, digits: int) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:,.0f}"
    return str(x)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |")
    return out
