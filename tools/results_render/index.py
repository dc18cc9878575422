"""The index page: what each page shows, and every record with its machine, date and commit."""

from __future__ import annotations

import html
import json

from .records import GENERATED, RECORD_DIRS, Records, filled_in, machine_label, provenance_cells
from .stats import num, table


def path_cell(rel: str) -> str:
    """A record's path for a table cell that may wrap only after a folder's slash (HTML code, `<wbr>`)."""
    return "<code>" + "/<wbr>".join(html.escape(part) for part in rel.split("/")) + "</code>"


def record_files(records: Records) -> list[str]:
    """Every record under RECORD_DIRS, by its path from the root."""
    files = sorted(p for d in RECORD_DIRS for p in (records.root / d).rglob("*.json")
                   if "/.venv/" not in str(p) and ".parts" not in p.parts[-2])
    return [p.relative_to(records.root).as_posix() for p in files]


def all_records(records: Records) -> list[str]:
    rows = []
    for rel in record_files(records):
        try:
            rec = json.loads((records.root / rel).read_text(encoding="utf-8"))
        except ValueError:
            rows.append([path_cell(rel), "**not valid JSON**", "", "", ""])
            continue
        if not isinstance(rec, dict):
            continue
        what = rec.get("benchmark") or rec.get("what") or rec.get("stack") and "stock " \
            "transformers under the oracle" or ("anchor parity" if "cases" in rec else "") or \
            ("anchor audit" if "policies" in rec else "")
        date, commit = provenance_cells(rec)
        rows.append([path_cell(rel), str(what).split(". ")[0][:90], machine_label(rec), date, commit])
    return table(["record", "what", "machine", "date", "commit"], rows)


def provenance_counts(records: Records) -> tuple[int, int]:
    """(records whose date and commit are their own, records) among the JSON objects under RECORD_DIRS."""
    own = total = 0
    for rel in record_files(records):
        try:
            rec = json.loads((records.root / rel).read_text(encoding="utf-8"))
        except ValueError:
            continue
        if isinstance(rec, dict):
            total += 1
            own += not filled_in(rec)
    return own, total


def index_page(records: Records) -> str:
    own, total = provenance_counts(records)
    out = ["# Results", "", GENERATED, "",
           "Every figure on these pages is computed from a JSON record in the repository, which names the machine "
           f"it came from. {num(own)} of the {num(total)} records below carry the date and commit their run wrote; in the "
           "others, a date or commit marked *(from git)* was filled in later from git history: the commit that last "
           "changed the record, which may be later than the run. The records live under `results/` by topic "
           "(`results/gpu/` holds every GPU record), written by `benchmarks/` and the product's own runs.", "",
           "- [Precision](precision.md): what bf16 does to RoPE, measured by the audit",
           "- [Speed](speed.md): anchor against full attention, the trainer against a plain loop",
           "- [Memory](memory.md): peaks against the estimates that refuse a run",
           "- [On the GPU](gpu.md): the real kernels against the oracle",
           "- [Evaluation](evaluation.md): the demo, RULER, and stock transformers per variant", "",
           "## Every record", ""]
    out += all_records(records)
    return "\n".join(out)
