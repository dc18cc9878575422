"""The project's import graph, read with `ast`, and its floors (docs/DESIGN.md §Architecture).

    python -m tests.imports            # the floors, the arrows between packages, any breach

A module is a room; `import a.b` or `from a import b` is an arrow to the module it names (`from a import
name` to `a` when `name` is not a module). Imports inside functions count: they run too. Test files
(`test_*.py`, `conftest.py`) and entry points (`__main__.py`, imported by nobody) are not rooms.

Floors, lowest first; a room may import its own floor and those below, never one above:
    0  anchor_core   the shared core: spec, weights, tokenizer, data, run folder, errors
    1  jaxref        the oracle           } beside each other: neither imports the other
    1  torchtrain    the trainer          }
    2  parity_tests  what compares them: parity, the precision audit (the oracle's and the torch stack's)
    3  anchor        the application: `import anchor`, the CLI and its verbs, demo, eval, bench
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"anchor_core": 0, "jaxref": 1, "torchtrain": 1, "parity_tests": 2, "anchor": 3}


def _is_room(path: Path) -> bool:
    return not (path.name.startswith("test_") or path.name in ("conftest.py", "__main__.py"))


def modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} for every room of the floors' packages."""
    found = {}
    for package in FLOORS:
        for path in sorted((root / package).rglob("*.py")):
            if not _is_room(path):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _targets(module: str, node: ast.AST, is_package: bool, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the project modules it imports} (an import of a name inside a module is an arrow to it)."""
    known = modules(root)
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, node, path.name == "__init__.py", known):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


# Where a function may import the project's own modules: at the verb boundary, so `anchor --help` loads no
# verb's dependencies (the commands, the console script, the pytest plugin pytest loads at every start).
VERB_BOUNDARY = ("anchor.commands", "anchor.cli", "anchor.pytest_plugin")


def late_imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(module, line, the import) for each import of a project module inside a function, outside the verb
    boundary: everywhere else a module's imports stand at its top, where the floors can be read."""
    found = []
    for name, path in modules(root).items():
        if name.startswith(VERB_BOUNDARY):
            continue
        source = path.read_text()
        for f in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    if getattr(node, "level", 0) or (module or "").split(".")[0] in FLOORS:
                        found.append((name, node.lineno, ast.get_source_segment(source, node) or ""))
    return sorted(set(found))


MAX_FUNCTION_LINES = 100
REASON = "longer than 100 lines because"  # the words a docstring uses to state why a function is long


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, str, int]]:
    """(module, function, lines) for each library function over `limit` lines whose docstring does not
    state why ("longer than 100 lines because ...")."""
    found = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit and REASON not in (ast.get_docstring(node) or "").lower():
                    found.append((name, node.name, lines))
    return sorted(found)


def floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows to a higher floor, or sideways between the two packages of floor 1."""
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            top_src, top_dst = src.split(".")[0], dst.split(".")[0]
            if floor(dst) > floor(src) or (floor(dst) == floor(src) and top_src != top_dst):
                bad.append((src, dst))
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    edges = graph()
    lines = defaultdict(int)
    for src, targets in edges.items():
        for dst in targets:
            a, b = src.split(".")[0], dst.split(".")[0]
            if a != b:
                lines[(a, b)] += 1
    for package, level in sorted(FLOORS.items(), key=lambda kv: (-kv[1], kv[0])):
        rooms = [m for m in modules() if m.split(".")[0] == package]
        arrows = ", ".join(f"{b} ({n})" for (a, b), n in sorted(lines.items()) if a == package) or "nothing"
        print(f"floor {level}  {package:<13} {len(rooms):>3} modules  imports {arrows}")
    bad, loops = upward(edges), cycles(edges)
    for src, dst in bad:
        print(f"breach: {src} -> {dst}")
    for loop in loops:
        print("cycle: " + " <-> ".join(loop))
    for module, function, lines in long_functions():
        print(f"long: {module}.{function} ({lines} lines, no reason stated)")
    return 1 if bad or loops else 0


if __name__ == "__main__":
    sys.exit(main())
