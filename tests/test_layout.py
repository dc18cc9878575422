"""The floors hold (tests/imports.py, docs/DESIGN.md §Architecture): no import from a lower floor to a
higher one, none between the oracle and the trainer, and no circle of imports. And the folders beside them
keep their roles: benchmarks/ holds benchmarks only (each measures speed or memory and writes JSON with its
machine), and nothing of the library or the tests reads experiments/ (one-off investigations)."""

from __future__ import annotations

import ast
import re
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
        "anchor_core/__init__.py": "",
        "anchor/long.py": f"def long():\n{body}\n\ndef explained():\n"
                          f'    """Longer than 100 lines because the table below is one unit."""\n{body}',
    })
    for package in ("jaxref", "torchtrain", "parity_tests", "anchor"):
        _tree(tmp_path, {f"{package}/__init__.py": ""})
    assert imports.long_functions(tmp_path) == [("anchor.long", "long", 102)]


def test_project_imports_stand_at_the_top_of_their_module():
    late = imports.late_imports()
    assert not late, "imports of the project inside functions, outside the verb boundary:\n" + "\n".join(
        f"{m}:{line}: {text}" for m, line, text in late)


def test_a_late_import_is_found_outside_the_verb_boundary_only(tmp_path):
    late = "def f():\n    from anchor_core import spec\n    import numpy\n"
    _tree(tmp_path, {"anchor_core/__init__.py": "", "anchor_core/spec.py": "", "anchor_core/late.py": late,
                     "anchor/__init__.py": "", "anchor/commands/__init__.py": "", "anchor/commands/verb.py": late})
    for package in ("jaxref", "torchtrain", "parity_tests"):
        _tree(tmp_path, {f"{package}/__init__.py": ""})
    assert imports.late_imports(tmp_path) == [("anchor_core.late", 2, "from anchor_core import spec")]


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
        "anchor_core/__init__.py": "",
        "anchor_core/spec.py": "def f():\n    from anchor import cli\n",
        "jaxref/__init__.py": "",
        "jaxref/model.py": "from anchor_core import spec\n",
        "torchtrain/__init__.py": "",
        "torchtrain/model/build.py": "import jaxref.model\n",
        "parity_tests/__init__.py": "",
        "parity_tests/a.py": "from parity_tests import b\n",
        "parity_tests/b.py": "def g():\n    from parity_tests.a import x\n",
        "parity_tests/test_a.py": "import anchor.cli\n",
        "anchor/__init__.py": "",
        "anchor/cli.py": "from parity_tests.a import x\n",
        "anchor/__main__.py": "from anchor.cli import main\n",
    })
    edges = imports.graph(tmp_path)
    assert imports.upward(edges) == [("anchor_core.spec", "anchor.cli"), ("torchtrain.model.build", "jaxref.model")]
    assert imports.cycles(edges) == [["parity_tests.a", "parity_tests.b"]]
    assert "parity_tests.test_a" not in edges and "anchor.__main__" not in edges


# benchmarks/ holds benchmarks only; experiments/ is read by neither the library nor the tests.

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("anchor_core", "anchor", "jaxref", "torchtrain", "parity_tests", "tests")
# calls that load a file or a module by name, and sys.path's methods that put a folder on the import path
LOADERS = {"addsitedir", "spec_from_file_location", "run_path", "import_module", "SourceFileLoader", "__import__"}
PATH_METHODS = {"insert", "append", "extend"}


def _calls(tree: ast.AST, names: set[str]) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)) in names]


