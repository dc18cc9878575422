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
  * a verb's own failure raised as `RunFailed` (a training step whose loss or gradient norm is not finite) prints
    one line the same way and exits 1;
  * a full or read-only disk met while writing prints one line naming the file and exits 2, and so does a
    path with a name longer than the file system holds (an excerpt of it: no message echoes an over-long name);
  * Ctrl-C (SIGINT) prints `anchor VERB: interrupted` and exits 130; SIGTERM (what `timeout` and
    job schedulers send) the same line and exits 143. The interrupt unwinds the run like an exception, so
    staging folders are removed and locks released on the way out; the process then ends without the
    interpreter's shutdown (`_leave_interrupted`: native threads may still be computing).

The interrupt's delivery is `anchor.interrupts` (why it is not Python's own KeyboardInterrupt: there).
"""

from __future__ import annotations

import errno
import importlib
import os
import pkgutil
import signal
import sys
from typing import Any

from anchor.interrupts import EXIT_INTERRUPTED, Interrupted, Signals


def _is_the_command() -> bool:
    """Whether this process is the `anchor` command: the console script, or `python -m anchor`."""
    argv0 = sys.argv[0] if sys.argv else ""
    return os.path.basename(argv0) == "anchor" or argv0.endswith(os.path.join("anchor", "__main__.py"))


# The command's process takes the signals over here, before the imports below (typer, and the verbs' JAX and
# torch later): a Ctrl-C from now on is reported as the interrupt, never as a traceback of an import.
_COMMAND_SIGNALS = Signals().install() if _is_the_command() else None


def _quiet_library_imports() -> None:
    """torchao (the `fp8` extra) logs at its import where its CUDA kernels cannot load (a CPU torch) and torch notes
    the enums torchao registers; transformers imports torchao in every process that builds a model once it is
    installed, so every command would print those lines. They say nothing about the run: errors still show."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


if _is_the_command():
    _quiet_library_imports()

import typer  # noqa: E402  (after the signals are taken over: see above)

from anchor_core.errors import InputError, RunFailed, bound_names  # noqa: E402
from anchor_core.extras import missing_extra  # noqa: E402

app = typer.Typer(
    name="anchor",
    help="Precision-aware long-context training: audit, data, training, parity, evaluation.",
    no_args_is_help=False,  # `anchor` alone is a usage error (main), not a help page on stdout
    add_completion=False,
    pretty_exceptions_enable=False,
)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs one verb and exits 0 (success), 1 (a verb's own failure,
    e.g. a parity FAIL), 2 (usage or input error), 130 (SIGINT) or 143 (SIGTERM)."""
    from anchor_core.errors import set_current_verb

    args = list(sys.argv[1:] if argv is None else argv)
    process = argv is None
    signals = _COMMAND_SIGNALS if process and _COMMAND_SIGNALS is not None else Signals()
    signals.owner = _run.__code__  # raised in `_run` and below; here, the interrupt is reported
    verb = args[0] if args and args[0] in _verb_modules() else None
    code: object = 0
    with signals:  # until the process leaves: a repeated signal while the run unwinds is ignored
        try:
            if signals.received is None:  # else a signal came before the run: nothing started
                rv = _run(args)
                code = rv if isinstance(rv, int) else 0
        except SystemExit as e:  # a usage or input error (one line printed), or a verb's own exit status
            code = e.code
        except KeyboardInterrupt as e:
            signals.received = getattr(e, "signum", signals.received or signal.SIGINT)
        except Exception:
            # raised while the interrupt unwound the run (e.g. a library whose import the signal cut short,
            # used again on the way out): the run was interrupted all the same
            if signals.received is None:
                raise
        finally:
            set_current_verb(None)
        if signals is _COMMAND_SIGNALS:
            # The outcome is decided. Python gives a signal it handles back to the system's default while the
            # interpreter shuts down, which would kill the process (exit -2, no line); ignored, it changes nothing.
            for s in EXIT_INTERRUPTED:
                signal.signal(s, signal.SIG_IGN)
        if signals.received is not None:
            print(f"{'anchor ' + verb if verb else 'anchor'}: interrupted", file=sys.stderr)
            _leave_interrupted(EXIT_INTERRUPTED.get(signals.received, 130), process=process)
    sys.exit(code)


def _run(args: list[str]) -> object:
    """Load the verbs and run the one `args` names; its return value, or SystemExit (a usage or input error:
    one line, exit 2). Interrupts are raised here and in what it calls (`Signals`)."""
    from anchor_core.errors import set_current_verb

    load_commands()
    verb = args[0] if args and args[0] in _verbs() else None
    set_current_verb(verb)
    prefix = f"anchor {verb}" if verb else "anchor"
    if not args:
        _fail(prefix, f"no verb given (verbs: {', '.join(_verbs())}); see `anchor --help`")
    try:
        return _click_command()(args=args, prog_name="anchor", standalone_mode=False)
    except InputError as e:
        _fail(prefix, str(e))
    except RunFailed as e:
        _fail(prefix, str(e), code=1)
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
        if e.errno == errno.ENAMETOOLONG:  # a path no check before it caught: named, never a traceback
            _fail(prefix, _too_long(e))
        if e.errno not in _DISK_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        _fail(prefix, f"{where}{e.strerror or e}")



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


def load_commands() -> None:
    """Import every module of `anchor.commands`: each registers its verb on `app` when imported."""
    import anchor.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"anchor.commands.{info.name}")


_CLICK: dict[int, Any] = {}


def _click_command() -> Any:
    """The click command typer makes of `app`, made once per process for its set of verbs: making it reads every
    verb's signature and type hints, a tenth of a second that a process calling `main` many times (a notebook, the
    test suite) would pay at each call."""
    import typer.main

    key = len(app.registered_commands)
    if key not in _CLICK:
        _CLICK.clear()
        _CLICK[key] = typer.main.get_command(app)
    return _CLICK[key]


def _verbs() -> list[str]:
    return sorted(c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands)


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def _verb_modules() -> set[str]:
    """The verbs' module names (`anchor.commands.*`), listed without importing them."""
    import anchor.commands as commands

    return {m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")}


def _too_long(e: OSError) -> str:
    """The line for ENAMETOOLONG: an excerpt of the path and what in it is too long (anchor_core.paths)."""
    from anchor_core.paths import path_excerpt, path_length_problem

    for name in (e.filename, e.filename2):
        if name is not None:
            name = os.fsdecode(name) if isinstance(name, (bytes, os.PathLike)) else str(name)
            problem = path_length_problem(name) or "a name in it is longer than the file system allows"
            return f"{path_excerpt(name)}: {problem}"
    return f"a path is longer than the file system allows ({e.strerror or e})"


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


def _fail(prefix: str, message: str, code: int = 2) -> None:
    print(f"{prefix}: error: {bound_names(one_line(message))}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
