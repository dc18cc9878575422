"""The `anchor` command line: one console script, one verb per module in `anchor.commands`.

Each verb module registers itself on `app` with `@app.command(short_help=SUMMARY)` and imports its
heavy dependencies (JAX, torch, transformers) inside the function, so `anchor --help` stays fast.
`SUMMARY`, one short sentence, is the verb's single line in `anchor --help` (typer prints the help there
with its line breaks kept, so a docstring would show as a paragraph broken mid-sentence); the function's
docstring is the full description `anchor VERB --help` shows.

One error path for every verb (`main`):
  * a usage error (no verb, an unknown verb or option, a missing or malformed option, an extra
    argument) and an `InputError` (bad file, option value, model, config key) print one line
    `anchor VERB: error: ...` on stderr and exit 2;
  * a full or read-only disk met while writing prints one line naming the file and exits 2;
  * Ctrl-C (SIGINT) prints `anchor VERB: interrupted` and exits 130; SIGTERM (what `timeout` and
    job schedulers send) the same line and exits 143. Both unwind the run like an exception, so
    staging folders are removed and locks released on the way out; the process then ends without the
    interpreter's shutdown (`_leave_interrupted`: native threads may still be computing).
"""

from __future__ import annotations

import errno
import importlib
import os
import pkgutil
import signal
import sys
import threading

import typer

from anchor_core.errors import InputError
from anchor_core.extras import missing_extra

# typer >= 0.25 ships its own copy of click (`typer._click`) and raises that copy's exceptions;
# older typers use the `click` package. Catch the classes of whichever is in use (and of the
# `click` package too, should anything raise those).
_CLICKS = [m for m in (getattr(typer, "_click", None),) if m is not None]
try:
    import click as _click_pkg

    _CLICKS.append(_click_pkg)
except ImportError:  # pragma: no cover - typer without click installed
    pass


def _classes(name: str) -> tuple[type[BaseException], ...]:
    out = []
    for mod in _CLICKS:
        cls = getattr(getattr(mod, "exceptions", mod), name, None) or getattr(mod, name, None)
        if isinstance(cls, type) and cls not in out:
            out.append(cls)
    return tuple(out)


_NO_ARGS = _classes("NoArgsIsHelpError")
_USAGE = _classes("UsageError")
_CLICK_ERROR = _classes("ClickException")
_EXIT = tuple(dict.fromkeys((typer.Exit, *_classes("Exit"))))
_ABORT = tuple(dict.fromkeys((typer.Abort, *_classes("Abort"))))

# errno values of a write that failed for a reason outside anchor: one line, exit 2
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM}

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}

app = typer.Typer(
    name="anchor",
    help="Precision-aware long-context training: audit, data, training, parity, evaluation.",
    no_args_is_help=False,  # `anchor` alone is a usage error (main), not a help page on stdout
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the main thread is, so `with` blocks clean up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def load_commands() -> None:
    """Import every module of `anchor.commands`: each registers its verb on `app` when imported."""
    import anchor.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"anchor.commands.{info.name}")


