"""Stage reuse: whether a finished stage of a demo folder is reused, resumed or redone, and what a redo removes.

A stage is reused where its fingerprint still matches, its folder still holds what it wrote (`scan_stage`: each
file's size and, up to `_HASHED_BYTES`, its bytes; files added since are kept) and the stages it reads have not
run since it read them (`_changed`); a stopped stage of `RESUMABLE` continues on the same settings and inputs
(`_decide`). Before a stage folder is redone, what the demo did not write in it is named and the demo stops,
unless `--fresh` asks for the stage anew (`_check_nothing_added`, checked for every stage before any work by
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

# Stages that a stopped demo continues (the same fingerprint): training from each run's newest checkpoint,
# evaluation from the checkpoint it was on (finished runs whole, finished checkpoints from their parts).
RESUMABLE = ("train", "eval")
# A stage folder's files up to this size count by their bytes in `stage_content`, larger ones by their size:
# the large ones are checkpoint weights and optimizer states, whose sha256 each checkpoint's manifest.json
# holds, so checking a demo for reuse reads megabytes, not the checkpoints' gigabytes.
_HASHED_BYTES = 64 << 20


def _stage_done(out: Path, stage: str, rec: dict[str, Any] | None, fp: str) -> bool:
    return bool(rec and rec.get("done") and rec.get("fingerprint") == fp and read_marker(out / stage) is not None)


def stage_content(folder: Path) -> str | None:
    """sha256 (16 hex) of what a stage folder holds: each file's path in it, its size and, up to
    `_HASHED_BYTES`, its bytes (the marker's among them), each link's target; None where the folder is missing
    or cannot be read (it then matches no record)."""
    scan = scan_stage(folder)
    return None if scan is None else scan[0]


def scan_stage(folder: Path) -> tuple[str, dict[str, str]] | None:
    """`stage_content` and the file list it is computed from: each file's path in the folder (posix, relative)
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


Scan = tuple[str, dict[str, str]] | None  # scan_stage's: a stage folder's content and its file list


class _Scans:
    """Each stage folder scanned once in a demo run (`scan_stage` reads every file up to `_HASHED_BYTES`): the
    reuse checks before any stage runs and those as each one comes read the same scan; a stage's is forgotten
    when its folder is cleared or written."""

    def __init__(self, out: Path):
        self.out, self._scans = out, {}

    def __call__(self, stage: str) -> Scan:
        if stage not in self._scans:
            self._scans[stage] = scan_stage(self.out / stage)
        return self._scans[stage]

    def forget(self, stage: str) -> None:
        self._scans.pop(stage, None)


def added_files(stage: str, rec: dict[str, Any] | None, scan: Scan) -> list[str] | None:
    """What is in the stage folder (`scan`) that the stage's recorded execution did not write: each added folder
    once (`stage/<path>/`: no file the stage wrote lies under it) and each added file in a folder the stage wrote
    (`stage/<path>`), sorted; [] where there is none or the folder is gone; None where the record has no file
    list (a demo folder written before stages recorded theirs: which files are whose is not known)."""
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
    return [f"{stage}/{x}" for x in sorted(items)]


def _changed(stage: str, rec: dict[str, Any], read: dict[str, str | None], scan: Scan) -> tuple[str | None, list[str]]:
    """Why the finished stage `rec` cannot be reused though its settings are unchanged (a stage it reads ran
    again since it read it, or its folder, `scan`, no longer holds what it wrote), or None where it can; and
    what was added to its folder since, where it is reused with that (every file it wrote still there
    unchanged)."""
    had = rec.get("read") or {}
    moved = [n for n in read if had.get(n) != read[n]]
    if moved:
        return f"the {moved[0]} stage it reads was run again since", []
    if rec.get("content") is not None and scan is not None and scan[0] == rec["content"]:
        return None, []
    files = rec.get("files")
    if rec.get("content") is not None and isinstance(files, dict) and scan is not None \
            and all(scan[1].get(k) == v for k, v in files.items()):
        return None, added_files(stage, rec, scan) or []
    return f"{stage}/ no longer holds what this stage wrote: replaced, or its files changed", []


def _name_files(files: list[str]) -> str:
    """At most three of `files` and how many more."""
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return ", ".join(files[:3]) + more


def _check_nothing_added(out: Path, stage: str, rec: dict[str, Any] | None, why: str | None, fresh: bool,
                         say: Callable[[str], None], scan: Scan) -> None:
    """Before a finished stage's folder is redone (`why`: the reason it is not reused; None: its settings
    changed): what was added to it since the stage wrote it (a checkpoint `anchor train --out` added to a demo
    run, a user's notes) is never removed silently: an InputError naming it, unless `--fresh` asked for the
    stage anew (then a line names what goes)."""
    added = added_files(stage, rec, scan)
    if not added:
        return
    if not fresh:
        raise InputError(f"the {stage} stage must run again ({why or 'its settings changed'}); redoing it would "
                         f"remove what the demo did not write: {_name_files(added)}; move that away, or pass --fresh "
                         "to redo the stage anyway", path=out / stage)
    say(f"    --fresh: removing what the demo did not write: {_name_files(added)}")


def _clear(out: Path, stage: str) -> None:
    """Remove a stage folder before it is redone: only one anchor wrote (its marker)."""
    path = out / stage
    if not path.exists():
        return
    if read_marker(path) is None and any(path.iterdir()):
        raise InputError(f"the demo's stage folder holds files anchor did not write (no {MARKER}); "
                         "move them away or name another --out", path=path)
    rmtree(path)


def _decide(out: Path, stage: str, rec: dict[str, Any] | None, fp: str, read: dict[str, str | None],
            fresh: bool, scans: _Scans) -> tuple[str, str | None, list[str]]:
    """What becomes of a stage: `reuse` (finished, same settings and inputs, its folder as it left it or only
    added to), `resume` (a stopped `RESUMABLE` stage on the same settings and inputs) or `redo`; why a finished
    stage is not reused (None where that is not the reason); the files added to a reused stage's folder."""
    changed = None
    if not fresh and _stage_done(out, stage, rec, fp):
        changed, added = _changed(stage, rec, read, scans(stage))
        if changed is None:
            return "reuse", None, added
    # a stopped stage continues only on the same settings and the same executions of what it reads
    resumable = (stage in RESUMABLE and not fresh and changed is None and rec is not None
                 and rec.get("fingerprint") == fp and rec.get("read") == read)
    return ("resume" if resumable else "redo"), changed, []


def _preflight(out: Path, todo: tuple[str, ...], stages: dict[str, Any], fps: dict[str, str], fresh: bool,
               scans: _Scans) -> None:
    """Before any stage runs: every stage that will be redone, decided as the loop will (a stage redone gives
    the stages reading it a new input), is checked for files added to its folder since the demo wrote it, so
    a refusal comes before any work."""
    ran_ids = {n: (r or {}).get("ran_id") for n, r in stages.items()}
    for stage in todo:
        read = {n: ran_ids.get(n) for n in NEEDS.get(stage, ())}
        action, changed, _ = _decide(out, stage, stages.get(stage), fps[stage], read, fresh, scans)
        if action != "reuse":
            ran_ids[stage] = f"to run: {stage}"
        if action == "redo" and not fresh:
            _check_nothing_added(out, stage, stages.get(stage), changed, fresh, lambda _: None, scans(stage))
