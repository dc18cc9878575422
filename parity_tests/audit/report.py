"""The audit's findings, Markdown report and figures, written atomically.

`findings(result)` states each of the paper's §2 findings and whether this model shows it, with the
numbers and the criterion used; nothing is forced: a finding that does not hold is reported so.

    write_audit(result, "runs/audit")   # audit.json, report.md, shift_curve.png, per_token.png,
                                        # length_curve.png, figure1.png, error_budget.png (and
                                        # rope_bases.png with the result's rope_bases)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from anchor_core.atomic import publish, staging_dir
from jaxref.policy import STAGES
from parity_tests.audit import metrics

# Criteria: stated in the report next to each verdict.
RATIO_MUCH_GREATER = 10.0     # "bf16 D ≫ fp32 D": at least an order of magnitude
ANGLE_VISIBLE_RAD = 1e-2      # a relative-angle error this large is a visible rotation error


def _low_precision(result: dict[str, Any]) -> list[str]:
    out = []
    for name, p in result["policies"].items():
        if any(v in ("bfloat16", "float16") for k, v in p.items() if k in STAGES):
            out.append(name)
    return out


def _mean_D(curve: dict[str, Any]) -> float:
    """Mean of D over the shift curve's Δ1 values."""
    return float(np.mean(curve["D"]))


def _spearman(x: list[float], y: list[float]) -> float:
    if len(x) < 2:
        return float("nan")
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    if np.std(rx) == 0 or np.std(ry) == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _g(x: float) -> str:
    return f"{x:.3g}"


def findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's §2 findings for this model: [{id, claim, criterion, holds (bool|None), numbers, text}].

    In order: bf16 breaks the relative property, the first token dominates, longer is worse,
    pretraining amplifies, one entry per error budget, and fp32 angles at long context. The bf16
    policies are compared with `ref`, fp32 (else fp64) when the audit ran it.
    """
    low = _low_precision(result)
    sc = result["shift_curve"]
    ref = "fp32" if "fp32" in sc else ("fp64" if "fp64" in sc else None)
    return [
        _bf16_breaks_relative(sc, low, ref),
        _first_token_dominant(result["per_token"], low, ref),
        _longer_is_worse(result["length_curve"], low, ref),
        _pretraining_amplifies(sc, result.get("random_init"), low),
        *(_error_budget_finding(name, eb) for name, eb in result.get("error_budget", {}).items()),
        _fp32_angles_long_context(result),
    ]


def _bf16_breaks_relative(sc: dict[str, Any], low: list[str], ref: str | None) -> dict[str, Any]:
    """Finding 1: bf16 breaks RoPE's relative property; fp32 keeps it."""
    f: dict[str, Any] = {"id": "bf16_breaks_relative", "claim": "Under bf16, shifting all positions changes the "
                         "attention maps far more than under fp32 (paper Fig. 1 left: bf16 ≫ fp32).",
                         "criterion": f"mean D over Δ1 of each bf16 policy ≥ {RATIO_MUCH_GREATER:g}× that of {ref}",
                         "numbers": {p: _mean_D(sc[p]) for p in sc}}
    if ref is None or not low:
        f["holds"], f["text"] = None, "needs fp32 (or fp64) and a bf16 policy among --policies"
    else:
        r = {p: _mean_D(sc[p]) / max(_mean_D(sc[ref]), 1e-300) for p in low}
        f["numbers"]["ratio_to_" + ref] = r
        f["holds"] = all(v >= RATIO_MUCH_GREATER for v in r.values())
        f["text"] = (f"mean D: {ref} {_g(_mean_D(sc[ref]))}; "
                     + "; ".join(f"{p} {_g(_mean_D(sc[p]))} ({_g(r[p])}× {ref})" for p in low))
    return f


