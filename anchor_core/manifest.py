"""A model folder checked before anything in it is read: a training checkpoint against its manifest.

A training checkpoint (`RUN/checkpoints/step-<N>`, or its `hf/`) holds `manifest.json`, the sha256 of each of
its files. `verify` holds a folder against it (the one check that resuming, `anchor eval --run` and every
`--model` share), and `model_folder` says which folder to read for a model named by a folder: a checkpoint's
verified `hf/`, or a folder without a manifest where it is plainly a Hugging Face folder and no checkpoint's,
which `load_weights` notes was read unverified. `file_digest` hashes a file once per process while its bytes
stay the same, so that a checkpoint checked twice is read once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from anchor_core.atomic import sha256_file
from anchor_core.errors import InputError

MANIFEST = "manifest.json"
# What a training checkpoint holds beside hf/ (torchtrain.training.checkpoint): a folder with one of these, or an
# `hf/` whose parent has one, is a checkpoint's, never a plain Hugging Face folder.
CHECKPOINT_FILES = ("trainer.json", "ds")
MANIFEST_ERRORS = (OSError, ValueError, KeyError, TypeError)
_NOTED: set[str] = set()


def read_manifest(folder: Path) -> dict[str, Any]:
    """`folder`'s manifest.json: a mapping with a `files` mapping, else one of `MANIFEST_ERRORS`."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError("not a manifest with a files mapping")
    return manifest


def verify(folder: Path) -> str | None:
    """None if `folder` matches its manifest exactly (same files, same sha256); else what is wrong.
    Each file is hashed once per process while its bytes stay the same (`file_digest`), so a checkpoint
    checked by a verb and again by the readers it calls is read once."""
    folder = Path(folder)
    try:
        files = read_manifest(folder)["files"]
    except MANIFEST_ERRORS as e:
        return f"no readable manifest ({type(e).__name__})"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST}
    missing = sorted(set(files) - present)
    if missing:
        return f"missing file {missing[0]}"
    extra = sorted(present - set(files))
    if extra:
        return f"unexpected file {extra[0]}"
    for rel, digest in files.items():
        if file_digest(folder / rel) != digest:
            return f"checksum mismatch in {rel}"
    return None


def model_folder(path: str | Path) -> Path:
    """The Hugging Face folder to read for a model named by the folder `path`, checked first.

    A training checkpoint (`path` holds manifest.json, or is the `hf/` of a folder that does) must verify
    against its manifest and have `hf/`; its `hf/` is returned. A folder without a manifest is returned as
    it is only where it is plainly not a checkpoint's: config.json, no trainer.json, ds/ or hf/ in it, nor
    trainer.json or ds/ beside it when it is named hf (`load_weights` notes that it read such a folder
    unverified). Anything else is a one-line InputError naming the folder and the problem."""
    return _model_folder(Path(path))[0]


def _model_folder(path: Path) -> tuple[Path, bool]:
    """`model_folder`'s folder, and whether it was verified against a manifest."""
    where = Path(os.path.abspath(path))
    if (where / MANIFEST).is_file():
        checkpoint, hf = where, path / "hf"
    elif where.name == "hf" and (where.parent / MANIFEST).is_file():
        checkpoint, hf = where.parent, path
    else:
        checkpoint = hf = None
    if checkpoint is not None:
        problem = verify(checkpoint)
        if problem:
            raise InputError(f"checkpoint {checkpoint.name} does not verify: {problem}", path=checkpoint)
        if not (hf / "config.json").is_file():
            raise InputError(f"checkpoint {checkpoint.name} has no hf/ weights", path=checkpoint)
        return hf, True
    beside = [where] + ([where.parent] if where.name == "hf" else [])
    if (where / "hf").is_dir() or any((p / f).exists() for p in beside for f in CHECKPOINT_FILES):
        raise InputError("a training checkpoint without its manifest.json, so it cannot be verified (a published "
                         "checkpoint always has one: this one is unfinished or damaged)", path=path)
    if not (where / "config.json").is_file():
        raise InputError("neither a Hugging Face model folder (no config.json) nor a training checkpoint "
                         "(no hf/, no manifest.json)", path=path)
    return path, False


def _note_unverified(path: Path) -> None:
    """One line on stderr, once per folder and process: a folder without a manifest was read as it is."""
    key = os.path.abspath(path)
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"note: {path}: a Hugging Face model folder without manifest.json, read as it is (not verified)",
              file=sys.stderr, flush=True)


_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, hashed once per (path, size, modification time, status-change time, inode)
    in a process: a rewrite within the process changes the status-change time, which no one can set back."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_file(p)
    return _DIGESTS[key]
