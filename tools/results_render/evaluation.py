"""The evaluation page: the demo, RULER by variant, and what stock transformers computes per variant."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .records import (DEMO, GENERATED, HF_STACK, PAPER_SMALL, VARIANTS, Records, agree, model_label, refuse,
                      section)
from .stats import Stats, num, spread, table


def ruler_scores(rel: str, rec: dict[str, Any]) -> dict[str, dict[int, Stats]]:
    """Per variant and length, RULER's mean over tasks at each checkpoint (`per_checkpoint`); the stored mean
    and sample SD checked against them."""
    out: dict[str, dict[int, Stats]] = {}
    for variant, v in rec.get("eval", {}).items():
        for length, s in (v.get("ruler_mean_of_tasks") or {}).items():
            where = f"eval.{variant}.ruler_mean_of_tasks.{length}"
            pts = s.get("per_checkpoint")
            if not pts:
                refuse(rel, f"{where}.per_checkpoint", "no per-checkpoint scores to compute the mean from")
            st = Stats.of(pts)
            # the scores and the summaries are each rounded to 2 decimals: they may differ by both roundings
            agree(rel, f"{where}.mean", s.get("mean"), st.mean, abs_tol=0.011)
            agree(rel, f"{where}.std", s.get("std"), statistics.stdev(pts) if len(pts) > 1 else 0.0, abs_tol=0.011)
            out.setdefault(variant, {})[int(length)] = st
    return out


def hf_rows(rel: str, rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of `anchor parity --stack hf`: what each computes, checked against its candidates' verdicts."""
    rows = rec.get("rows", [])
    verdicts = []
    for i, r in enumerate(rows):
        cand = r.get("candidates")
        if r.get("status") in ("computes", "instead", "none") and cand:
            where = f"rows[{i}] ({r.get('implementation')}, {r.get('inputs')}, {r.get('variant')})"
            within = sorted((c["worst_margin"], v) for v, c in cand.items() if c["pass"])
            computes = r["variant"] if cand[r["variant"]]["pass"] else (within[0][1] if within else None)
            agree(rel, f"{where}.computes", r.get("computes"), computes)
            agree(rel, f"{where}.closest", r.get("closest"), min(cand, key=lambda v: cand[v]["worst_margin"]))
            agree(rel, f"{where}.status", r.get("status"),
                  "computes" if computes == r["variant"] else "instead" if computes else "none")
        verdicts.append(r.get("status") == "computes" and (r.get("bf16") is None or bool(r["bf16"].get("pass"))))
    agree(rel, "pass", rec.get("pass"), all(verdicts))
    return rows


