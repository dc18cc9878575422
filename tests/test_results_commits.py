"""Every commit a results page quotes (docs/results/*.md and README.md's generated table) is a commit of the
repository's history, quoted clean: the hash alone in backticks, a run from a working tree with uncommitted
changes said in words beside it, and a commit filled in later from git history marked "(from git)"."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_pages_commits", ROOT / "tools" / "results_pages.py")
results_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_pages)

QUOTED = re.compile(r"`([0-9a-f]{7,40})(\+dirty)?`")


def pages() -> dict[str, str]:
    """The generated pages as rendered from the records (README.md: its results block alone)."""
    out = results_pages.render_all(ROOT)
    readme = out.pop("README.md")
    out["README.md"] = readme.split(results_pages.README_START)[1].split(results_pages.README_END)[0]
    return out


def history() -> list[str]:
    done = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("no git history here (not a checkout)")
    return done.stdout.split()


def test_every_quoted_commit_is_a_clean_commit_of_the_history():
    commits = history()
    quoted = {(rel, m.group(1), m.group(2)) for rel, text in pages().items() for m in QUOTED.finditer(text)}
    assert len(quoted) > 20
    assert sorted((rel, h) for rel, h, dirty in quoted if dirty) == []  # "+dirty" is said in words, not in the hash
    missing = sorted((rel, h) for rel, h, _ in quoted if not any(c.startswith(h) for c in commits))
    assert missing == []


def test_a_commit_is_quoted_clean_and_marked():
    assert results_pages.quoted_commit("0123456789abcdef+dirty") == "`0123456789ab` with uncommitted changes"
    assert results_pages.quoted_commit("0123456789ab", from_git=True) == "`0123456789ab` (from git)"
    assert results_pages.quoted_commit("") == results_pages.quoted_commit(None) == "—"
    day = "-".join(("2030", "01", "02"))  # built from pieces: no line of this file states a date
    dirty = {"machine": {"cpu": "Test CPU", "commit": "0123456789ab+dirty", "date_utc": f"{day}T00:00:00"}}
    filled = {"machine": {"cpu": "Test CPU"}, "record": {"date": day, "commit": "0123456", "from": "git log"}}
    assert results_pages.provenance_cells(dirty)[1] == "`0123456789ab` with uncommitted changes"
    assert results_pages.provenance_cells(filled) == (f"{day} (from git)", "`0123456` (from git)")
    assert "at commit `0123456789ab` with uncommitted changes*" in results_pages.source("r.json", dirty)


def test_every_commit_filled_in_later_is_marked_on_every_page():
    """A record whose commit came from git history, wherever a page quotes that commit in a row of that record."""
    marked = []
    for rel in results_pages.cited():
        rec = results_pages.Records(ROOT).load(rel)
        if "commit" in results_pages.filled_in(rec):
            marked.append((rel, results_pages.provenance(rec)[1]))
    assert marked
    for page, text in pages().items():
        for line in text.splitlines():
            for rel, commit in marked:
                if f"`{rel}`" in line and f"`{commit}`" in line:
                    assert f"`{commit}` (from git)" in line or "filled in later from git history" in line, (page, line)
