"""The one reader of the project's YAML files: train configs, data configs, dtype policies.

    d = read_yaml_mapping("configs/train/tiny.yaml", what="train config")
    d, lines = read_yaml_mapping_lines("configs/train/tiny.yaml", what="train config")   # lines["optim.lr"] == 23

Every failure is an InputError whose one-line message names the file and the problem (the CLI
prints it and exits 2): the file cannot be read, is not UTF-8 text, is not valid YAML (with the
line and column of the problem), gives a key twice in one mapping (YAML requires keys to be unique;
PyYAML alone would keep the last silently), or does not hold a mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchor_core.errors import InputError


def read_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """The data of the YAML file `path` (None for an empty file). `what` names the file's kind in
    the cannot-read message ("train config", "policy file")."""
    return read_yaml_lines(path, what=what)[0]


def read_yaml_lines(path: str | Path, *, what: str = "YAML file") -> tuple[Any, dict[str, int]]:
    """The data of the YAML file `path`, and the line (from 1) of each key of its mappings by dotted path
    (`optim.lr`; a mapping inside a list: `items[0].name`): where errors about a key's value point."""
    import yaml

    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror or e}", path=path) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (invalid byte at offset {e.start})", path=path) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        if node is not None:
            _key_lines(node, "", loader, lines, set(), path)
        return (None if node is None else loader.construct_document(node)), lines
    except yaml.YAMLError as e:
        raise InputError(f"invalid YAML{_problem(e)}", path=path) from None
    finally:
        loader.dispose()


def read_yaml_mapping(path: str | Path, *, what: str = "YAML file", empty_ok: bool = True) -> dict[str, Any]:
    """The mapping the YAML file `path` holds; an empty file is `{}` when `empty_ok`, else an error
    like any other non-mapping."""
    return read_yaml_mapping_lines(path, what=what, empty_ok=empty_ok)[0]


def read_yaml_mapping_lines(path: str | Path, *, what: str = "YAML file",
                            empty_ok: bool = True) -> tuple[dict[str, Any], dict[str, int]]:
    """`read_yaml_mapping`, and the line of each key (`read_yaml_lines`)."""
    data, lines = read_yaml_lines(path, what=what)
    if data is None and empty_ok:
        return {}, {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise InputError(f"a {what} must be a mapping of keys to values, got {got}", path=path)
    return data, lines


def _key_lines(node: Any, prefix: str, loader: Any, lines: dict[str, int], seen: set[int], path: Path) -> None:
    """Record the line of every mapping key under `node` (dotted below `prefix`); a key given twice in one
    mapping is an InputError naming it, both values and their lines. Merge keys (`<<: *base`) are YAML's own
    way to override, not repeats."""
    import yaml

    if id(node) in seen:  # an alias of a node already walked (a recursive structure stops here)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _key_lines(item, f"{prefix}[{i}]", loader, lines, seen, path)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    given: dict[Any, tuple[Any, Any]] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            first = given.get(key)
        except TypeError:  # an unhashable key: PyYAML's constructor names it
            continue
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if first is not None:
            (k1, v1), (k2, v2) = first, (key_node, value_node)
            raise InputError(f"{dotted} is given twice: {_shown(v1)} (line {k1.start_mark.line + 1}) and "
                             f"{_shown(v2)} (line {k2.start_mark.line + 1}); give each key once", path=path)
        given[key] = (key_node, value_node)
        lines[dotted] = key_node.start_mark.line + 1
        _key_lines(value_node, dotted, loader, lines, seen, path)


def _shown(node: Any) -> str:
    """A value as its YAML text (a scalar, shortened) or its kind (a mapping, a list)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    text = " ".join(str(node.value).split()) or "null"
    return text if len(text) <= 40 else text[:37] + "..."


def _problem(e: Exception) -> str:
    """` at line L, column C: problem (context)` of a PyYAML error, or `: its text` on one line."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return f": {' '.join(str(e).split())}"
    context = getattr(e, "context", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