def evaluation_page(records: Records) -> str:
    def demo_train(rel, rec):
        rows = []
        for v, t in rec.get("train", {}).items():
            loss = t.get("loss") or []
            rows.append([v, num(len(loss)), num(loss[0]) if loss else "—", num(loss[-1]) if loss else "—",
                         spread(min(loss), max(loss)) if loss else "—"])
        p = rec.get("parity", {})
        if p:
            agree(rel, "parity.pass", p.get("pass"), p.get("passed") == p.get("cases")
                  and p.get("grad_passed") == p.get("grad_cases"))
        tail = [f"Parity of the trained checkpoint: {p.get('passed')}/{p.get('cases')} forward cases, "
                f"{p.get('grad_passed')}/{p.get('grad_cases')} gradient cases pass."] if p else []
        wall = (f"`make demo` on a fresh clone, the install included: {num(rec['make_demo_wall_s'])} s (one run; "
                f"{rec.get('note', '')})." if rec.get("make_demo_wall_s") else "")
        return table(["run", "steps", "first loss", "last loss", "loss min–max"], rows) + [
            "", "The record keeps each run's losses but not its step times (a median only), so no step time is "
            "shown here: the speed page's records keep their steps.", ""] + tail + ["", wall]

    def demo_ruler(rel, rec):
        ev = rec.get("eval", {})
        lengths = sorted({int(l) for v in ev.values() for l in v if str(l).isdigit()})
        rows = [[variant] + [f"{num(v[str(n)]['mean'])} ± {num(v[str(n)]['std'])} (over {v[str(n)].get('checkpoints')})"
                             if str(n) in v else "—" for n in lengths] for variant, v in ev.items()]
        return table(["variant"] + [f"RULER {l:,}: mean ± SD over checkpoints, as stored" for l in lengths], rows) + [
            "", "The record keeps these means and SDs, not the checkpoints' scores, so they are shown as it stores "
            "them and not checked."]

    def ruler(rel, rec):
        scores = ruler_scores(rel, rec)
        lengths = sorted({l for v in scores.values() for l in v})
        rows = [[variant] + [f"{num(s[l].mean)} ({num(s[l].median)}; {spread(s[l].lo, s[l].hi)})" if l in s else "—"
                             for l in lengths] for variant, s in scores.items()]
        n = {s.n for v in scores.values() for s in v.values()}
        return table(["variant"] + [f"RULER {l:,}: mean (median; min–max)" for l in lengths], rows) + [
            "", f"Over {', '.join(map(str, sorted(n)))} evaluation checkpoints per variant (each checkpoint's score "
            "the mean over tasks)."]

    def hf(rel, rec):
        cells: dict[tuple[str, str], dict[str, str]] = {}
        for r in hf_rows(rel, rec):
            st = r.get("status")
            if st == "computes":
                text = "computes it"
            elif st == "instead":
                text = f"computes `{r.get('computes')}` instead"
            elif st == "none":
                text = f"none of the four (closest `{r.get('closest')}`)"
            elif st in ("crash", "error"):
                text = f"{'' if st == 'crash' else 'error: '}{r.get('error')}"
            elif st == "not_run":
                text = "not run"
            else:
                text = st or "—"
            bf = (r.get("bf16") or {}).get("pass")
            if st == "computes" and bf is not None:
                text += ", bf16 " + ("passes" if bf else "**fails**")
            # a record without `inputs` holds the default style only (its rows' `feed` says which inputs)
            cells.setdefault((r["implementation"], r.get("inputs") or "flattening-nocache"), {})[r["variant"]] = text
        rows = [[f"`{impl}`", f"`{inputs}`"] + [c.get(v, "—") for v in VARIANTS]
                for (impl, inputs), c in cells.items()]
        return [f"Model {model_label(rec.get('model'))}; T={rec.get('seq_len')}.", ""] + table(
            ["implementation", "inputs"] + [f"asked for `{v}`" for v in VARIANTS], rows)

    out = ["# Evaluation", "", GENERATED, "",
           "The paper's comparison at small scale (`anchor demo`), and what stock transformers computes for each "
           "variant (`anchor parity --stack hf`).", ""]
    what = "Short runs on the embedded corpus, one per variant the record names."
    if records.exists(DEMO):
        s = records.load(DEMO).get("settings", {})
        what = (f"Model {model_label(s.get('model'))}; runs {', '.join(s.get('train_variants', []))}, "
                f"{s.get('train_steps')} steps each at T={s.get('seq_len')}, on the embedded corpus.")
    out += section(records, DEMO, "`make demo`: training", what, demo_train)
    out += section(records, DEMO, "`make demo`: RULER", "Over the runs' evaluation checkpoints.", demo_ruler)
    out += section(records, PAPER_SMALL, "`anchor demo --profile paper-small`: RULER by variant",
                   "The four variants, each scored at every evaluation checkpoint.", ruler)
    for rel in HF_STACK:
        out += section(records, rel, f"Stock transformers: `{Path(rel).stem}`", "Each implementation asked for "
                       "each variant, in each input style (how the batch reaches the model: "
                       "`anchor parity --stack hf --inputs`).", hf)
    return "\n".join(out)
