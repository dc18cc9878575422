"""Errors the command line turns into a one-line message and exit code 2, and the one-line warning (`warn_line`)
for what a run reads on, such as a name renamed since an earlier release."""

from __future__ import annotations

import re
import sys

# A run of more characters than any file name may have (255 bytes), between spaces, slashes or quotes: an
# over-long path component, shown as its start and its length so that the line stays short.
_OVERLONG = re.compile(r"[^\s/'\"]{256,}")


def bound_names(text: str) -> str:
    """`text` with every over-long name (`_OVERLONG`) cut to its first 24 characters, an ellipsis and its length
    in bytes (punctuation that ends the run, as in `NAME: message`, stays after it)."""

    def cut(m: re.Match[str]) -> str:
        name = m.group().rstrip(":,;.)")
        size = len(name.encode("utf-8", "surrogateescape"))
        return m.group() if size < 256 else f"{name[:24]}… ({size} bytes){m.group()[len(name):]}"
    return _OVERLONG.sub(cut, text)


class InputError(Exception):
    """Bad user input: a file, a config key, a model, an option.

    The message is one line and names the file (or option) and the problem; the CLI
    prints it without a traceback and exits with status 2.
    """

    def __init__(self, message: str, *, path: object | None = None):
        self.path = None if path is None else str(path)
        self.message = message  # without the path: what a caller that names another place re-raises
        text = f"{self.path}: {message}" if self.path else message
        super().__init__(bound_names(" ".join(text.split())))


class UnavailableError(InputError):
    """An engine, device or optional package this run asked for is not available here."""


class RunFailed(Exception):
    """A verb's own failure, not its input's (a training step whose loss or gradient norm is not a finite number):
    the CLI prints the one-line message as it prints an InputError's and exits with status 1."""

    def __init__(self, message: str):
        super().__init__(bound_names(" ".join(message.split())))


_current_verb: str | None = None


def set_current_verb(verb: str | None) -> None:
    """The verb `anchor.cli.main` runs: it names the errors and warnings, and is the output marker's `verb` when a
    writer does not name one (anchor_core.outdir)."""
    global _current_verb
    _current_verb = verb


def current_verb() -> str:
    return _current_verb or "anchor"


def warn_line(message: str, *, path: object | None = None) -> None:
    """One line on stderr, as the CLI words an error's: `anchor VERB: warning: PATH: message` (`anchor: warning: ...`
    outside a verb), for what the run reads on, such as a config key or a shipped config's name of an earlier
    release."""
    verb = current_verb()
    text = f"{path}: {message}" if path is not None else message
    print(f"{'anchor' if verb == 'anchor' else 'anchor ' + verb}: warning: {bound_names(' '.join(text.split()))}",
          file=sys.stderr, flush=True)


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
