"""The demo's pipeline: which jobs run (`jobs_to_run`), which are reused, their fingerprints and the record
(demo.json), and `run_demo`.

Every job is recorded in `demo.json` (under `jobs`) with a fingerprint of its settings, its inputs'
fingerprints and anchor's version, the content of its folder when it finished (`job_content`) and the files it
wrote (`files`), an id of that execution (`ran_id`) and the ids of the jobs it read (`read`). A job writes into
its own folder alone. A job is reused where its fingerprint still matches, its folder still holds what it
wrote (files added since are kept), and the jobs it reads have not run since it read them: a job folder
another verb replaced (`anchor corpus --out DEMO/corpus`) or whose files changed runs again, and so does
every job that reads it, in this demo or the next that selects it. A job is redone only where that
removes nothing the demo did not write (`anchor train --out DEMO/train/anchor` adding a checkpoint): such
files are named and the demo stops before any work, unless `--fresh` asks for the job anew. `train` and
`eval` resume where a killed demo left them (`RESUMABLE`) when the jobs they read have not run since.
A demo.json an earlier version wrote (its jobs under the old key, `settings.OLD_JOBS_KEY`) is read as this
version's (`settings.upgrade_record`) and its finished jobs reused: their fingerprints are unchanged.

Job reuse (the folder scans, the decision, what a redo would remove) is `anchor.demo.reuse`'s, and the checks
before any work with the choice of dtype are `anchor.demo.checks`'s; this module holds the selection, the
fingerprints, the record and `run_demo`, and imports their names that other code imports from here.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from anchor.demo.checks import (  # noqa: F401 (re-exported)
    _check_model,
    bytes_per_param,
    check_disk,
    checkpoint_bytes,
    choose_dtype,
    feasible,
    resolve_dtype,
)
from anchor.demo.jobs import RUNNERS, JobContext
from anchor.demo.page import index_page, summary_figure
from anchor.demo.reuse import (  # noqa: F401 (re-exported)
    RESUMABLE,
    Scan,
    _check_nothing_added,
    _clear,
    _decide,
    _name_files,
    _preflight,
    _Scans,
    added_files,
    job_content,
    scan_job,
)
from anchor.demo.settings import (
    DEMO_JSON,
    NEEDS,
    PROFILES,
    JOBS,
    TITLES,
    DemoSettings,
    upgrade_record,
)
from anchor.demo.summary import write_summary
from anchor_core import __version__
from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.outdir import MARKER, guard_out, out_lock, read_marker, remove_stale_staging, rmtree, write_marker
from anchor_core.paths import resolve_model_name

# The settings each job's result depends on (besides its inputs' fingerprints and the model file).
_KEYS = {"top5": ("model", "prompt", "policy"), "corpus": (), "pack": ("model", "seq_len", "budget"),
         "audit": ("model",),
         "train": ("model", "seq_len", "train_variants", "train_steps", "global_batch", "lr", "train_engine",
                   "train_dtype", "eval_every", "eval_window", "seed"),
         "parity": ("parity_seq_len", "parity_policies", "parity_grad_layers"),
         "eval": ("eval_tasks", "eval_lengths", "eval_samples", "eval_dtype", "eval_engine", "perplexity_windows",
                  "seed"),
         "bench": ("model", "bench_seq_lens", "bench_windows", "bench_repeats", "seed")}
# Settings hashed into a job's fingerprint only where they differ from their default, so that a demo folder
# written by a version without them keeps its fingerprints (and is reused) while any other value changes them.
# Every field of DemoSettings is in _KEYS, here, or in _NOT_RESULTS (`unlisted_settings()`, tested).
_KEYS_IF_SET = {"pack": ("pack_docs",),
                "train": ("train_rope_theta", "zero_stage", "train_warmup_steps", "fp32_variants", "fp32_steps",
                          "fp32_eval_window", "only_runs", "timing_steps"),
                "eval": ("eval_batch_size", "eval_group_by_budget", "perplexity_docs", "perplexity_bucket",
                         "perplexity_data", "only_runs")}
# Fields that change no job's result: what runs by default, and where the summary goes.
_NOT_RESULTS = ("jobs", "summary_json")
# The key under which a fingerprint hashes its job's name: the name it had before the demo's pipeline units were
# named jobs, so that the hashed bytes, and with them the fingerprints of every demo folder written before, stay
# as they were (tests/test_demo_old_folders.py)
_FINGERPRINT_NAME_KEY = "stage"


def check_jobs(jobs: str | tuple[str, ...] | list[str], option: str = "--jobs") -> tuple[str, ...]:
    """`--jobs` as a tuple of known job names, in the pipeline's order; none or an unknown one is an InputError
    (naming `option`: the option the names came with)."""
    items = [x.strip() for x in jobs.split(",")] if isinstance(jobs, str) else [str(x).strip() for x in jobs]
    items = [x for x in items if x]
    if not items:
        raise InputError(f"{option}: no job given: select at least one job ({', '.join(JOBS)})")
    unknown = [x for x in items if x not in JOBS]
    if unknown:
        raise InputError(f"{option}: unknown demo job {unknown[0]!r} (jobs: {', '.join(JOBS)})")
    return tuple(x for x in JOBS if x in items)


def jobs_to_run(jobs: tuple[str, ...]) -> tuple[str, ...]:
    """The selected jobs and every job they need, in the pipeline's order."""
    want: set[str] = set()

    def add(x: str) -> None:
        if x not in want:
            want.add(x)
            for y in NEEDS.get(x, ()):
                add(y)

    for x in jobs:
        add(x)
    return tuple(x for x in JOBS if x in want)


