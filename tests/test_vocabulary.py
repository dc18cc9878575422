"""The docs and the code speak of the project and its users alone.

A reader has the repository: no account of the sittings in which it was built, of the machines it borrowed
or of how long each job could run, and no document the docs answer to but cannot show. So none of these terms
appears, case-insensitively and as a whole word, in the user-facing files (each spelled here with a bracketed
letter, as in the patterns below, so that `git grep -wi` for it finds no file of the project but the changelog):

  s[e]ssion, s[e]ssions, short j[o]b, short j[o]bs, 64 M[i]B (64M[i]B too), device t[i]me, l[e]nt, dr[a]wn,
  c[o]ntract, c[o]ntracts, original c[o]ntract.

Whole words: a letter, digit or underscore on either side is another word ("silently", "excellent",
"withdrawn", "redrawn", "a c[o]ntractor", `new_s[e]ssion()`), and a digit or a decimal point before 64 another
number ("0.64", "164"). A phrase may break across a line: the text is searched whole, `\\s+` between words. A
file's path is checked too.

Scanned (`in_scope`): README.md, Makefile, mkdocs.yml, pyproject.toml and the files under docs/ (the results
pages, docs/results/*.md, included), tools/, anchor/, anchor_core/, torchtrain/, jaxref/ and parity_tests/ whose
name ends in one of `TEXT_SUFFIXES` (.py .pyi .md .sh .bash .yaml .yml .toml .txt .cfg .ini .json .jsonl .cc .c
.h .cpp .cu .css .js .html) or is Makefile; one with a NUL byte in its first 8 KiB is binary and skipped. A text
file in scope with another suffix fails `test_every_text_file_in_scope_has_a_scanned_suffix`, so no new format
slips past. Not scanned: the changelog (CHANGELOG.md, and docs/changelog.md, its include line on the site),
experiments/ (one folder per investigated question, with its history) and tests/ (which plant the terms).

Allowed (`ALLOWED`): the usages an API needs, blanked before the search, nothing broader:
  `scope="s[e]ssion"` (single or double quotes): pytest's fixture scope, as pytest spells it.

The records under results/ are measurements, kept as they were made: `obtained` checks them and the pages for
the narrower set of words that say how a machine was had, and for records named after a sitting.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.test_no_history import ROOT, tracked_files

# What is scanned: these files, and the files under these folders ('/'-separated, relative to the root).
IN_SCOPE_FILES = ("README.md", "Makefile", "mkdocs.yml", "pyproject.toml")
IN_SCOPE_DIRS = ("docs/", "tools/", "anchor/", "anchor_core/", "torchtrain/", "jaxref/", "parity_tests/")
# The changelog records history by design (docs/changelog.md is its include line on the site).
EXEMPT = ("CHANGELOG.md", "docs/changelog.md")
EXEMPT_DIRS = ("experiments/",)
TEXT_SUFFIXES = (".py", ".pyi", ".md", ".sh", ".bash", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".json",
                 ".jsonl", ".cc", ".c", ".h", ".cpp", ".cu", ".css", ".js", ".html")
TEXT_NAMES = ("Makefile",)
# Not text: skipped without reading (a file of another suffix is read only to check it is not text).
BINARY_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".ico", ".pdf", ".npz", ".npy", ".gguf", ".safetensors",
                   ".pt", ".bin", ".so", ".o", ".whl", ".tgz", ".gz", ".zip", ".woff", ".woff2", ".ttf")

# (the term, its pattern): whole words, case-insensitive, `\s+` between the words of a phrase.
_W = r"(?<!\w)"  # a word's start: no letter, digit or underscore before it
_E = r"(?!\w)"   # a word's end
VOCABULARY: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (what, re.compile(_W + p + _E, re.IGNORECASE)) for what, p in (
        ("s[e]ssion", r"s[e]ssions?"),
        ("short j[o]b", r"short[\s-]+j[o]bs?"),
        ("64 M[i]B", r"(?<![\d.,])64[\s-]*M[i]B"),
        ("device t[i]me", r"device[\s-]+t[i]me"),
        ("l[e]nt", r"l[e]nt"),
        ("dr[a]wn", r"dr[a]wn"),
        ("original c[o]ntract", r"original\s+c[o]ntracts?"),
        ("c[o]ntract", r"c[o]ntracts?"),
    ))
# (why, pattern): the usages an API needs, blanked before the search.
ALLOWED: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("pytest's fixture scope", re.compile(r"""\bscope\s*=\s*(["'])s[e]ssion\1""")),
)


