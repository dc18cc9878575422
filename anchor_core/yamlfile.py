"""The one reader of the project's YAML files: train configs, data configs, dtype policies.

    d = read_yaml_mapping("configs/train/tiny.yaml", what="train config")

Every failure is an InputError whose one-line message names the file and the problem (the CLI
prints it and exits 2): the file cannot be read, is not UTF-8 text, is not valid YAML (with the
line and column of the problem), or does not hold a mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchor_core.errors import InputError


def read_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """The data of the YAML file `path` (None for an empty file). `what` names the file's kind in
    the cannot-read message ("train config", "policy file")."""
    import yaml

    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror or e}", path=path) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (invalid byte at offset {e.start})", path=path) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError(f"invalid YAML{_problem(e)}", path=path) from None


def read_yaml_mapping(path: str | Path, *, what: str = "YAML file", empty_ok: bool = True) -> dict[str, Any]:
    """The mapping the YAML file `path` holds; an empty file is `{}` when `empty_ok`, else an error
    like any other non-mapping."""
    data = read_yaml(path, what=what)
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise InputError(f"a {what} must be a mapping of keys to values, got {got}", path=path)
    return data


def _problem(e: Exception) -> str:
    """` at line L, column C: problem (context)` of a PyYAML error, or `: its text` on one line."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return f": {' '.join(str(e).split())}"
    context = getattr(e, "context", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
