"""The `anchor` command line: one console script, one verb per module in `anchor.commands`.

Each verb module registers itself on `app` with `@app.command()` and imports its heavy
dependencies (JAX, torch, transformers) inside the function, so `anchor --help` stays fast.
Errors: an `InputError` (bad file, option, model, config key) prints one line and exits 2;
usage errors exit 2 as well.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click
import typer

from anchor.errors import InputError

app = typer.Typer(
    name="anchor",
    help="Precision-aware long-context training: audit, data, training, parity, evaluation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _load_commands() -> None:
    import anchor.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"anchor.commands.{info.name}")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    _load_commands()
    verb = (argv if argv is not None else sys.argv[1:])[:1]
    prefix = f"anchor {verb[0]}" if verb and not verb[0].startswith("-") else "anchor"
    try:
        rv = app(args=argv, prog_name="anchor", standalone_mode=False)
    except InputError as e:
        print(f"{prefix}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as e:
        e.show()
        sys.exit(2)
    except click.UsageError as e:
        print(f"{prefix}: error: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        print(f"{prefix}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
