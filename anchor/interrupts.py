"""SIGINT and SIGTERM as an exception raised in the run's own code: how `anchor` is interrupted.

Why not Python's own KeyboardInterrupt. A signal's handler runs at the next bytecode of the main thread,
which may belong to a module being imported (cut short, it stays half-made) or to a library that a native
extension called back (JAX's MLIR bindings: an exception there aborts the process with "terminate called
after throwing an instance of 'nanobind::python_error'", exit 134, no line and no cleanup). So the handler
(`Signals`) raises `Interrupted` only where the stack up to the run's frame is the run's own Python; elsewhere
it notes the signal, and the interrupt is raised in the run's frame that called into that code, at its next
line, once the call has returned (a trace function on that frame alone). `anchor.cli.main` takes the signals
over before its first import of a library, so a signal that comes before the run or while its end is reported
is not a traceback: it is reported as the interrupt; once the outcome is decided, a signal during the exit is
ignored. tests/cli/test_signals.py and test_interrupts*.py hold each case (a hundred Ctrl-C at random moments
among them).

    with Signals() as signals:          # the frame that entered is the run's
        run()                           # Interrupted(signum) raised in run's own code, with blocks cleaned up
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import CodeType, FrameType

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}

# This distribution's packages (pyproject.toml) and the command-line layer between `main` and a verb's
# function (click, typer: Python calling Python): code where an exception unwinds through Python alone.
_OWN_PACKAGES = frozenset({"anchor", "anchor_core", "jaxref", "parity_tests", "torchtrain"})
_CLI_PACKAGES = frozenset({"click", "typer"})
_IMPORT_SYSTEM = frozenset({"importlib._bootstrap", "importlib._bootstrap_external", "_frozen_importlib",
                            "_frozen_importlib_external"})
_THIRD_PARTY_DIRS = tuple(f"{os.sep}{d}{os.sep}" for d in ("site-packages", "dist-packages"))


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the main thread runs the run's own code, so `with` blocks clean up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _foreign(frame: FrameType) -> bool:
    """Code an exception must not be raised in: another package's module being imported (cut short, it would
    stay half-made), and third-party libraries other than the command-line layer (their Python may run as a
    native extension's callback, where an exception cannot pass)."""
    g = frame.f_globals
    name = g.get("__name__") or ""
    top = name.partition(".")[0]
    if top in _OWN_PACKAGES:
        return False
    if frame.f_code.co_name == "<module>":
        return True
    if top in _CLI_PACKAGES:
        return False
    path = g.get("__file__") or frame.f_code.co_filename
    return any(d in path for d in _THIRD_PARTY_DIRS)


def _importing(frame: FrameType) -> bool:
    """A frame of the import system (between an `import` and the module it runs)."""
    return (frame.f_globals.get("__name__") or "") in _IMPORT_SYSTEM


def _untraced(frame: FrameType, event: str, arg: object) -> None:
    """The thread's trace function while an interrupt waits for its frame: frames started meanwhile are not traced."""
    return None


class Signals:
    """SIGINT/SIGTERM -> `Interrupted`, raised in the run's own code (once; a repeat is ignored).

    The run is the frame that runs `owner` (a code object: `main` gives `_run`'s), else the frame that entered
    the `with`, and what it calls. The handler walks the stack from the frame it interrupted up to the run's:
      * all of it the run's own code (this distribution, the standard library, the command-line layer, a
        test's or script's code): it raises there;
      * another package's import or a third-party library on the way (`_foreign`): it notes the signal and
        sets a trace function on the run's frame that called (or imported) it; that frame raises `Interrupted`
        at its next line (or as it returns), once the call or the import is done;
      * the run's frame not on the stack (before the run, or while its end is reported): it notes the
        signal; `main` reports it when the run returns.
    A handler that still lands where Python cannot raise (a garbage collector's callback or a `__del__` of
    the run's own code: Python prints the exception as "Exception ignored" and runs on) is caught by
    `unraisable`: it takes the swallowed `Interrupted` back and sends the signal again 50 ms later, from a
    helper thread, so the handler runs anew once the main thread is elsewhere."""

    def __init__(self, owner: CodeType | None = None) -> None:
        self.owner = owner
        self.received: int | None = None
        self.old: dict[int, object] = {}
        self.old_hook = sys.unraisablehook
        self.installed = False
        self._entered = False
        self._owner_frame: FrameType | None = None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signum
        stack = self._run_stack(frame)
        if stack is None:
            return
        foreign = [i for i, f in enumerate(stack[:-1]) if _foreign(f)]
        if not foreign:
            raise Interrupted(signum)
        caller = max(foreign) + 1
        while _importing(stack[caller]):  # the module that imports: the one whose import completed stays whole
            caller += 1
        _raise_at_next_line(stack[caller], signum)

    def _run_stack(self, frame: FrameType | None) -> list[FrameType] | None:
        """The frames from `frame` up to the run's (innermost first), or None where the run's is not among them."""
        stack = []
        while frame is not None:
            stack.append(frame)
            if frame is self._owner_frame or (self.owner is not None and frame.f_code is self.owner):
                return stack
            frame = frame.f_back
        return None

    def unraisable(self, info: object) -> None:
        exc = getattr(info, "exc_value", None)
        if not isinstance(exc, Interrupted):
            self.old_hook(info)  # type: ignore[arg-type]
            return
        self.received = None
        again = threading.Timer(0.05, os.kill, (os.getpid(), exc.signum))  # after this hook has returned
        again.daemon = True
        again.start()

    def install(self) -> "Signals":
        """Take SIGINT and SIGTERM over (in the main thread; elsewhere signals cannot be handled)."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return self
        for s in EXIT_INTERRUPTED:
            try:
                self.old[s] = signal.signal(s, self.handler)
            except (ValueError, OSError):  # pragma: no cover
                pass
        self.old_hook = sys.unraisablehook
        sys.unraisablehook = self.unraisable
        self.installed = True
        return self

    def restore(self) -> None:
        for s, h in self.old.items():
            try:
                signal.signal(s, h)  # type: ignore[arg-type]
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass
        self.old = {}
        if sys.unraisablehook == self.unraisable:
            sys.unraisablehook = self.old_hook
        self.installed = False

    def __enter__(self) -> "Signals":
        if self.owner is None:
            self._owner_frame = sys._getframe(1)
        self._entered = not self.installed
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self._owner_frame = None
        if self._entered:
            self.restore()


def _raise_at_next_line(frame: FrameType, signum: int) -> None:
    """`Interrupted` raised in `frame` at its next line, or as it returns: a trace function on that frame
    alone, with tracing on for this thread until then (Python turns it off when a trace function raises)."""

    def at_next_line(f: FrameType, event: str, arg: object) -> object:
        if event in ("line", "return", "exception"):
            raise Interrupted(signum)
        return at_next_line

    frame.f_trace = at_next_line
    frame.f_trace_lines = True
    sys.settrace(_untraced)
