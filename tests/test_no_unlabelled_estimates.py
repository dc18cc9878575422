"""No duration is stated as a measurement unless a record measured it: in the docs pages, README.md, the
Makefile's comments and the help of every `anchor` verb, a duration ("20 minutes", "about 3 min", "110 s",
"1.5 hours") is either on a results page rendered from its record (docs/results, README.md's generated
table) or labelled in its sentence: an estimate (with its basis) or a limit the code or a machine sets.
The check itself is `results_pages.unlabelled_durations`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import typer

from anchor.cli import app, load_commands

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_pages_durations", ROOT / "tools" / "results_pages.py")
results_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_pages)


def makefile_comments(text: str) -> str:
    """The Makefile's comment lines, one paragraph per block of them."""
    return "\n".join(line.split("#", 1)[1] if line.lstrip().startswith("#") else "" for line in text.splitlines())


def cli_help() -> dict[str, str]:
    """Every verb's help as `anchor VERB --help` shows it, before typer wraps it into boxes: the verb's
    description and each option's and argument's help, a paragraph each."""
    load_commands()
    group = typer.main.get_command(app)
    out = {"anchor --help": group.help or ""}
    for name, cmd in group.commands.items():
        parts = [cmd.help or "", cmd.short_help or ""] + [p.help for p in cmd.params if getattr(p, "help", None)]
        out[f"anchor {name} --help"] = "\n\n".join(parts)
    return out


def sources(root: Path) -> dict[str, str]:
    out = results_pages.prose(root)
    out["Makefile (comments)"] = makefile_comments((root / "Makefile").read_text(encoding="utf-8"))
    return out


def test_docs_readme_makefile_and_help_state_no_unmeasured_duration():
    texts = {**sources(ROOT), **cli_help()}
    assert any(name.startswith("docs/verbs/") for name in texts) and "anchor demo --help" in texts
    found = [f"{name}: {d}" for name, text in texts.items() for d in results_pages.unlabelled_durations(text)]
    for line in found:
        print(line)
    assert found == []


PLANTED = [
    "**What it needs.** It is sized for about 20 minutes on one H100.",
    "On one H100 a bf16 run is about 3 minutes of training and 3 of evaluation.",
    "pip compiles at install (make test about 3 minutes slower, for 110 s saved at install).",
    "The demo takes about 16 min on a fresh clone.",
    "It runs for 1.5 hours on a CPU.",
    "A default audit finishes in 45s.",
    "The handler fires 50 ms later.",
    "It took 31–33 minutes.",
    "Training takes 2 days on 8 GPUs.",
]
LABELLED = [
    "It is sized for about 20 minutes on one H100 (an estimate from the step times of one record).",
    "The driver stops a pass silent past its limit (15 minutes by default).",
    "A run is estimated at 3 hours from the step times.",
    "H100s and 16K windows hold 5e5 positions in 2 layers.",
]


@pytest.mark.parametrize("sentence", PLANTED)
def test_a_planted_unlabelled_duration_is_caught(sentence):
    assert len(results_pages.unlabelled_durations(f"Some prose. {sentence} More prose.")) >= 1


@pytest.mark.parametrize("sentence", LABELLED)
def test_a_labelled_duration_or_a_number_of_something_else_passes(sentence):
    assert results_pages.unlabelled_durations(f"Some prose. {sentence} More prose.") == []


def test_only_the_generated_parts_of_pages_are_exempt(tmp_path: Path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "verbs").mkdir()
    (tmp_path / "docs" / "verbs" / "x.md").write_text("# x\n\nIt is sized for about 20 minutes on one H100.\n")
    (tmp_path / "docs" / "results" / "speed.md").write_text(
        f"# Speed\n\n{results_pages.GENERATED}\n\n| run | 651 s (one run) |\n")
    (tmp_path / "README.md").write_text(
        f"# r\n\n{results_pages.README_START}\n| demo | 651 s |\n{results_pages.README_END}\n\n"
        "A run takes 3 minutes.\n")
    (tmp_path / "Makefile").write_text("# The demo (16 minutes on a fresh clone).\ndemo:\n\techo 5 s\n")
    found = {name: results_pages.unlabelled_durations(text) for name, text in sources(tmp_path).items()}
    assert [d.split(" in: ")[0] for d in found["docs/verbs/x.md"]] == ["'20 minutes'"]
    assert "docs/results/speed.md" not in found
    assert [d.split(" in: ")[0] for d in found["README.md"]] == ["'3 minutes'"]
    assert [d.split(" in: ")[0] for d in found["Makefile (comments)"]] == ["'16 minutes'"]
