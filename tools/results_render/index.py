"""The index page (every record) and README.md's headline table."""

from __future__ import annotations

import html
import json
from pathlib import Path

from .evaluation import ruler_scores
from .gpu import not_todays, parity_counts
from .precision import shift_curves
from .records import (AUDIT, BENCH_H100, GENERATED, GPU_PARITY, PAPER_SMALL, RECORD_DIRS, Records, machine_label,
                      model_label, provenance)
from .speed import bench_attention
from .stats import Stats, num, ratio_cells, table


def path_cell(rel: str) -> str:
    """A record's path for a table cell that may wrap only after a folder's slash (HTML code, `<wbr>`)."""
    return "<code>" + "/<wbr>".join(html.escape(part) for part in rel.split("/")) + "</code>"


def all_records(records: Records) -> list[str]:
    files = sorted(p for d in RECORD_DIRS for p in (records.root / d).rglob("*.json")
                   if "/.venv/" not in str(p) and ".parts" not in p.parts[-2])
    rows = []
    for p in files:
        rel = p.relative_to(records.root).as_posix()
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except ValueError:
            rows.append([path_cell(rel), "**not valid JSON**", "", "", ""])
            continue
        if not isinstance(rec, dict):
            continue
        what = rec.get("benchmark") or rec.get("what") or rec.get("session") or rec.get("stack") and "stock " \
            "transformers under the oracle" or ("anchor parity" if "cases" in rec else "") or \
            ("anchor audit" if "policies" in rec else "")
        date, commit = provenance(rec)
        rows.append([path_cell(rel), str(what).split(". ")[0][:90], machine_label(rec), date, f"`{commit}`"])
    return table(["record", "what", "machine", "date", "commit"], rows)


def index_page(records: Records) -> str:
    out = ["# Results", "", GENERATED, "",
           "Every figure on these pages is computed from a JSON record in the repository, which names the machine "
           "it came from; the date and commit are the record's own. The product's records live under `results/` by "
           "topic (`results/gpu/` holds every GPU record), written by `benchmarks/` and the product's own runs; "
           "one-off investigations keep theirs in `experiments/<topic>/results/`.", "",
           "- [Precision](precision.md): what bf16 does to RoPE, measured by the audit",
           "- [Speed](speed.md): anchor against full attention, the trainer against a plain loop",
           "- [Memory](memory.md): peaks against the estimates that refuse a run",
           "- [On the GPU](gpu.md): the real kernels against the oracle",
           "- [Evaluation](evaluation.md): the demo, RULER, and stock transformers per variant", "",
           "## Every record", ""]
    out += all_records(records)
    return "\n".join(out)


def readme_table(records: Records) -> list[str]:
    """README's headline table: one line per claim, each with its record, machine, date and commit."""
    rows = []
    if records.exists(AUDIT):
        rec = records.load(AUDIT)
        curves = shift_curves(AUDIT, rec)
        if "fp32" in curves:
            fp32 = curves["fp32"]
            worst = max((p for p in curves if p != "fp32"), key=lambda p: curves[p].mean)
            rows.append([f"bf16 moves a pretrained model's attention when positions shift (model "
                         f"{model_label(rec.get('model'))})", f"D over {fp32.n} shifts, by mean: fp32 {num(fp32.mean)}, "
                         f"`{worst}` {num(curves[worst].mean)}; "
                         f"by median: {num(fp32.median)}, {num(curves[worst].median)}", AUDIT, rec])
    if records.exists(BENCH_H100):
        rec = records.load(BENCH_H100)
        rows_h = [a for a in rec.get("attention", []) if a.get("variant") == "anchor" and "error" not in a
                  and a.get("distribution") == "corpus"]
        longest = max(rows_h, key=lambda a: a["seq_len"], default=None)
        if longest:
            full = next(a for a in rec["attention"] if a.get("variant") == "full" and a.get("distribution") == "corpus"
                        and a.get("seq_len") == longest["seq_len"] and a.get("engine") == longest["engine"])
            by_mean, by_median = ratio_cells(Stats.of(longest["ms_windows"]), Stats.of(full["ms_windows"]))
            bench_attention(BENCH_H100, rec)  # the stored sums and ratios checked
            rows.append([f"AnchorAttention's attention time against full at T={longest['seq_len']:,} (one H100)",
                         f"anchor ÷ full time: by mean {by_mean}, by median {by_median} over "
                         f"{len(longest['ms_windows'])} windows (FLOPs {num(longest['flops'] / full['flops'])})",
                         BENCH_H100, rec])
    for rel in GPU_PARITY[:2]:
        if records.exists(rel):
            rec = records.load(rel)
            n = parity_counts(rel, rec)
            differs = not_todays(rec)
            other = [w for w, d in (("rule", differs["rule"]), ("emulation", differs["emulation"])) if d]
            rows.append([f"The real GPU kernels against the oracle, `{Path(rel).stem}`",
                         f"forward {n['forward'][0]}/{n['forward'][1]}, gradients {n['gradients'][0]}/"
                         f"{n['gradients'][1]}" + (" (unfinished)" if n["unfinished"] else "")
                         + (f"; judged under a {' and '.join(other)} that {'are' if len(other) > 1 else 'is'} not "
                            "today's" if other else ""), rel, rec])
    if records.exists(PAPER_SMALL):
        rec = records.load(PAPER_SMALL)
        scores = ruler_scores(PAPER_SMALL, rec)
        cells = [f"{v} " + " / ".join(num(scores[v][l].mean) for l in sorted(scores[v]))
                 for v in ("anchor", "full") if scores.get(v)]
        if cells:
            lengths = sorted(scores.get("anchor") or next(iter(scores.values())))
            n = sorted({s.n for v in scores.values() for s in v.values()})
            rows.append(["RULER by length, paper-small profile (" + " / ".join(f"{l // 1024}K" for l in lengths)
                         + f"), mean over {', '.join(map(str, n))} checkpoints", "; ".join(cells), PAPER_SMALL, rec])
    out = table(["what", "measured", "record (machine, date, commit)"],
                [[w, m, f"`{rel}` ({machine_label(rec)}, {provenance(rec)[0]}, `{provenance(rec)[1]}`)"]
                 for w, m, rel, rec in rows])
    return out + ["", "All results, each with its record: [docs/results](docs/results/index.md)."]
