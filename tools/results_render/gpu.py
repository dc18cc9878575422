"""The GPU page: `anchor parity --device cuda` reports, each case's verdict read from its taps."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from parity_tests.emulations import emulation

from .records import GENERATED, GPU_PARITY, Records, agree, model_label, refuse, section
from .stats import num, table


def _section_verdict(sec: dict[str, Any]) -> bool:
    """A gradient section's verdict from its per-parameter verdicts (a slim report keeps only the verdict of
    a step section)."""
    return all(p["pass"] for p in sec["params"]) if sec.get("params") else bool(sec["pass"])


def parity_verdicts(rel: str, rec: dict[str, Any]) -> dict[str, Any]:
    """Each case's verdict from its own taps (forward) or parameters (gradients), the counts from those and the
    report's verdict; the verdicts and counts the report stores are checked against them."""
    forward, grads = [], []
    for i, c in enumerate(rec.get("cases", [])):
        taps = [t["pass"] for lay in c.get("layers", []) for t in lay["taps"].values()]
        if not taps:
            refuse(rel, f"cases[{i}].layers", "a forward case without its taps' verdicts")
        ok = all(taps)
        agree(rel, f"cases[{i}].pass ({c.get('id')})", c.get("pass"), ok)
        agree(rel, f"cases[{i}].failures ({c.get('id')})", c.get("failures"), taps.count(False))
        forward.append((c, ok, f"{sum(taps)}/{len(taps)}"))
    for i, g in enumerate(rec.get("grad_cases", [])):
        sections = {k: v for k, v in g.items() if isinstance(v, dict) and "pass" in v}
        if not sections:
            refuse(rel, f"grad_cases[{i}]", "a gradient case without its sections' verdicts")
        for k, sec in sections.items():
            agree(rel, f"grad_cases[{i}].{k}.pass ({g.get('id')})", sec.get("pass"), _section_verdict(sec))
        ok = all(_section_verdict(s) for s in sections.values())
        agree(rel, f"grad_cases[{i}].pass ({g.get('id')})", g.get("pass"), ok)
        params = [p["pass"] for p in sections.get("grads", {}).get("params", [])]
        grads.append((g, ok, f"{sum(params)}/{len(params)}" if params else "—"))
    unfinished = list(rec.get("unfinished") or [])
    overall = all(ok for _, ok, _ in forward + grads) and not unfinished
    agree(rel, "pass", rec.get("pass"), overall)
    return {"forward": forward, "grads": grads, "unfinished": unfinished, "pass": overall,
            "counts": {"forward": (sum(ok for _, ok, _ in forward), len(forward)),
                       "gradients": (sum(ok for _, ok, _ in grads), len(grads))}}


def parity_counts(rel: str, rec: dict[str, Any]) -> dict[str, Any]:
    """Passed / judged forward and gradient cases of an `anchor parity` report, and what it did not finish."""
    v = parity_verdicts(rel, rec)
    return {**v["counts"], "unfinished": v["unfinished"]}


@functools.cache
def current_rule() -> dict[str, Any] | None:
    """The parity rule the code applies today (parity_tests.core.RULE), to flag reports judged under another."""
    try:
        from parity_tests.core import RULE  # JAX: loaded only when a page shows a parity report
    except ImportError:
        return None
    return RULE.to_dict()


def not_todays(rec: dict[str, Any]) -> dict[str, Any]:
    """What a parity report was judged under that the code does not apply today: {"rule": {key: today's
    value}, "emulation": {engine: (recorded, today's)}}, each empty where it is today's."""
    rule, now = rec.get("rule") or {}, current_rule()
    rule_diff = {k: v for k, v in (now or {}).items() if rule and rule.get(k) != v
                 and k in ("factor", "floor", "orders", "grad_orders")}
    device = "cuda" if str(rec.get("device", "")).startswith("cuda") else "cpu"
    emul = {}
    for c in rec.get("cases", []) + rec.get("grad_cases", []):
        if c.get("dtype") == "bfloat16" and c.get("policy") != emulation(c.get("engine"), device):
            emul[c.get("engine")] = (c.get("policy"), emulation(c.get("engine"), device))
    return {"rule": rule_diff, "emulation": emul}


def gpu_page(records: Records) -> str:
    def report(rel, rec):
        v = parity_verdicts(rel, rec)
        n = v["counts"]
        grads = {(g.get("variant"), g.get("engine")): (g, ok, params) for g, ok, params in v["grads"]}
        differs = not_todays(rec)
        rows = []
        for c, ok, taps in v["forward"]:
            g = grads.get((c.get("variant"), c.get("engine")))
            div = c.get("first_divergence")
            emul = f"`{c.get('policy')}`"
            if c.get("engine") in differs["emulation"]:
                emul += f" (today: `{differs['emulation'][c.get('engine')][1]}`)"
            grad_cell = "not run"
            if g is not None:
                gdiv = g[0].get("first_divergence")
                grad_cell = "pass" if g[1] else "**fail**" + (f" ({_div(gdiv)})" if gdiv else "")
            rows.append([c.get("variant"), c.get("engine"), emul, num(c.get("seq_len")), taps,
                         "pass" if ok else "**fail**" + (f" ({_div(div)})" if div else ""),
                         g[2] if g else "—", grad_cell])
        status = ("finished" if not v["unfinished"]
                  else f"**unfinished** ({len(v['unfinished'])} of its parts did not finish)")
        rule = rec.get("rule") or {}
        judged = (f" Judged by the rule recorded with it: bf16 tolerance {num(rule.get('factor'))}× the baseline's "
                  f"error over {rule.get('orders')} summation orders" + (f" ({rule['grad_orders']} for gradients)"
                                                                  if rule.get("grad_orders") else "") + "."
                  ) if rule else ""
        if differs["rule"]:
            judged += (f" **Today's rule differs** ({', '.join(f'{k} {x}' for k, x in differs['rule'].items())}): "
                       "these verdicts are not today's.")
        if differs["emulation"]:
            judged += (" **Today's emulation differs** for " + ", ".join(
                f"{e} (`{old}`, today `{new}`)" for e, (old, new) in differs["emulation"].items()) + ".")
        head = (f"Model {model_label(rec.get('model'))}; the kernels on `{rec.get('device')}`, the oracle on "
                f"{rec.get('oracle_device')}.")
        return [head, "", f"Forward {n['forward'][0]}/{n['forward'][1]} cases pass, gradients {n['gradients'][0]}/"
                f"{n['gradients'][1]}; the report is {status}; overall: {'pass' if v['pass'] else 'not passed'}."
                f"{judged}", ""] + table(
            ["variant", "engine", "emulation", "T", "forward taps passed", "forward", "gradients passed",
             "gradients"], rows) + ["", "Each case's verdict is read from its taps' (forward) or parameters' "
                                    "(gradients) verdicts in the record."]

    out = ["# On the GPU", "", GENERATED, "",
           "`anchor parity --device cuda`: the real kernels, layer by layer, against the oracle's emulation of each "
           "kernel, with the model each report names. A report that did not finish says so; its counts are of the "
           "cases it judged.", ""]
    for rel in GPU_PARITY:
        name = Path(rel).stem
        out += section(records, rel, f"`{name}`", "Every case the report judged.", report)
    return "\n".join(out)


def _div(d: dict[str, Any]) -> str:
    if not isinstance(d, dict):
        return str(d)
    where = f"layer {d['layer']} " if d.get("layer") is not None else ""
    what = d.get("tap") or d.get("param") or d.get("name") or ""
    return f"{where}{what}".strip()
