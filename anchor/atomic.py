"""Outputs appear whole or not at all: build in a temporary folder beside the target, then rename.

    with staging_dir(out) as tmp:
        work = tmp / "x"; work.mkdir(); ...fill work...
        publish(work, out)        # atomic rename; an older `out` is replaced, never half-overwritten

A run killed or failing before `publish` leaves the previous `out` (or nothing) and no temporary
folder once the `with` block exits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from anchor.errors import InputError


class staging_dir:
    """A temporary folder next to `out` (same file system, so the final rename is atomic); removed on exit."""

    def __init__(self, out: str | Path):
        self.out = Path(out)

    def __enter__(self) -> Path:
        if self.out.exists() and not self.out.is_dir():
            raise InputError("the output exists and is not a folder", path=self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def publish(src: Path, out: str | Path) -> None:
    """Move the finished folder `src` into place at `out`, replacing an older one."""
    out = Path(out)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(src, 0o777 & ~umask)  # mkdtemp folders are private; the result is an ordinary folder
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(src, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, out)
