"""The precision page: what bf16 does to RoPE, from the audit's record."""

from __future__ import annotations

import functools
import statistics
from typing import Any, Callable

from .records import AUDIT, AUDIT_MILLION, GENERATED, Records, agree, section
from .stats import Stats, num, ratio_cells, table


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


@functools.cache
def _walls() -> Callable[[dict[str, Any]], dict[str, Any]]:
    from parity_tests.audit.metrics import walls  # JAX: loaded only when a page needs it
    return walls


def bases_walls(rel: str, rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per RoPE base of the record's `rope_bases`, each policy's walls recomputed from its shift curve by the
    audit's own rule; a stored wall that disagrees stops the render."""
    out = {}
    for key, b in rec.get("rope_bases", {}).items():
        mine = _walls()(b["shift_curve"])
        for pol, w in mine.items():
            stored = b.get("walls", {}).get(pol, {})
            for field in ("over_floor", "over_reference"):
                if field in stored:  # None (never) compared as a word: agree() takes a stored None as unstated
                    agree(rel, f"rope_bases.{key}.walls.{pol}.{field}", _wall_key(stored[field]), _wall_key(w[field]))
        out[key] = mine
    return out


def _wall_key(x: int | None) -> int | str:
    return "never" if x is None else x


def _wall(x: int | None) -> str:
    return "never" if x is None else num(x)


def _at(curve: dict[str, Any], field: str, which) -> float:
    """`curve[field]` at the smallest (`which` = min) or the largest (max) shift."""
    i = curve["shifts"].index(which(curve["shifts"]))
    return curve[field][i]


def _pct(x: float) -> str:
    return f"{num(100 * x, 2)}%"


def million_section(rel: str, rec: dict[str, Any]) -> list[str]:
    """The audit to a million positions under several RoPE bases: per policy and base, D near and far, the two walls
    and the first token's share; then the first token's share with the model's weights and at random init."""
    walls = bases_walls(rel, rec)
    pols = list(rec["shift_curve"])
    s = rec["settings"]
    lo, hi = min(s["shifts"]), max(s["shifts"])
    any_wall = next((w for per_base in walls.values() for w in per_base.values()), None)
    factor = num(any_wall["factor"]) if any_wall else "—"
    took = f"{num(rec['runtime_s'])} s" + (f" ({num(rec['runtime_s'] / 60)} min)" if rec["runtime_s"] >= 120 else "")
    out = [f"The audit took {took}: {num(len(pols))} policies, {num(len(s['shifts']))} shifts from {num(lo)} to "
           f"{num(hi)} on {num(s['num_seqs'])} window{'s' if s['num_seqs'] != 1 else ''} of {num(s['seq_len'])} "
           f"tokens, under {num(len(rec.get('rope_bases', {})))} RoPE bases"
           + (", and at random init" if "random_init" in rec else "") + ".", ""]
    rows = []
    for p in pols:
        for key, b in rec.get("rope_bases", {}).items():
            c, w = b["shift_curve"][p], walls[key][p]
            rows.append([f"`{p}`", key + (" (own)" if b["own"] else ""), num(_at(c, "D", min)), num(_at(c, "D", max)),
                         _wall(w["over_floor"]),
                         "–" if w["reference"] is None or p == w["reference"] else _wall(w["over_reference"]),
                         _pct(_at(c, "first_token_share", max)), num(b["phase_error"][p]["max_abs"][-1])])
    last = next(iter(rec.get("rope_bases", {}).values()), {}).get("phase_error", {})
    last = num(next(iter(last.values()))["positions"][-1]) if last else "—"
    out += table(["policy", "RoPE base", f"D at Δ={num(lo)}", f"D at Δ={num(hi)}",
                  f"first Δ past {factor}× its own floor", f"first Δ past {factor}× fp32's",
                  f"first token's share at Δ={num(hi)}", f"RoPE table error at position {last}"], rows)
    out += ["", f"A wall is the first shift where D passes {factor}× a baseline: the policy's own D at the smallest "
            "shift (the shift itself now adds error), or fp32's D at the same shift (a bf16 policy passes that at "
            "once: its noise is bf16's at every shift); `never` when D stays under it to the largest shift. The RoPE table "
            "error is the largest of cos and sin against fp64's at the farthest window's last slot: a frequency "
            "rounded to the table's dtype counts in it, though it keeps positions relative.", ""]
    kinds = [("the model's weights", rec["shift_curve"])]
    if "random_init" in rec:
        kinds.append(("random init", rec["random_init"]["shift_curve"]))
    rows = [[f"`{p}`", *[_pct(_at(sc[p], "first_token_share", which)) for _, sc in kinds for which in (min, max)]]
            for p in pols]
    out += table(["policy", *[f"{name}: Δ={num(d)}" for name, _ in kinds for d in (lo, hi)]], rows)
    out += ["", f"The first key token's share of the change D (its column of |P(Δ) − P({num(s['ref_shift'])})|, "
            "normalised as D), under the model's own RoPE base, at the smallest and the largest shift."]
    return out + ["", _claims(rec, kinds, lo, hi)]


def _claims(rec: dict[str, Any], kinds: list[tuple[str, dict[str, Any]]], lo: int, hi: int) -> str:
    """The two published readings of whose error it is, beside the shares the record holds for its low-precision
    policies (a stage in bf16, fp16 or FP8)."""
    low = [p for p, pol in rec["policies"].items()
           if any(str(v).startswith(("bfloat16", "float16", "float8")) for v in pol.values())]

    def span(sc: dict[str, Any], which) -> str:
        v = [_at(sc[p], "first_token_share", which) for p in low]
        return f"{_pct(min(v))}–{_pct(max(v))}" if v else "—"

    measured = "; ".join(f"{span(sc, min)} at Δ={num(lo)} and {span(sc, max)} at Δ={num(hi)} ({name})"
                         for name, sc in kinds)
    return ("Whose error it is. The paper reads its Figure 1 as most of the shift's change sitting on the first "
            "token; the SinkCast report finds the sink key explains only a small part of it (single-digit "
            f"percentages, on Llama-3.1-8B and Mistral-7B). Here, over the {num(len(low))} low-precision policies, "
            f"the first token carries {measured}. The paper's claim as checked above is judged by rank (the first "
            "token's slot against the next largest); the share says how much of the whole it is.")


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
    out += section(records, AUDIT_MILLION, "Past the paper: a million positions, RoPE bases, FP8",
                   "`anchor audit --shifts million --rope-base …`: the windows stay short and their positions move "
                   "to a million, under each RoPE base, per policy: bf16, FP8 and the phase-mod-2π remedies.",
                   million_section)
    return "\n".join(out)
