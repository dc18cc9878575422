"""The demo's page and figures: `index.html` (a section per finished stage, tables and figures inline,
every link relative) and `summary.png` (four figures of the run side by side)."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from anchor.atomic import write_text_atomic
from anchor_app.demo.settings import DEMO_JSON, STAGES, TITLES


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure to `path` atomically (a temporary name, then a rename)."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)


SUMMARY_PANELS = (("audit", "figure1.png", "precision audit"), ("train", "loss.png", "training loss"),
                  ("eval", "ruler.png", "RULER"), ("bench", "time_ratio_vs_flop_ratio.png", "attention time"))
# Figures that fill the summary up to four panels where a profile runs no audit or bench (paper-gpu).
EXTRA_PANELS = (("train", "step_time_vs_flops.png", "step time against FLOPs"),
                ("eval", "position_loss.png", "held-out loss by position"))


def summary_figure(out: Path, record: dict[str, Any]) -> Path | None:
    """`summary.png`: the audit, the loss curves, RULER and the speed figure side by side (those that exist),
    filled up to four with EXTRA_PANELS."""
    def there(st: str, name: str) -> bool:
        return bool(record["stages"].get(st, {}).get("done")) and (out / st / name).is_file()

    panels = [(out / st / name, title) for st, name, title in SUMMARY_PANELS if there(st, name)]
    panels += [(out / st / name, title) for st, name, title in EXTRA_PANELS if there(st, name)][:max(0, 4 - len(panels))]
    target = out / "summary.png"
    if not panels:
        target.unlink(missing_ok=True)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    # the audit's figure (four panels of its own) spans the top row at full width; the others share rows of two
    wide = [pt for pt in panels if pt[1] == "precision audit"]
    rest = [pt for pt in panels if pt[1] != "precision audit"]
    cols = 2 if len(rest) > 1 else 1
    rows = (len(rest) + cols - 1) // cols
    heights = ([2.0] if wide else []) + [1.0] * rows
    fig = plt.figure(figsize=(7 * cols if rest else 14, 4.2 * sum(heights)))
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights)
    cells = ([fig.add_subplot(grid[0, :])] if wide else []) + [
        fig.add_subplot(grid[(1 if wide else 0) + k // cols, k % cols]) for k in range(len(rest))]
    for ax, (path, title) in zip(cells, wide + rest):
        ax.axis("off")
        ax.imshow(mpimg.imread(path))
    fig.suptitle(f"anchor demo — {record['model']}", fontsize=14)
    fig.tight_layout()
    save_figure(fig, target, dpi=90)
    plt.close(fig)
    return target


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def num(x: Any, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


class _Page:
    def __init__(self, out: Path):
        self.out, self.parts = out, []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def link(self, rel: str, text: str | None = None) -> str:
        """A relative link to `rel` when the file exists (else its name, unlinked)."""
        if (self.out / rel).exists():
            return f"<a href='{_esc(rel)}'>{_esc(text or rel)}</a>"
        return _esc(text or rel)

    def img(self, rel: str, alt: str) -> None:
        self.figs([(rel, alt)], grid=False)

    def figs(self, items: list[tuple[str, str]], grid: bool = True) -> None:
        """Figures that exist, inline; two to a row when `grid`."""
        cells = [f"<figure><img src='{_esc(rel)}' alt='{_esc(alt)}'><figcaption>{_esc(alt)}</figcaption></figure>"
                 for rel, alt in items if (self.out / rel).is_file()]
        if cells:
            self.add(f"<div class='{'figs' if grid and len(cells) > 1 else 'fig'}'>" + "".join(cells) + "</div>")


def _section_top5(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Prompt <code>{_esc(s['prompt'])}</code> ({s['tokens']} tokens), oracle policy {_esc(s['policy'])}. "
          f"Same top-5 in the same order: <b>{s['same_top5']}</b>; largest probability difference "
          f"{s['max_prob_diff_top5']:.2e}. {p.link('top5/top5.md', 'top5.md')}</p>")
    p.add(_table(["rank", "oracle", "p", "transformers", "p"],
                 [[r, repr(a["token"]), f"{a['prob']:.5f}", repr(b["token"]), f"{b['prob']:.5f}"]
                  for r, (a, b) in enumerate(zip(s["oracle"], s["transformers"]), 1)]))


def _section_corpus(p: _Page, s: dict[str, Any]) -> None:
    flat = [[k, v if not isinstance(v, (dict, list)) else json.dumps(v)[:120]] for k, v in s.items()]
    p.add(_table(["key", "value"], flat))
    p.add(f"<p>{p.link('corpus/corpus.json', 'corpus.json')}</p>")


def _section_pack(p: _Page, s: dict[str, Any]) -> None:
    p.add(_table(["key", "value"], [[k, v] for k, v in s.items()]))
    p.add(f"<p>{p.link('pack/stats.md', 'stats.md')} · {p.link('pack/stats.json', 'stats.json')}</p>")


def _section_audit(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Policies {', '.join(map(_esc, s.get('policies', [])))}: attention difference D under a shift of every "
          f"position, per token and per length (quick settings). {p.link('audit/report.md', 'report.md')} · "
          f"{p.link('audit/audit.json', 'audit.json')}</p>")
    p.img("audit/figure1.png", "figure 1: the paper's panels on this model")
    p.figs([(f"audit/{name}.png", name.replace("_", " "))
            for name in ("shift_curve", "per_token", "length_curve", "error_budget")])


def _section_train(p: _Page, s: dict[str, Any]) -> None:
    rope = f", RoPE base {num(s['rope_theta'], '.3g')}" if s.get("rope_theta") else ""
    zero = f", DeepSpeed ZeRO-{s['zero_stage']}" if s.get("zero_stage") else ""
    p.add(f"<p>{_esc(s['model'])}, windows of {s['seq_len']} slots, engine {_esc(s['engine'])}, {_esc(s['dtype'])}"
          f"{_esc(rope)}{_esc(zero)}. Step time: median over the steps after the first; FLOP ratio: the run's "
          "mask against full attention on the windows it trained on, for the whole step (6 FLOPs per matmul "
          "parameter and token plus attention) and for attention alone (anchor_app/bench/flops.py).</p>")
    def load(r: dict[str, Any]) -> str:
        la = r.get("load_average") or {}
        text = f"{num(la.get('before'), '.2f')} → {num(la.get('after'), '.2f')} ({la.get('cores', '?')} cores)"
        return text + (" busy" if r.get("busy") else "")

    def ratio(r: dict[str, Any], k: str) -> str:
        return num((r.get("flop_ratio") or {}).get(k), ".3f")

    p.add(_table(["run", "dtype", "engine", "device", "steps", "loss: first", "last", "step s (median)", "tokens/s",
                  "step time / full", "FLOP ratio: step", "attention", "load average (before → after)",
                  "evaluation checkpoints"],
                 [[v, r.get("dtype", s["dtype"]), r.get("engine", s["engine"]), r.get("device", ""), r["steps"], num(r["loss_first"]),
                   num(r["loss_last"]), num(r["step_s_median"], ".3g"), num(r["tokens_per_s_median"], ".4g"),
                   num(r.get("step_time_vs_full"), ".3f"), ratio(r, "step"), ratio(r, "attention"), load(r),
                   ", ".join(r["eval_checkpoints"])] for v, r in s["runs"].items()]))
    busy = [v for v, r in s["runs"].items() if r.get("busy")]
    if busy:
        p.add(f"<p class='note'>The machine was busy with other work when {', '.join(map(_esc, busy))} started "
              "(1-minute load average above half the cores): its step times, and the ratios to full, are not "
              "comparable. Run the demo alone to time it.</p>")
    whys = [(v, r["step_time_vs_full_why"]) for v, r in s["runs"].items() if r.get("step_time_vs_full_why")]
    if whys:
        p.add("<p class='note'>Step time / full: " + "; ".join(f"{_esc(v)}: {_esc(w)}" for v, w in whys) + ".</p>")
    p.figs([("train/loss.png", "loss per step"),
            ("train/step_time_vs_flops.png", "step time over full's against the FLOP ratio")])
    p.add("<p>" + " · ".join(f"{v}: {p.link(f'train/{v}/metrics.jsonl', 'metrics.jsonl')}, "
                              f"{p.link(f'train/{v}/config.yaml', 'config.yaml')}" for v in s["runs"]) + "</p>")


def _section_parity(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Model: the trained checkpoint <code>{_esc(s['model'])}</code>. Forward, layer by layer: "
          f"<b>{s['passed']}/{s['cases']}</b> cases pass; gradients of every parameter and AdamW steps (fp32, "
          f"<code>{_esc(s.get('grad_model', s['model']))}</code>): <b>{s['grad_passed']}/{s['grad_cases']}</b>. "
          f"{p.link('parity/index.html', 'layer-wise report')} · {p.link('parity/summary.md', 'summary.md')}</p>")
    p.add(_table(["case", "pass"], s["ids"]))
    p.figs([(f"parity/figures/{fig.name}", fig.stem.split("_", 2)[-1] + ": per-parameter errors")
            for fig in sorted((p.out / "parity" / "figures").glob("grads_*.png"))[:4]])


def score_cell(x: dict[str, Any]) -> str:
    """A score averaged over checkpoints: mean ± std over them, and the standard error over samples."""
    se = f" (SE {x['se']:.1f})" if x.get("se") is not None else ""
    return f"{x['mean']:.1f} ± {x['std']:.1f}{se}"


def _section_eval(p: _Page, s: dict[str, Any]) -> None:
    Ls = [str(L) for L in s["lengths"]]
    p.add(f"<p>RULER tasks {', '.join(map(_esc, s['tasks']))}, {s['samples']} samples per task and length, greedy, "
          f"{_esc(s['dtype'])}, prefill engine {_esc(s.get('engine', 'sdpa'))}; each cell: the mean of the tasks, "
          "mean ± std over the run's evaluation checkpoints (the paper's table), and in brackets the standard "
          "error over samples (each sample's score averaged over the checkpoints, which read the same prompts; "
          f"at most 50 / √({len(s['tasks'])} × {s['samples']}) = "
          f"{50 / (len(s['tasks']) * s['samples']) ** 0.5:.1f} points for a 0–100 score).</p>")
    if s.get("dtype_choice", {}).get("reason"):
        p.add(f"<p>dtype: {_esc(s['dtype_choice']['reason'])}.</p>")
    p.add(_table(["run", "checkpoints", *Ls],
                 [[v, ", ".join(r["checkpoints"]), *[score_cell(r["scores"][L]) for L in Ls]] for v, r in s["runs"].items()]))
    p.img("eval/ruler.png", "RULER score against length")
    rows = []
    for v, r in s["runs"].items():
        for t in r["tasks"]:
            rows.append([v, t["task"], t["length"], score_cell(t)])
    p.add("<h3>Per task</h3>" + _table(["run", "task", "length", "score: mean ± std over checkpoints (SE)"], rows))
    if any(r["perplexity"] for r in s["runs"].values()):
        docs = ("one long held-out document per window" if s.get("perplexity_docs") == "long"
                else "held-out packed windows")
        p.add(f"<h3>Perplexity on {docs} (mean over checkpoints)</h3>")
        p.add(_table(["run", *Ls], [[v, *[num(r["perplexity"].get(L), ".4g") for L in Ls]] for v, r in s["runs"].items()]))
    _position_buckets(p, s)
    if s.get("reset", {}).get("pairs"):
        _reset(p, s["reset"])
    p.add("<p>" + " · ".join(f"{v}: {p.link(f'eval/{v}/report.md', 'report.md')}, "
                              f"{p.link(f'eval/{v}/samples.jsonl', 'samples.jsonl')}" for v in s["runs"]) + "</p>")


def _position_buckets(p: _Page, s: dict[str, Any]) -> None:
    """The held-out NLL by position bucket at the longest length: a run per row, mean ± std over checkpoints."""
    with_buckets = {v: r["buckets"] for v, r in s["runs"].items() if r.get("buckets")}
    if not with_buckets:
        return
    L = str(max(int(x) for b in with_buckets.values() for x in b))
    spans = sorted({(c["start"], c["end"]) for b in with_buckets.values() for c in b.get(L, [])})
    p.add(f"<h3>Held-out loss by position at {L} (NLL per token, mean ± std over checkpoints)</h3>")
    p.add(f"<p>Bucket a–b: the predictions made at positions a to b − 1 of the held-out "
          f"{'documents' if s.get('perplexity_docs') == 'long' else 'windows'}.</p>")
    rows = []
    for v, b in with_buckets.items():
        by = {(c["start"], c["end"]): c for c in b.get(L, [])}
        rows.append([v, *[f"{by[k]['nll']:.3f} ± {by[k]['std']:.3f}" if k in by else "—" for k in spans]])
    p.add(_table(["run", *[f"{a}–{e}" for a, e in spans]], rows))
    p.img("eval/position_loss.png", "held-out loss by position, and against full attention")


def _reset(p: _Page, r: dict[str, Any]) -> None:
    """intra_doc_reset − intra_doc in each dtype (anchor_app.demo.summary.reset_effect)."""
    p.add("<h3>The reset of positions: intra_doc_reset − intra_doc, bf16 against fp32</h3>")
    p.add(f"<p>Training loss over the first {r.get('steps_compared')} steps (the steps every one of these runs "
          "trained, on the same windows), RULER (mean of tasks) and held-out NLL, each averaged over the runs' "
          "evaluation checkpoints. In exact arithmetic the reset changes nothing under an intra-document mask "
          "(RoPE is relative); fp32 keeps that to rounding.</p>")
    Ls = sorted({L for e in r["pairs"] for L in e.get("ruler_diff", {})}, key=int)
    rows = []
    for e in r["pairs"]:
        ld = e["loss_diff"]
        rows.append([" − ".join(reversed(e["runs"])), e.get("dtype"), f"{ld['mean_abs']:.3g}", f"{ld['max_abs']:.3g}",
                     *[num(e.get("ruler_diff", {}).get(L), "+.1f") for L in Ls],
                     *[num(e.get("heldout_nll_diff", {}).get(L), "+.3g") for L in Ls]])
    p.add(_table(["runs", "dtype", "|Δ loss| mean", "max", *[f"Δ RULER {L}" for L in Ls],
                  *[f"Δ NLL {L}" for L in Ls]], rows))
    if r.get("size"):
        p.add(f"<p><b>{_esc(r['size'])}</b>.</p>")


def _section_bench(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Attention alone, forward + backward, on windows packed from the corpus ({_esc(s.get('machine'))}); "
          "ratios against full measured in the same run on the same windows.</p>")
    p.add(_table(["engine", "variant", "T", "ms", "time / full", "FLOPs / full"],
                 [[r["engine"], r["variant"], r["seq_len"], num(r["ms"], ".4g"), num(r["time_ratio"], ".3f"),
                   num(r["flop_ratio"], ".3f")] for r in s["attention"]]))
    p.figs([(f"bench/{name}.png", name.replace("_", " ")) for name in ("time_ratio_vs_flop_ratio", "time_vs_length")])
    est = [e for e in s.get("estimate", []) if e.get("variant") == "anchor"]
    if est:
        p.add("<h3>Estimate for the paper's setting (assumed GPU rates)</h3>")
        p.add(_table(["model", "T", "GPUs", "distribution", "days / 1B tokens", "saving vs full"],
                     [[e.get("model"), e.get("seq_len"), e.get("gpus"), e.get("distribution"),
                       num(e.get("days_per_1b_tokens"), ".3g"), num(e.get("saving_vs_full"), ".1%")] for e in est]))
    p.add(f"<p>{p.link('bench/report.md', 'report.md')} · {p.link('bench/bench.json', 'bench.json')}</p>")


SECTIONS = {"top5": _section_top5, "corpus": _section_corpus, "pack": _section_pack, "audit": _section_audit,
            "train": _section_train, "parity": _section_parity, "eval": _section_eval, "bench": _section_bench}

_CSS = ("body{font:15px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
        "img{max-width:100%}figure{margin:1em 0}figcaption{font-size:12px;color:#666}"
        "table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #ddd;"
        "text-align:left;font-size:13px}code{background:#f4f4f4;padding:0 3px}.note{color:#a60}"
        ".figs{display:grid;grid-template-columns:1fr 1fr;gap:10px}.fig img{max-width:720px}")


def index_page(out: Path, record: dict[str, Any], fps: dict[str, str] | None = None) -> None:
    """`index.html`: a section per finished stage, tables and figures inline, every link relative."""
    p = _Page(out)
    done = [st for st in STAGES if record["stages"].get(st, {}).get("done")]
    p.add(f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>anchor demo — {_esc(record['model'])}"
          f"</title><style>{_CSS}</style></head><body>")
    p.add(f"<h1>anchor demo — {_esc(record['model'])}</h1>")
    p.add(f"<p>The paper's experiment end to end: {', '.join(done) or 'no stage finished yet'}. "
          f"This run: {record.get('seconds', 0):.0f} s; ran {', '.join(record.get('ran', [])) or 'nothing'}; "
          f"reused {', '.join(record.get('reused', [])) or 'nothing'}. {p.link(DEMO_JSON, DEMO_JSON)}</p>")
    for part in record.get("merged_from") or []:
        p.add(f"<p>Part {_esc(part['folder'])}: runs {_esc(', '.join(part['runs']))} on "
              f"{_esc(', '.join(part['devices']))}, {num(part.get('seconds'), '.0f')} s, finished "
              f"{_esc(part.get('finished'))} (anchor demo --merge).</p>")
    if record.get("left_out"):
        p.add("<p class='note'>Left out on this model: " + "; ".join(map(_esc, record["left_out"])) + ".</p>")
    if record.get("summary_json"):
        p.add(f"<p>Summary of the runs: {p.link(record['summary_json'], record['summary_json'])} (machine, seconds, "
              "per run and evaluation checkpoint: RULER per task and length with standard errors, held-out loss "
              "by position, step times).</p>")
    p.img("summary.png", "summary: audit, training loss, RULER, attention time")
    p.add("<ul>" + "".join(f"<li><a href='#{st}'>{_esc(TITLES[st])}</a></li>" for st in done) + "</ul>")
    for st in done:
        rec = record["stages"][st]
        p.add(f"<h2 id='{st}'>{_esc(TITLES[st])}</h2>")
        stale = fps is not None and rec.get("fingerprint") != fps.get(st)
        p.add(f"<p>Finished {_esc(rec.get('finished'))} in {num(rec.get('seconds'), '.0f')} s"
              + (" <span class='note'>(from an earlier demo with other settings)</span>" if stale else "") + ".</p>")
        try:
            SECTIONS[st](p, rec["summary"])
        except (KeyError, TypeError) as e:  # a record from an older demo: link the folder
            p.add(f"<p class='note'>No summary in this record ({_esc(e)}).</p>")
    p.add("</body></html>")
    write_text_atomic(out / "index.html", "\n".join(p.parts) + "\n")