def _first_token_dominant(pt: dict[str, Any], low: list[str], ref: str | None) -> dict[str, Any]:
    """Finding 2: the first key token carries most of the per-token difference."""
    f: dict[str, Any] = {"id": "first_token_dominant", "claim": "The first token contributes most of the attention "
                         "difference (paper Fig. 1 middle, Δ1=0, Δ2=16).",
                         "criterion": "key slot 0 has the largest per-token difference", "numbers": {}}
    texts, holds = [], []
    for p in low or list(pt):
        v = np.asarray(pt[p]["values"])
        rank = int((v > v[0]).sum()) + 1
        nxt = float(v[1:].max()) if v.size > 1 else 0.0
        f["numbers"][p] = {"first_token_share": float(pt[p]["first_token_share"]), "first_token_rank": rank,
                           "first_over_next_largest": float(v[0] / nxt) if nxt > 0 else None,
                           "D_without_first": float(v[1:].sum())}
        holds.append(rank == 1)
        texts.append(f"{p}: slot 0 carries {100 * pt[p]['first_token_share']:.1f}% of D (rank {rank}, "
                     f"{_g(v[0] / nxt) if nxt > 0 else '∞'}× the next largest slot)")
    if ref in pt:
        v = np.asarray(pt[ref]["values"])
        f["numbers"][ref + "_D_without_first"] = float(v[1:].sum())
        wo = ", ".join(f"{p} {_g(f['numbers'][p]['D_without_first'])}" for p in low)
        texts.append(f"without slot 0, D is {wo} against {ref} {_g(float(v[1:].sum()))}")
    f["holds"] = all(holds) if low else None
    f["text"] = "; ".join(texts)
    return f


def _longer_is_worse(lc: dict[str, Any], low: list[str], ref: str | None) -> dict[str, Any]:
    """Finding 3: longer sequences make the first token's logit error worse."""
    f: dict[str, Any] = {"id": "longer_is_worse", "claim": "D_logit (first key's logits, Δ1=0, Δ2=16) grows with the "
                         "sequence length (paper Fig. 1 right).", "criterion": "D_logit at the longest length > at "
                         "the shortest, and Spearman rank correlation with L ≥ 0.8", "numbers": {}}
    texts, holds = [], []
    for p in low:
        L, y = lc[p]["lengths"], lc[p]["D_logit"]
        rho = _spearman(L, y)
        grow = y[-1] / y[0] if y[0] > 0 else float("inf")
        f["numbers"][p] = {"spearman": rho, "ratio_longest_to_shortest": grow}
        holds.append(len(L) > 1 and y[-1] > y[0] and rho >= 0.8)
        texts.append(f"{p}: D_logit {_g(y[0])} at L={L[0]} → {_g(y[-1])} at L={L[-1]} ({_g(grow)}×, Spearman "
                     f"{rho:.2f})")
    if ref in lc:
        y = lc[ref]["D_logit"]
        texts.append(f"{ref}: {_g(y[0])} → {_g(y[-1])}")
    f["holds"] = all(holds) if low else None
    f["text"] = "; ".join(texts)
    return f


def _pretraining_amplifies(sc: dict[str, Any], ri: dict[str, Any] | None, low: list[str]) -> dict[str, Any]:
    """Finding 4: pretraining amplifies the discrepancy (pretrained vs PyTorch-default random init, bf16)."""
    f: dict[str, Any] = {"id": "pretraining_amplifies", "claim": "Pretrained weights show a larger D than the same "
                         "architecture randomly initialised, both in bf16 (paper Fig. 1 left: blue vs green).",
                         "criterion": "mean D pretrained > mean D random-init for each bf16 policy", "numbers": {}}
    if ri is None or not low:
        f["holds"], f["text"] = None, "it needs the random-init run (`--random-init`)"
        return f
    texts, holds = [], []
    for p in low:
        a, b = _mean_D(sc[p]), _mean_D(ri["shift_curve"][p])
        f["numbers"][p] = {"pretrained": a, "random_init": b, "ratio": a / b if b > 0 else None}
        holds.append(a > b)
        texts.append(f"{p}: pretrained {_g(a)} vs random init {_g(b)} ({_g(a / b) if b > 0 else '∞'}×)")
    f["holds"] = all(holds)
    f["text"] = "; ".join(texts)
    return f


def _error_budget_finding(name: str, eb: dict[str, Any]) -> dict[str, Any]:
    """Finding 5 (one per budgeted policy): which stages carry D."""
    st = {k: v for k, v in eb["stages"].items() if k != "head"}
    top = sorted((s for s in st if s != "others"), key=lambda s: -st[s]["raise_alone_contribution"])[:3]
    topc = sorted(st, key=lambda s: -st[s]["cumulative_contribution"])[:3]
    share = {s: st[s]["cumulative_contribution"] / eb["D"] if eb["D"] > 0 else None for s in st}
    return {
        "id": "error_budget", "claim": f"Where the D of {name} comes from (beyond the paper).",
        "criterion": "stages raised to fp64 cumulatively in pipeline order account for D − D_fp64 exactly; "
                     "the all-raised run equals fp64",
        "holds": bool(abs(eb["sum_cumulative_contributions"] - (eb["D"] - eb["D_all_raised"]))
                      <= 1e-9 * max(1.0, eb["D"]) and abs(eb["D_all_raised"] - eb["D_fp64"]) <= 1e-9),
        "numbers": {"D": eb["D"], "D_fp64": eb["D_fp64"], "D_all_raised": eb["D_all_raised"],
                    "cumulative_share": share},
        "text": (f"D={_g(eb['D'])} (T={eb['seq_len']}); raising one stage alone removes most for "
                 + ", ".join(f"{s} ({_g(st[s]['raise_alone_contribution'])})" for s in top)
                 + "; in the cumulative order the largest increments are "
                 + ", ".join(f"{s} ({100 * share[s]:.0f}%)" for s in topc if share[s] is not None)
                 + f"; all raised: D={_g(eb['D_all_raised'])} (fp64 {_g(eb['D_fp64'])})"),
    }


