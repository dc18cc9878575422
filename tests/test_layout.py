"""The floors hold (tests/imports.py, docs/DESIGN.md §Architecture): no import from a lower floor to a
higher one, none between the oracle and the trainer, and no circle of imports."""

from __future__ import annotations

from pathlib import Path

from tests import imports


def test_floors_are_in_order():
    breaches = imports.upward(imports.graph())
    assert not breaches, "imports from a lower floor to a higher one:\n" + "\n".join(f"{a} -> {b}" for a, b in breaches)


def test_no_circle_of_imports():
    loops = imports.cycles(imports.graph())
    assert not loops, "circles of imports:\n" + "\n".join(" <-> ".join(loop) for loop in loops)


def test_no_long_function_without_a_reason():
    long = imports.long_functions()
    assert not long, "library functions over 100 lines whose docstring states no reason:\n" + "\n".join(
        f"{m}.{f}: {n} lines" for m, f, n in long)


def test_a_long_function_is_found_unless_its_docstring_says_why(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(101))
    _tree(tmp_path, {
        "anchor/__init__.py": "",
        "anchor/long.py": f"def long():\n{body}\n\ndef explained():\n"
                          f'    """Longer than 100 lines because the table below is one unit."""\n{body}',
    })
    for package in ("jaxref", "torchtrain", "parity_tests", "anchor_app"):
        _tree(tmp_path, {f"{package}/__init__.py": ""})
    assert imports.long_functions(tmp_path) == [("anchor.long", "long", 102)]


def test_every_floor_package_is_read():
    rooms = imports.modules()
    for package in imports.FLOORS:
        assert package in rooms, f"{package}/__init__.py not found: the floors name a package that is gone"
    assert len(rooms) > 80


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_breach_and_circle_are_found(tmp_path):
    """The checks can fail: a core module importing the app, the trainer importing the oracle, and a
    circle through a function-level import are each reported."""
    _tree(tmp_path, {
        "anchor/__init__.py": "",
        "anchor/spec.py": "def f():\n    from anchor_app import cli\n",
        "jaxref/__init__.py": "",
        "jaxref/model.py": "from anchor import spec\n",
        "torchtrain/__init__.py": "",
        "torchtrain/model.py": "import jaxref.model\n",
        "parity_tests/__init__.py": "",
        "parity_tests/a.py": "from parity_tests import b\n",
        "parity_tests/b.py": "def g():\n    from parity_tests.a import x\n",
        "parity_tests/test_a.py": "import anchor_app.cli\n",
        "anchor_app/__init__.py": "",
        "anchor_app/cli.py": "from parity_tests.a import x\n",
        "anchor_app/__main__.py": "from anchor_app.cli import main\n",
    })
    edges = imports.graph(tmp_path)
    assert imports.upward(edges) == [("anchor.spec", "anchor_app.cli"), ("torchtrain.model", "jaxref.model")]
    assert imports.cycles(edges) == [["parity_tests.a", "parity_tests.b"]]
    assert "parity_tests.test_a" not in edges and "anchor_app.__main__" not in edges
