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
    return "step" if n == 1 else f"{n} steps"


def spread(lo: float, hi: float) -> str:
    return f"{num(lo)}–{num(hi)}"


def ratio_cells(top: Stats, bottom: Stats) -> list[str]:
    """`top` over `bottom` by mean and by median."""
    return [num(top.mean / bottom.mean), num(top.median / bottom.median)]


# ---- formatting -------------------------------------------------------------------------------------

def num(x: Any, digits: int = 3) -> str:
    """A number with `digits` significant digits (no exponent between 1e-3 and 1e6); '—' for none."""
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
