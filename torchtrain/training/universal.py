"""A ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal format.

    clear_unfinished(run)              # what a killed conversion left (prepare_run, before anything else)
    convert_for_resume(run, step)      # the launcher, before any rank starts (prepare_run)
    # every rank then loads step-<N>/ds/universal (torchtrain.training.checkpoint.universal_step, Checkpointer.resume)

At ZeRO >= 1 DeepSpeed's optimizer states are partitioned over the processes that wrote them (ds/state holds one
file per rank). When a run resumes with another process count, the checkpoint it resumes from is converted once
by DeepSpeed's own converter (`deepspeed.checkpoint.ds_to_universal`: each parameter's fp32 master weights and
AdamW moments whole) into `step-<N>/ds/universal/`, which every rank then loads with DeepSpeed's
`checkpoint.load_universal` and re-partitions over the new world; the data position and the RNG states continue
as a ZeRO-0 resume's (torchtrain.training.checkpoint.Checkpointer.resume).

Nothing half-made is ever used: the conversion is written in `RUN/checkpoints/.universal-step-<N>.tmp` (removed
when found at the next start), reads DeepSpeed's pickles through the checkpoint's `weights_only` reader
(`safe_loads`), and lands by two renames: the folder into `ds/universal`, then the checkpoint's manifest, extended
with the new files' sha256, over the old one. A `ds/universal` the manifest does not list (a conversion killed
between the two) is removed and made again; one the manifest lists is verified with the rest of the checkpoint
before anything reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
from pathlib import Path

from anchor_core.atomic import sha256_file, write_text_atomic
from anchor_core.weights import MANIFEST, read_manifest
from torchtrain.training.checkpoint import UNIVERSAL, checkpoints_dir, safe_loads, step_dir

_PREFIX = f"ds/{UNIVERSAL}/"


def _tmp(run: Path, step: int) -> Path:
    return checkpoints_dir(run) / f".universal-step-{step}.tmp"


def has_universal(folder: Path) -> bool:
    """`folder/ds/universal` exists and the checkpoint's manifest lists its files."""
    try:
        files = read_manifest(folder)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (folder / "ds" / UNIVERSAL).is_dir() and any(k.startswith(_PREFIX) for k in files)


def clear_unfinished(run: Path) -> None:
    """Remove what a killed conversion left: its temporary folder, and a `ds/universal` its manifest does not list
    (the folder renamed into place, the manifest not yet): both are made again when needed."""
    root = checkpoints_dir(run)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(".universal-step-"):
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_dir() and (p / "ds" / UNIVERSAL).is_dir() and not has_universal(p):
            shutil.rmtree(p / "ds" / UNIVERSAL, ignore_errors=True)


def convert_for_resume(run: Path, step: int, *, progress: bool = True) -> None:
    """Convert checkpoint `step` of `run` to DeepSpeed's universal format (module docstring), unless it holds a
    listed conversion already. One process (the launcher) calls this before any rank starts."""
    folder = step_dir(run, step)
    if has_universal(folder):
        return
    tmp = _tmp(run, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    out = tmp / UNIVERSAL
    if progress:
        print(f"converting {folder} to DeepSpeed's universal checkpoint for another process count", flush=True)
    _convert(folder / "ds" / "state", out)
    manifest = read_manifest(folder)
    files = dict(manifest["files"])
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[_PREFIX + path.relative_to(out).as_posix()] = sha256_file(path)
    new_manifest = tmp / MANIFEST
    write_text_atomic(new_manifest, json.dumps({**manifest, "files": files}, indent=1))
    os.replace(out, folder / "ds" / UNIVERSAL)
    os.replace(new_manifest, folder / MANIFEST)
    shutil.rmtree(tmp, ignore_errors=True)


def _convert(state: Path, out: Path) -> None:
    """DeepSpeed's converter on one ZeRO checkpoint (`ds/state`), in this process (one worker each for its
    extraction and merge), its pickles read through `safe_loads`, its prints and progress bars kept off the run's output."""
    from deepspeed.checkpoint.ds_to_universal import main

    args = argparse.Namespace(input_folder=str(state), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with safe_loads(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(args)
    shutil.rmtree(out / "tmp", ignore_errors=True)