def _verbs() -> list[str]:
    return sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class _Signals:
    """SIGINT/SIGTERM -> `Interrupted` (once; a repeat while cleaning up is ignored).

    Python runs a signal's handler at the next bytecode of the main thread, which may be a garbage
    collector's callback (JAX's `_xla_gc_callback`) or a `__del__`: there an exception cannot propagate, and
    Python prints it as "Exception ignored" and runs on. `unraisable` catches that case: it takes the
    swallowed `Interrupted` back and sends the signal again, from a helper thread 50 ms later, so the handler
    runs anew once the main thread is back in the run's own code (and so on, should it land in one again)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.old: dict[int, object] = {}
        self.old_hook = sys.unraisablehook

    def handler(self, signum: int, frame: object) -> None:
        if self.received is not None:
            return
        self.received = signum
        raise Interrupted(signum)

    def unraisable(self, info: object) -> None:
        exc = getattr(info, "exc_value", None)
        if not isinstance(exc, Interrupted):
            self.old_hook(info)  # type: ignore[arg-type]
            return
        self.received = None
        again = threading.Timer(0.05, os.kill, (os.getpid(), exc.signum))  # after this hook has returned
        again.daemon = True
        again.start()

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for s in EXIT_INTERRUPTED:
                try:
                    self.old[s] = signal.signal(s, self.handler)
                except (ValueError, OSError):  # pragma: no cover
                    pass
            sys.unraisablehook = self.unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            try:
                signal.signal(s, h)  # type: ignore[arg-type]
            except (ValueError, OSError, TypeError):  # pragma: no cover
                pass
        if sys.unraisablehook == self.unraisable:
            sys.unraisablehook = self.old_hook


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs one verb and exits 0 (success), 1 (a verb's own failure,
    e.g. a parity FAIL), 2 (usage or input error), 130 (SIGINT) or 143 (SIGTERM)."""
    from anchor_core.outdir import set_current_verb

    args = list(sys.argv[1:] if argv is None else argv)
    signals = _Signals()
    verb = None
    try:
        with signals:
            load_commands()
            verb = args[0] if args and args[0] in _verbs() else None
            set_current_verb(verb)
            prefix = f"anchor {verb}" if verb else "anchor"
            if not args:
                _fail(prefix, f"no verb given (verbs: {', '.join(_verbs())}); see `anchor --help`")
            try:
                rv = app(args=args, prog_name="anchor", standalone_mode=False)
            except InputError as e:
                _fail(prefix, str(e))
            except ModuleNotFoundError as e:  # a module of an extra not installed here: name the extra
                line = missing_extra(e, f"`{prefix}`")
                if line is None:
                    raise
                _fail(prefix, line)
            except _NO_ARGS:
                _fail(prefix, f"no verb given (verbs: {', '.join(_verbs())}); see `anchor --help`"
                      if verb is None else f"nothing to do; see `{prefix} --help`")
            except _USAGE as e:
                ctx = getattr(e, "ctx", None)
                where = getattr(ctx, "command_path", None) or prefix
                _fail(prefix, f"{e.format_message()} (see `{where} --help`)")
            except _CLICK_ERROR as e:
                _fail(prefix, e.format_message())
            except _EXIT as e:
                sys.exit(getattr(e, "exit_code", 0))
            except _ABORT:
                raise Interrupted(signal.SIGINT) from None
            except OSError as e:
                if e.errno not in _DISK_ERRNOS:
                    raise
                where = f"{e.filename}: " if e.filename else ""
                _fail(prefix, f"{where}{e.strerror or e}")
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signals.received or signal.SIGINT)
        print(f"{'anchor ' + verb if verb else 'anchor'}: interrupted", file=sys.stderr)
        _leave_interrupted(EXIT_INTERRUPTED.get(signum, 130), process=argv is None)
    except Exception:
        if signals.received is None:
            raise
        # raised while the interrupt unwound the run (e.g. a library whose import the signal cut short, used
        # again on the way out): the run was interrupted all the same
        print(f"{'anchor ' + verb if verb else 'anchor'}: interrupted", file=sys.stderr)
        _leave_interrupted(EXIT_INTERRUPTED.get(signals.received, 130), process=argv is None)
    finally:
        set_current_verb(None)
    if signals.received is not None:  # typer turned the interrupt into a return code
        print(f"{'anchor ' + verb if verb else 'anchor'}: interrupted", file=sys.stderr)
        _leave_interrupted(EXIT_INTERRUPTED.get(signals.received, 130), process=argv is None)
    sys.exit(rv if isinstance(rv, int) else 0)


def _leave_interrupted(code: int, *, process: bool) -> None:
    """Exit an interrupted run with `code`, once the interrupt has unwound it (staging folders removed, locks
    released, finished parts kept: each was written whole).

    As the console script (`process`), the process ends here without the interpreter's shutdown: a signal
    can stop the main thread while native threads still compute (XLA's CPU threads running the oracle's
    programs, the jaxref kernels on them), and tearing the interpreter and those libraries down under them
    can crash the process (SIGSEGV: exit 139 instead of 130 or 143). So the output streams are flushed, the
    child processes of `multiprocessing` stopped (as the shutdown would), and the process leaves with the
    code. Called in-process (`main(argv)`, the tests), it raises SystemExit."""
    if not process:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more can reach it
            pass
    mp = sys.modules.get("multiprocessing")
    if mp is not None:
        for child in mp.active_children():
            child.terminate()
    os._exit(code)


def _fail(prefix: str, message: str) -> None:
    print(f"{prefix}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
