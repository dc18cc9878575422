"""No module of the library, the tools or the benchmarks is over 500 lines: a longer one is split by concern into
modules of its package, each owning what its docstring says. Tests and experiments are not held to it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("anchor", "anchor_core", "torchtrain", "jaxref", "parity_tests", "tools", "benchmarks")
MAX_LINES = 500


def test_no_module_is_over_500_lines():
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 80, f"too few modules found under {FOLDERS}: the folders moved?"
    over = {p.relative_to(ROOT).as_posix(): n for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    print("\n".join(f"{path}: {n} lines" for path, n in sorted(over.items())))
    assert not over, f"modules over {MAX_LINES} lines: " + ", ".join(f"{p} ({n})" for p, n in sorted(over.items()))
