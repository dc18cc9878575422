"""No history in the code: library, test, config and doc files say what the code does and why, never
when or in which run. A dated remark, an issue, item, build or acceptance number, a commit that fixed
something or an account of a past GPU run belongs in CHANGELOG.md (or in a result's own record), not
beside the code.

`scan` is the check itself, a pure function of (path, text) pairs; `tracked_files` lists what it reads:
every file git tracks or would track (untracked but not ignored), or the tree where git is unavailable.
Exempt: the changelog, recorded results (docs/results, experiments, results) and
data files (JSON, CSV, images, archives, arrays, anything binary).

Beside it, tests/test_vocabulary.py (which reads the tree through `tracked_files`) keeps the docs, the code and
the results pages and records free of the vocabulary of the sittings the project was built in: how a machine
was obtained, how long it was held, what one transfer to it could carry.

This file holds no line its own patterns match: the planted examples below are built from pieces.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Paths that record history by design (prefixes of the path relative to the root, '/'-separated).
EXEMPT_FILES = ("CHANGELOG.md",)
EXEMPT_DIRS = ("docs/results/", "experiments/", "results/")
# Data, not prose.
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".tgz", ".tar.gz", ".gz", ".zip", ".npz", ".npy", ".png",
                 ".jpg", ".jpeg", ".gif", ".svg", ".pdf", ".gguf", ".safetensors", ".bin", ".pt", ".log")
# Where the tree is walked without git: folders that are never part of the sources.
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", "build", "dist", "site", ".pytest_cache",
             ".ruff_cache", ".mypy_cache"}

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
# (name, pattern): each names a kind of history. Ordinary prose without a number ("an item of the list",
# "the build step", "a session of the suite") does not match.
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(p)) for name, p in (
    ("a date", r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    ("a date", rf"\b\d{{1,2}} {_MONTH},? 20\d\d\b|\b{_MONTH} \d{{1,2}},? 20\d\d\b"),
    ("an issue number", r"(?i)\bissues? #?\d+"),
    ("a pull request number", r"\b(?:PR|[Pp]ull(?: request)?) ?#\d+|\bPR \d+\b"),
    ("an acceptance number", r"(?i)\bacceptance(?: criteri(?:on|a))? #?\d+"),
    ("a build number", r"(?i)\bbuild(?:s| point| step)? #?\d+\b(?! ?(?:[KMGT]i?B|bytes|programs?|times|x\b))"),
    ("an item number", r"(?i)\bitems? #?\d+\b(?:\s*(?:and|,)\s*\d+)*(?=[\s:;,.)']|$)(?! ?(?:of|in|to)\b)"),
    ("a dated remark", rf"(?i)\b(?:until|before|since|after|as of|on|from)\s+(?:20\d\d-\d\d|{_MONTH} 20\d\d)"),
    # `l[e]nt`: the word, spelled so that `git grep -w` for it finds no file but the changelog
    ("a past run", r"(?i)\b(?:in|on|during|of)\s+(?:the|that|this|an?|its)\s+(?:first\s+|last\s+|l[e]nt\s+)?"
                   r"(?:GPU|H100|H200|A100|B200|device|l[e]nt|CUDA)[\w-]*\s+(?:GPU\s+)?session\b"),
    ("a past run", r"(?i)\b(?:first|second|third|last|previous) l[e]nt (?:GPU|machine|H100|H200)\b"),
    ("a commit", r"(?i)\b(?:fixed|introduced|changed|reverted|added|removed|broken) (?:in|by|since) "
                 r"(?:commit )?[0-9a-f]{7,40}\b|\bcommit [0-9a-f]{7,40}\b"),
    ("a past fix", r"(?i)\bbefore the fix\b|\bon the old code\b|\bas before 20\d\d"),
))


def exempt(path: str) -> bool:
    """True for a path (relative, '/'-separated) the check leaves alone: the changelog, recorded results,
    data files."""
    low = path.lower()
    return (path in EXEMPT_FILES or path.startswith(EXEMPT_DIRS) or low.endswith(DATA_SUFFIXES))


# A block rendered from the records (README.md's results table, by tools/results_pages.py) carries each
# record's date by design, as the results pages do.
GENERATED_START, GENERATED_END = "<!-- results:readme:start -->", "<!-- results:readme:end -->"


def scan(files: Iterable[tuple[str, str]]) -> list[str]:
    """`path:line: [kind] text` for every line of every (path, text) that states history; exempt paths
    and the lines of a generated results block are skipped."""
    hits = []
    for path, text in files:
        if exempt(path):
            continue
        generated = False
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip() in (GENERATED_START, GENERATED_END):
                generated = line.strip() == GENERATED_START
                continue
            if generated:
                continue
            for name, pattern in PATTERNS:
                if pattern.search(line):
                    hits.append(f"{path}:{n}: [{name}] {line.strip()[:200]}")
                    break
    return hits


def tracked_files(root: Path = ROOT, use_git: bool = True) -> list[str]:
    """Paths (relative, '/'-separated) of the files git tracks or would track under `root`: tracked ones
    still present and untracked ones it does not ignore. Without git (`use_git` False, git missing, or
    `root` outside a repository) every file under `root` but the folders in SKIP_DIRS and hidden ones."""
    try:
        if not use_git:
            raise OSError("not asked to use git")
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True, timeout=30).stdout
        paths = sorted({p for p in out.decode("utf-8", "surrogateescape").split("\0") if p})
    except (OSError, subprocess.SubprocessError):
        paths = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")]
            rel = Path(folder).relative_to(root)
            paths += [(rel / n).as_posix() for n in names]
        paths.sort()
    return [p for p in paths if (root / p).is_file() and not (root / p).is_symlink()]


def read_texts(root: Path, paths: Iterable[str]) -> Iterable[tuple[str, str]]:
    """(path, text) of each non-exempt path that is text (UTF-8, no NUL byte)."""
    for p in paths:
        if exempt(p):
            continue
        data = (root / p).read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            yield p, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_no_tracked_file_states_history():
    paths = tracked_files()
    assert any(p.endswith("test_no_history.py") for p in paths), "the listing misses this very file"
    hits = scan(read_texts(ROOT, paths))
    assert not hits, ("history in the code (say what and why, without when; history goes to CHANGELOG.md):\n"
                      + "\n".join(hits))


def test_the_scan_catches_planted_history_and_leaves_exempt_paths_alone(tmp_path):
    date = "20" + "26-11-22"  # built from pieces so that this file does not match itself
    issue = "issue " + "31"
    planted = {
        "pkg/mod.py": f"x = 1\n# fixed on {date} ({issue})\ny = 2\n",
        "pkg/notes.md": "Fine prose: an item of the list, the build step, a session of the suite.\n"
                        "The sdpa kernel is held against sdpa_cpu_bf16 (as " + "before " + date + ").\n",
        "tests/test_x.py": '"""Issue ' + "32 item" + ' 11: a killed writer."""\n',
        "conf/a.yaml": "# Accept" + "ance 4, Bui" + "ld 6\nkey: 1\n",
        "tools/x.sh": "# measured in the " + "H100 sess" + "ion of the suite\n",
        "experiments/x.py": f"# fixed on {date} ({issue})\n",
        "CHANGELOG.md": f"- {date}: {issue} fixed\n",
        "results/gpu/run.md": f"Run of {date}\n",
        "results/speed/speed.json": f'{{"when": "{date}"}}\n',
        "docs/results/page.md": f"{date}\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    hits = scan(read_texts(tmp_path, tracked_files(tmp_path, use_git=False)))
    print("\n".join(hits))
    where = [h.split(": [")[0] for h in hits]
    assert where == ["conf/a.yaml:1", "pkg/mod.py:2", "pkg/notes.md:2", "tests/test_x.py:1", "tools/x.sh:1"], hits
    # the same lines, given directly: the exempt paths are skipped by path, whatever their text
    assert scan([("experiments/x.py", planted["pkg/mod.py"]), ("CHANGELOG.md", planted["pkg/mod.py"])]) == []
    assert len(scan([("anchor/x.py", planted["pkg/mod.py"])])) == 1
    # a generated results block may carry dates; the same line outside it may not
    readme = f"{GENERATED_START}\n| a record | {date} |\n{GENERATED_END}\n| a record | {date} |\n"
    assert [h.split(": [")[0] for h in scan([("README.md", readme)])] == ["README.md:4"]


def test_each_kind_is_caught_and_ordinary_prose_is_not():
    d = "20" + "26"  # a year, in pieces (see the module docstring)
    history = [  # (line, the kind it is reported as)
        (f"# as before {d}-11-22 hf_bf16 was the emulation", "a date"),
        (f"measured on 25 Nov {d} and on November 26, {d}", "a date"),
        ("(Issue" + " #15, bui" + "ld 6)", "an issue number"),
        ("see P" + "R #31 for the change", "a pull request number"),
        ('"""Every variant (accep' + 'tance 1)"""', "an acceptance number"),
        ("(issue Bui" + "ld 7)", "a build number"),
        ("now such an attempt removes its run folder (it" + "em 11)", "an item number"),
        ("its it" + "ems 7 and 11 asked for it", "an item number"),
        (f"sdpa was held against hf_bf16 unt" + f"il Nov {d}", "a dated remark"),
        ("found in the first l" + "ent GPU's run", "a past run"),
        ("as measured during the H200 ses" + "sion of the suite", "a past run"),
        ("this check found it, fix" + "ed in a05a53a", "a commit"),
        ("Each test failed on the code before the f" + "ix", "a past fix"),
    ]
    for line, kind in history:
        hits = scan([("anchor/x.py", line)])
        assert len(hits) == 1 and f"[{kind}]" in hits[0], (line, hits)
    prose = [
        "an item of the list, the items the reader yields, item_size = 4",
        "`build_model` builds 2 programs; the build step runs once",
        "cases carried from one GPU session to the next, the parts of one GPU session; a session-scoped fixture",
        "Attention on an H100 (about 20 minutes on one H100), 8 A100s",
        'time.strftime("%Y-%m-%d %H:%M:%S"); anchor < 0.1.1; SQuAD v2.0; 1234567 and 7654321',
        "the issue is the order of the sums; an acceptance test; since the fix of the seed, nothing moves",
        "until the report is published; before any work; since the last checkpoint",
    ]
    assert scan([("anchor/x.py", "\n".join(prose))]) == []


# How a machine was obtained, how long it was held, an account of the sittings the project was built in: that
# vocabulary, in the docs, the code and the results pages and records, is tests/test_vocabulary.py's.
