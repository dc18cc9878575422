"""`anchor --help` lists each verb on one line, its summary (`short_help`), within the terminal's width;
`anchor VERB --help` shows the verb's whole description (its docstring), re-wrapped but word for word."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from anchor.cli import app, load_commands, one_line

ROOT = Path(__file__).resolve().parents[2]

load_commands()
COMMANDS = typer.main.get_command(app).commands  # every registered verb, as `anchor --help` lists them

# Variables that make rich or typer ignore COLUMNS or colour a pipe: removed so the width asked is the width drawn.
_WIDTH_OVERRIDES = ("TERMINAL_WIDTH", "FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS", "TTY_COMPATIBLE")


def _help(args: list[str], columns: int) -> list[str]:
    """Lines of `python -m anchor ARGS --help` drawn for a terminal `columns` wide (a fresh process, as a user runs it)."""
    env = {k: v for k, v in os.environ.items() if k not in _WIDTH_OVERRIDES}
    env["COLUMNS"] = str(columns)
    done = subprocess.run([sys.executable, "-m", "anchor", *args, "--help"], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    print(f"COLUMNS={columns} anchor {' '.join(args)} --help -> exit {done.returncode}\n{done.stdout}{done.stderr}")
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _too_wide(lines: list[str], columns: int) -> list[str]:
    return [line for line in lines if len(line.rstrip()) > columns]


def _commands_panel(lines: list[str]) -> list[str]:
    """The rows inside the `Commands` panel, borders stripped."""
    start = next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("╰"))
    return [line.strip().strip("│").strip() for line in lines[start + 1:end]]


def _description(lines: list[str]) -> str:
    """The prose between a verb's `Usage:` line and its first panel, whitespace collapsed."""
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╭─"))
    return one_line(" ".join(lines[start + 1:end]))


def test_every_verb_has_a_one_line_summary():
    for name, command in sorted(COMMANDS.items()):
        print(f"{name}: short_help={command.short_help!r}")
    assert sorted(COMMANDS), "no verb registered"
    for name, command in COMMANDS.items():
        assert command.short_help, f"{name}: no short_help"
        assert "\n" not in command.short_help and command.short_help == command.short_help.strip(), name
        assert one_line(command.short_help) != one_line(inspect.cleandoc(command.help or "")), (
            f"{name}: the summary is the whole description")


@pytest.mark.parametrize("columns", [80, 120])
def test_top_level_help_lists_each_verb_on_one_line(columns):
    lines = _help([], columns)
    rows = _commands_panel(lines)
    expected = {name: one_line(command.short_help or command.help or "") for name, command in COMMANDS.items()}
    print("rows:", *rows, sep="\n  ")
    assert not _too_wide(lines, columns), _too_wide(lines, columns)
    names = [row.split(maxsplit=1)[0] if row else "" for row in rows]
    assert len(rows) == len(expected), f"{len(rows)} lines for {len(expected)} verbs: a summary wrapped"
    assert sorted(names) == sorted(expected)
    for name, row in zip(names, rows):
        shown = row.split(maxsplit=1)[1] if len(row.split(maxsplit=1)) == 2 else ""
        assert shown == expected[name], (name, shown, expected[name])


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_verb_help_shows_the_whole_description(verb):
    lines = _help([verb], 80)
    whole = one_line(inspect.cleandoc(COMMANDS[verb].help or ""))
    assert whole, f"{verb}: no description"
    assert not _too_wide(lines, 80), _too_wide(lines, 80)
    assert _description(lines) == whole
