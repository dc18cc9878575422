"""The parity report: parity.json, index.html (summary table, a layer-wise error plot per case,
emulation fidelity per layer), summary.md (also printed for CI logs), and figures/*.png.

Everything is written into a temporary folder next to `--out`, which is renamed when complete.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from anchor_core.atomic import publish, staging_dir
from parity_tests.core import EMBED, HEAD
from parity_tests.hf_report import render_markdown as render_hf
from parity_tests.runners import PER_LAYER
from parity_tests.suite import where

_COLORS = {"embed": "#7f7f7f", "q": "#1f77b4", "k": "#aec7e8", "scores": "#ff7f0e", "probs": "#ffbb78",
           "attn_out": "#2ca02c", "mlp_out": "#98df8a", "hidden": "#d62728", "logits": "#9467bd"}
_FLOOR = 1e-12  # zero errors are plotted here on the log axis


def _x(label: Any, num_layers: int) -> int:
    return -1 if label == EMBED else num_layers if label == HEAD else int(label)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _slug(case_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in case_id)


def plot_case(case: dict[str, Any], path: Path) -> None:
    """The layer-wise error curves of one case (and, for bf16, its emulation fidelity) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = case["layers"]
    L = len(layers) - 2
    bf16 = case["dtype"] == "bfloat16"
    ncols = 2 if bf16 else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.4 * ncols, 4.2), squeeze=False)
    ax = axes[0, 0]
    for name in PER_LAYER:
        pts = [(_x(e["layer"], L), e["taps"][name]) for e in layers if name in e["taps"]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax.plot(xs, [max(p[1]["rel_l2"], _FLOOR) for p in pts], "-o", ms=3, color=_COLORS[name], label=name)
        if "baseline_rel_l2" in pts[0][1]:
            ax.plot(xs, [max(p[1]["baseline_rel_l2"], _FLOOR) for p in pts], ":", color=_COLORS[name], lw=1)
    for e in layers:
        for name in ("embed", "logits"):
            if name in e["taps"]:
                err = e["taps"][name]
                ax.plot([_x(e["layer"], L)], [max(err["rel_l2"], _FLOOR)], "s", color=_COLORS[name], label=name)
    if bf16:
        hid = [(_x(e["layer"], L), e["taps"]["hidden"]["tol"]) for e in layers if "tol" in e["taps"].get("hidden", {})]
        if hid:
            ax.plot([h[0] for h in hid], [h[1] for h in hid], "--", color="black", lw=1, label="tol (hidden)")
    else:
        ax.axhline(1e-5, ls="--", color="black", lw=1, label="tol 1e-5")
    first = case.get("first_divergence")
    if first:
        ax.plot([_x(first["layer"], L)], [max(first["rel_l2"], _FLOOR)], "x", color="red", ms=14, mew=3,
                label=f"first divergence: {where(first)}")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (-1: embeddings, L: logits)")
    base = case["policy"] if bf16 else "oracle fp32"
    ax.set_ylabel("rel. L2 error vs fp64")
    ax.set_title(f"trainer ({case['dtype']}) — solid; {base} — dotted", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    if bf16:
        ax = axes[0, 1]
        for name, style in (("hidden", "-"), ("q", "--")):
            pts = [(_x(r["layer"], L), r["taps"][name]) for r in case["fidelity"] if name in r["taps"]]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            for key, color, label in (("trainer_vs_emulation", "#d62728", "trainer vs emulation"),
                                      ("trainer_vs_fp64", "#1f77b4", "trainer vs fp64"),
                                      ("emulation_vs_fp64", "#2ca02c", "emulation vs fp64")):
                ax.plot(xs, [max(p[1][key], _FLOOR) for p in pts], style, marker="o", ms=3, color=color,
                        label=f"{label} ({name})")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("rel. L2 distance")
        ax.set_title(f"emulation fidelity: torch bf16 vs oracle {case['policy']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(case["id"] + ("  PASS" if case["pass"] else "  FAIL"), fontsize=10,
                 color="black" if case["pass"] else "red")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


_GRAD_STYLES = {"grads": ("#1f77b4", "gradient vs fp64"), "step": ("#d62728", "step vs oracle AdamW on the same gradients"),
                "update": ("#2ca02c", "update vs fp64 trajectory (reported)")}


def plot_grad_case(case: dict[str, Any], path: Path) -> None:
    """Per-parameter errors of a gradient case as a PNG: x the parameters in backward order (from
    the loss), y the rel. L2 of the gradient, the parameters and the update after the last step
    against fp64 (solid), the oracle's own (dotted) and the tolerance (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = case["steps"]
    sections = [("grads", case["grads"]), ("step", case[f"step@{k}"]), ("update", case[f"update@{k}"])]
    names = [r["param"] for r in case["grads"]["params"]]
    fig, ax = plt.subplots(figsize=(max(6.4, 0.09 * len(names) + 3), 4.4))
    xs = list(range(len(names)))
    for key, sec in sections:
        color, label = _GRAD_STYLES[key]
        label = label if key == "grads" else f"{label}, after {k} steps"
        ax.plot(xs, [max(r["rel_l2"], _FLOOR) for r in sec["params"]], "-o", ms=2.5, lw=1, color=color, label=label)
        if key != "step":  # the step's reference is exact: no baseline of its own
            ax.plot(xs, [max(r["baseline_rel_l2"], _FLOOR) for r in sec["params"]], ":", lw=1, color=color)
        if key != "update":  # updates are reported, not judged
            ax.plot(xs, [r["tol"] for r in sec["params"]], "--", lw=0.8, color=color, alpha=0.6)
    first = case.get("first_divergence")
    if first:
        ax.plot([names.index(first["param"])], [max(first["rel_l2"], _FLOOR)], "x", color="red", ms=14, mew=3,
                label=f"first divergence: {first['kind']} of {first['param']}")
    ticks = [i for i, n in enumerate(names) if not n.startswith("model.layers.") or n.endswith("mlp.down_proj.weight")]
    ax.set_xticks(ticks)
    ax.set_xticklabels([names[i].replace("model.", "").replace(".mlp.down_proj.weight", "") for i in ticks],
                       rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("parameter, in backward order from the loss (a tick per layer's first parameter)")
    ax.set_ylabel("rel. L2 vs fp64")
    ax.set_title(f"trainer ({case['dtype']}) — solid; oracle {case['baseline_policy']} — dotted; tolerance — dashed",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(case["id"] + " gradients and AdamW steps" + ("  PASS" if case["pass"] else "  FAIL"), fontsize=10,
                 color="black" if case["pass"] else "red")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _grad_summary(case: dict[str, Any]) -> dict[str, Any]:
    k = case["steps"]
    worst = lambda sec: max((r["rel_l2"] / r["tol"] for r in case[sec]["params"]), default=0.0)  # noqa: E731
    return {"grads_max": max(r["rel_l2"] for r in case["grads"]["params"]),
            "grads_margin": worst("grads"), "step_margin": worst(f"step@{k}"),
            "update": "{:.2e} ({:.2e})".format(*(max(r[x] for r in case[f"update@{k}"]["params"])
                                                   for x in ("rel_l2", "baseline_rel_l2"))),
            "loss": f"{case['loss']['trainer'][0]:.5f} / {case['loss']['truth'][0]:.5f}"}


def _grad_where(first: dict[str, Any] | None) -> str:
    return "-" if first is None else f"{first['kind']} of {first['param']}"


def _fidelity_summary(case: dict[str, Any]) -> tuple[float, float] | None:
    """(median, max) over layers of the trainer-vs-emulation / distance-to-fp64 ratio of `hidden`."""
    rows = [r["taps"]["hidden"]["ratio"] for r in case.get("fidelity", []) if "hidden" in r["taps"]]
    if not rows:
        return None
    s = sorted(rows)
    return s[len(s) // 2], s[-1]


def render_markdown(result: dict[str, Any]) -> str:
    """A summary for CI logs: one row per case, then the failing cases' first divergence."""
    cases = result["cases"]
    n_fail = sum(not c["pass"] for c in cases)
    lines = [
        f"# Parity: {len(cases) - n_fail}/{len(cases)} cases pass" + ("" if not n_fail else f", {n_fail} FAIL"),
        "",
        f"Rule: fp32 rel. L2 vs fp64 <= max({result['rule']['fp32_tol']:g}, {result['rule']['factor']:g} x "
        f"(oracle fp32 vs fp64)) per tap; bf16 rel. L2 vs fp64 <= "
        f"{result['rule']['factor']:g} x (oracle emulation vs fp64) + {result['rule']['floor']:g} per tap "
        f"(logits: also mean KL <= {result['rule']['factor']:g} x + {result['rule']['kl_floor']:g}).",
        "",
        "| case | pass | first divergence | logits rel L2 | baseline | KL mean | worst margin | fidelity (hidden, median/max) | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if result.get("unfinished"):
        lines[1:1] = ["", f"**Unfinished**: the run(s) kept in {', '.join(result['unfinished'])} stopped before their last "
                          "case; this report holds the cases they finished (tools/merge_parity.py)."]
    for c in cases:
        s = c["summary"]
        fid = _fidelity_summary(c)
        lines.append(
            f"| {c['id']} | {'pass' if c['pass'] else '**FAIL**'} | {where(c['first_divergence'])} | "
            f"{_g(s['logits_rel_l2'])} | {_g(s['logits_baseline_rel_l2'])} | {_g(s['logits_kl_mean'])} | "
            f"{s['worst_margin']:.2f} | {'-' if fid is None else f'{fid[0]:.2f} / {fid[1]:.2f}'} | {c['runtime_s']:.1f} |"
        )
    fails = [c for c in cases if not c["pass"]]
    if fails:
        lines += ["", "## Failing cases", ""]
        for c in fails:
            f = c["first_divergence"]
            lines.append(f"- {c['id']}: first divergent at {where(f)} (rel. L2 {f['rel_l2']:.3e} > tol {f['tol']:.3e}; "
                         f"{c['failures']} taps fail)")
    grad_cases = result.get("grad_cases", [])
    if grad_cases:
        n_gfail = sum(not c["pass"] for c in grad_cases)
        opt = result.get("optimizer", {})
        lines += ["", f"## Gradients and AdamW steps: {len(grad_cases) - n_gfail}/{len(grad_cases)} pass", "",
                  f"Per parameter: rel. L2 of the gradient vs fp64, and of the trainer's update after 1 and "
                  f"{grad_cases[0]['steps']} AdamW steps vs the oracle's AdamW on the same gradients (lr {opt.get('lr')}, betas {opt.get('betas')}, weight decay "
                  f"{opt.get('weight_decay')} except {opt.get('no_decay')}): fp32 <= max({result['rule']['fp32_tol']:g}, "
                  f"{result['rule']['factor']:g} x the oracle's fp32), bf16 <= "
                  f"{result['rule']['factor']:g} x the emulation's + {result['rule']['floor']:g} (gradients); steps within "
                  f"{result['rule']['fp32_tol']:g}. The trajectory against fp64 truth's (p_k - p_0) is reported beside the "
                  f"oracle's own, not judged (AdamW's sign-like first step).", "",
                  "| case | pass | first divergence (backwards from the loss) | max grad rel L2 | grad margin | step margin | update vs fp64 (oracle's) | loss trainer / truth | s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in grad_cases:
            g = _grad_summary(c)
            lines.append(f"| {c['id']} | {'pass' if c['pass'] else '**FAIL**'} | {_grad_where(c['first_divergence'])} | "
                         f"{g['grads_max']:.2e} | {g['grads_margin']:.2f} | {g['step_margin']:.2f} | {g['update']} | {g['loss']} | "
                         f"{c['runtime_s']:.1f} |")
    lines += ["", "`worst margin`: max over taps of error / tolerance (< 1 passes). `fidelity`: distance between the "
              "trainer in bf16 and the oracle's emulation of the same stack, over the larger of their distances to fp64.",
              "", f"Total {result['runtime_s']:.0f} s."]
    if result.get("reused"):
        r = result["reused"]
        lines[-1] += (f" {r['cases']} case(s) and {r['grad_cases']} gradient case(s) were finished by an earlier "
                      f"run (killed, or with --keep-parts) with the same settings, code, versions and machine, "
                      f"and taken from what it kept ({r['seconds']:.0f} s of its time).")
    return "\n".join(lines) + "\n"


def _fidelity_table(case: dict[str, Any]) -> str:
    rows = []
    for r in case["fidelity"]:
        for name, f in r["taps"].items():
            rows.append(f"<tr><td>{r['layer']}</td><td>{name}</td><td>{_g(f['trainer_vs_emulation'])}</td>"
                        f"<td>{_g(f['trainer_vs_fp64'])}</td><td>{_g(f['emulation_vs_fp64'])}</td>"
                        f"<td>{f['ratio']:.2f}</td></tr>")
    return ("<details><summary>emulation fidelity per layer and tap</summary><table><tr><th>layer</th><th>tap</th>"
            "<th>trainer vs emulation</th><th>trainer vs fp64</th><th>emulation vs fp64</th><th>ratio</th></tr>"
            + "".join(rows) + "</table></details>")


def _errors_table(case: dict[str, Any]) -> str:
    rows = []
    for e in case["layers"]:
        for name, err in e["taps"].items():
            bad = "" if err.get("pass", True) else ' class="fail"'
            extra = f" KL {err['kl_mean']:.2e}" if "kl_mean" in err else ""
            rows.append(f"<tr{bad}><td>{e['layer']}</td><td>{name}</td><td>{_g(err['rel_l2'])}</td>"
                        f"<td>{_g(err['max_abs'])}</td><td>{_g(err.get('baseline_rel_l2'))}</td>"
                        f"<td>{_g(err.get('tol'))}</td><td>{'ok' if err.get('pass', True) else 'FAIL'}{extra}</td></tr>")
    return ("<details><summary>errors per layer and tap</summary><table><tr><th>layer</th><th>tap</th><th>rel L2</th>"
            "<th>max abs</th><th>baseline rel L2</th><th>tol</th><th></th></tr>" + "".join(rows) + "</table></details>")


def _grad_table(case: dict[str, Any]) -> str:
    k = case["steps"]
    secs = [s for s in ("grads", "step@1", f"step@{k}", "params@1", f"params@{k}", "update@1", f"update@{k}") if s in case]
    secs = list(dict.fromkeys(secs))
    rows = []
    by = {s: {r["param"]: r for r in case[s]["params"]} for s in secs}
    for r in case["grads"]["params"]:
        n = r["param"]
        cells = "".join(("<td>" if by[s][n]["pass"] else "<td class='fail'>")
                        + f"{_g(by[s][n]['rel_l2'])} / {_g(by[s][n]['tol'])}</td>" for s in secs)
        rows.append(f"<tr><td>{html.escape(n)}</td>{cells}<td>{r['cosine']:.8f}</td><td>{_g(r['max_abs'])}</td></tr>")
    head = "".join(f"<th>{s} rel L2 / tol</th>" for s in secs)
    return (f"<details><summary>per parameter (backward order)</summary><table><tr><th>parameter</th>{head}"
            f"<th>grad cosine</th><th>grad max abs</th></tr>" + "".join(rows) + "</table></details>")


def render_html(result: dict[str, Any], figures: list[str], markdown: str, grad_figures: list[str] | None = None) -> str:
    cases = result["cases"]
    head = ("<tr><th>case</th><th>pass</th><th>first divergence</th><th>logits rel L2</th><th>baseline</th>"
            "<th>KL mean</th><th>worst margin</th><th>fidelity (hidden) median / max</th><th>s</th></tr>")
    rows = []
    for c in cases:
        s = c["summary"]
        fid = _fidelity_summary(c)
        cls = "" if c["pass"] else ' class="fail"'
        rows.append(
            f"<tr{cls}><td><a href='#{_slug(c['id'])}'>{html.escape(c['id'])}</a></td>"
            f"<td>{'pass' if c['pass'] else 'FAIL'}</td><td>{html.escape(where(c['first_divergence']))}</td>"
            f"<td>{_g(s['logits_rel_l2'])}</td><td>{_g(s['logits_baseline_rel_l2'])}</td><td>{_g(s['logits_kl_mean'])}</td>"
            f"<td>{s['worst_margin']:.2f}</td><td>{'-' if fid is None else f'{fid[0]:.2f} / {fid[1]:.2f}'}</td>"
            f"<td>{c['runtime_s']:.1f}</td></tr>")
    sections = []
    for c, fig in zip(cases, figures):
        body = [f"<h3 id='{_slug(c['id'])}'>{html.escape(c['id'])}: {'pass' if c['pass'] else 'FAIL'}</h3>",
                f"<p>{c['windows']} window(s) of {c['seq_len']} slots, layout {c['layout']}, trainer {c['dtype']} on "
                f"engine {html.escape(c['engine'])}, held against oracle {html.escape(c['policy'])} (truth fp64); "
                f"tapped attention rows {c['rows']}.</p>",
                f"<img src='{fig}' alt='layer-wise errors of {html.escape(c['id'])}'>",
                _errors_table(c)]
        if "fidelity" in c:
            body.append(_fidelity_table(c))
        sections.append("\n".join(body))
    for c, fig in zip(result.get("grad_cases", []), grad_figures or []):
        sections.append("\n".join([
            f"<h3 id='{_slug(c['id'])}-grads'>{html.escape(c['id'])} gradients and {c['steps']} AdamW steps: "
            f"{'pass' if c['pass'] else 'FAIL at ' + html.escape(_grad_where(c['first_divergence']))}</h3>",
            f"<p>Loss per step: trainer {c['loss']['trainer']}, truth {c['loss']['truth']}; tolerance from oracle "
            f"{html.escape(c['baseline_policy'])}.</p>",
            f"<img src='{fig}' alt='per-parameter errors of {html.escape(c['id'])}'>", _grad_table(c)]))
    style = ("body{font-family:sans-serif;max-width:1400px;margin:1em auto}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}tr.fail{background:#fdd}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>anchor parity</title><style>{style}</style>"
            f"</head><body><h1>{'transformers' if result.get('stack') == 'hf' else 'torchtrain'} against jaxref, "
            f"layer by layer</h1>"
            f"<pre>{html.escape(markdown.splitlines()[0].lstrip('# '))}</pre>"
            f"<p>{html.escape(markdown.splitlines()[2])}</p>"
            f"<h2>Summary</h2><table>{head}{''.join(rows)}</table><h2>Cases</h2>{''.join(sections)}</body></html>")


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(type(x).__name__)


def _finite(x: Any) -> Any:
    """JSON has no inf/nan: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def judged_cases(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The suite's case entries of a report: its cases, or, for `--stack hf`, each row's (its bf16 entry
    where the bf16 rule ran, else its fp32 entry against the variant asked; rows that raised, crashed or
    were not run have none)."""
    if result.get("stack") != "hf":
        return result["cases"]
    return [row["bf16"] or row["fp32"] for row in result["rows"] if row.get("fp32")]


def write_report(result: dict[str, Any], out: str | Path) -> Path:
    """Write parity.json, summary.md, index.html and figures/ (each case's layer-wise errors) into `out`
    atomically. Returns `out`.

    The one writer of `anchor parity`: the suite's cases, and `--stack hf`'s rows, whose summary.md is
    parity_tests.hf_report's table (what each stack computes) and whose figures are their case entries'.
    """
    out = Path(out).resolve()
    cases = judged_cases(result)
    with staging_dir(out, "parity") as tmp:
        work = tmp / "report"
        (work / "figures").mkdir(parents=True)
        figures = []
        for i, c in enumerate(cases):
            figures.append(f"figures/{i:03d}_{_slug(c['id'])}.png")
            plot_case(c, work / figures[-1])
        grad_figures = []
        for i, c in enumerate(result.get("grad_cases", [])):
            grad_figures.append(f"figures/grads_{i:03d}_{_slug(c['id'])}.png")
            plot_grad_case(c, work / grad_figures[-1])
        if result.get("stack") == "hf":
            md = render_hf(result)
        else:
            md = render_markdown(result)
        (work / "parity.json").write_text(json.dumps(_finite(result), indent=1, default=_json_default))
        (work / "summary.md").write_text(md)
        (work / "index.html").write_text(render_html({**result, "cases": cases}, figures, md, grad_figures))
        publish(work, out, "parity")
    return out