def _fp32_angles_long_context(result: dict[str, Any]) -> dict[str, Any]:
    """Finding 6: fp32 RoPE angles alone at very long context."""
    ae = result["angle_error"]
    last = ae["relative_max_abs"][-1]
    return {
        "id": "fp32_angles_long_context", "claim": "fp32 RoPE angles alone break shift invariance at very long "
        "context (beyond the paper).", "criterion": f"relative-angle error (Δ={result['settings']['ref_shift']}) "
        f"at position {ae['positions'][-1]:,} ≥ {ANGLE_VISIBLE_RAD:g} rad",
        "holds": bool(last >= ANGLE_VISIBLE_RAD), "numbers": ae,
        "text": "; ".join(f"pos {p:,}: |angle error| ≤ {_g(a)} rad, relative-angle error ≤ {_g(r)} rad"
                          for p, a, r in zip(ae["positions"], ae["max_abs"], ae["relative_max_abs"])
                          if p in (ae["positions"][0], 32768, 131072, ae["positions"][-1])),
    }


def _verdict(h: bool | None) -> str:
    return {True: "**holds**", False: "**does not hold**", None: "**not measured**"}[h]


def render_report(result: dict[str, Any], figures: list[str]) -> str:
    """report.md: settings, each finding with its verdict and numbers, tables, figures."""
    s = result["settings"]
    lines = [f"# Precision audit: `{result['model']}`", "",
             f"Family {result['spec']['family']}, {result['spec']['num_layers']} layers × "
             f"{result['spec']['num_heads']} heads, RoPE base {result['spec']['rope']['base']:g}. "
             f"Shift curve: {s['num_seqs']} windows of {s['seq_len']} tokens from {s['data']}, Δ2 = {s['ref_shift']}, "
             f"variant `full`; length curve up to {s['max_len']} ({s['length_seqs']} window(s)); error budget on {s['budget_seqs']} window(s) of "
             f"{s['budget_seq_len']}. Runtime {result['runtime_s']:.0f} s on {result['machine']['cpu_count']} CPUs"
             + (f" (taken from a killed audit with the same settings: {', '.join(result['reused']['pieces'])})"
                if result.get("reused") else "") + ".",
             "", "Metrics as in docs/DESIGN.md §5 (paper Eq. 4 and 6); logits are the scaled q·k/√d the stack stores; "
             "the paper used LLaMA-2-7B, 50 windows of 4096 tokens.", "", "## Findings", ""]
    for f in result.get("findings") or findings(result):
        lines += [f"### {f['claim']}", "", f"{_verdict(f['holds'])}. {f['text']}.", "",
                  f"_Criterion: {f['criterion']}._", ""]
    comp = result.get("comparison")
    if comp:
        stack = result["stack"]
        lines += ["## The torch stack beside the oracle's emulation of it", "",
                  f"`{comp['torch']}`: torchtrain's model on engine `{stack['engine']}` in {stack['dtype']} (logits "
                  f"{stack['logits']}; maps from the q and k the engine received), against the oracle under "
                  f"`{comp['oracle']}`, on the same windows and shifts. Largest relative difference of D: "
                  f"{comp['max_rel_diff']:.1%}.", "",
                  "| Δ1 | D torch | D oracle | torch / oracle |", "|---|---|---|---|"]
        for d, a, b, r in zip(comp["shifts"], comp["D_torch"], comp["D_oracle"], comp["ratio"]):
            lines.append(f"| {d} | {_g(a)} | {_g(b)} | {r:.3f} |")
        lines.append("")
    sc = result["shift_curve"]
    pols = list(sc)
    ri = result.get("random_init")
    lines += ["## Shift curve: D(X, Δ1, 16)", "", "| Δ1 | " + " | ".join(pols)
              + (" | " + " | ".join(f"{p} (random init)" for p in pols) if ri else "") + " |",
              "|---" * (1 + len(pols) * (2 if ri else 1)) + "|"]
    for i, d in enumerate(sc[pols[0]]["shifts"]):
        row = [_g(sc[p]["D"][i]) for p in pols] + ([_g(ri["shift_curve"][p]["D"][i]) for p in pols] if ri else [])
        lines.append(f"| {d} | " + " | ".join(row) + " |")
    lines += _walls_lines(result) + _bases_lines(result)
    lines += ["", "## Per-token difference (Δ1 = 0, Δ2 = 16): the largest key slots", ""]
    for p, v in result["per_token"].items():
        v = np.asarray(v["values"])
        top = np.argsort(-v)[:5]
        lines.append(f"- {p}: " + ", ".join(f"slot {j}: {_g(v[j])}" for j in top)
                     + f" (total D {_g(v.sum())}, slot 0 share {100 * v[0] / max(v.sum(), 1e-300):.1f}%)")
    lc = result["length_curve"]
    Ls = lc[pols[0]]["lengths"]
    lines += ["", "## Length curve: D_logit(Δ1 = 0, Δ2 = 16)", "", "| L | " + " | ".join(pols)
              + (" | " + " | ".join(f"{p} (random init)" for p in pols) if ri else "") + " |",
              "|---" * (1 + len(pols) * (2 if ri else 1)) + "|"]
    for i, L in enumerate(Ls):
        row = [_g(lc[p]["D_logit"][i]) for p in pols] + ([_g(ri["length_curve"][p]["D_logit"][i]) for p in pols]
                                                        if ri else [])
        lines.append(f"| {L} | " + " | ".join(row) + " |")
    for name, eb in result.get("error_budget", {}).items():
        lines += ["", f"## Error budget of {name} (D(0, 16) at T = {eb['seq_len']})", "",
                  f"D = {_g(eb['D'])}; fp32 (same attention arithmetic) {_g(eb['D_fp32'])}; fp64 {_g(eb['D_fp64'])}; "
                  f"all stages raised {_g(eb['D_all_raised'])}. Cumulative contributions sum to "
                  f"{_g(eb['sum_cumulative_contributions'])} = D − D_all_raised.", "",
                  "Three views of one question. *Raised alone*: D removed when only that stage runs in fp64 "
                  "(small when a later bf16 rounding re-quantises the same error). *Cumulative*: stages raised one "
                  "after another in pipeline order; the increments add up to D − D_fp64 exactly, and each is "
                  "credited to the first stage whose rounding no longer lets the shift through (once q and k are "
                  "exact, rounding the logits to bf16 gives the same value under both shifts). *Lowered alone*: "
                  "D of an fp32 stack (same attention arithmetic) with only that stage in the policy's dtype: "
                  "what that stage breaks by itself.", "",
                  "| stage | dtype | D with it raised alone | raise-alone contribution | cumulative contribution "
                  "(share of D) | lowered alone from fp32: contribution |", "|---|---|---|---|---|---|"]
        for st, v in eb["stages"].items():
            share = 100 * v["cumulative_contribution"] / eb["D"] if eb["D"] > 0 else 0.0
            if "lower_alone_contribution" in v:
                low = _g(v["lower_alone_contribution"])
            elif st in ("head", "others"):
                low = "–"
            else:
                low = "– (fp32 already)"
            ra = v["raise_alone_contribution"]
            lines.append(f"| {st} | {v['dtype']} | {_g(v['raised_alone_D']) if 'raised_alone_D' in v else '–'} | "
                         f"{'–' if ra is None else _g(ra)} | {_g(v['cumulative_contribution'])} ({share:.1f}%) "
                         f"| {low} |")
    ae = result["angle_error"]
    lines += ["", "## fp32 RoPE angles at long positions", "",
              "| position | max abs angle error (rad) | mean abs (rad) | relative-angle error, Δ=16 (rad) |",
              "|---|---|---|---|"]
    lines += [f"| {p:,} | {_g(a)} | {_g(m)} | {_g(r)} |"
              for p, a, m, r in zip(ae["positions"], ae["max_abs"], ae["mean_abs"], ae["relative_max_abs"])]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    lines += ["", "## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def _wall(x: int | None) -> str:
    return "never" if x is None else f"{x:,}"


def _walls_lines(result: dict[str, Any]) -> list[str]:
    """Per policy: where D passes twice its own floor and twice fp32's, and the first key token's share of the
    change at the smallest and the largest shift."""
    walls, sc = result.get("walls"), result["shift_curve"]
    if not walls:
        return []
    lines = ["", f"## Where D leaves its baseline (factor {metrics.WALL_FACTOR:g})", "",
             "The first shift where a policy's D passes twice its own D at the smallest shift (the shift itself now "
             "adds error) and twice fp32's D at the same shift; the first key token's share of the change at the "
             "smallest and the largest shift.", "",
             "| policy | D at the smallest shift | first Δ past 2× its floor | first Δ past 2× fp32's | first token's "
             "share, smallest Δ | largest Δ |", "|---|---|---|---|---|---|"]
    for p, w in walls.items():
        c = sc[p]
        lo, hi = int(np.argmin(c["shifts"])), int(np.argmax(c["shifts"]))
        lines.append(f"| {p} | {_g(w['floor'])} | {_wall(w['over_floor'])} | "
                     f"{'–' if w['reference'] is None or p == w['reference'] else _wall(w['over_reference'])} | "
                     f"{100 * c['first_token_share'][lo]:.1f}% | {100 * c['first_token_share'][hi]:.1f}% |")
    return lines


def _bases_lines(result: dict[str, Any]) -> list[str]:
    """The shift curve under each RoPE base of `rope_bases`: per policy and base, D at the largest shift, the two
    walls and the phase error of the RoPE table at the last slot."""
    bases = result.get("rope_bases")
    if not bases:
        return []
    lines = ["", "## RoPE bases", "",
             "The same weights and windows under each RoPE base; per policy and base: D at the largest shift, the "
             "first Δ past twice its floor, the first Δ past twice fp32's, and the largest error of its RoPE table "
             "(cos and sin against fp64) at the last slot of the farthest-shifted window.", "",
             "| policy | base | D at the largest Δ | past 2× its floor | past 2× fp32's | RoPE table error |",
             "|---|---|---|---|---|---|"]
    for p in result["shift_curve"]:
        for key, b in bases.items():
            c, w = b["shift_curve"][p], b["walls"][p]
            pe = b["phase_error"][p]["max_abs"][-1]
            lines.append(f"| {p} | {key}{' (own)' if b['own'] else ''} | {_g(c['D'][int(np.argmax(c['shifts']))])} | "
                         f"{_wall(w['over_floor'])} | "
                         f"{'–' if w['reference'] is None or p == w['reference'] else _wall(w['over_reference'])} | "
                         f"{_g(pe)} |")
    return lines


def plot_figures(result: dict[str, Any], out: Path) -> list[str]:
    """The three panels of the paper's Figure 1 (separately and together) and the error budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc, pt, lc, ri = result["shift_curve"], result["per_token"], result["length_curve"], result.get("random_init")
    colors = {p: f"C{i}" for i, p in enumerate(sc)}

    def shift_panel(ax):
        for p, c in sc.items():
            x = np.arange(len(c["shifts"]))
            ax.plot(x, np.maximum(c["D"], 1e-300), "o-", color=colors[p], label=p, ms=3)
            if ri:
                ax.plot(x, np.maximum(ri["shift_curve"][p]["D"], 1e-300), "s--", color=colors[p], ms=3,
                        label=f"{p} (random init)", alpha=0.7)
        shifts = next(iter(sc.values()))["shifts"]
        ax.set_xticks(np.arange(len(shifts)), [str(s) for s in shifts], rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel(f"Δ1 (Δ2 = {result['settings']['ref_shift']})")
        ax.set_ylabel("attention difference D")
        ax.set_title(f"Shift curve (T = {result['settings']['seq_len']})")
        ax.legend(fontsize=6)

    def token_panel(ax):
        for p, v in pt.items():
            v = np.asarray(v["values"])
            ax.plot(np.arange(1, v.size + 1), np.maximum(v, 1e-300), color=colors[p], label=p, lw=1)
            ax.plot([1], [max(v[0], 1e-300)], "o", color=colors[p], ms=5)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("key token j (1 = first token)")
        ax.set_ylabel("per-token difference")
        ax.set_title("Per-token difference (Δ1 = 0, Δ2 = 16)")
        ax.legend(fontsize=6)

    def length_panel(ax):
        for p, c in lc.items():
            ax.plot(c["lengths"], np.maximum(c["D_logit"], 1e-300), "o-", color=colors[p], label=p, ms=3)
            if ri:
                ax.plot(c["lengths"], np.maximum(ri["length_curve"][p]["D_logit"], 1e-300), "s--", color=colors[p],
                        ms=3, alpha=0.7, label=f"{p} (random init)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("first-token logit difference D_logit")
        ax.set_title("Length curve (Δ1 = 0, Δ2 = 16)")
        ax.legend(fontsize=6)

    files = []
    for name, panel in (("shift_curve", shift_panel), ("per_token", token_panel), ("length_curve", length_panel)):
        fig, ax = plt.subplots(figsize=(5.5, 4))
        panel(ax)
        fig.subplots_adjust(left=0.15, right=0.97, top=0.92, bottom=0.16 if name == "shift_curve" else 0.12)
        fig.savefig(out / f"{name}.png", dpi=120)
        plt.close(fig)
        files.append(f"{name}.png")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.3))
    for ax, panel in zip(axes, (shift_panel, token_panel, length_panel)):
        panel(ax)
    fig.suptitle(f"RoPE under reduced precision: {result['model']}")
    fig.subplots_adjust(left=0.05, right=0.99, top=0.86, bottom=0.17, wspace=0.25)
    fig.savefig(out / "figure1.png", dpi=110)
    plt.close(fig)
    files.append("figure1.png")
    if result.get("rope_bases"):
        files.append(_plot_bases(result, out, colors, plt))
    for name, eb in result.get("error_budget", {}).items():
        st = [s for s in eb["stages"] if s != "head"]
        y = np.arange(len(st))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.barh(y - 0.2, [eb["stages"][s]["raise_alone_contribution"] or 0.0 for s in st], 0.4,
                label="raised alone to fp64")
        ax.barh(y + 0.2, [eb["stages"][s]["cumulative_contribution"] for s in st], 0.4,
                label="cumulative (pipeline order)")
        ax.set_yticks(y, st)
        ax.invert_yaxis()
        ax.axvline(0, color="k", lw=0.5)
        ax.set_xlabel(f"D removed by raising the stage to fp64 (D = {eb['D']:.3g})")
        ax.set_title(f"Error budget of {name}")
        ax.legend(fontsize=7)
        fig.subplots_adjust(left=0.2, right=0.97, top=0.93, bottom=0.12)
        fig.savefig(out / "error_budget.png", dpi=120)
        plt.close(fig)
        files.append("error_budget.png")
        break
    return files


def _plot_bases(result: dict[str, Any], out: Path, colors: dict[str, str], plt) -> str:
    """rope_bases.png: one panel per RoPE base, D against the shift (log-log, the shift plus one) per policy,
    each policy's first shift past twice its floor marked."""
    bases = result["rope_bases"]
    fig, axes = plt.subplots(1, len(bases), figsize=(4.2 * len(bases), 3.8), sharey=True, squeeze=False)
    for ax, (key, b) in zip(axes[0], bases.items()):
        for p, c in b["shift_curve"].items():
            order = np.argsort(c["shifts"])
            x = np.asarray(c["shifts"])[order] + 1
            ax.plot(x, np.maximum(np.asarray(c["D"])[order], 1e-300), "o-", color=colors.get(p), label=p, ms=3)
            wall = b["walls"][p]["over_floor"]
            if wall is not None:
                ax.axvline(wall + 1, color=colors.get(p), lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("Δ1 + 1")
        ax.set_title(f"RoPE base {key}{' (own)' if b['own'] else ''}")
    axes[0][0].set_ylabel("attention difference D")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"The shift curve under each RoPE base (T = {result['settings']['seq_len']}; dotted: first Δ past "
                 f"{metrics.WALL_FACTOR:g}× the policy's floor)", fontsize=9)
    fig.subplots_adjust(left=0.06, right=0.99, top=0.85, bottom=0.14, wspace=0.08)
    fig.savefig(out / "rope_bases.png", dpi=110)
    plt.close(fig)
    return "rope_bases.png"


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x).__name__)


def write_audit(result: dict[str, Any], out: str | Path) -> Path:
    """Write audit.json, report.md and the figures into `out`, via a temporary folder renamed at the end."""
    out = Path(out).resolve()
    result = dict(result)
    result["findings"] = findings(result)
    with staging_dir(out) as tmp:
        work = tmp / "audit"
        work.mkdir()
        figures = plot_figures(result, work)
        (work / "audit.json").write_text(json.dumps(result, indent=1, default=_json_default))
        (work / "report.md").write_text(render_report(result, figures))
        publish(work, out)
    return out
