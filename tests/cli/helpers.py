"""Shared by the CLI safety tests: run a verb in this process, check the one-line error, hash folders."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from anchor.cli import main


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`anchor ARGV` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    code = e.value.code if isinstance(e.value.code, int) else (0 if e.value.code is None else 1)
    with capsys.disabled():  # shown with -s and in failure reports, not swallowed by the next readouterr
        print("argv:", [str(a) for a in argv], "-> exit", code)
        print("stderr:", err)
    return code, out, err


def assert_usage_error(code: int, err: str, verb: str | None, *needles: str) -> str:
    """Exit 2, exactly one non-empty stderr line `anchor VERB: error: ...`, no traceback; returns the line."""
    lines = [line for line in err.splitlines() if line.strip()]
    prefix = f"anchor {verb}: error:" if verb else "anchor: error:"
    print("expect exit 2 and one line starting with", repr(prefix), "holding", needles)
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def tree_hash(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (relative path -> digest), symlinks by their target."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            p = Path(root) / name
            rel = str(p.relative_to(folder))
            out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(parent: Path, name: str) -> list[str]:
    """Staging folders, set-aside outputs and lock files of `parent/name` (`.name.*`)."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def write_corpus(path: Path, n: int = 40, seed: int = 0) -> Path:
    """A tiny JSONL corpus in two domains."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "the", "a"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(rng.choice(words, int(rng.integers(5, 80))))
            f.write(json.dumps({"text": text, "domain": ["web", "code"][i % 2]}) + "\n")
    return path


def user_folder(path: Path) -> Path:
    """A folder of the user's own files (not written by anchor)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("my notes\n")
    (path / "sub").mkdir(exist_ok=True)
    (path / "sub" / "data.bin").write_bytes(bytes(range(256)) * 4)
    return path
