"""`anchor demo`: every job on a tiny random Llama, the page's links, job reuse by fingerprint,
a setting that invalidates only the jobs downstream of it, a killed training run resumed, `--jobs` errors,
`--steps` (its old name) with its warning, a job folder of the user's files left alone.

The end-to-end test runs the jobs once (about a minute and a half on 2 cores) and then reruns them in the
same folder: one test, so that parallel workers never build the demo twice.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from anchor.demo import JOBS, DemoSettings, fingerprints, jobs_to_run, read_record, run_demo
from anchor_core.errors import InputError
from anchor_core.outdir import read_marker
from tests.browser.pagecheck import check_links
from tests.cli.helpers import assert_usage_error, run_cli

MODEL = "random:llama"
TINY = DemoSettings(model=MODEL, seq_len=128, budget=20_000, train_steps=4, global_batch=2, lr=1e-3, eval_every=2, eval_window=4,
                    parity_seq_len=33, parity_policies=("fp32",), parity_grad_layers=1, eval_tasks=("niah_single_1",), eval_lengths=(1024,),
                    eval_samples=2, perplexity_windows=1, bench_seq_lens=(256,), bench_windows=1, bench_repeats=1)


def quiet(_: str) -> None:
    pass


@pytest.mark.slow  # minutes of CPU: make test-all
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    record = run_demo(MODEL, out, settings=TINY, progress=False, say=quiet)
    assert record["ran"] == list(JOBS) and record["reused"] == []
    print(f"first run: {record['seconds']} s")
    check_record_and_page(out)
    check_rerun_and_invalidation(out)
    check_killed_training_resumes(out)
    check_killed_evaluation_resumes(out)


def check_record_and_page(out: Path) -> None:
    record = read_record(out)
    fps = fingerprints(TINY)
    for job in JOBS:
        rec = record["jobs"][job]
        assert rec["done"] and rec["fingerprint"] == fps[job], job
        assert read_marker(out / job) is not None, f"{job}: no anchor marker"
    assert read_marker(out)["verb"] == "demo"
    train = record["jobs"]["train"]["summary"]["runs"]
    assert set(train) == {"anchor", "full"}
    for v, r in train.items():
        assert r["steps"] == TINY.train_steps and len(r["loss"]) == TINY.train_steps
        assert r["eval_checkpoints"] == ["step-2", "step-4"], r
    # the evaluation averages over both evaluation checkpoints of each run
    for v, r in record["jobs"]["eval"]["summary"]["runs"].items():
        assert r["checkpoints"] == ["step-2", "step-4"]
        assert r["scores"]["1024"]["checkpoints"] == 2
    rows = json.loads((out / "eval" / "anchor" / "eval.json").read_text())["rows"]
    assert sorted({r["checkpoint"] for r in rows}) == ["step-2", "step-4"]
    # parity ran on the trained checkpoint, forward and gradients
    par = record["jobs"]["parity"]["summary"]
    assert par["model"] == "train/anchor/checkpoints/step-4/hf" and par["grad_cases"] == 2
    assert par["grad_model"].endswith("(first 1 of 3 layers)") and par["cases"] == 4  # forward: whole and cut
    parity = json.loads((out / "parity" / "parity.json").read_text())
    assert parity["model"].endswith("train/anchor/checkpoints/step-4/hf") and parity["grad_cases"]
    page = (out / "index.html").read_text()
    for job in JOBS:
        assert f"id='{job}'" in page, f"no section for {job}"
    problems = check_links(out / "index.html")
    assert not problems, "\n".join(problems)
    assert "<img src='summary.png'" in page and (out / "summary.png").is_file()


def check_rerun_and_invalidation(out: Path) -> None:
    again = run_demo(MODEL, out, settings=TINY, progress=False, say=quiet)
    assert again["ran"] == [] and again["reused"] == list(JOBS), again
    print(f"second run: {again['seconds']} s")
    # fewer evaluation samples: only eval depends on it
    fewer = run_demo(MODEL, out, settings=TINY, progress=False, say=quiet, eval_samples=1)
    assert fewer["ran"] == ["eval"] and set(fewer["reused"]) == set(JOBS) - {"eval"}, fewer
    assert read_record(out)["jobs"]["eval"]["summary"]["samples"] == 1
    # a new window size: pack and everything that trains on it; the corpus, top5, audit and bench stay
    a = fingerprints(TINY)
    b = fingerprints(replace(TINY, seq_len=96))
    assert [s for s in JOBS if a[s] != b[s]] == ["pack", "train", "parity", "eval"]
    assert jobs_to_run(("eval",)) == ("corpus", "pack", "train", "eval")
    # --fresh redoes what is selected, and only that
    top = run_demo(MODEL, out, jobs=("top5",), settings=TINY, progress=False, say=quiet, fresh=True, eval_samples=1)
    assert top["ran"] == ["top5"] and top["reused"] == []


def check_killed_training_resumes(out: Path) -> None:
    before = (out / "train" / "full" / "metrics.jsonl").read_text()
    # as a demo killed during the full run's last steps leaves it: the job started, not done, the
    # run's newest checkpoint not yet written
    rec = json.loads((out / "demo.json").read_text())
    rec["jobs"]["train"]["done"] = False
    (out / "demo.json").write_text(json.dumps(rec))
    shutil.rmtree(out / "train" / "full" / "checkpoints" / "step-4")
    again = run_demo(MODEL, out, jobs=("train",), settings=TINY, progress=False, say=quiet)
    assert again["ran"] == ["train"] and again["reused"] == ["corpus", "pack"], again
    assert sorted(p.name for p in (out / "train" / "full" / "checkpoints").iterdir() if p.is_dir()) == \
        ["step-2", "step-4"]
    after = (out / "train" / "full" / "metrics.jsonl").read_text()
    losses = [[json.loads(x)["loss"] for x in t.splitlines()] for t in (before, after)]
    assert losses[0] == losses[1], losses


def check_killed_evaluation_resumes(out: Path) -> None:
    done = run_demo(MODEL, out, jobs=("eval",), settings=TINY, progress=False, say=quiet)
    scores = done["jobs"]["eval"]["summary"]["runs"]
    # as a demo killed while evaluating its second run leaves it: the job started, not done, the first
    # run's evaluation published, the second's not
    rec = json.loads((out / "demo.json").read_text())
    rec["jobs"]["eval"]["done"] = False
    (out / "demo.json").write_text(json.dumps(rec))
    first, second = TINY.train_variants
    shutil.rmtree(out / "eval" / second)
    kept = (out / "eval" / first / "eval.json").stat()
    said: list[str] = []
    again = run_demo(MODEL, out, jobs=("eval",), settings=TINY, progress=False, say=said.append)
    assert again["ran"] == ["eval"], again
    assert any(f"{first}: evaluated before the demo stopped, reused" in x for x in said), said
    assert not any(f"{second}: evaluated before" in x for x in said), said
    assert (out / "eval" / first / "eval.json").stat().st_mtime_ns == kept.st_mtime_ns
    assert (out / "eval" / second / "eval.json").is_file()
    # the prefill engine is the setting's (varlen by default: the fused path per prompt)
    assert json.loads((out / "eval" / second / "eval.json").read_text())["settings"]["engine"] == TINY.eval_engine
    drop_time = lambda runs: {v: {k: x for k, x in r.items() if k != "runtime_s"} for v, r in runs.items()}  # noqa: E731
    assert drop_time(again["jobs"]["eval"]["summary"]["runs"]) == drop_time(scores)
    # another setting: nothing is reused, the job starts over
    said.clear()
    other = run_demo(MODEL, out, jobs=("eval",), settings=TINY, progress=False, say=said.append, eval_samples=1)
    assert other["ran"] == ["eval"], other
    assert not any("evaluated before" in x for x in said), said


def test_jobs_errors(tmp_path, capsys):
    for jobs, needle in (("", "no job given"), (" , ", "no job given"), ("train,nope", "'nope'")):
        code, _, err = run_cli(["demo", "--model", MODEL, "--jobs", jobs, "--out", tmp_path / "d", "--no-progress"],
                               capsys)
        assert_usage_error(code, err, "demo", needle)
    code, _, err = run_cli(["demo", "--model", MODEL, "--profile", "huge", "--out", tmp_path / "d"], capsys)
    assert_usage_error(code, err, "demo", "--profile")
    assert not (tmp_path / "d").exists()


def test_steps_the_old_name_of_jobs_selects_them_with_one_warning_line(tmp_path, capsys):
    """`--steps`, the name of `--jobs` in earlier releases, still selects the jobs, with one warning line on
    stderr naming `--jobs`; both given is a usage error (exit 2, one line), before anything is written."""
    out = tmp_path / "d"
    code, _, err = run_cli(["demo", "--model", MODEL, "--steps", "top5", "--out", out, "--no-progress"], capsys)
    assert code == 0, err
    said = [x for x in err.splitlines() if "--steps" in x or "warning" in x]
    assert len(said) == 1 and said[0].startswith("anchor demo: warning: --steps is now --jobs"), err
    assert read_record(out)["selected"] == ["top5"] and read_record(out)["jobs"]["top5"]["done"]
    code, _, err = run_cli(["demo", "--model", MODEL, "--jobs", "top5", "--steps", "top5", "--out", tmp_path / "e",
                            "--no-progress"], capsys)
    assert_usage_error(code, err, "demo", "--steps", "--jobs")
    assert not (tmp_path / "e").exists()


def test_a_job_folder_of_user_files_is_never_removed(tmp_path, capsys):
    out = tmp_path / "demo"
    run_demo(MODEL, out, jobs=("top5",), settings=TINY, progress=False, say=quiet)
    mine = out / "corpus"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, _, err = run_cli(["demo", "--model", MODEL, "--jobs", "corpus", "--out", out, "--no-progress"], capsys)
    assert_usage_error(code, err, "demo", "anchor did not write")
    assert (mine / "notes.txt").read_text() == "mine"


def test_a_task_that_cannot_fit_is_left_out_before_any_work(tmp_path):
    """The demo's default RULER tasks on random:llama (a byte-level tokenizer): `vt` needs
    ~1.7K tokens and cannot fit 1024, so it is left out of the whole grid before any job runs, with a line
    said and kept for the page; where no task fits, one line and exit 2 in seconds, no folder."""
    import time

    from anchor.demo import PROFILES
    from anchor.demo.pipeline import feasible

    s = replace(PROFILES["demo"], model=MODEL)
    kept, notes = feasible(s, jobs_to_run(("eval",)))
    assert kept.eval_tasks == ("niah_single_1",) and kept.eval_lengths == s.eval_lengths
    assert len(notes) == 1 and notes[0].startswith("RULER vt: ") and "does not fit in 1023 tokens" in notes[0]
    assert feasible(s, jobs_to_run(("bench",))) == (s, [])  # no evaluation: nothing to check
    assert fingerprints(kept)["eval"] != fingerprints(s)["eval"] and fingerprints(kept)["train"] == fingerprints(s)["train"]

    t = time.time()
    with pytest.raises(InputError, match="no RULER task of the demo fits its evaluation lengths 64"):
        run_demo(MODEL, tmp_path / "d", settings=replace(s, eval_lengths=(64,)), progress=False, say=quiet)
    assert time.time() - t < 30 and not (tmp_path / "d").exists()


def test_an_interrupted_first_job_keeps_what_the_user_put_in_out(tmp_path, monkeypatch):
    """The demo's first job fails (here: interrupted) before any job finished; it removes
    what it wrote, but a file the user put into the (empty, then) `--out` meanwhile stays, with the folder.
    Without such a file the folder goes."""
    out = tmp_path / "demo"
    out.mkdir()

    def interrupted(ctx):
        from anchor_core.outdir import write_marker

        ctx.folder("top5").mkdir(parents=True, exist_ok=True)
        write_marker(ctx.folder("top5"), "demo")  # a job folder the demo made
        (out / "my-notes.txt").write_text("mine")  # the user, meanwhile
        raise KeyboardInterrupt

    import anchor.demo.pipeline as pipeline

    monkeypatch.setitem(pipeline.RUNNERS, "top5", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_demo(MODEL, out, jobs=("top5",), settings=TINY, progress=False, say=quiet)
    assert sorted(p.name for p in out.iterdir()) == ["my-notes.txt"]

    def interrupted_alone(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(pipeline.RUNNERS, "top5", interrupted_alone)
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        run_demo(MODEL, fresh, jobs=("top5",), settings=TINY, progress=False, say=quiet)
    assert not fresh.exists()


def test_the_seconds_of_an_attempt_a_signal_stopped_count_when_the_job_resumes(tmp_path, monkeypatch):
    """A job stopped by a signal (`timeout` sends SIGTERM; it unwinds like Ctrl-C) keeps the
    seconds it ran in demo.json; the attempt that resumes and finishes it adds its own: the time a run took
    on the machine, all attempts (the whole run's GPU time)."""
    import time

    import anchor.demo.pipeline as pipeline

    calls = []

    def train(ctx):
        calls.append(1)
        time.sleep(0.4 if len(calls) == 1 else 0.2)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return {"runs": {}}

    monkeypatch.setitem(pipeline.RUNNERS, "train", train)
    out = tmp_path / "demo"
    with pytest.raises(KeyboardInterrupt):
        run_demo(MODEL, out, jobs=("train",), settings=TINY, progress=False, say=quiet)
    rec = read_record(out)["jobs"]["train"]
    assert rec["done"] is False and len(rec["stopped_attempts_s"]) == 1 and rec["stopped_attempts_s"][0] >= 0.4
    stopped = rec["stopped_attempts_s"][0]
    record = run_demo(MODEL, out, jobs=("train",), settings=TINY, progress=False, say=quiet)
    assert record["ran"] == ["train"] and record["reused"] == ["corpus", "pack"]
    rec = read_record(out)["jobs"]["train"]
    assert rec["done"] and rec["stopped_attempts_s"] == [stopped] and rec["seconds"] >= 0.2
    assert rec["seconds_all_attempts"] == round(rec["seconds"] + stopped, 1)
    # a fresh start (another fingerprint) does not inherit them
    run_demo(MODEL, out, jobs=("train",), settings=replace(TINY, train_steps=3), progress=False, say=quiet)
    rec = read_record(out)["jobs"]["train"]
    assert rec["stopped_attempts_s"] == [] and rec["seconds_all_attempts"] == rec["seconds"]
