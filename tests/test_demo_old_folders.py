"""A demo folder an earlier version wrote is this version's to continue.

Before the demo's pipeline units were named jobs, demo.json held them under `stages` (and the settings' `jobs`
as `stages`). This version reads such a record (`anchor.demo.settings.upgrade_record`), reuses every finished
job of it, resumes its stopped `train` and `eval` jobs where they were, and writes the record back under the
new names. The fingerprints hash the same bytes as before the rename.

`fixtures/demo_before_jobs.json` is the demo.json the code before the rename wrote (anchor `OLD_VERSION`) for
`SETTINGS` on random:llama, every job of the pipeline run: the fingerprints it holds are that code's, so
`test_the_fingerprints_are_those_of_the_code_before_the_rename` fails when a fingerprint changes. The folder the
other tests rerun is made here by this version (a checkpoint fixture would be megabytes) and its demo.json
written back as the code before the rename wrote it (`as_before`: the two keys renamed back, each job's
fingerprint the fixture's): `test_as_before_is_what_the_code_before_the_rename_wrote` holds that record to the
fixture's keys (top level, per job, per job summary, settings), so a reuse shown on it is the reuse of a folder
the earlier version wrote, and a changed fingerprint leaves the job unreused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import anchor.demo.pipeline as pipeline
from anchor.demo import JOBS, DemoSettings, fingerprints, read_record, run_demo
from anchor.demo.settings import OLD_JOBS_KEY, upgrade_record

FIXTURE = Path(__file__).parent / "fixtures" / "demo_before_jobs.json"
OLD_VERSION = "0.1.0"  # anchor's version when the fixture was written (a fingerprint hashes it)
MODEL = "random:llama"
SETTINGS = DemoSettings(model=MODEL, seq_len=128, budget=20_000, train_steps=2, global_batch=1, lr=1e-3,
                        eval_every=1, eval_window=2, parity_seq_len=17, parity_policies=("fp32",),
                        parity_grad_layers=1, eval_tasks=("niah_single_1",), eval_lengths=(1024,), eval_samples=1,
                        perplexity_windows=0, bench_seq_lens=(256,), bench_windows=1, bench_repeats=1)
# the jobs of the folder rerun here: paper-gpu's, the resumable train and eval with what they read
PART = ("corpus", "pack", "train", "eval")


def quiet(_: str) -> None:
    pass


def before() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def as_before(record: dict[str, Any]) -> dict[str, Any]:
    """`record` (this version's demo.json) as the code before the rename wrote it: the jobs under `stages`, the
    settings' `jobs` as `stages`, each job's fingerprint the one that code computed (the fixture's)."""
    old = before()["stages"]
    d = {("stages" if k == "jobs" else k): v for k, v in record.items()}
    d["settings"] = {("stages" if k == "jobs" else k): v for k, v in record["settings"].items()}
    d["stages"] = {job: {**rec, "fingerprint": old[job]["fingerprint"]} for job, rec in record["jobs"].items()}
    return d


def write_as_before(out: Path, edit=None) -> dict[str, Any]:
    d = as_before(json.loads((out / "demo.json").read_text(encoding="utf-8")))
    if edit:
        edit(d)
    (out / "demo.json").write_text(json.dumps(d, indent=1), encoding="utf-8")
    return d


def keys(d: dict[str, Any]) -> dict[str, Any]:
    """The keys of a demo.json: top level, per job, per job summary, settings."""
    jobs = d["stages"]
    return {"top": sorted(d), "settings": sorted(d["settings"]),
            "job": {j: sorted(r) for j, r in jobs.items()},
            "summary": {j: sorted(r["summary"]) for j, r in jobs.items()}}


@pytest.fixture(scope="module")
def old_version():
    """anchor's version as it was when the fixture was written: the fingerprints hash the version."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "__version__", OLD_VERSION)
        yield


@pytest.fixture(scope="module")
def demo(tmp_path_factory, old_version) -> Path:
    """`PART` of the fixture's demo, run by this version (at `OLD_VERSION`)."""
    out = tmp_path_factory.mktemp("old") / "demo"
    record = run_demo(MODEL, out, jobs=PART, settings=SETTINGS, progress=False, say=quiet)
    assert record["ran"] == list(PART), record["ran"]
    return out


def copy(demo: Path, tmp_path: Path) -> Path:
    out = tmp_path / "demo"
    shutil.copytree(demo, out, symlinks=True)
    return out


def test_the_fingerprints_are_those_of_the_code_before_the_rename(old_version):
    old = before()
    assert "jobs" not in old and set(old[OLD_JOBS_KEY]) == set(JOBS)
    new = upgrade_record(old)
    assert OLD_JOBS_KEY not in new and list(new["jobs"]) == list(old["stages"])
    assert OLD_JOBS_KEY not in new["settings"] and new["settings"]["jobs"] == list(JOBS)
    settings = DemoSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in new["settings"].items()})
    assert settings == SETTINGS
    assert fingerprints(settings) == {job: rec["fingerprint"] for job, rec in old["stages"].items()}


