"""Nothing a demo finished is lost or misreported.

A merge writes only into a new folder or into a merge of its own: a finished demo's folder (the `--out` given,
or `runs/demo` by default) is refused in one line and left as it was, and a merge's folder is not a demo's to
run jobs in. A part whose own records disagree (a metrics.jsonl cut short, another run's losses or config)
is refused in one line naming the part and what disagrees. A demo's job folder that another verb replaced,
or whose files changed, runs again, and so does every job that reads it, also when it ran again in an
earlier demo that did not select them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from anchor.demo import DemoSettings, run_demo
from anchor_core.outdir import read_marker
from tests.cli.helpers import assert_usage_error, run_cli, tree_hash

MODEL = "random:llama"
TINY = DemoSettings(model=MODEL, seq_len=128, budget=20_000, train_steps=2, global_batch=1, lr=1e-3, eval_every=1,
                    eval_window=1, eval_tasks=("niah_single_1",), eval_lengths=(1024,), eval_samples=1,
                    perplexity_windows=0, jobs=("corpus", "pack", "train", "eval"))
PART_JOBS = ("corpus", "pack", "train", "eval")
MERGE_VERB = "demo --merge"  # the verb a merge's marker names (docs/verbs/demo.md)


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    """Two finished demo parts of one experiment: `full` alone and `anchor` alone."""
    root = tmp_path_factory.mktemp("parts")
    for run in ("full", "anchor"):
        run_demo(MODEL, root / run, jobs=PART_JOBS, settings=replace(TINY, only_runs=(run,)), progress=False,
                 say=quiet)
    return root


def copy_parts(parts: Path, into: Path) -> tuple[Path, Path]:
    a, b = into / "part-full", into / "part-anchor"
    shutil.copytree(parts / "full", a, symlinks=True)
    shutil.copytree(parts / "anchor", b, symlinks=True)
    return a, b


def merge(capsys, *parts: Path, out: Path | None) -> tuple[int, str, str]:
    return run_cli(["demo", *[x for p in parts for x in ("--merge", p)], *(["--out", out] if out else [])], capsys)


# ---------------------------------------------------------------------------------------------
# Where a merge writes


def test_a_merge_never_replaces_a_finished_demo(parts, tmp_path, capsys, monkeypatch):
    """`--out A` naming a finished demo (checkpoints, pack, corpus) and, without `--out`, an existing
    `runs/demo`: one line naming the folder, exit 2, every file as it was."""
    a, b = copy_parts(parts, tmp_path)
    finished = tmp_path / "A"
    shutil.copytree(parts / "full", finished, symlinks=True)  # a demo that ran its jobs, not a part given here
    assert any((finished / "train" / "full" / "checkpoints").iterdir())
    before = tree_hash(finished)
    code, _, err = merge(capsys, a, b, out=finished)
    assert_usage_error(code, err, "demo", str(finished), "anchor demo")
    assert tree_hash(finished) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "part-anchor", "part-full"]  # no staging, no lock

    monkeypatch.chdir(tmp_path)
    default = tmp_path / "runs" / "demo"
    shutil.copytree(parts / "anchor", default, symlinks=True)
    before = tree_hash(default)
    code, _, err = merge(capsys, a, b, out=None)
    assert_usage_error(code, err, "demo", "runs/demo", "anchor demo")
    assert tree_hash(default) == before and sorted(p.name for p in default.parent.iterdir()) == ["demo"]


def test_a_merge_replaces_its_own_merge_and_no_demo_runs_jobs_in_it(parts, tmp_path, capsys):
    """A merge's folder carries the merge's marker: a second merge replaces it; `anchor demo` running jobs
    there is refused in one line, the merge as it was."""
    a, b = copy_parts(parts, tmp_path)
    out = tmp_path / "merged"
    code, _, err = merge(capsys, a, b, out=out)
    assert code == 0, err
    before = tree_hash(out)
    code, _, err = run_cli(["demo", "--model", MODEL, "--jobs", "corpus", "--no-progress", "--out", out], capsys)
    assert_usage_error(code, err, "demo", str(out), MERGE_VERB)
    assert tree_hash(out) == before
    assert read_marker(out)["verb"] == MERGE_VERB
    (out / "index.html").unlink()  # the second merge replaces the whole folder
    code, _, err = merge(capsys, a, b, out=out)
    assert code == 0, err
    assert (out / "index.html").is_file() and read_marker(out)["verb"] == MERGE_VERB


# ---------------------------------------------------------------------------------------------
# A part whose records disagree


def _cut_last_line(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))


def _other_loss(path: Path) -> None:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[0]["loss"] += 1.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("name, edit, needle", [
    ("metrics.jsonl", _cut_last_line, "train/anchor/metrics.jsonl holds 1 steps, demo.json 2"),
    ("metrics.jsonl", _other_loss, "train/anchor/metrics.jsonl holds other losses than demo.json"),
    ("config.yaml", lambda p: p.write_text(p.read_text().replace("variant: anchor", "variant: full")),
     "train/anchor/config.yaml has variant 'full', demo.json 'anchor'"),
], ids=["metrics-cut-short", "metrics-other-loss", "config-of-another-run"])
def test_a_part_whose_records_disagree_is_refused(parts, tmp_path, capsys, name, edit, needle):
    a, b = copy_parts(parts, tmp_path)
    path = b / "train" / "anchor" / name
    before = path.read_text()
    edit(path)
    assert path.read_text() != before
    out = tmp_path / "merged"
    code, _, err = merge(capsys, a, b, out=out)
    assert_usage_error(code, err, "demo", str(b), "records disagree", needle)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# A replaced job runs again


@pytest.fixture
def demo(tmp_path) -> tuple[Path, dict]:
    """A demo of the corpus and pack jobs (seconds)."""
    out = tmp_path / "demo"
    record = run_demo(MODEL, out, jobs=("corpus", "pack"), settings=TINY, progress=False, say=quiet)
    assert record["ran"] == ["corpus", "pack"]
    return out, record


def test_a_corpus_another_verb_wrote_over_the_demos_runs_again_with_what_reads_it(demo, capsys):
    out, first = demo
    code, _, err = run_cli(["corpus", "--max-docs", "3", "--no-progress", "--out", out / "corpus"], capsys)
    assert code == 0, err
    assert read_marker(out / "corpus")["verb"] == "corpus"
    replaced = json.loads((out / "corpus" / "corpus.json").read_text())
    assert replaced != first["jobs"]["corpus"]["summary"]
    said: list[str] = []
    again = run_demo(MODEL, out, jobs=("corpus", "pack"), settings=TINY, progress=False, say=said.append)
    print("\n".join(said))
    assert again["ran"] == ["corpus", "pack"] and again["reused"] == [], again
    assert any("corpus: not reused: corpus/ no longer holds" in x for x in said), said
    assert any("pack: not reused: the corpus job it reads was run again since" in x for x in said), said
    assert again["jobs"]["corpus"]["summary"] == first["jobs"]["corpus"]["summary"]
    assert json.loads((out / "corpus" / "corpus.json").read_text()) == first["jobs"]["corpus"]["summary"]
    assert again["jobs"]["pack"]["summary"] == first["jobs"]["pack"]["summary"]
    third = run_demo(MODEL, out, jobs=("corpus", "pack"), settings=TINY, progress=False, say=quiet)
    assert third["ran"] == [] and third["reused"] == ["corpus", "pack"], third


def test_a_job_that_ran_again_alone_runs_what_reads_it_in_the_next_demo(demo):
    """The corpus changed and ran again in a demo that did not select pack: the next demo with pack runs pack
    again (it read the corpus before that ran again), though the corpus is reused."""
    out, _ = demo
    with open(out / "corpus" / "corpus.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "a document the demo did not write", "domain": "code"}) + "\n")
    alone = run_demo(MODEL, out, jobs=("corpus",), settings=TINY, progress=False, say=quiet)
    assert alone["ran"] == ["corpus"], alone
    said: list[str] = []
    both = run_demo(MODEL, out, jobs=("corpus", "pack"), settings=TINY, progress=False, say=said.append)
    print("\n".join(said))
    assert both["reused"] == ["corpus"] and both["ran"] == ["pack"], both
    assert any("pack: not reused: the corpus job it reads was run again since" in x for x in said), said
    third = run_demo(MODEL, out, jobs=("corpus", "pack"), settings=TINY, progress=False, say=quiet)
    assert third["ran"] == [] and third["reused"] == ["corpus", "pack"], third


def test_a_changed_file_in_a_later_job_runs_that_job_alone(demo):
    out, first = demo
    (out / "pack" / "stats.md").write_text("edited by hand\n")
    again = run_demo(MODEL, out, jobs=("corpus", "pack"), settings=TINY, progress=False, say=quiet)
    assert again["reused"] == ["corpus"] and again["ran"] == ["pack"], again
    assert (out / "pack" / "stats.md").read_text() != "edited by hand\n"
