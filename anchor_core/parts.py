"""Finished parts of a long command, kept beside its output so that a killed run loses none of them.

    parts = Parts(parts_dir(out), "eval")                  # `.<name>.parts` beside --out
    value, taken = parts.kept("part-0", key, compute)      # a killed run's value under this key, or compute()'s,
                                                           # kept (one JSON file, written atomically)
    ...publish `out`...; parts.remove()                    # the parts go once the output is published

A part is reused only when its key (the settings it was computed with, the anchor version, the files it
read) equals the call's: `normal` puts a key or a result in the form it reads back in (tuples become lists,
numpy scalars Python numbers), so a reused result and a fresh one are the same thing. Non-finite floats
round-trip (JSON's `Infinity`, `NaN`). The folder carries anchor's marker (anchor_core.outdir) naming the verb
that keeps it; one holding files anchor did not write, or another verb's parts, is refused, never written
into or removed. Used by `anchor eval` (a part per checkpoint), `anchor parity` (a part per case) and
`anchor audit` (a part per policy's curves, one for the error budget).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.outdir import read_marker, rmtree, write_marker


def parts_dir(out: str | Path) -> Path:
    """`.<name>.parts` beside `out`: where a command writing `out` keeps its finished parts."""
    out = Path(os.path.abspath(os.path.expanduser(str(out))))
    return out.parent / f".{out.name}.parts"


def files_id(source: str | Path) -> list[list[Any]]:
    """What results read from `source` depend on besides the settings, for a key: its files (name, size,
    modification time), or the name itself where it is not a file or folder (a built-in model)."""
    p = Path(source)
    if p.is_file():
        st = p.stat()
        return [[p.name, st.st_size, st.st_mtime_ns]]
    if p.is_dir():
        return sorted([str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns]
                      for f in p.rglob("*") if f.is_file())
    return [[str(source)]]


# Not the code a result depends on: tests, caches, compiled bytecode.
_NOT_SOURCE_DIRS = {"__pycache__", "tests"}


def sources_id(packages: Iterable[str]) -> str:
    """A hash of the code in `packages` (top-level package names, found without importing them): every file
    under each one's folder but tests (`tests/`, `test_*.py`, `conftest.py`) and caches, by relative path
    and code (`_code`: a Python file's comments and docstrings left out). For a key whose results must not
    outlive a change of the code that computed them (parts carried to another run or machine:
    `anchor parity --keep-parts`). A package not found adds its name."""
    import hashlib
    from importlib.util import find_spec

    h = hashlib.sha256()
    for name in packages:
        spec = find_spec(name)
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        h.update(f"\0package {name} {len(roots)}\0".encode())
        for root in map(Path, roots):
            files = sorted(f for f in root.rglob("*") if f.is_file()
                           and not _NOT_SOURCE_DIRS & set(f.relative_to(root).parts[:-1])
                           and not f.name.startswith("test_") and f.name != "conftest.py"
                           and f.suffix not in (".pyc", ".pyo"))
            for f in files:
                h.update(f"\0{f.relative_to(root).as_posix()}\0".encode())
                h.update(_code(f))
    return h.hexdigest()[:16]


def _code(path: Path) -> bytes:
    """A source file's code: a Python file's syntax tree without its docstrings (so that comments and
    docstrings, which compute nothing, leave the id as it was); any other file's bytes."""
    data = path.read_bytes()
    return _python_code(data) if path.suffix == ".py" else data


@functools.lru_cache(maxsize=1024)
def _python_code(data: bytes) -> bytes:
    """`_code` of a Python file's bytes, parsed once per content in a process (a parse of the four packages
    takes about a second; a process that runs several parity commands, the test suite, asks again)."""
    import ast

    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return data
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def plain(x: Any) -> Any:
    """JSON's fallback for what it cannot write: a numpy scalar as its Python number, else its text."""
    return x.item() if hasattr(x, "item") else str(x)


def normal(x: Any) -> Any:
    """`x` as it reads back from a part (tuples become lists), for comparing keys and storing results."""
    return json.loads(json.dumps(x, default=plain))


class Parts:
    """Finished parts of one command, a JSON file each (`<name>.json`, written atomically), in a folder
    carrying anchor's marker for `verb`. `folder` None keeps nothing (every load misses)."""

    def __init__(self, folder: str | Path | None, verb: str):
        self.folder = Path(folder) if folder is not None else None
        self.verb = verb
        if self.folder is None:
            return
        if self.folder.exists() and not self.folder.is_dir():
            raise InputError(f"is not a folder (it should hold the finished parts of an `anchor {verb}`)",
                             path=self.folder)
        marker = read_marker(self.folder) if self.folder.is_dir() else None
        if self.folder.is_dir() and marker is None and any(self.folder.iterdir()):
            raise InputError("holds files anchor did not write; move it away", path=self.folder)
        if marker is not None and marker["verb"] != verb:  # another verb's parts: never written into or removed
            raise InputError(f"holds the kept parts of `anchor {marker['verb']}`, not of `anchor {verb}`; "
                             "name another --out (or remove that folder)", path=self.folder)

    def load(self, name: str, key: Any) -> dict[str, Any] | None:
        """The part `name` when one was saved with this `key` (compared in `normal` form), else None."""
        if self.folder is None:
            return None
        try:
            d = json.loads((self.folder / f"{name}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) and d.get("key") == normal(key) else None

    def saved(self) -> dict[str, dict[str, Any]]:
        """Every part kept in the folder, whatever its key: {name: {"key": ..., "value": ...}} (to read
        what a stopped run finished, e.g. tools/merge_parity.py). A file that is not a part is refused."""
        out: dict[str, dict[str, Any]] = {}
        if self.folder is None or not self.folder.is_dir():
            return out
        for f in sorted(self.folder.glob("[!.]*.json")):
            try:
                d = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise InputError(f"not a part anchor kept ({e})", path=f) from None
            if not (isinstance(d, dict) and {"key", "value"} <= d.keys()):
                raise InputError("not a part anchor kept (JSON with key and value)", path=f)
            out[f.stem] = d
        return out

    def save(self, name: str, part: dict[str, Any]) -> None:
        """Write the part `name` (its "key" included) atomically."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if read_marker(self.folder) is None:
            write_marker(self.folder, self.verb)
        write_text_atomic(self.folder / f"{name}.json", json.dumps(part, default=plain))

    def kept(self, name: str, key: Any, compute: Callable[[], Any]) -> tuple[Any, bool]:
        """(value, taken): the value a killed run kept as part `name` under this `key` (taken True), else
        `compute()`'s, kept as that part in the form it reads back in (`normal`) before it is returned.
        Without a folder, `compute()`'s value as it is."""
        if self.folder is None:
            return compute(), False
        done = self.load(name, key)
        if done is not None and "value" in done:
            return done["value"], True
        value = normal(compute())
        self.save(name, {"key": key, "value": value})
        return value, False

    def remove(self) -> None:
        """Delete the folder (once the command's output is published): `remove_parts`."""
        if self.folder is not None:
            remove_parts(self.folder, self.verb)


def remove_parts(folder: str | Path, verb: str) -> None:
    """Delete `folder` when it carries anchor's marker naming `verb`: the parts of one verb are never removed
    by another (`anchor audit --out S` leaves the `.S.parts` an `anchor parity --keep-parts` kept); anything
    else stays where it is."""
    folder = Path(folder)
    marker = read_marker(folder) if folder.is_dir() else None
    if marker is not None and marker["verb"] == verb:
        rmtree(folder)


__all__ = ["Parts", "files_id", "normal", "parts_dir", "plain", "remove_parts", "sources_id"]
