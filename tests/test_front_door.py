"""The front door for a pip user: README.md's first screen has the `pip install` and a table of every extra
pyproject.toml declares; README.md and docs/index.md link every guide in docs/guides/; the torch requirement is
pyproject.toml's range and constraints.txt's pin, as stated; `check_step` has one public name in the docs; and
README's results table holds current rows only."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "index.md"
FIRST_SCREEN = 25  # lines a terminal or a repository page shows before scrolling
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS = sorted(PYPROJECT["project"]["optional-dependencies"])
GUIDES = sorted(p.name for p in (ROOT / "docs" / "guides").glob("*.md"))


def extras_table(markdown: str) -> set[str]:
    """The extras named in the first column of the Markdown table whose header's first cell is `extra`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\|\s*extra\s*\|", line))
    named: set[str] = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        named |= set(re.findall(r"`([\w-]+)`", line.split("|")[1]))
    return named


def linked_guides(markdown: str, prefix: str) -> set[str]:
    """The files of docs/guides/ a Markdown page links, its links to them starting with `prefix`."""
    return set(re.findall(rf"\]\({re.escape(prefix)}([\w-]+\.md)(?:#[\w-]*)?\)", markdown))


def test_readme_has_pip_install_and_every_extra_on_its_first_screen():
    first = README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN]
    assert any(line.startswith("pip install ") for line in first), "README.md: no `pip install` in its first screen"
    assert len(EXTRAS) >= 10 and {"oracle", "train", "hf", "demo", "all"} <= set(EXTRAS)
    assert extras_table("\n".join(first)) == set(EXTRAS)


def test_docs_index_has_pip_install_and_every_extra():
    text = INDEX.read_text(encoding="utf-8")
    assert re.search(r"^pip install ", text, re.M), "docs/index.md: no `pip install` line"
    assert extras_table(text) == set(EXTRAS)


def test_readme_and_docs_index_link_every_guide():
    assert {"hf-trainer.md", "multinode.md", "python-api.md"} <= set(GUIDES)
    readme = README.read_text(encoding="utf-8")
    guides = readme[readme.index("- Guides:"):]
    guides = guides[:guides.index("\n- [")]  # the Documentation list's Guides item
    assert linked_guides(guides, "docs/guides/") == set(GUIDES)
    assert linked_guides(INDEX.read_text(encoding="utf-8"), "guides/") == set(GUIDES)


def test_the_torch_requirement_is_pyprojects_range_and_the_checkouts_pin():
    (low,) = [r.removeprefix("torch>=") for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch>=")]
    (pin,) = re.findall(r"^torch==([\d.]+)$", (ROOT / "constraints.txt").read_text(encoding="utf-8"), re.M)
    for page in (README, INDEX):
        text = page.read_text(encoding="utf-8")
        ranges = re.findall(r"torch (?:≥|>=) ?([\d.]+)", text)
        pins = re.findall(r"torch ?==? ?(\d+\.\d+\.\d+)", text)
        assert ranges == [low], (page.name, ranges)  # the range, stated once
        assert pins == [pin], (page.name, pins)  # the checkout's pin, stated once
        assert "CPU wheel" in text, page.name


def test_check_step_has_one_public_name_in_the_docs():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    other = re.compile(r"parity_tests\.blackbox\.check_step|from parity_tests\.blackbox import check_step")
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages for m in other.finditer(p.read_text("utf-8"))]
    assert found == []
    assert "anchor.check_step" in README.read_text(encoding="utf-8")
    assert "anchor.check_step" in (ROOT / "docs" / "guides" / "hf-trainer.md").read_text(encoding="utf-8")


def test_readme_results_table_holds_current_rows_only():
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- results:readme:start -->")[1].split("<!-- results:readme:end -->")[0]
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    assert len(rows) >= 4
    assert [r for r in rows if "not today's" in r or "(unfinished)" in r or "unfinished" in r] == []
    assert text.index("## Quick start") < text.index("<!-- results:readme:start -->")


def test_readme_trainer_snippet_names_the_engine_and_the_variant_apart():
    from tests.test_readme import trainer_snippet

    snippet = trainer_snippet(README.read_text(encoding="utf-8"))
    assert re.search(r'^engine = "anchor_varlen"\s+# the attention engine', snippet, re.M)
    assert re.search(r'^variant = "anchor"\s+# the masking variant', snippet, re.M)
    assert "attn_implementation=engine" in snippet and "PackingCollator(variant," in snippet