def not_benchmarks(root: Path = ROOT) -> list[str]:
    """Each *.py or *.sh directly under benchmarks/ that is not a benchmark: a benchmark is bench_*.py and
    writes JSON (json.dump/json.dumps) with its machine (a call of anchor_core.machine.machine, imported by name).
    A module the benchmarks share is _*.py, imported by one of them, and runs nothing of its own (no
    `if __name__ == "__main__"`)."""
    found = []
    benches = [p.read_text() for p in sorted((root / "benchmarks").glob("bench_*.py"))]
    for path in sorted((root / "benchmarks").glob("*")):
        if path.suffix not in (".py", ".sh") or not path.is_file():
            continue
        name = path.relative_to(root)
        if path.suffix == ".py" and path.name.startswith("_"):
            text = path.read_text()
            if "__main__" in text:
                found.append(f"{name}: a shared module runs nothing of its own (a benchmark is bench_*.py)")
            if not any(re.search(rf"^\s*(from {path.stem} import|import {path.stem}\b)", b, re.M) for b in benches):
                found.append(f"{name}: a shared module no benchmark imports")
            continue
        if path.suffix != ".py" or not path.name.startswith("bench_"):
            found.append(f"{name}: not bench_*.py (an experiment goes to experiments/, a tool to tools/)")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = any(isinstance(n, ast.ImportFrom) and n.module == "anchor_core.machine"
                       and any(a.name == "machine" and a.asname in (None, "machine") for a in n.names)
                       for n in ast.walk(tree))
        if not (imported and _calls(tree, {"machine"})):
            found.append(f"{name}: records no machine (from anchor_core.machine import machine; machine(...))")
        if not any(isinstance(c.func, ast.Attribute) and getattr(c.func.value, "id", None) == "json"
                   for c in _calls(tree, {"dump", "dumps"})):
            found.append(f"{name}: writes no JSON (json.dump or json.dumps)")
    return found


def _is_sys_path(node: ast.AST) -> bool:
    """`sys.path`, or `path` imported from sys."""
    return (isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
            or isinstance(node, ast.Name) and node.id == "path")


def _assigned(tree: ast.AST, source: str) -> dict[str, list[str]]:
    """Each name's assigned values in a module, as source text (any scope)."""
    values: dict[str, list[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Name):
                        values.setdefault(leaf.id, []).append(ast.get_source_segment(source, n.value) or "")
    return values


def _mentions_experiments(text: str, values: dict[str, list[str]], depth: int = 3) -> bool:
    """Whether code `text`, or what the names in it were assigned (a few levels down), names experiments/."""
    if "experiments" in text:
        return True
    if depth == 0:
        return False
    names = {m for m in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text) if m in values}
    return any(_mentions_experiments(v, values, depth - 1) for m in names for v in values[m])


def experiment_imports(root: Path = ROOT) -> list[str]:
    """Each place in the library's packages, tests/ and parity_tests/ (and the root conftest.py) that imports
    from experiments/ or puts it on the import path (sys.path, spec_from_file_location, run_path, ...)."""
    files = [p for d in LIBRARY for p in sorted((root / d).rglob("*.py")) if "__pycache__" not in p.parts]
    files += [root / "conftest.py"] if (root / "conftest.py").is_file() else []
    found = []
    for path in files:
        source = path.read_text()
        if "experiments" not in source:  # every import or path that reaches it names it
            continue
        tree = ast.parse(source, filename=str(path))
        name = path.relative_to(root)
        for n in ast.walk(tree):
            modules = ([a.name for a in n.names] if isinstance(n, ast.Import)
                       else [n.module or ""] if isinstance(n, ast.ImportFrom) and n.level == 0 else [])
            for m in modules:
                if m.split(".")[0] == "experiments":
                    found.append(f"{name}:{n.lineno}: imports {m}")
        values = _assigned(tree, source)
        for call in _calls(tree, LOADERS) + [c for c in _calls(tree, PATH_METHODS)
                                           if isinstance(c.func, ast.Attribute) and _is_sys_path(c.func.value)]:
            if _mentions_experiments(ast.get_source_segment(source, call) or "", values):
                found.append(f"{name}:{call.lineno}: loads from experiments/ "
                             f"({ast.get_source_segment(source, call.func)})")
    return found


def test_benchmarks_holds_only_benchmarks():
    found = not_benchmarks()
    assert not found, "\n".join(found)
    assert len(list((ROOT / "benchmarks").glob("bench_*.py"))) > 5  # the scan reads the real folder


def test_neither_the_library_nor_the_tests_read_experiments():
    found = experiment_imports()
    assert not found, "\n".join(found)


