"""The precision page: what bf16 does to RoPE, from the audit's record."""

from __future__ import annotations

import functools
import statistics
from typing import Any, Callable

from .records import AUDIT, GENERATED, Records, agree, section
from .stats import Stats, ratio_cells, table


def shift_curves(rel: str, rec: dict[str, Any]) -> dict[str, Stats]:
    """Per policy, D over the shifts: each shift's D the mean over the sequences (`D_per_seq`), checked
    against the stored `D`."""
    out = {}
    for pol, c in rec.get("shift_curve", {}).items():
        per_seq = c["D_per_seq"]
        d = [statistics.fmean(col) for col in zip(*per_seq)]
        for i, (stored, mine) in enumerate(zip(c.get("D", d), d)):
            agree(rel, f"shift_curve.{pol}.D[{i}]", stored, mine, abs_tol=1e-15)
        agree(rel, f"shift_curve.{pol}.D", len(c.get("D", d)), len(d))
        out[pol] = Stats.of(d)
    return out


@functools.cache
def _audit_findings() -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    from parity_tests.audit.report import findings  # JAX: loaded only when a page needs the audit's judge
    return findings


def audit_findings(rel: str, rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's claims judged again from the audit's curves by the audit's own judge; a stored verdict
    that disagrees stops the render."""
    mine = _audit_findings()(rec)
    stored = rec.get("findings", [])
    agree(rel, "findings", [f.get("id") for f in stored], [f["id"] for f in mine])
    for i, (s, m) in enumerate(zip(stored, mine)):
        agree(rel, f"findings[{i}].holds ({m['id']})", s.get("holds"), m["holds"])
    return mine


def precision_page(records: Records) -> str:
    def shift(rel, rec):
        curves = shift_curves(rel, rec)
        fp32 = curves.get("fp32")
        rows = [[f"`{pol}`", *s.cells()[1:], *(ratio_cells(s, fp32) if fp32 and pol != "fp32" else ["—", "—"])]
                for pol, s in curves.items()]
        first = next(iter(rec.get("shift_curve", {}).values()), {})
        n = next(iter(curves.values())).n if curves else 0
        note = (f"D at each of {n} shifts ({first.get('shifts', [None])[0]}–{first.get('shifts', [None])[-1]}) "
                f"against the reference shift {first.get('ref_shift')}, each the mean over {first.get('num_seqs')} "
                f"windows of {first.get('seq_len')} tokens.") if first else ""
        return table(["policy", "D over shifts: mean", "median", "min–max", "D ÷ fp32's D, by mean",
                      "by median"], rows) + ["", note]

    def findings(rel, rec):
        verdict = {True: "holds", False: "**does not hold**", None: "not measured"}
        rows = [[f["claim"], f["criterion"], verdict[f["holds"]], f.get("text", "")] for f in audit_findings(rel, rec)]
        return table(["the paper's claim", "criterion", "verdict", "measured"], rows)

    out = ["# Precision", "", GENERATED, "",
           "What bf16 does to RoPE's relative positions in a pretrained model: the audit (`anchor audit`) "
           "shifts every position by Δ and measures how far the attention maps move (D), per dtype policy.", ""]
    out += section(records, AUDIT, "The shift curve", "D over the shifts, per policy (the paper's Figure 1, left), "
                   "and each bf16 policy's D over fp32's.", shift)
    out += section(records, AUDIT, "The paper's claims, checked", "Each claim of the paper's §2 with the "
                   "criterion the audit applies, judged again here from the record's curves.", findings)
    return "\n".join(out)
