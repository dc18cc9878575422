"""A package shows its public names only: no package `__init__` re-exports a private (`_`-prefixed) name, and a
module built around one entry point opens with it (parity_tests/blackbox.py: `check_step`, helpers after)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("anchor_core", "jaxref", "torchtrain", "parity_tests", "anchor")
ENTRY_FIRST = {"parity_tests/blackbox.py": "check_step"}
MODULE_DOCSTRING_LINES = 25  # the opening a reader sees before the entry point


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reexports(path: Path) -> list[str]:
    """Each private name that the package `__init__` at `path` imports from elsewhere or lists in `__all__`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            bad += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "__all__" for t in targets) and isinstance(node.value, (ast.List, ast.Tuple)):
                bad += [f"line {node.lineno}: __all__ lists {e.value}" for e in node.value.elts
                        if isinstance(e, ast.Constant) and isinstance(e.value, str) and _private(e.value)]
    return bad


def _inits() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--", "*__init__.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    return sorted(ROOT / f for f in listed if f.split("/")[0] in PACKAGES)


def test_no_package_reexports_a_private_name():
    inits = _inits()
    assert len(inits) > 10, inits
    bad = {str(p.relative_to(ROOT)): b for p in inits if (b := private_reexports(p))}
    assert not bad, f"private names re-exported: {bad}"


def test_a_private_reexport_is_found(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text("from a import public, _hidden\nfrom b import machine as _machine\n__all__ = ['public', '_x']\n")
    assert private_reexports(init) == ["line 1: from a import _hidden", "line 3: __all__ lists _x"]


def entry_point_problems(path: Path, entry: str) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    problems = []
    doc = ast.get_docstring(tree, clean=False) or ""
    if len(doc.splitlines()) > MODULE_DOCSTRING_LINES:
        problems.append(f"module docstring of {len(doc.splitlines())} lines (at most {MODULE_DOCSTRING_LINES})")
    defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    if not defs or defs[0] != entry:
        problems.append(f"first definition is {defs[0] if defs else None}, not {entry}")
    return problems


def test_the_entry_point_opens_its_module():
    for rel, entry in ENTRY_FIRST.items():
        assert entry_point_problems(ROOT / rel, entry) == [], rel


def test_a_buried_entry_point_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""' + "line\n" * 30 + '"""\n\ndef _helper():\n    pass\n\n\ndef entry():\n    pass\n')
    assert entry_point_problems(module, "entry") == [
        f"module docstring of 30 lines (at most {MODULE_DOCSTRING_LINES})", "first definition is _helper, not entry"]
