"""The sections of the demo's page: one per job, written from that job's summary in demo.json as HTML.

`SECTIONS` maps each job name to the function that adds its section to a `_Page` (the page's parts, with
relative links and inline figures for the files that exist): tables of the summary's numbers with what they
mean, and the figures the job saved. `num`, `score_cell` and `docs_sentence` format the numbers the same
way on the page and in the profile's summary.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from anchor.demo.figures import _read_json


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def num(x: Any, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


class _Page:
    def __init__(self, out: Path, record: dict[str, Any] | None = None):
        self.out, self.parts, self.record = out, [], record

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


def _text(v: Any) -> str:
    """A value for a table cell or a sentence: numbers formatted, a mapping as `key value, ...` (nested ones in
    brackets), a list comma-separated; never a dict's or JSON's braces."""
    if isinstance(v, bool) or v is None:
        return "—" if v is None else str(v).lower()
    if isinstance(v, float):
        return format(v, ".4g")
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, dict):
        return ", ".join(f"{k.replace('_', ' ')} {_text(x) if not isinstance(x, dict) else '(' + _text(x) + ')'}"
                         for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(_text(x) for x in v)
    return str(v)


def _kv_table(d: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """The scalar (and formatted) entries of a summary as a two-column table."""
    return _table(["key", "value"], [[k.replace("_", " "), _text(v)] for k, v in d.items() if k not in skip])


def _section_corpus(p: _Page, s: dict[str, Any]) -> None:
    p.add(_kv_table(s, skip=("domains",)))
    domains = s.get("domains")
    if isinstance(domains, dict) and domains:
        p.add(_table(["domain", "documents", "characters"],
                     [[d, _text(x.get("docs")), _text(x.get("chars"))] if isinstance(x, dict) else [d, _text(x), ""]
                      for d, x in domains.items()]))
    p.add(f"<p>{p.link('corpus/corpus.json', 'corpus.json')}</p>")


def docs_sentence(s: dict[str, Any]) -> str:
    """Documents per window (median, quartiles, range) and the share of slots whose visible keys differ
    between the anchor mask and full attention, from the pack job's summary ('' without them)."""
    d, share = s.get("docs_per_window"), s.get("keys_differ_share")
    if not isinstance(d, dict) or share is None:
        return ""
    return (f"Documents per window: median {d['median']:g} (quartiles {d['q1']:g}–{d['q3']:g}, range "
            f"{d['min']}–{d['max']}, mean {d['mean']:.1f}). Slots whose visible keys differ between anchor and full "
            f"attention: {share:.0%} (a slot of a window's first document sees the same keys under both; one of a "
            "later document sees its own document and the anchor under anchor, every earlier slot under full).")


