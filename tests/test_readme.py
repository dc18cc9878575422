"""README.md is the landing page: short, the two set-up commands on its first screen, a pip user's install and
Trainer snippet on its first page (tests/test_readme_api.py runs the snippet), and every link in it resolves to a
file of the repository (and, for a Markdown file, to one of its headings)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
FIRST_SCREEN = 25  # lines a terminal or a repository page shows before scrolling
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub and MkDocs give a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", markdown, re.M)}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each link in the Markdown file `path` that does not resolve: not relative, no such file, no such heading."""
    text = path.read_text(encoding="utf-8")
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+://|mailto:", target):
            bad.append(f"{target}: not a file of the repository")
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_file() or root.resolve() not in dest.parents:
            bad.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: {file or path.name} has no heading #{anchor}")
    return bad


def test_readme_is_a_short_landing_page_with_both_commands_first():
    # the code blocks' recipe declarations (tests/test_docs_recipes.py) are comments no reader sees
    lines = [line for line in README.read_text(encoding="utf-8").splitlines() if not line.startswith("<!-- recipe:")]
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; the details go to docs/"
    first = "\n".join(lines[:FIRST_SCREEN])
    assert re.search(r"^make demo\b", first, re.M) and re.search(r"^make test\b", first, re.M)


def test_every_readme_link_resolves():
    assert LINK.search(README.read_text(encoding="utf-8")), "the link pattern finds the README's links"
    assert broken_links(README) == []


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Some `code` here\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/page.md) [ok](docs/page.md#some-code-here) ![gone](docs/x.png)\n"
                    "[bad anchor](docs/page.md#nowhere) [web](https://example.org) [out](../x.md)\n")
    assert broken_links(page, tmp_path) == [
        "docs/x.png: no such file in the repository",
        "docs/page.md#nowhere: docs/page.md has no heading #nowhere",
        "https://example.org: not a file of the repository",
        "../x.md: no such file in the repository",
    ]


FIRST_PAGE = 60  # the pip user's install and Trainer snippet stand within these lines


def first_page_blocks(text: str) -> dict[str, list[str]]:
    """The fenced code blocks of the README's first FIRST_PAGE lines, by language."""
    first = "\n".join(text.splitlines()[:FIRST_PAGE])
    blocks: dict[str, list[str]] = {}
    for m in re.finditer(r"^```(\w+)\n(.*?)^```", first, re.M | re.S):
        blocks.setdefault(m.group(1), []).append(m.group(2))
    return blocks


def trainer_snippet(text: str) -> str:
    """The first page's Python block that trains in transformers' Trainer (tests/test_readme_api.py runs it)."""
    found = [b for b in first_page_blocks(text).get("python", []) if "Trainer(" in b and "PackingCollator" in b]
    assert found, f"README.md: no ```python block with Trainer( and PackingCollator in its first {FIRST_PAGE} lines"
    return found[0]


def test_the_first_page_shows_the_pip_install_and_a_trainer_snippet():
    text = README.read_text(encoding="utf-8")
    pip = [line for b in first_page_blocks(text).get("bash", []) for line in b.splitlines()
           if line.startswith("pip install ")]
    assert pip, f"README.md: no ```bash block with `pip install` in its first {FIRST_PAGE} lines"
    extras = set(re.findall(r'anchor-toolkit\[([\w,]+)\]', " ".join(pip))[0].split(",")) if "[" in pip[0] else set()
    snippet = trainer_snippet(text)
    if "check_step" in snippet:  # parity_tests.blackbox imports JAX: the oracle extra
        assert extras & {"oracle", "all", "demo"}, f"the snippet calls check_step; {pip[0]!r} lacks the oracle extra"
    compile(snippet, "README.md:trainer", "exec")


def test_a_missing_trainer_snippet_is_found():
    page = "# x\n\n```bash\nmake demo\n```\n" + "\n" * 70 + "```python\nTrainer(data_collator=PackingCollator())\n```\n"
    assert "bash" in first_page_blocks(page) and "python" not in first_page_blocks(page)
    try:
        trainer_snippet(page)
    except AssertionError as e:
        assert "no ```python block" in str(e)
    else:
        raise AssertionError("a snippet past the first page was taken")
