"""A row of the report as its readers take it: whether it holds (`passed`), its margins
(`closest_margin`, `asked_margin`) and one line in words (`describe_row`).
"""

from __future__ import annotations

from typing import Any

from parity_tests.suite import where


def passed(row: dict[str, Any]) -> bool:
    """A row holds: not run (it cannot be judged here), or it computes the variant asked and passes the
    bf16 rule where that was run."""
    if row["status"] == "not_run":
        return True
    return row["status"] == "computes" and (row["bf16"] is None or row["bf16"]["pass"])


def closest_margin(row: dict[str, Any]) -> float:
    """The closest variant's worst error over the fp32 tolerance (> 1 for a row that computes none)."""
    return row["candidates"][row["closest"]]["worst_margin"]


def asked_margin(row: dict[str, Any]) -> float:
    """The variant asked's worst error over the fp32 tolerance (> 1 for a row that computes another)."""
    return row["candidates"][row["variant"]]["worst_margin"]


def describe_row(row: dict[str, Any]) -> str:
    """One line: what the stack computes for the variant asked, and the bf16 rule's verdict."""
    status = row["status"]
    if status == "not_run":
        return f"not run ({row['reason']})"
    if status == "error":
        return f"error: {row['error']}"
    if status == "crash":
        return row["error"]
    fp32 = f"fp32 first divergence from {row['variant']} at {where(row['fp32']['first_divergence'])}"
    if status == "instead":
        return (f"computes {row['computes']} instead of {row['variant']} ({asked_margin(row):.3g} x the fp32 "
                f"tolerance from it; {fp32})")
    if status == "none":
        return (f"computes none of the variants (closest: {row['closest']}, "
                f"{closest_margin(row):.3g} x the fp32 tolerance; {fp32})")
    if row["bf16"] is None:
        return "computes it"
    b = row["bf16"]
    return "computes it; bf16 rule " + ("passes" if b["pass"] else f"FAILS at {where(b['first_divergence'])}")
