"""Job reuse: whether a finished job of a demo folder is reused, resumed or redone, and what a redo removes.

A job is reused where its fingerprint still matches, its folder still holds what it wrote (`scan_job`: each
file's size and, up to `_HASHED_BYTES`, its bytes; files added since are kept) and the jobs it reads have not
run since it read them (`_changed`); a stopped job of `RESUMABLE` continues on the same settings and inputs
(`_decide`). Before a job folder is redone, what the demo did not write in it is named and the demo stops,
unless `--fresh` asks for the job anew (`_check_nothing_added`, checked for every job before any work by
`_preflight`), and only a folder anchor wrote is removed (`_clear`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from anchor.demo.settings import NEEDS
from anchor_core.errors import InputError
from anchor_core.outdir import MARKER, read_marker, rmtree

# Jobs that a stopped demo continues (the same fingerprint): training from each run's newest checkpoint,
# evaluation from the checkpoint it was on (finished runs whole, finished checkpoints from their parts).
RESUMABLE = ("train", "eval")
# A job folder's files up to this size count by their bytes in `job_content`, larger ones by their size:
# the large ones are checkpoint weights and optimizer states, whose sha256 each checkpoint's manifest.json
# holds, so checking a demo for reuse reads megabytes, not the checkpoints' gigabytes.
_HASHED_BYTES = 64 << 20


def _job_done(out: Path, job: str, rec: dict[str, Any] | None, fp: str) -> bool:
    return bool(rec and rec.get("done") and rec.get("fingerprint") == fp and read_marker(out / job) is not None)


def job_content(folder: Path) -> str | None:
    """sha256 (16 hex) of what a job folder holds: each file's path in it, its size and, up to
    `_HASHED_BYTES`, its bytes (the marker's among them), each link's target; None where the folder is missing
    or cannot be read (it then matches no record)."""
    scan = scan_job(folder)
    return None if scan is None else scan[0]


def scan_job(folder: Path) -> tuple[str, dict[str, str]] | None:
    """`job_content` and the file list it is computed from: each file's path in the folder (posix, relative)
    with `<size>:<sha256 16 hex>` (`<size>` alone above `_HASHED_BYTES`, `link:<target>` for a link); None where
    the folder is missing or cannot be read."""
    if not folder.is_dir() or folder.is_symlink():
        return None
    h = hashlib.sha256()
    files: dict[str, str] = {}
    try:
        for root, dirs, names in os.walk(folder, onerror=_raise):
            dirs.sort()
            for name in sorted(names + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
                p = Path(root) / name
                rel = p.relative_to(folder).as_posix()
                if p.is_symlink():
                    h.update(json.dumps([rel, "link", os.readlink(p)]).encode())
                    files[rel] = f"link:{os.readlink(p)}"
                    continue
                size = p.stat().st_size
                h.update(json.dumps([rel, size]).encode())
                files[rel] = str(size)
                if size <= _HASHED_BYTES:
                    digest = hashlib.sha256(p.read_bytes()).digest()
                    h.update(digest)
                    files[rel] += f":{digest.hex()[:16]}"
    except OSError:
        return None
    return h.hexdigest()[:16], files


def _raise(e: OSError) -> None:
    raise e


Scan = tuple[str, dict[str, str]] | None  # scan_job's: a job folder's content and its file list


class _Scans:
    """Each job folder scanned once in a demo run (`scan_job` reads every file up to `_HASHED_BYTES`): the
    reuse checks before any job runs and those as each one comes read the same scan; a job's is forgotten
    when its folder is cleared or written."""

    def __init__(self, out: Path):
        self.out, self._scans = out, {}

    def __call__(self, job: str) -> Scan:
        if job not in self._scans:
            self._scans[job] = scan_job(self.out / job)
        return self._scans[job]

    def forget(self, job: str) -> None:
        self._scans.pop(job, None)


def added_files(job: str, rec: dict[str, Any] | None, scan: Scan) -> list[str] | None:
    """What is in the job folder (`scan`) that the job's recorded execution did not write: each added folder
    once (`job/<path>/`: no file the job wrote lies under it) and each added file in a folder the job wrote
    (`job/<path>`), sorted; [] where there is none or the folder is gone; None where the record has no file
    list (a demo folder written before jobs recorded theirs: which files are whose is not known)."""
    had = (rec or {}).get("files")
    if not isinstance(had, dict):
        return None
    if scan is None:
        return []
    written_dirs = {"/".join(k.split("/")[:i]) for k in had for i in range(1, k.count("/") + 1)}
    items = set()
    for rel in set(scan[1]) - set(had):
        parts = rel.split("/")
        top = next((i for i in range(1, len(parts)) if "/".join(parts[:i]) not in written_dirs), None)
        items.add(rel if top is None else "/".join(parts[:top]) + "/")
    return [f"{job}/{x}" for x in sorted(items)]


def _changed(job: str, rec: dict[str, Any], read: dict[str, str | None], scan: Scan) -> tuple[str | None, list[str]]:
    """Why the finished job `rec` cannot be reused though its settings are unchanged (a job it reads ran
    again since it read it, or its folder, `scan`, no longer holds what it wrote), or None where it can; and
    what was added to its folder since, where it is reused with that (every file it wrote still there
    unchanged)."""
    had = rec.get("read") or {}
    moved = [n for n in read if had.get(n) != read[n]]
    if moved:
        return f"the {moved[0]} job it reads was run again since", []
    if rec.get("content") is not None and scan is not None and scan[0] == rec["content"]:
        return None, []
    files = rec.get("files")
    if rec.get("content") is not None and isinstance(files, dict) and scan is not None \
            and all(scan[1].get(k) == v for k, v in files.items()):
        return None, added_files(job, rec, scan) or []
    return f"{job}/ no longer holds what this job wrote: replaced, or its files changed", []


def _name_files(files: list[str]) -> str:
    """At most three of `files` and how many more."""
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return ", ".join(files[:3]) + more


def _check_nothing_added(out: Path, job: str, rec: dict[str, Any] | None, why: str | None, fresh: bool,
                         say: Callable[[str], None], scan: Scan) -> None:
    """Before a finished job's folder is redone (`why`: the reason it is not reused; None: its settings
    changed): what was added to it since the job wrote it (a checkpoint `anchor train --out` added to a demo
    run, a user's notes) is never removed silently: an InputError naming it, unless `--fresh` asked for the
    job anew (then a line names what goes)."""
    added = added_files(job, rec, scan)
    if not added:
        return
    if not fresh:
        raise InputError(f"the {job} job must run again ({why or 'its settings changed'}); redoing it would "
                         f"remove what the demo did not write: {_name_files(added)}; move that away, or pass --fresh "
                         "to redo the job anyway", path=out / job)
    say(f"    --fresh: removing what the demo did not write: {_name_files(added)}")


def _clear(out: Path, job: str) -> None:
    """Remove a job folder before it is redone: only one anchor wrote (its marker)."""
    path = out / job
    if not path.exists():
        return
    if read_marker(path) is None and any(path.iterdir()):
        raise InputError(f"the demo's job folder holds files anchor did not write (no {MARKER}); "
                         "move them away or name another --out", path=path)
    rmtree(path)


def _decide(out: Path, job: str, rec: dict[str, Any] | None, fp: str, read: dict[str, str | None],
            fresh: bool, scans: _Scans) -> tuple[str, str | None, list[str]]:
    """What becomes of a job: `reuse` (finished, same settings and inputs, its folder as it left it or only
    added to), `resume` (a stopped `RESUMABLE` job on the same settings and inputs) or `redo`; why a finished
    job is not reused (None where that is not the reason); the files added to a reused job's folder."""
    changed = None
    if not fresh and _job_done(out, job, rec, fp):
        changed, added = _changed(job, rec, read, scans(job))
        if changed is None:
            return "reuse", None, added
    # a stopped job continues only on the same settings and the same executions of what it reads
    resumable = (job in RESUMABLE and not fresh and changed is None and rec is not None
                 and rec.get("fingerprint") == fp and rec.get("read") == read)
    return ("resume" if resumable else "redo"), changed, []


def _preflight(out: Path, todo: tuple[str, ...], jobs: dict[str, Any], fps: dict[str, str], fresh: bool,
               scans: _Scans) -> None:
    """Before any job runs: every job that will be redone, decided as the loop will (a job redone gives
    the jobs reading it a new input), is checked for files added to its folder since the demo wrote it, so
    a refusal comes before any work."""
    ran_ids = {n: (r or {}).get("ran_id") for n, r in jobs.items()}
    for job in todo:
        read = {n: ran_ids.get(n) for n in NEEDS.get(job, ())}
        action, changed, _ = _decide(out, job, jobs.get(job), fps[job], read, fresh, scans)
        if action != "reuse":
            ran_ids[job] = f"to run: {job}"
        if action == "redo" and not fresh:
            _check_nothing_added(out, job, jobs.get(job), changed, fresh, lambda _: None, scans(job))
