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