def _section_pack(p: _Page, s: dict[str, Any]) -> None:
    text = docs_sentence(s)
    if text:
        p.add(f"<p><b>{_esc(text)}</b> In a window of one document, anchor, intra-document and full attention "
              "compute the same thing; the share above is where the runs' computations differ (the training "
              "section gives the attention FLOP ratio of anchor to full on the windows they trained on).</p>")
    docs = s.get("documents")
    if isinstance(docs, dict) and "pieces" in docs:
        t = docs.get("tokens_per_piece") or {}
        p.add(f"<p>The corpus's {docs['documents']:,} files are cut where they divide themselves: modules at each "
              f"function, class and method, texts at each section heading ({p.link('pack/pieces.jsonl', 'pieces.jsonl')}); "
              f"{docs['pieces']:,} pieces of a median {num(t.get('median'), '.0f')} tokens (quartiles "
              f"{num(t.get('q1'), '.0f')}–{num(t.get('q3'), '.0f')}, 90th percentile {num(t.get('p90'), '.0f')}, "
              f"longest {num(t.get('max'), ',')}): most pieces short, a few long, so windows hold several documents "
              "each, as the paper's do. "
              f"{docs.get('left_out', 0):,} pieces longer than {num(docs.get('max_chars'), ',')} characters "
              "(data tables: character maps, entity lists) are left out: each would fill several windows alone. "
              f"{num(docs.get('selected'), ',')} pieces are taken in each domain's share of tokens "
              f"({_esc(docs.get('mixture', ''))} mixture) and packed in order.</p>")
        if isinstance(docs.get("domains"), dict):
            p.add(_table(["domain", "files", "pieces", "left out", "characters left out"],
                         [[d, _text(x.get("documents")), _text(x.get("pieces")), _text(x.get("left_out")),
                           _text(x.get("left_out_chars"))] for d, x in docs["domains"].items()]))
    w = s.get("windows")
    if isinstance(w, dict):
        dpw = w.get("docs_per_window") or {}
        p.add(_table(["windows", "slots per window", "slots", "padding slots", "windows holding a boundary"],
                     [[_text(w.get("count")), _text(w.get("seq_len")), _text(w.get("slots")),
                       _text(w.get("padding_slots")), num(w.get("boundary_window_share"), ".0%")]]))
        if not text and dpw:
            p.add(f"<p>Documents per window: median {num(dpw.get('median'), 'g')}, mean "
                  f"{num(dpw.get('mean'), '.2f')}, max {num(dpw.get('max'), 'g')}.</p>")
    rest = {k: v for k, v in s.items() if k not in ("windows", "documents", "docs_per_window", "keys_differ_share")}
    if rest:
        p.add(_kv_table(rest))
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
          "parameter and token plus attention) and for attention alone (anchor_core/flops.py). Load "
          "average: the machine's 1-minute load (os.getloadavg) sampled while the run trained, against its "
          "cores: above the cores, other work shared them and the step times are longer than the run's own.</p>")
    choice = (p.record or {}).get("dtype_choice")
    if choice:
        p.add(f"<p>Precision: <b>{_esc(choice['dtype'])}</b> for training and evaluation, because "
              f"{_esc(choice['reason'])}.</p>")
    def load(r: dict[str, Any]) -> str:
        la = r.get("load_average") or {}
        text = f"{num(la.get('before'), '.2f')} → {num(la.get('after'), '.2f')} ({la.get('cores', '?')} cores)"
        during = la.get("during") or {}
        if during.get("samples"):
            text = (f"{num(during.get('mean'), '.2f')} ({num(during.get('min'), '.2f')}–{num(during.get('max'), '.2f')}, "
                    f"{during['samples']} samples); " + text)
        return text + (" busy" if r.get("busy") else "")

    def ratio(r: dict[str, Any], k: str) -> str:
        return num((r.get("flop_ratio") or {}).get(k), ".3f")

    p.add(_table(["run", "dtype", "engine", "device", "steps", "loss: first", "last", "step s (median)", "tokens/s",
                  "step time / full", "FLOP ratio: step", "attention",
                  "load average: during the run (range, samples); before → after",
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
    if s.get("trained_dtype"):
        p.add(f"<p>The checkpoint trained in {_esc(s['trained_dtype'])}; forward cases under the policies "
              f"{_esc(', '.join(s.get('policies', [])))} (its own dtype among them).</p>")
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
    demo = (p.record or {}).get("dtype_choice")
    if demo and demo.get("dtype") == s.get("dtype"):  # the demo chose it for training and evaluation
        p.add(f"<p>dtype: {_esc(s['dtype'])}, as the training's: {_esc(demo['reason'])}.</p>")
    elif s.get("dtype_choice", {}).get("reason"):
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
    """intra_doc_reset − intra_doc in each dtype (anchor.demo.summary.reset_effect)."""
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
    m = (_read_json(p.out / "bench" / "bench.json") or {}).get("machine") or {}
    end, cores = m.get("load_average"), os.cpu_count()
    load = (f" The machine's 1-minute load average when the bench ended: {end[0]:.2f} on {cores} cores"
            + (" (above half the cores: other work shared them while it timed)"
               if end[0] > 0.5 * (cores or 1) else "") + "." if isinstance(end, list) and end else "")
    p.add(f"<p>Attention alone, forward + backward, on windows packed from the corpus ({_esc(s.get('machine'))}); "
          f"ratios against full measured in the same run on the same windows.{_esc(load)}</p>")
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
