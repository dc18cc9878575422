"""Errors the command line turns into a one-line message and exit code 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad user input: a file, a config key, a model, an option.

    The message is one line and names the file (or option) and the problem; the CLI
    prints it without a traceback and exits with status 2.
    """

    def __init__(self, message: str, *, path: object | None = None):
        self.path = None if path is None else str(path)
        text = f"{self.path}: {message}" if self.path else message
        super().__init__(" ".join(text.split()))


class UnavailableError(InputError):
    """An engine, device or optional package this run asked for is not available here."""


def read_json_object(path, *, name: object | None = None) -> dict:
    """The JSON object in the file `path`; unreadable, malformed or non-object content is an
    InputError naming `name` (default: the file)."""
    import json
    from pathlib import Path

    path = Path(path)
    where = path if name is None else name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"unreadable {path.name}: {e}", path=where) from None
    if not isinstance(data, dict):
        raise InputError(f"{path.name} must hold a JSON object, got {type(data).__name__}", path=where)
    return data
