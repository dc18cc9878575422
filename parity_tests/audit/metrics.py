"""The paper's shift metrics (docs/DESIGN.md §5, paper §2 Eq. 4 and 6) and the fp32 RoPE angle error.

Legend: L layers, N heads, T slots (query rows i, key columns j, 0-based here; the paper counts
from 1). Every function takes maps whose leading axes are summed over (layers, heads, ...), so
the same code serves one head, one layer or a whole model.

    D(X, Δ1, Δ2)   = Σ_{l,h} Σ_j n_j Σ_i |P_ij(Δ1) − P_ij(Δ2)|,   n_j = 1 / (T − j)   (0-based j)
    per-token_j    = Σ_{l,h}     n_j Σ_i |P_ij(Δ1) − P_ij(Δ2)|    (one value per key slot j)
    D_logit        = (1/T) Σ_{l,h} Σ_i |A_i0(Δ1) − A_i0(Δ2)|        (logits towards the first key)

The audit never holds whole maps: a probe reduces them inside the forward pass to column sums
`Σ_i |P_ij(Δ1) − P_ij(Δ2)|` ([..., T]) and per-row first-key logit differences ([..., T]); the
`*_from_*` functions finish the metrics from those, so they agree with the map functions by
construction (and a test holds them against plain loops).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxref import rope as rope_lib
from jaxref.policy import get_policy
from anchor_core.spec import RopeSpec


def column_norm(T: int) -> np.ndarray:
    """`n_j = 1/(T − j)` for 0-based key slots j (the paper's [1/L, 1/(L−1), …, 1]): float64 [T]."""
    return 1.0 / (T - np.arange(T, dtype=np.float64))


def column_sums(p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
    """`Σ_i |p1_ij − p2_ij|`: [..., T, T] (rows i, columns j) → float64 [..., T]."""
    return np.abs(np.asarray(p1, np.float64) - np.asarray(p2, np.float64)).sum(axis=-2)


def per_token_from_colsums(colsums: np.ndarray) -> np.ndarray:
    """Per-token difference from column sums [..., T] (leading axes summed): float64 [T]."""
    c = np.asarray(colsums, np.float64)
    T = c.shape[-1]
    return c.reshape(-1, T).sum(axis=0) * column_norm(T)


def d_from_colsums(colsums: np.ndarray) -> float:
    """`D` from column sums [..., T] (leading axes summed)."""
    return float(per_token_from_colsums(colsums).sum())


def attention_difference(p1: np.ndarray, p2: np.ndarray) -> float:
    """`D(X, Δ1, Δ2)` of two stacks of causal attention maps [..., T, T] (leading axes: layers, heads)."""
    return d_from_colsums(column_sums(p1, p2))


def per_token_difference(p1: np.ndarray, p2: np.ndarray) -> np.ndarray:
    """Per-token difference (one value per key slot j) of two stacks of maps [..., T, T]: float64 [T]."""
    return per_token_from_colsums(column_sums(p1, p2))


def first_key_rows(a1: np.ndarray, a2: np.ndarray) -> np.ndarray:
    """`Σ_{l,h} |A_i0(Δ1) − A_i0(Δ2)|` per query row i, from logit maps [..., T, T]: float64 [T]."""
    d = np.abs(np.asarray(a1, np.float64)[..., :, 0] - np.asarray(a2, np.float64)[..., :, 0])
    return d.reshape(-1, d.shape[-1]).sum(axis=0)


def d_logit_from_rows(rows: np.ndarray, T: int | None = None) -> float:
    """`D_logit` of the first `T` query rows (default all) from per-row sums [T_max].

    Under causal attention row i never sees later slots, so the first `T` rows of a longer
    sequence are exactly the rows of its length-`T` prefix: one forward pass gives every length.
    """
    rows = np.asarray(rows, np.float64)
    T = rows.shape[-1] if T is None else int(T)
    return float(rows[:T].sum() / T)


def logit_difference(a1: np.ndarray, a2: np.ndarray) -> float:
    """`D_logit` of two stacks of attention-logit maps [..., T, T] (only column 0 is read)."""
    return d_logit_from_rows(first_key_rows(a1, a2))


def angle_error(rope: RopeSpec, head_dim: int, positions, shift: int = 16) -> dict[str, list[float]]:
    """How far fp32 RoPE angles are from exact, at the given (long) positions.

    The stack computes `inv_freq` in fp32 and `position * inv_freq` in fp32 (transformers does, in
    every dtype policy here but fp64); "exact" is the same definition in fp64.

    Args:
      rope: the model's RoPE spec. head_dim: D. positions: ints (e.g. up to 1M). shift: Δ of the
        relative-angle check.

    Returns:
      lists over `positions`: `max_abs` / `mean_abs` (radians, over the D/2 frequencies) of
      `|angle_fp32(p) − angle_exact(p)|`, and `relative_max_abs` of
      `|(angle_fp32(p+Δ) − angle_fp32(p)) − Δ·θ_exact|`, the error of the relative angle RoPE is
      meant to encode (0 for an exactly relative encoding).
    """
    pos = np.asarray(positions, dtype=np.int64)
    f32, _ = rope_lib.inv_freq(rope, head_dim, dtype=np.float32)
    f64, _ = rope_lib.inv_freq(rope, head_dim, dtype=np.float64)
    a32 = np.asarray(rope_lib.angles(pos, f32, np.float32), np.float64)
    a32s = np.asarray(rope_lib.angles(pos + shift, f32, np.float32), np.float64)
    exact = pos[:, None].astype(np.float64) * np.asarray(f64)[None, :]
    err = np.abs(a32 - exact)
    rel = np.abs((a32s - a32) - shift * np.asarray(f64)[None, :])
    return {
        "positions": [int(p) for p in pos],
        "max_abs": err.max(axis=1).tolist(),
        "mean_abs": err.mean(axis=1).tolist(),
        "relative_max_abs": rel.max(axis=1).tolist(),
    }
def phase_error(rope: RopeSpec, head_dim: int, positions, policies) -> dict[str, dict[str, list[float]]]:
    """Each policy's RoPE table against fp64's at the given positions (`jaxref.rope.rope_tables`): the error of
    cos and sin as the policy's `rope_table` holds them, which takes in its angle's rounding (`rope_angle`,
    `rope_phase`) and its frequencies'. A policy's error at a position is what RoPE feeds its attention there.

    Returns {policy name: {"positions": [...], "max_abs": [...] (over the D frequencies, cos and sin)}}."""
    pos = np.asarray(positions, dtype=np.int64)
    truth = [np.asarray(t) for t in rope_lib.rope_tables(rope, head_dim, pos, get_policy("fp64"))]
    out = {}
    for policy in policies:
        got = [np.asarray(t, np.float64) for t in rope_lib.rope_tables(rope, head_dim, pos, policy)]
        err = np.maximum(np.abs(got[0] - truth[0]), np.abs(got[1] - truth[1])).max(axis=-1)
        out[policy.name] = {"positions": [int(p) for p in pos], "max_abs": err.tolist()}
    return out




WALL_FACTOR = 2.0
"""A policy's D has left a baseline once it passes this many times the baseline's D (`walls`)."""


def walls(shift_curve: dict[str, dict[str, Any]], reference: str = "fp32") -> dict[str, dict[str, Any]]:
    """Per policy of a shift curve, the first shift (in increasing order) where its D passes WALL_FACTOR × a
    baseline, in two readings:

      over_reference  the reference policy's D at the same shift: "past what `reference` does here". A bf16
                      policy passes it at its smallest shift (its noise is bf16's at every shift); a remedy in
                      fp32 arithmetic passes it where fp32's own angles lose more than the remedy's.
      over_floor      the policy's own D at its smallest shift, where every angle is most exact: "the shift
                      itself now adds error", where rounding position × inv_freq starts to move the maps.

    Each is None when D never passes (and over_reference when `reference` was not audited). `ratio_to_reference`
    is D ÷ the reference's D per shift (None without it).

    Returns {policy: {"shifts", "over_reference", "over_floor", "floor", "ratio_to_reference", "reference",
    "factor"}}.
    """
    ref = shift_curve.get(reference)
    out = {}
    for name, c in shift_curve.items():
        order = sorted(range(len(c["shifts"])), key=lambda i: c["shifts"][i])
        shifts = [int(c["shifts"][i]) for i in order]
        d = [float(c["D"][i]) for i in order]
        floor = d[0]
        over_floor = next((s for s, x in zip(shifts, d) if x > WALL_FACTOR * floor), None)
        ratio = over_ref = None
        if ref is not None and list(ref["shifts"]) == list(c["shifts"]):
            r = [float(ref["D"][i]) for i in order]
            ratio = [x / y if y > 0 else (None if x > 0 else 1.0) for x, y in zip(d, r)]  # None: over a zero
            over_ref = next((s for s, x, y in zip(shifts, d, r) if x > WALL_FACTOR * y), None)
        out[name] = {"shifts": shifts, "floor": floor, "over_floor": over_floor, "over_reference": over_ref,
                     "ratio_to_reference": ratio, "reference": reference if ratio is not None else None,
                     "factor": WALL_FACTOR}
    return out