def in_scope(path: str) -> bool:
    """True for a path (relative, '/'-separated) the vocabulary check reads."""
    if path in EXEMPT or path.startswith(EXEMPT_DIRS):
        return False
    return path in IN_SCOPE_FILES or path.startswith(IN_SCOPE_DIRS)


def scanned_suffix(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name in TEXT_NAMES or name.lower().endswith(TEXT_SUFFIXES)


def _blank_allowed(text: str) -> str:
    for _, pattern in ALLOWED:
        text = pattern.sub(lambda m: " " * len(m.group(0)), text)
    return text


def scan(files: Iterable[tuple[str, str]]) -> list[str]:
    """`path:line: [what] text` for each line of each (path, text) in scope that uses the vocabulary (a line
    once, under the first term it holds), and `path: [what] in the file's name` for a path that does; the
    allowed usages are blanked first."""
    hits = []
    for path, text in files:
        if not in_scope(path):
            continue
        name = next((what for what, pattern in VOCABULARY if pattern.search(path.replace("_", " "))), None)
        if name:
            hits.append(f"{path}: [{name}] in the file's name")
        text = _blank_allowed(text)
        lines, found = text.splitlines(), {}
        for what, pattern in VOCABULARY:
            for m in pattern.finditer(text):
                found.setdefault(text.count("\n", 0, m.start()) + 1, what)
        hits += [f"{path}:{n}: [{what}] {lines[n - 1].strip()[:200]}" for n, what in sorted(found.items())]
    return hits


def read_scope(root: Path, paths: Iterable[str]) -> Iterable[tuple[str, str]]:
    """(path, text) of each path in scope with a scanned suffix that is text (no NUL byte in its first 8 KiB,
    UTF-8)."""
    for p in paths:
        if not in_scope(p) or not scanned_suffix(p):
            continue
        data = (root / p).read_bytes()
        if b"\0" in data[:8192]:
            continue
        yield p, data.decode("utf-8", "replace")


def test_no_file_in_scope_uses_the_vocabulary():
    paths = tracked_files()
    assert any(p.startswith("docs/results/") for p in paths) and "tools/gpu_kit.py" in paths, \
        "the listing misses the results pages or the tools"
    hits = scan(read_scope(ROOT, paths))
    assert not hits, ("say what a user does and why, not how this project was built (module docstring):\n"
                      + "\n".join(hits))


def test_every_text_file_in_scope_has_a_scanned_suffix():
    """A text file in scope whose suffix is not in TEXT_SUFFIXES would escape the check: none is there."""
    unread = []
    for p in tracked_files():
        if not in_scope(p) or scanned_suffix(p) or p.lower().endswith(BINARY_SUFFIXES):
            continue
        data = (ROOT / p).read_bytes()
        if b"\0" not in data[:8192]:
            unread.append(p)
    assert not unread, "text files of a suffix the check does not read (add it to TEXT_SUFFIXES):\n" + "\n".join(unread)


# Each term as a writer would put it, built from pieces: (term, a line that holds it).
PLANTED = [
    ("sitting", "# run once per " + "ses" + "sion, before the others"),
    ("sittings", "carried between GPU " + "ses" + "sions"),
    ("a job's length", "a GPU host reached in " + "short " + "jo" + "bs"),
    ("a job's length, broken across a line", "a host reached in short\n" + "jo" + "bs: one part each"),
    ("transfer size", "each call within " + "64" + " MiB with the tree"),
    ("transfer size without a space", "at most " + "64" + "MiB"),
    ("the time a machine is held", "fifteen minutes of " + "device " + "ti" + "me"),
    ("a machine on loan", "a machine " + "le" + "nt for the tests"),
    ("a machine chosen by lot", "the GPU " + "dra" + "wn for this task"),
    ("agreement, upper case", "Mask (" + "CON" + "TRACT" + " §2)"),
    ("agreement, its file", "see " + "CON" + "TRACT" + ".md"),
    ("original agreement", "*Differs from the original " + "con" + "tract:*"),
    ("the agreement said", "the " + "con" + "tract said slot positions"),
]


@pytest.mark.parametrize("where", ["tools/x.py", "docs/results/gpu.md", "README.md", "torchtrain/a/b.yaml",
                                   "jaxref/kernels/k.cc", "Makefile"])
@pytest.mark.parametrize("term,line", PLANTED, ids=[t for t, _ in PLANTED])
def test_each_planted_term_fails_the_check(tmp_path, term, line, where):
    """Each term, written into a file of the tree, is found in it: by `scan` on the text, and through
    `read_scope` on a folder that holds the file (git-less listing)."""
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(f"clean first line\n{line}\nclean last line\n", encoding="utf-8")
    hits = scan(read_scope(tmp_path, tracked_files(tmp_path, use_git=False)))
    assert [h.split(": [")[0] for h in hits] == [f"{where}:2"], (term, hits)


def test_out_of_scope_binary_and_ordinary_words_are_left_alone(tmp_path):
    word = "l" + "ent"
    planted = {
        "CHANGELOG.md": f"- a GPU {word} for the parity\n",
        "docs/changelog.md": f"a GPU {word}\n",
        "experiments/q/README.md": f"measured on the GPU {word} to us\n",
        "tests/test_x.py": f"# a GPU {word}\n",
        "anchor/fig.png": f"\0PNG a GPU {word}\n",
        "anchor/ok.py": "# silently, an excellent result; withdrawn and redrawn figures; lentils; a contractor;\n"
                        "# the contraction of the axis; session_id = new_session(); tmp_path_factory; 640 MiB\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    assert scan(read_scope(tmp_path, tracked_files(tmp_path, use_git=False))) == []


def test_a_file_named_with_the_vocabulary_is_found():
    name = "tools/gpu_" + "ses" + "sion_plan.sh"
    assert scan([(name, "echo fine\n")]) == [f"{name}: [s[e]ssion] in the file's name"]


def test_only_the_stated_api_usage_is_allowed():
    word = "ses" + "sion"
    allowed = f'@pytest.fixture(scope="{word}")\ndef corpus(): ...\n@pytest.fixture(scope=\'{word}\')\n'
    assert scan([("parity_tests/conftest.py", allowed)]) == []
    broader = [f'@pytest.fixture(scope="{word}")  # once a {word}',  # the same line, another use
               f'SCOPE = "{word}"', f"import requests; requests.{word.title()}()", f"scope={word}"]
    for line in broader:
        assert len(scan([("parity_tests/conftest.py", line)])) == 1, line


# How a machine was obtained, the time it was held, an issue: none of it belongs on a page or in a record, which
# speak of the measurement alone (the changelog aside). The records under results/ are kept as they were measured
# and may use the word for a sitting in its ordinary sense; these narrower words they may not. Built from pieces,
# as above.
OBTAINED = re.compile(r"(?i)\b(?:" + "l" + "ent|device " + "ti" + "me|short " + "jo" + "bs|short " + "ses"
                      + "sions|iss" + r"ue [0-9]+)\b")
MEASUREMENT_PAGES = ("docs/", "results/", "README.md")
NOT_A_PAGE = ("docs/changelog.md",)


def obtained(files: Iterable[tuple[str, str]]) -> list[str]:
    """`path:line: text` for each line of a page or record that says how a machine was obtained, the time it
    was held or an issue number; and each record named after a sitting (`results/**/s[e]ssion*`)."""
    hits = []
    for path, text in files:
        if not path.startswith(MEASUREMENT_PAGES) or path in NOT_A_PAGE:
            continue
        if path.startswith("results/") and path.rsplit("/", 1)[-1].startswith("ses" + "sion"):
            hits.append(f"{path}: a record named after a sitting, not after what it measured")
        for n, line in enumerate(text.splitlines(), 1):
            if OBTAINED.search(line):
                hits.append(f"{path}:{n}: {line.strip()[:200]}")
    return hits


def _page_texts(root: Path) -> Iterable[tuple[str, str]]:
    for p in tracked_files(root):
        if not p.startswith(MEASUREMENT_PAGES):
            continue
        data = (root / p).read_bytes()
        if b"\0" in data[:8192]:
            yield p, ""  # a binary file: only its name is checked
            continue
        yield p, data.decode("utf-8", "replace")


def test_pages_and_records_speak_of_the_measurement_alone():
    hits = obtained(_page_texts(ROOT))
    assert not hits, "say what was measured, not how the machine was had:\n" + "\n".join(hits)


def test_the_measurement_check_catches_planted_words():
    word = "l" + "ent"
    planted = [("docs/verbs/x.md", f"A GPU {word} in short " + "ses" + "sions."),
               ("results/gpu/x.json", '{"what": "iss' + 'ue 28 on an H100"}'),
               ("README.md", "reached in short " + "jo" + "bs"),
               ("results/gpu/" + "ses" + "sion_h100.json", "{}"),
               ("docs/changelog.md", f"a GPU {word}"),
               ("anchor/x.py", f"# a GPU {word}")]
    assert [h.split(":")[0] for h in obtained(planted)] == [
        "docs/verbs/x.md", "results/gpu/x.json", "README.md", "results/gpu/" + "ses" + "sion_h100.json"]
    assert obtained([("docs/x.md", "the excellent result; an issue of the list; lentils")]) == []
