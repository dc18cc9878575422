"""One word per meaning: "stage" is a dtype policy's numerical stage (and DeepSpeed's ZeRO stage, DeepSpeed's
word); a length schedule is made of *phases*; the demo's pipeline is made of *jobs*, picked with `--jobs`; "plan"
is the memory plan.

Two checks:

- The files that own the length schedule and the demo (`OWNERS`: the trainer's config and training loop, the
  demo, the `demo`, `train` and `plan` verbs and their pages, the shipped train configs) say "stage" only in
  DeepSpeed's phrases and where they read what an earlier release wrote (`ALLOWED`).
- No file in the vocabulary check's scope (tests/test_vocabulary.py) uses a phrase that can only mean a demo's or a
  schedule's stage, or the demo's `--steps` (`PHRASES`), outside the lines that name the older spelling.
"""

from __future__ import annotations

import re

import pytest

from tests.test_no_history import ROOT, tracked_files
from tests.test_vocabulary import read_scope

OWNERS = ("anchor/demo/", "anchor/commands/demo.py", "anchor/commands/plan.py", "anchor/commands/train.py",
          "torchtrain/training/", "torchtrain/config/", "anchor_core/configs/train/", "docs/verbs/demo.md",
          "docs/verbs/train.md", "docs/verbs/plan.md")
STAGE = re.compile(r"(?<![A-Za-z])stages?(?![A-Za-z])", re.IGNORECASE)
# (why, pattern): blanked before STAGE is searched in an owner's line.
ALLOWED: tuple[tuple[str, re.Pattern[str]], ...] = tuple((why, re.compile(p, re.IGNORECASE | re.MULTILINE))
                                                     for why, p in (
    ("DeepSpeed's ZeRO stage", r"zero[\w\s.\"'{}:-]{0,30}?stages?"),
    ("DeepSpeed's stage N", r"stages?[- ]?[0-3](?!\d)"),
    ("DeepSpeed's stage", r"deepspeed's\s+stages?|what\s+its\s+stage\s+partitions"),
    ("a dtype policy's stage", r"(numerical|polic\w*|dtype)\s+stages?"),
    ("the older name, read for one release", r"^.*(earlier\s+release|older?\s+name|\bOLD_\w+|\bRENAMED\b).*$"),
    ("an older name in code", r"`[^`\n]*stage[^`\n]*`|[\"'][\w.]*stages?\w*[\"']"),
))
# (what it means, pattern): searched in every file in scope, outside the lines that name the older spelling.
PHRASES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((what, re.compile(p, re.IGNORECASE)) for what, p in (
    ("a demo's stage", r"(finished|reused?|selected|resumable|demo's|every)\s+stages?\s+(but|whose|of\s+the\s+demo)"
                       r"|(finished|reused|selected|resumable|demo's)\s+stages?"),
    ("a demo's stage", r"stages?\s+(folders?|reuse|is\s+reused|are\s+reused)"),
    ("a length schedule's stage", r"schedule\.stages|schedule's\s+stages?|length[- ]schedule\s+stages?"),
    ("the demo's old option", r"anchor\s+demo\b[^\n]*\s--steps\b"),
))
OLDER = re.compile(r"earlier\s+release|older?\s+name|\bOLD_|RENAMED|\bis\s+now\b", re.IGNORECASE)


def owned(path: str) -> bool:
    return path.startswith(OWNERS)


def owner_hits(files) -> list[str]:
    """`path:line: text` of each owner's line that says "stage" outside ALLOWED (a phrase of ALLOWED may break
    across a line, as DeepSpeed's "ZeRO stage" does in a wrapped docstring)."""
    hits = []
    for path, text in files:
        if not owned(path):
            continue
        blank = text
        for _, pattern in ALLOWED:
            blank = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), blank)  # keeps the lines where they are
        lines = text.splitlines()
        found = sorted({blank.count("\n", 0, m.start()) + 1 for m in STAGE.finditer(blank)})
        hits += [f"{path}:{n}: {lines[n - 1].strip()[:160]}" for n in found]
    return hits


def phrase_hits(files) -> list[str]:
    """`path:line: [meaning] text` of each line in scope with a phrase of PHRASES, outside the older spelling's."""
    hits = []
    for path, text in files:
        for n, line in enumerate(text.splitlines(), 1):
            if OLDER.search(line):
                continue
            what = next((w for w, p in PHRASES if p.search(line)), None)
            if what:
                hits.append(f"{path}:{n}: [{what}] {line.strip()[:160]}")
    return hits


@pytest.fixture(scope="module")
def scope() -> list[tuple[str, str]]:
    return list(read_scope(ROOT, tracked_files()))


def test_the_owners_of_the_schedule_and_the_demo_say_phase_and_job(scope):
    assert any(p == "anchor/demo/jobs.py" for p, _ in scope) and any(p == "docs/verbs/train.md" for p, _ in scope)
    hits = owner_hits(scope)
    assert not hits, ("a length schedule has phases, the demo has jobs; 'stage' is a dtype policy's "
                      "(tests/test_one_word.py):\n" + "\n".join(hits))


def test_no_file_says_a_demo_or_schedule_stage(scope):
    hits = phrase_hits(scope)
    assert not hits, "\n".join(hits)


def test_no_module_or_config_keeps_the_old_names():
    paths = tracked_files()
    old = [p for p in paths if re.search(r"(anchor/demo/(planning|stages|\w+_stage|stage_\w+)\.py"
                                         r"|torchtrain/training/stages\.py|configs/train/\w*stages\w*\.yaml)$", p)]
    assert not old, old


@pytest.mark.parametrize("path, line", [
    ("anchor/demo/jobs.py", "    # the train stage reads the pack"),
    ("torchtrain/training/phases.py", '    """The stage optimizer step `step` trains in."""'),
    ("docs/verbs/demo.md", "A second run reuses every finished job; each stage has its folder."),
    ("anchor_core/configs/train/tiny_phases.yaml", "schedule:\n  stages:"),
])
def test_a_planted_stage_in_an_owner_is_found(path, line):
    assert owner_hits([(path, line)]), line


@pytest.mark.parametrize("line", [
    "A second run reuses every finished stage.",
    "anchor demo --steps train,eval --out runs/demo",
    "schedule.stages: [{steps: 4, seq_len: 97}]",
    "each stage folder holds what it wrote",
])
def test_a_planted_phrase_anywhere_is_found(line):
    assert phrase_hits([("README.md", line)]), line


@pytest.mark.parametrize("path, line", [
    ("torchtrain/config/deepspeed_json.py", '    "zero_optimization": {"stage": 3},'),
    ("torchtrain/training/memory.py", "        # DeepSpeed's stage-0 bf16 optimizer departs from the fp32 update"),
    ("docs/verbs/train.md", "weights and AdamW states per ZeRO stage, activations linear in T"),
    ("torchtrain/config/validation.py", 'RENAMED = {"schedule.stages": "schedule.phases"}  # older name'),
    ("docs/verbs/demo.md", "`--steps`, its name in earlier releases, is accepted with a warning."),
])
def test_deepspeeds_stage_and_the_older_names_pass(path, line):
    assert not owner_hits([(path, line)]) and not phrase_hits([(path, line)]), line
