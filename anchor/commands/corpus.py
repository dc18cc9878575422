"""`anchor corpus`: build the embedded default corpus (JSONL with `text` and `domain`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


SUMMARY = "Build the default corpus from the text Python ships with."


@app.command(short_help=SUMMARY)
def corpus(
    out: Annotated[Path, typer.Option("--out", help="Folder to write corpus.jsonl and corpus.json into "
                                                    "(replaced when complete; see docs/verbs/index.md: what --out may replace).")],
    max_docs: Annotated[Optional[int], typer.Option(
        "--max-docs", help="Keep at most this many documents per domain (evenly spread; at least 1).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Build the default corpus from text every Python installation carries: the standard library's
    modules (code), pydoc topics (docs), shipped READMEs and release notes (prose), the license."""
    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
    from anchor_core.limits import check_int
    from anchor_core.outdir import guard_out, out_lock

    if max_docs is not None:
        check_int(max_docs, "--max-docs", lo=1)
    out = guard_out(out, "corpus")
    with out_lock(out, "corpus"):
        summary = write_default_corpus(out, max_docs_per_domain=max_docs, progress=progress)
    parts = ", ".join(f"{k} {v['docs']} docs" for k, v in summary["domains"].items())
    typer.echo(f"wrote {out / CORPUS_FILE} ({parts})")
