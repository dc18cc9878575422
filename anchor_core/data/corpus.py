"""The embedded default corpus: real text every Python installation carries (docs/DESIGN.md §6).

Domains, each in a deterministic order (sorted paths / keys):
  code     the standard library's modules (`*.py`, test suites and site-packages left out)
  docs     `pydoc_data.topics`: the language reference topics `help()` shows
  prose    release notes, READMEs and help pages shipped with the standard library (idlelib,
           email, ...), and the Zen of Python
  license  the Python license (`LICENSE.txt`), one document per section

    n = write_default_corpus(Path("runs/corpus"))   # runs/corpus/corpus.jsonl + corpus.json
"""

from __future__ import annotations

import ast
import codecs
import html.parser
import json
import os
import re
import sys
import sysconfig
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from anchor_core.atomic import publish, staging_dir
from anchor_core.errors import InputError, read_json_object
from anchor_core.outdir import read_marker

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "__phello__"}
PROSE_SUFFIXES = (".txt", ".rst", ".md")
CORPUS_FILE = "corpus.jsonl"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    """The files under `root` outside SKIP_DIRS, sorted (as `rglob`, without walking into the skipped folders:
    the stdlib's site-packages can hold tens of thousands of files)."""
    out = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        out += [p for p in (Path(top) / n for n in names) if p.is_file()]
    return sorted(out)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


class _HTMLText(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag: str) -> None:
        self._skip -= tag in ("script", "style") and self._skip > 0

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_to_text(text: str) -> str:
    parser = _HTMLText()
    parser.feed(text)
    return re.sub(r"\n{3,}", "\n\n", "".join(parser.parts)).strip()


def _zen(root: Path) -> str | None:
    """The Zen of Python: rot13 text in `this.py` (read, not imported: importing it prints)."""
    source = _read(root / "this.py")
    if source is None:
        return None
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "s" for t in node.targets):
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    return None


def _plan(max_docs_per_domain: int | None) -> list[tuple[str, str, Callable[[], str | None]]]:
    """`(domain, source, read)` per document, in order; `read()` gives the text (None: skip).

    Only the small domains are read here; the modules of `code` are read when their turn comes.
    """
    root = stdlib_dir()
    domains: dict[str, list[tuple[str, Callable[[], str | None]]]] = {"code": [], "docs": [], "prose": [],
                                                                    "license": []}
    for p in _files(root):
        rel = p.relative_to(root).as_posix()
        if p.suffix == ".py":
            domains["code"].append((rel, partial(_read, p)))
        elif p.name == "LICENSE.txt" and p.parent == root:
            text = _read(p) or ""
            sections = [s.strip() for s in re.split(r"\n(?=[A-Z][A-Z0-9 .,/-]{8,}\n[=-]{8,}\n)", text)]
            domains["license"] += [(f"{rel}#{i}", partial(str, s)) for i, s in enumerate(sections) if s]
        elif p.suffix in PROSE_SUFFIXES or p.name.startswith("README"):
            domains["prose"].append((rel, partial(_read, p)))
        elif p.suffix == ".html":
            domains["prose"].append((rel, partial(lambda q: html_to_text(_read(q) or ""), p)))
    zen = _zen(root)
    if zen:
        domains["prose"].append(("this.py#zen", partial(str, zen)))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions leave pydoc_data out
        topics = {}
    domains["docs"] = [(f"pydoc_data/topics.py#{k}", partial(str, topics[k])) for k in sorted(topics)]
    plan = []
    for domain, docs in domains.items():
        if max_docs_per_domain is not None and len(docs) > max_docs_per_domain:
            step = len(docs) / max_docs_per_domain
            docs = [docs[int(i * step)] for i in range(max_docs_per_domain)]
        plan += [(domain, source, read) for source, read in docs]
    return plan


def default_corpus_documents(max_docs_per_domain: int | None = None) -> Iterator[dict[str, str]]:
    """`{"text", "domain", "source"}` records of the default corpus, deterministically ordered.

    `max_docs_per_domain` keeps that many documents of each domain (evenly spread over its order;
    empty files among them are left out).
    """
    for domain, source, read in _plan(max_docs_per_domain):
        text = read()
        if text and text.strip():
            yield {"text": text, "domain": domain, "source": source}


def _progress(items: list, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, unit=" docs", desc="corpus", mininterval=0.5, leave=False)


def write_default_corpus(out: Path, *, max_docs_per_domain: int | None = None, progress: bool = False) -> dict:
    """Write `out/corpus.jsonl` (and `out/corpus.json`, a summary) via a temporary folder; returns the summary."""
    out = Path(out)
    counts: dict[str, dict[str, int]] = {}
    plan = _plan(max_docs_per_domain)
    records = ({"text": t, "domain": d, "source": s} for d, s, read in _progress(plan, progress)
               if (t := read()) and t.strip())
    with staging_dir(out, "corpus") as tmp:
        folder = tmp / "corpus"
        folder.mkdir()
        with open(folder / CORPUS_FILE, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
                c = counts.setdefault(r["domain"], {"docs": 0, "chars": 0})
                c["docs"] += 1
                c["chars"] += len(r["text"])
        summary = {"file": CORPUS_FILE, "python": sys.version.split()[0], "stdlib": str(stdlib_dir()),
                   "max_docs_per_domain": max_docs_per_domain, "domains": counts}
        (folder / "corpus.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        publish(folder, out, "corpus")
    return summary


def corpus_folder_file(path: str | Path) -> Path | None:
    """The JSONL file a folder written by `anchor corpus` declares (`file` in its corpus.json summary), or None
    when `path` is not such a folder (no anchor marker of the corpus verb). Readers read that file alone: the
    summary beside it is JSON, not documents. A declared name that is not a plain `.jsonl` file of the folder
    is an InputError naming corpus.json."""
    folder = Path(path)
    marker = read_marker(folder) if folder.is_dir() else None
    if marker is None or marker["verb"] != "corpus":
        return None
    summary = folder / "corpus.json"
    name = read_json_object(summary).get("file")
    if not isinstance(name, str) or not name.endswith(".jsonl") or Path(name).name != name or name.startswith("."):
        raise InputError(f"`file` must name the folder's JSONL file (a name ending .jsonl), got {name!r}", path=summary)
    jsonl = folder / name
    if jsonl.is_symlink() or not jsonl.is_file():
        raise InputError(f"the corpus file {name} it declares is not a plain file of the folder", path=summary)
    return jsonl
