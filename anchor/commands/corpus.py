"""`anchor corpus`: build the embedded default corpus (JSONL with `text` and `domain`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


@app.command()
def corpus(
    out: Annotated[Path, typer.Option("--out", help="Folder to write corpus.jsonl and corpus.json into.")],
    max_docs: Annotated[Optional[int], typer.Option(
        "--max-docs", min=1, help="Keep at most this many documents per domain (evenly spread).")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Build the default corpus from text every Python installation carries: the standard library's
    modules (code), pydoc topics (docs), shipped READMEs and release notes (prose), the license."""
    from anchor.data.corpus import CORPUS_FILE, write_default_corpus

    summary = write_default_corpus(out, max_docs_per_domain=max_docs, progress=progress)
    parts = ", ".join(f"{k} {v['docs']} docs" for k, v in summary["domains"].items())
    typer.echo(f"wrote {out / CORPUS_FILE} ({parts})")
