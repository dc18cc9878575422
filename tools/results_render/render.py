"""Every generated file rendered from the records, checked (`--check`) or written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from . import ROOT, __doc__ as DOC
from .evaluation import evaluation_page
from .gpu import gpu_page
from .index import index_page
from .readme import readme_table
from .memory import memory_page
from .precision import precision_page
from .prose import prose, unlabelled_durations
from .records import (AUDIT, AUDIT_MILLION, AUDIT_SPEED, BENCH_CPU, BENCH_H100, BENCH_H100_FLEX, DATA, DEMO,
                      GPU_PARITY, HF_STACK, LONGEST_WINDOW, MEMORY, MEMORY_ESTIMATES, ORACLE_FORWARD, ORACLE_GRAD_MEMORY, PAPER_SMALL,
                      README_END, README_START, STEP_MEMORY, TRAIN_GPU, TRAIN_OVERHEAD, Records)
from .speed import speed_page


PAGES: dict[str, Callable[[Records], str]] = {
    "docs/results/index.md": index_page,
    "docs/results/precision.md": precision_page,
    "docs/results/speed.md": speed_page,
    "docs/results/memory.md": memory_page,
    "docs/results/gpu.md": gpu_page,
    "docs/results/evaluation.md": evaluation_page,
}


def render_readme(text: str, records: Records) -> str:
    """README.md with its results table replaced from the records (the text between the two markers)."""
    if README_START not in text or README_END not in text:
        raise SystemExit(f"results_pages: README.md has no '{README_START}' ... '{README_END}' block")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return head + README_START + "\n" + "\n".join(readme_table(records)) + "\n" + README_END + tail


def render_all(root: Path = ROOT, paths: dict[str, Path] | None = None) -> dict[str, str]:
    """Every generated file's expected text, by its path from `root`; `paths` as for `Records`."""
    records = Records(root, paths)
    out = {rel: fn(records).rstrip() + "\n" for rel, fn in PAGES.items()}
    readme = root / "README.md"
    if readme.is_file():
        out["README.md"] = render_readme(readme.read_text(encoding="utf-8"), records)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The generated files whose text differs from what their records give."""
    return [rel for rel, text in render_all(root).items()
            if not (root / rel).is_file() or (root / rel).read_text(encoding="utf-8") != text]


def write_all(root: Path = ROOT) -> list[str]:
    """Write every generated file under `root` (each replaced atomically); returns their paths."""
    written = []
    for rel, text in render_all(root).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        written.append(rel)
    return written


def cited() -> list[str]:
    """Every record a page or README's table reads."""
    return [AUDIT, AUDIT_MILLION, BENCH_CPU, BENCH_H100, BENCH_H100_FLEX, TRAIN_GPU, TRAIN_OVERHEAD, *AUDIT_SPEED, DATA,
            ORACLE_FORWARD, MEMORY, MEMORY_ESTIMATES, STEP_MEMORY, LONGEST_WINDOW, ORACLE_GRAD_MEMORY, *GPU_PARITY,
            DEMO,
            PAPER_SMALL, *HF_STACK]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DOC.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only say which pages are stale and which durations in "
                    "docs and README.md are unlabelled (a non-zero exit if any)")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for rel in bad:
            print(f"results_pages: {rel} is stale: run python tools/results_pages.py", file=sys.stderr)
        loose = [(rel, d) for rel, text in prose().items() for d in unlabelled_durations(text)]
        for rel, d in loose:
            print(f"results_pages: {rel}: a duration no record measured, not labelled an estimate: {d}",
                  file=sys.stderr)
        return 1 if bad or loose else 0
    for rel in write_all():
        print(rel)
    return 0
