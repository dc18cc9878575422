"""`anchor bench` keeps every repeat it times (anchor/bench/timing.py): each window's time is the median of
its repeats, and the repeats themselves are in the record beside it."""

from __future__ import annotations

import statistics

import numpy as np

from anchor.bench.timing import Heads, time_variants


def test_every_timed_repeat_is_kept_beside_its_median():
    seg = np.array([[0] + [1] * 19 + [2] * 12, [0] + [1] * 7 + [2] * 24])  # two windows: slot 0, two documents
    rows = time_variants("varlen", ["full", "anchor"], seg, Heads(2, 1, 8), device="cpu", dtype="float32",
                         repeats=3)
    for row in rows.values():
        assert "error" not in row
        assert len(row["ms_repeats"]) == len(row["ms_windows"]) == 2
        for reps, ms in zip(row["ms_repeats"], row["ms_windows"]):
            assert len(reps) == 3 and ms == round(statistics.median(reps), 3)
