"""Outputs appear whole or not at all: build in a temporary folder beside the target, then rename.

    with staging_dir(out, "pack") as tmp:
        work = tmp / "x"; work.mkdir(); ...fill work...
        publish(work, out, "pack")   # writes the marker; the old `out` is replaced, never half-overwritten

`staging_dir` checks `out` with `anchor_core.outdir.guard_out` (a folder is replaced only when it is
missing, empty or carries anchor's marker), takes the writer's lock beside `out`, removes staging
folders of dead processes, and makes `.<name>.tmp-<pid>-<random>` next to `out` (same file
system, so the final rename is atomic). On leaving the `with` block (normally, on an error, or on
SIGINT/SIGTERM, which `anchor.cli.main` turns into an exception) the staging folder is removed and
the lock released. A run killed with SIGKILL leaves the staging folder; the next writer of the same
`out` removes it.

`publish` never leaves `out` missing: the old folder is renamed aside, the new one renamed in, then
the old one deleted (on failure it is renamed back); SIGINT/SIGTERM are held off between the renames.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from anchor_core.errors import InputError, current_verb
from anchor_core.outdir import (
    MARKER,
    guard_out,
    out_lock,
    pid_alive,
    read_marker,
    remove_stale_staging,
    rmtree,
    staging_prefix,
    write_marker,
)


class staging_dir:
    """A temporary folder next to `out`, removed on exit; `out` guarded and locked meanwhile."""

    def __init__(self, out: str | Path, verb: str | None = None, *, inputs: Iterable[Any] = ()):
        self.out = Path(out)
        self.verb = verb
        self.inputs = tuple(inputs)
        self.path: Path | None = None

    def __enter__(self) -> Path:
        verb = self.verb or current_verb()
        self.out = guard_out(self.out, verb, inputs=self.inputs)
        self._lock = out_lock(self.out, verb)
        self._lock.__enter__()
        try:
            remove_stale_staging(self.out)
            self.path = Path(tempfile.mkdtemp(prefix=staging_prefix(self.out), dir=self.out.parent))
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self.path

    def __exit__(self, *exc: object) -> None:
        try:
            if self.path is not None:
                with _signals_held():
                    rmtree(self.path)
        finally:
            self._lock.__exit__(None, None, None)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (pending) until the block ends; a no-op off the main thread."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def publish(src: Path, out: str | Path, verb: str | None = None) -> None:
    """Move the finished folder `src` into place at `out` (marked as anchor's), replacing an older one."""
    out = Path(out)
    write_marker(src, verb or current_verb())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(src, 0o777 & ~umask)  # mkdtemp folders are private; the result is an ordinary folder
    if out.is_dir() and not out.is_symlink() and read_marker(out) is None and any(out.iterdir()):
        # guard_out let it through at the start; someone filled it since: never delete their files
        raise InputError(f"the folder now holds files anchor did not write (no {MARKER}); nothing was replaced",
                         path=out)
    with _signals_held():
        if out.exists() or out.is_symlink():
            old = out.with_name(f"{staging_prefix(out, 'old')}{secrets.token_hex(4)}")
            os.replace(out, old)
            try:
                os.replace(src, out)
            except BaseException:
                os.replace(old, out)
                raise
            rmtree(old)
        else:
            os.replace(src, out)


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes (hex), read a MiB at a time: the checksum written beside
    checkpoints, cached tokenizers and the parts of a file carried to another machine."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_text_atomic(path: str | Path, text: str) -> None:
    """`path` holds the old text or the new, never part of it: written beside it, fsynced, renamed. The
    temporary files a killed writer left beside it (`.<name>.tmp-<pid>` of a dead pid) are removed."""
    path = Path(path)
    remove_dead_writers_files(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_dead_writers_files(path: Path) -> None:
    """Remove `.<name>.tmp-<pid>` beside `path` where no process `pid` runs (a writer killed between its
    write and its rename)."""
    prefix = f".{path.name}.tmp-"
    try:
        leftovers = [p for p in path.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for p in leftovers:
        pid = p.name[len(prefix):]
        if pid.isdigit() and not pid_alive(int(pid)):
            try:
                p.unlink()
            except OSError:
                pass
