"""The summary of `anchor parity --stack hf` (parity_tests.hf_stack); parity_tests.report.write_report writes it
with parity.json, index.html and the figures, as it writes the suite's.

summary.md holds the table (implementation, input style) x variant (what each computes when asked for each
variant, and whether it passes the bf16 rule), then one line per row with its first divergences.
"""

from __future__ import annotations

from typing import Any

from anchor_core.variants import VARIANTS
from parity_tests.hf_stack import asked_margin, closest_margin, describe_row
from parity_tests.suite import where


def cell(row: dict[str, Any]) -> str:
    """The table's cell of a row: computes it / computes X instead / none / error / crashes / not run; bf16
    verdict."""
    status = row["status"]
    if status == "not_run":
        return "not run"
    if status == "error":
        return f"error: `{row['error']}`"
    if status == "crash":
        return row["error"]
    if status == "instead":
        return f"computes `{row['computes']}` instead ({asked_margin(row):.3g} x tol from the one asked)"
    if status == "none":
        return f"computes none (closest `{row['closest']}`, {closest_margin(row):.3g} x tol)"
    b = row["bf16"]
    if b is None:
        return "computes it"
    return f"computes it; bf16 {'passes' if b['pass'] else 'FAILS'} ({b['worst_margin']:.2f})"


def _inputs(row: dict[str, Any]) -> str:
    return row.get("inputs") or "-"


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: a row per implementation and input style, a column per variant asked."""
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in result["rows"])]
    names = list(dict.fromkeys((r["implementation"], _inputs(r)) for r in result["rows"]))
    by = {(r["implementation"], _inputs(r), r["variant"]): r for r in result["rows"]}
    lines = ["| implementation | inputs | " + " | ".join(f"`{v}`" for v in variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for n, style in names:
        lines.append(f"| `{n}` | `{style}` | "
                     + " | ".join(cell(by[(n, style, v)]) if (n, style, v) in by else "" for v in variants) + " |")
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    """summary.md (also printed): the table, the rule, the feeds, each row's details and what was not run."""
    rule = result["rule"]
    rows = result["rows"]
    held = sum(r["status"] not in ("not_run",) for r in rows)
    ok = sum(r["status"] == "computes" and (r["bf16"] is None or r["bf16"]["pass"]) for r in rows)
    lines = [
        f"# transformers {result['transformers']} under the oracle: {result['model']}, T = {result['seq_len']}",
        "",
        f"{ok}/{held} (implementation, inputs, variant) rows compute the variant asked"
        + (" and pass the bf16 rule" if "bfloat16" in result["dtypes"] else "")
        + (f"; {len(rows) - held} not run here" if held < len(rows) else "") + ".",
        "",
        *table(result),
        "",
        f"What it computes: its float32 taps (embeddings, q and k after RoPE, attention and MLP outputs, hidden "
        f"states, logits; every layer) against the oracle's fp64 taps of each variant on the same tokens and "
        f"documents, at that variant's positions; a variant is computed when every tap is within "
        f"{rule['fp32_tol']:g} (relative L2) or {rule['factor']:g} x the oracle's own fp32 error, whichever is "
        f"larger. bf16 rule, where it computes the variant asked: relative L2 against "
        f"fp64 <= {rule['factor']:g} x the emulation's (RMS over {rule['orders']} summation orders) + "
        f"{rule['floor']:g} per tap and layer (logits: also mean KL); the number in brackets is the worst "
        f"error / tolerance (< 1 passes).",
        "",
        "Inputs (by style): " + "; ".join(sorted({f"`{_inputs(r)}`: {r['feed']}" for r in rows})) + ".",
        "",
        "| implementation | inputs | variant | finding | bf16 rule (emulation) | s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["bf16"]
        bf16 = "-" if b is None else (f"passes ({b['policy']}, {b['worst_margin']:.2f})" if b["pass"] else
                                      f"FAILS at {where(b['first_divergence'])} ({b['policy']})")
        lines.append(f"| `{r['implementation']}` | `{_inputs(r)}` | `{r['variant']}` | {describe_row(r)} | {bf16} | "
                     f"{r.get('runtime_s', 0):.1f} |")
    lines += ["", f"Total {result['runtime_s']:.0f} s."]
    return "\n".join(lines) + "\n"