def _model_identity(model: str) -> dict[str, Any]:
    try:
        path = Path(resolve_model_name(model))
    except Exception:  # noqa: BLE001 - the jobs report a bad model themselves
        return {"name": model}
    if path.is_file():
        st = path.stat()
        return {"name": model, "path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"name": model, "path": str(path.resolve()),
                "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    return {"name": model}


def fingerprints(settings: DemoSettings) -> dict[str, str]:
    """sha256 (16 hex) per job of its settings, its inputs' fingerprints, the model file and anchor's version."""
    d = asdict(settings)
    default = asdict(DemoSettings())
    ident = _model_identity(settings.model)
    fps: dict[str, str] = {}
    for job in JOBS:
        keys = {k: d[k] for k in _KEYS[job]}
        keys.update({k: d[k] for k in _KEYS_IF_SET.get(job, ()) if d[k] != default[k]})
        blob = {_FINGERPRINT_NAME_KEY: job, "version": __version__, "settings": keys,
                "needs": {x: fps[x] for x in NEEDS.get(job, ())}}
        if "model" in _KEYS[job]:
            blob["model"] = ident
        text = json.dumps(blob, sort_keys=True, default=list)
        fps[job] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return fps


def unlisted_settings() -> list[str]:
    """Fields of DemoSettings that no job's fingerprint names and that are not marked as changing no
    result ([] when the fingerprints are complete)."""
    from dataclasses import fields

    listed = {k for keys in (*_KEYS.values(), *_KEYS_IF_SET.values()) for k in keys} | set(_NOT_RESULTS)
    return [f.name for f in fields(DemoSettings) if f.name not in listed]


def read_record(out: Path) -> dict[str, Any]:
    """demo.json of an earlier demo in `out`, as this version writes it (`upgrade_record`: one an earlier version
    wrote has its jobs under the old key); {} when none or unreadable."""
    try:
        d = upgrade_record(json.loads((out / DEMO_JSON).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) and isinstance(d.get("jobs"), dict) else {}


def run_demo(model: str = "default", out: str | Path = "runs/demo", *, jobs: tuple[str, ...] | None = None,
             settings: DemoSettings | None = None, fresh: bool = False, say: Callable[[str], None] = print,
             progress: bool = True, **overrides: Any) -> dict[str, Any]:
    """Run (or reuse) the selected jobs into the demo folder `out`. Returns the record written to demo.json.

    `jobs`: the jobs to run (None: the profile's, `settings.jobs`). `overrides` replace fields of
    `settings` (default: the `demo` profile), e.g. seq_len=512."""
    s = replace(settings or PROFILES["demo"], model=model, **overrides)
    s, dtype_choice = resolve_dtype(s)  # before the fingerprints: a run in bf16 is another result than in fp32
    jobs = check_jobs(s.jobs if jobs is None else jobs)
    pol_file = s.policy if s.policy.endswith((".yaml", ".yml")) else None
    out = guard_out(out, "demo", inputs=(model, pol_file), replace=False)
    todo = jobs_to_run(jobs)
    t0 = time.time()
    _check_model(s.model)  # a bad model fails before the folder exists
    s, left_out = feasible(s, todo)  # and a task that cannot run is left out before any work
    if "train" in todo:
        check_disk(s, out)  # the runs' checkpoints fit the disk
    for line in left_out:
        say(f"left out: {line}")
    fps = fingerprints(s)
    created = not out.exists() or not any(out.iterdir())
    with out_lock(out, "demo"):
        try:
            return _run_jobs(out, s, jobs, todo, fps, fresh, say, progress, t0, left_out, dtype_choice)
        except BaseException:
            if created and not any(r.get("done") for r in read_record(out).get("jobs", {}).values()):
                _remove_own_files(out)  # nothing finished: leave no half-written demo folder behind
            raise


def _remove_own_files(out: Path) -> None:
    """Remove what this demo wrote in `out` (its record, page, figure, marker, job folders with their
    markers, staging leftovers), then `out` itself if nothing else is left: files a user put there
    meanwhile stay, and so does the folder holding them."""
    if not out.is_dir():
        return
    for p in out.iterdir():
        own = (p.name in (DEMO_JSON, "index.html", "summary.png", MARKER) or p.name in _summary_names()
               or (p.is_dir() and p.name in JOBS and read_marker(p) is not None)
               or (p.name.startswith(".") and (".tmp-" in p.name or p.name.startswith(".parity-model-"))))
        if own:
            rmtree(p) if p.is_dir() else p.unlink()
    if not any(out.iterdir()):
        out.rmdir()


def _summary_names() -> set[str]:
    """The summary JSON names of every profile (files the demo writes into its folder)."""
    return {p.summary_json for p in PROFILES.values() if p.summary_json}


def _run_jobs(out: Path, s: DemoSettings, jobs: tuple[str, ...], todo: tuple[str, ...], fps: dict[str, str],
              fresh: bool, say: Callable[[str], None], progress: bool, t0: float,
              left_out: list[str], dtype_choice: dict[str, Any] | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "demo")
    for job in JOBS:
        remove_stale_staging(out / job)
    for tmp in out.glob(".parity-model-*"):  # the cut model of a killed parity job
        shutil.rmtree(tmp, ignore_errors=True)
    old = read_record(out)
    record: dict[str, Any] = {"model": s.model, "settings": asdict(s), "jobs": dict(old.get("jobs", {})),
                              "ran": [], "reused": [], "selected": list(jobs), "left_out": left_out}
    if dtype_choice:
        record["dtype_choice"] = dtype_choice
        say(f"dtype: {dtype_choice['dtype']} ({dtype_choice['reason']})")
    ctx = JobContext(out, s, progress, say, record["jobs"])
    scans = _Scans(out)
    _preflight(out, todo, record["jobs"], fps, fresh, scans)
    for i, job in enumerate(todo, 1):
        rec = record["jobs"].get(job)
        # the executions of the jobs this one reads (earlier in `todo`: run or reused by now)
        read = {n: (record["jobs"].get(n) or {}).get("ran_id") for n in NEEDS.get(job, ())}
        action, changed, added = _decide(out, job, rec, fps[job], read, fresh, scans)
        if action == "reuse":
            kept = f"; kept what was added since: {_name_files(added)}" if added else ""
            say(f"[{i}/{len(todo)}] {job}: reused (finished {rec['finished']}, settings unchanged{kept})")
            record["reused"].append(job)
            continue
        if changed is not None:
            say(f"[{i}/{len(todo)}] {job}: not reused: {changed}")
        resumable = action == "resume"
        if not resumable:
            _check_nothing_added(out, job, rec, changed, fresh, say, scans(job))
            _clear(out, job)
        scans.forget(job)  # written from here on
        say(f"[{i}/{len(todo)}] {job}: {TITLES[job]}")
        # the seconds of the attempts a signal stopped (SIGTERM, Ctrl-C: they unwind) that this one resumes
        earlier = list(rec.get("stopped_attempts_s", [])) if resumable else []
        record["jobs"][job] = {"fingerprint": fps[job], "done": False, "started": _now(),
                               "stopped_attempts_s": earlier, "read": read}
        _write_record(out, record, t0)
        t = time.time()
        try:
            summary = RUNNERS[job](ctx)
        except BaseException:
            record["jobs"][job]["stopped_attempts_s"] = [*earlier, round(time.time() - t, 1)]
            _write_record(out, record, t0)
            raise
        seconds = round(time.time() - t, 1)
        content, files = scans(job) or (None, None)
        record["jobs"][job] = {"fingerprint": fps[job], "done": True, "started": record["jobs"][job]["started"],
                               "finished": _now(), "seconds": seconds, "stopped_attempts_s": earlier,
                               "seconds_all_attempts": round(seconds + sum(earlier), 1), "summary": summary,
                               "read": read, "content": content, "files": files,
                               "ran_id": secrets.token_hex(8)}
        record["ran"].append(job)
        _write_record(out, record, t0)
        index_page(out, record, fps)
    record["seconds"] = round(time.time() - t0, 1)
    _write_record(out, record, t0)
    summary_figure(out, record)
    if write_summary(out, record, s) is not None:
        record["summary_json"] = s.summary_json
        _write_record(out, record, t0)
    index_page(out, record, fps)
    return record


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _write_record(out: Path, record: dict[str, Any], t0: float) -> None:
    record["seconds"] = round(time.time() - t0, 1)
    record["finished"] = _now()
    write_text_atomic(out / DEMO_JSON, json.dumps(record, indent=1, ensure_ascii=False, default=str))
