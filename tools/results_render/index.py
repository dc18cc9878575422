"""The index page: what each page shows, and every record with its machine, date and commit."""

from __future__ import annotations

import html
import json

from .records import GENERATED, RECORD_DIRS, Records, machine_label, provenance
from .stats import table


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
