"""The demo's page and figures: `index.html` (a section per finished job, tables and figures inline,
every link relative) and `summary.png` (the run's results in one grid of panels at the page's width).

The summary figure and `save_figure` are `anchor.demo.figures`'s, and the section of each job is
`anchor.demo.sections`'s; this module puts the page together (`index_page`) and imports their names that other
code imports from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchor.demo.figures import (  # noqa: F401 (re-exported)
    SUMMARY_DPI,
    SUMMARY_GROUPS,
    SUMMARY_WIDTH_IN,
    draw_summary,
    save_figure,
    summary_figure,
)
from anchor.demo.sections import (  # noqa: F401 (re-exported)
    SECTIONS,
    _esc,
    _Page,
    docs_sentence,
    num,
    score_cell,
)
from anchor.demo.settings import DEMO_JSON, JOBS, TITLES
from anchor_core.atomic import write_text_atomic

_CSS = ("body{font:15px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
        "img{max-width:100%}figure{margin:1em 0}figcaption{font-size:12px;color:#666}"
        "table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #ddd;"
        "text-align:left;font-size:13px}code{background:#f4f4f4;padding:0 3px}.note{color:#a60}"
        ".figs{display:grid;grid-template-columns:1fr 1fr;gap:10px}.fig img{max-width:720px}.wide img{width:100%}")


def index_page(out: Path, record: dict[str, Any], fps: dict[str, str] | None = None) -> None:
    """`index.html`: a section per finished job, tables and figures inline, every link relative."""
    p = _Page(out, record)
    done = [st for st in JOBS if record["jobs"].get(st, {}).get("done")]
    p.add(f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>anchor demo — {_esc(record['model'])}"
          f"</title><style>{_CSS}</style></head><body>")
    p.add(f"<h1>anchor demo — {_esc(record['model'])}</h1>")
    p.add(f"<p>The paper's experiment end to end: {', '.join(done) or 'no job finished yet'}. "
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
    pack = (record["jobs"].get("pack") or {}).get("summary") if "pack" in done else None
    facts = docs_sentence(pack) if isinstance(pack, dict) else ""
    if record.get("dtype_choice"):
        c = record["dtype_choice"]
        facts += f" Training and evaluation in {c['dtype']}: {c['reason']}."
    if facts:
        p.add(f"<p>{_esc(facts.strip())}</p>")
    if (out / "summary.png").is_file():
        p.add("<figure class='wide'><img src='summary.png' alt='summary: audit, training loss, RULER, speed'>"
              "<figcaption>summary: the audit's curves (one legend: the RoPE policies), training loss and RULER "
              "(one legend: the runs), attention time against the FLOP ratio</figcaption></figure>")
    p.add("<ul>" + "".join(f"<li><a href='#{st}'>{_esc(TITLES[st])}</a></li>" for st in done) + "</ul>")
    for st in done:
        rec = record["jobs"][st]
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
