"""Checkpoints of a training run (CONTRACT §8): atomic folders with a sha256 manifest.

    RUN/checkpoints/step-<N>/
      manifest.json        {"step": N, "files": {relative path: sha256}, ...}; written last
      trainer.json         step, loader position, RNG states of every rank (JSON), metrics lines so far
      ds/state/...         DeepSpeed's own files (model, optimizer, ZeRO partitions): pickles
      hf/                  config.json, model.safetensors, tokenizer: a Hugging Face folder

A checkpoint is built in `RUN/checkpoints/.step-<N>.tmp` by all ranks and renamed into place by
rank 0 after the manifest is written, so `step-<N>` exists only complete. DeepSpeed loads its files
with `torch.load(weights_only=False)` (pickle), so a checkpoint is loaded only after every file's
sha256 matches the manifest this run wrote; otherwise the next older one is tried.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from anchor.atomic import write_text_atomic

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run: Path) -> Path:
    return Path(run) / "checkpoints"


def step_dir(run: Path, step: int) -> Path:
    return checkpoints_dir(run) / f"step-{step}"


def staging_path(run: Path, step: int) -> Path:
    return checkpoints_dir(run) / f".step-{step}.tmp"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash every file under `folder` (fsynced first) into `folder/manifest.json`; returns the manifest."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(folder).as_posix()] = sha256_file(path)
    manifest = {"step": step, "files": files, **(extra or {})}
    write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def verify(folder: Path) -> str | None:
    """None if `folder` matches its manifest exactly (same files, same hashes); else what is wrong."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable manifest ({type(e).__name__})"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
    missing = sorted(set(files) - present)
    if missing:
        return f"missing file {missing[0]}"
    extra = sorted(present - set(files))
    if extra:
        return f"unexpected file {extra[0]}"
    for rel, digest in files.items():
        if sha256_file(folder / rel) != digest:
            return f"checksum mismatch in {rel}"
    return None


def list_steps(run: Path) -> list[int]:
    """Steps of the published checkpoints, newest first."""
    root = checkpoints_dir(run)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(steps, reverse=True)


def newest_valid(run: Path, log=print) -> int | None:
    """The newest checkpoint whose manifest verifies; each rejected one is reported in one line."""
    rejected: list[tuple[int, str]] = []
    for step in list_steps(run):
        problem = verify(step_dir(run, step))
        if problem is None:
            for bad, why in rejected:
                log(f"checkpoint step-{bad} is corrupt ({why}): resuming from step-{step}")
            return step
        rejected.append((step, problem))
    for bad, why in rejected:
        log(f"checkpoint step-{bad} is corrupt ({why}): starting from scratch")
    return None


def publish(run: Path, step: int) -> Path:
    """Rename the finished staging folder of `step` into place (replacing a corrupt older copy)."""
    src, dst = staging_path(run, step), step_dir(run, step)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)
    return dst


def prune(run: Path, keep_last: int, keep: set[int]) -> list[int]:
    """Delete regular checkpoints beyond the newest `keep_last` (0: keep all), sparing `keep`."""
    if keep_last <= 0:
        return []
    regular = [s for s in list_steps(run) if s not in keep]
    gone = regular[keep_last:]
    for step in gone:
        shutil.rmtree(step_dir(run, step), ignore_errors=True)
    return gone


def clear_staging(run: Path) -> None:
    """Remove half-written checkpoint folders of a killed run."""
    root = checkpoints_dir(run)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-"):
                shutil.rmtree(p, ignore_errors=True)