def test_as_before_is_what_the_code_before_the_rename_wrote(demo):
    mine = as_before(read_record(demo))
    old = before()
    old["stages"] = {job: old["stages"][job] for job in PART}
    assert keys(mine) == keys(old)
    assert mine["settings"] == old["settings"]


def test_every_finished_job_of_a_folder_the_earlier_version_wrote_is_reused(demo, tmp_path, old_version):
    out = copy(demo, tmp_path)
    old = write_as_before(out)
    assert "jobs" not in json.loads((out / "demo.json").read_text())
    said: list[str] = []
    record = run_demo(MODEL, out, jobs=PART, settings=SETTINGS, progress=False, say=said.append)
    assert record["ran"] == [] and record["reused"] == list(PART), (record["ran"], said)
    # written back under the new names, each job's record as it was
    d = json.loads((out / "demo.json").read_text(encoding="utf-8"))
    assert OLD_JOBS_KEY not in d and OLD_JOBS_KEY not in d["settings"] and d["settings"]["jobs"] == list(JOBS)
    assert d["jobs"] == old["stages"]


@pytest.mark.slow  # minutes; make test keeps the reuse of such a folder and its fingerprints
def test_a_stopped_eval_job_of_a_folder_the_earlier_version_wrote_resumes(demo, tmp_path, old_version):
    """As a demo of the earlier version killed while evaluating its second run leaves it: the first run's
    evaluation is reused, the second's made. In the module's folder itself (an evaluation resumes on the
    checkpoints it started on, by their paths), before the train job's test."""
    out = demo
    first, second = SETTINGS.train_variants
    shutil.rmtree(out / "eval" / second)
    kept = (out / "eval" / first / "eval.json").stat().st_mtime_ns
    write_as_before(out, lambda d: d["stages"]["eval"].update(done=False))
    said: list[str] = []
    record = run_demo(MODEL, out, jobs=("eval",), settings=SETTINGS, progress=False, say=said.append)
    assert record["ran"] == ["eval"] and record["reused"] == ["corpus", "pack", "train"], record
    assert any(f"{first}: evaluated before the demo stopped, reused" in x for x in said), said
    assert (out / "eval" / first / "eval.json").stat().st_mtime_ns == kept
    assert (out / "eval" / second / "eval.json").is_file()


@pytest.mark.slow  # minutes; make test keeps the reuse of such a folder and its fingerprints
def test_a_stopped_train_job_of_a_folder_the_earlier_version_wrote_resumes(demo, tmp_path, old_version):
    """As a demo of the earlier version killed during the full run's last step leaves it: the job started, not
    done, the run's newest checkpoint not written. This version resumes the job (its folder is not cleared: the
    checkpoints of the anchor run it finished are the same files) and the full run's losses are those of the whole run. In the module's folder
    itself, and last (a run resumes in the folder it started in: its config names the packed windows' path)."""
    out = demo
    ckpts = out / "train" / "full" / "checkpoints"
    before_losses = (out / "train" / "full" / "metrics.jsonl").read_text()
    shutil.rmtree(ckpts / f"step-{SETTINGS.train_steps}")
    kept = {p: p.stat().st_mtime_ns for p in (out / "train" / "anchor" / "checkpoints").rglob("*") if p.is_file()}
    assert kept
    write_as_before(out, lambda d: d["stages"]["train"].update(done=False))
    record = run_demo(MODEL, out, jobs=("train",), settings=SETTINGS, progress=False, say=quiet)
    assert record["ran"] == ["train"] and record["reused"] == ["corpus", "pack"], record
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # resumed: the run it finished kept its checkpoints
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step-1", "step-2"]
    losses = [[json.loads(x)["loss"] for x in t.splitlines()]
              for t in (before_losses, (out / "train" / "full" / "metrics.jsonl").read_text())]
    assert losses[0] == losses[1], losses
    assert read_record(out)["jobs"]["train"]["done"]