def test_a_planted_non_benchmark_is_found(tmp_path):
    """The check can fail: a script that is not bench_*.py, a shell script, a bench_*.py without the
    machine, one whose machine() is some other function, a shared _*.py no benchmark imports and one that
    runs as a script are each reported; a real benchmark, and a shared module one imports, are not."""
    bench = ("import json\nfrom anchor_core.machine import machine\n\n"
             "def main(out):\n    out.write_text(json.dumps({'machine': machine(), 'seconds': 1.0}))\n")
    _tree(tmp_path, {
        "benchmarks/bench_ok.py": bench,
        "benchmarks/bench_late_import.py": bench.replace("from anchor_core.machine import machine\n", "").replace(
            "def main(out):\n", "def main(out):\n    from anchor_core.machine import machine\n\n"),
        "benchmarks/probe.py": bench,
        "benchmarks/run_on_gpu.sh": "#!/bin/sh\n",
        "benchmarks/bench_no_machine.py": "import json\nprint(json.dumps({'seconds': 1.0}))\n",
        "benchmarks/bench_other_machine.py": bench.replace("from anchor_core.machine import machine", "from os import uname as machine"),
        "benchmarks/bench_no_json.py": bench.replace("json.dumps(", "str("),
        "benchmarks/results/notes.py": "x = 1\n",  # not directly under benchmarks/
        "benchmarks/_shared.py": "def f():\n    return 1\n",
        "benchmarks/bench_uses_shared.py": "from _shared import f\n" + bench,
        "benchmarks/_orphan.py": "def g():\n    return 2\n",
        "benchmarks/_script.py": "import _shared\nif __name__ == '__main__':\n    print(1)\n",
    })
    assert not_benchmarks(tmp_path) == [
        "benchmarks/_orphan.py: a shared module no benchmark imports",
        "benchmarks/_script.py: a shared module runs nothing of its own (a benchmark is bench_*.py)",
        "benchmarks/_script.py: a shared module no benchmark imports",
        "benchmarks/bench_no_json.py: writes no JSON (json.dump or json.dumps)",
        "benchmarks/bench_no_machine.py: records no machine (from anchor_core.machine import machine; machine(...))",
        "benchmarks/bench_other_machine.py: records no machine (from anchor_core.machine import machine; machine(...))",
        "benchmarks/probe.py: not bench_*.py (an experiment goes to experiments/, a tool to tools/)",
        "benchmarks/run_on_gpu.sh: not bench_*.py (an experiment goes to experiments/, a tool to tools/)",
    ]


def test_a_planted_read_of_experiments_is_found(tmp_path):
    """The check can fail: an import, a function-level import, sys.path given experiments/ directly and
    through a name, and a file loaded by spec_from_file_location are each reported, in the library and in
    the tests; experiments/ itself and tools/ may do so, and prose that names experiments/ is no read."""
    _tree(tmp_path, {
        "anchor/a.py": "from experiments.grad_baseline import grad_draws\n",
        "jaxref/b.py": "def f():\n    import experiments.loss_counting.loss_counting as lc\n",
        "torchtrain/c.py": '"""See experiments/hf_stack/README.md."""\nimport sys\nsys.path.insert(0, "benchmarks")\n',
        "parity_tests/d.py": ("import sys\nfrom pathlib import Path\nROOT = Path(__file__).parent.parent\n"
                              "EXP = ROOT / 'experiments' / 'grad_baseline'\n\ndef f():\n"
                              "    sys.path.append(str(EXP))\n"),
        "tests/test_e.py": ("import importlib.util\nfrom pathlib import Path\n"
                            "spec = importlib.util.spec_from_file_location('x', Path('experiments/x/x.py'))\n"),
        "anchor/f.py": "import sys\nsys.path.insert(0, '/work/experiments')\n",
        "experiments/x/test_x.py": "import sys\nsys.path.insert(0, 'experiments/x')\nimport x\n",
        "tools/t.py": "import sys\nsys.path.insert(0, 'experiments/attn_grad_diag')\n",
    })
    assert experiment_imports(tmp_path) == [
        "anchor/a.py:1: imports experiments.grad_baseline",
        "anchor/f.py:2: loads from experiments/ (sys.path.insert)",
        "jaxref/b.py:2: imports experiments.loss_counting.loss_counting",
        "parity_tests/d.py:7: loads from experiments/ (sys.path.append)",
        "tests/test_e.py:3: loads from experiments/ (importlib.util.spec_from_file_location)",
    ]
