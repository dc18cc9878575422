"""Comparisons shared by the oracle's tests."""

from __future__ import annotations

import numpy as np


def rel(a, b) -> float:
    """Relative L2 error of `a` against the reference `b`, in fp64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
