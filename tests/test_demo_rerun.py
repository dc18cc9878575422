"""A demo run again reuses every finished job, and never removes what was added to its folder.

One demo of every job on a tiny random Llama, its documents cut into pieces as the `demo` profile packs
them (several documents a window), runs once for the module; each test reruns it, or a `cp -a` copy of it.
A second run reuses every job in seconds, on the same folder and on a copy, for each profile's job list;
each job's folder still holds exactly what its record says (no later job writes into it). A checkpoint
`anchor train` added to a demo run is kept: the rerun that would redo the job stops in one line naming it,
before any work, unless `--fresh`; files added beside a job's own are kept and the job reused.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from anchor.demo import JOBS, PROFILES, read_record, run_demo
from anchor.demo.pipeline import job_content
from anchor_core.errors import InputError
from tests.cli.helpers import run_cli, tree_hash
from tests.cli.test_demo import MODEL, TINY

PIECES = replace(TINY, pack_docs="pieces", jobs=PROFILES["demo"].jobs)
REUSE_S = 10.0  # a rerun of finished jobs reads their folders and writes demo.json and the page


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rerun") / "demo"
    record = run_demo(MODEL, out, settings=PIECES, progress=False, say=print)
    assert record["ran"] == list(PROFILES["demo"].jobs), record["ran"]
    return out


def copy(src: Path, dest: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dest)], check=True)
    return dest


def rerun(out: Path, said: list[str] | None = None, **kw) -> tuple[dict, float]:
    t = time.perf_counter()
    record = run_demo(MODEL, out, settings=PIECES, progress=False, say=(said.append if said is not None else print),
                      **kw)
    return record, time.perf_counter() - t


@pytest.mark.slow
def test_a_second_run_reuses_every_job_in_seconds(demo, tmp_path):
    record = read_record(demo)
    for job in PIECES.jobs:  # no job wrote into another's folder after that one was recorded
        assert job_content(demo / job) == record["jobs"][job]["content"], job
    assert (demo / "pack" / "pieces.jsonl").is_file() and not (demo / "corpus" / "pieces.jsonl").exists()
    again, seconds = rerun(demo)
    print(f"second run on the same folder: {seconds:.2f} s")
    assert again["ran"] == [] and again["reused"] == list(PIECES.jobs), again
    assert seconds < REUSE_S
    copied = copy(demo, tmp_path / "copied")
    third, seconds = rerun(copied)
    print(f"a cp -a copy: {seconds:.2f} s")
    assert third["ran"] == [] and third["reused"] == list(PIECES.jobs), third
    assert seconds < REUSE_S
    lists = {p.jobs for p in PROFILES.values()}  # every profile's job list, each a selection of this demo's
    for jobs in sorted(lists):
        r, seconds = rerun(copied, jobs=jobs)
        print(f"jobs {','.join(jobs)}: {seconds:.2f} s")
        assert r["ran"] == [] and r["reused"] == [s for s in JOBS if s in jobs], (jobs, r)
        assert seconds < REUSE_S


def extend_a_run(out: Path, capsys, tmp_path: Path, steps: int) -> Path:
    """`anchor train` continues the demo's anchor run to `steps` in its own folder, as docs/verbs/demo.md
    says a user may; returns the checkpoint it adds."""
    config = tmp_path / "config.yaml"
    config.write_bytes((out / "train" / "anchor" / "config.yaml").read_bytes())
    code, _, err = run_cli(["train", "--config", config, "--out", out / "train" / "anchor", f"schedule.steps={steps}",
                            "--no-progress"], capsys)
    assert code == 0, err
    added = out / "train" / "anchor" / "checkpoints" / f"step-{steps}"
    assert added.is_dir()
    return added


@pytest.mark.slow
def test_a_checkpoint_anchor_train_added_is_never_removed(demo, tmp_path, capsys):
    out = copy(demo, tmp_path / "demo")
    added = extend_a_run(out, capsys, tmp_path, PIECES.train_steps + 2)
    before = tree_hash(out)
    said: list[str] = []
    with pytest.raises(InputError) as e:
        rerun(out, said)
    line = str(e.value)
    print(line)
    assert "\n" not in line and len(line) < 400
    assert f"train/anchor/checkpoints/{added.name}/" in line and "--fresh" in line
    assert said == [], said  # refused before any job, reused or run
    after = tree_hash(out)
    assert {k: v for k, v in after.items() if k != "demo.json"} == {k: v for k, v in before.items() if k != "demo.json"}
    # --fresh redoes the job, naming what it removes
    said.clear()
    record, _ = rerun(out, said, fresh=True, jobs=("train",))
    assert record["ran"] == ["corpus", "pack", "train"], record["ran"]
    assert any("--fresh: removing what the demo did not write" in x and added.name in x for x in said), said
    assert not added.exists()


@pytest.mark.slow
def test_files_added_beside_a_jobs_own_are_kept_and_the_job_reused(demo, tmp_path):
    out = copy(demo, tmp_path / "demo")
    notes = [out / "train" / "anchor" / "notes.md", out / "eval" / "my-plot.png", out / "pack" / "extra" / "a.txt"]
    for p in notes:
        p.parent.mkdir(exist_ok=True)
        p.write_text("mine\n")
    said: list[str] = []
    record, _ = rerun(out, said)
    assert record["ran"] == [] and record["reused"] == list(PIECES.jobs), record
    assert all(p.read_text() == "mine\n" for p in notes)
    assert any("train: reused" in x and "train/anchor/notes.md" in x for x in said), said
    assert any("pack: reused" in x and "pack/extra/" in x for x in said), said
    # a setting that redoes the job: the added file is named, nothing runs, nothing is removed
    with pytest.raises(InputError) as e:
        run_demo(MODEL, out, settings=replace(PIECES, eval_samples=1), progress=False, say=said.append)
    assert "eval/my-plot.png" in str(e.value) and "its settings changed" in str(e.value), str(e.value)
    assert all(p.read_text() == "mine\n" for p in notes)
    record = json.loads((out / "demo.json").read_text())
    assert record["jobs"]["eval"]["done"], "the refused demo left the eval job's record as it was"
