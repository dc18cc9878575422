"""What `--out` may name, and who may write it: checked before any work starts.

    out = guard_out(args.out, "pack", inputs=(args.data, args.model))   # InputError if unsafe
    with out_lock(out, "pack"):                                          # one writer at a time
        ... work ...; publish via anchor_core.atomic (writes MARKER)

Rules (docs/verbs/index.md, "What --out may replace"):
  * every output folder anchor publishes carries MARKER, a small JSON file naming the verb and the
    anchor version that wrote it;
  * a folder is replaced only when it is missing, empty, or carries MARKER (for a resumable run
    folder, `replace=False`: MARKER of the same verb), so nothing the user wrote is ever deleted;
  * refused always: `/`, the home folder, the working directory and its parents, a path below a
    file, a folder that holds or lies inside an input (`--data`, `--model`, `--run`, policy files),
    a parent anchor cannot write, a path (of --out or of an input) with a name longer than its file
    system holds (anchor_core.paths.check_path_length: before any stat, so no ENAMETOOLONG traceback);
  * `.<name>.parts` beside the folder (anchor_core.parts) belongs to the verb its MARKER names: a verb that
    keeps parts refuses an --out whose parts folder is another verb's;
  * a lock file `.<name>.lock` beside the folder holds the writer's pid (and an flock, released by
    the kernel when the process dies however it dies): a second writer gets an InputError naming
    the holder; a lock left by a dead process is taken over;
  * staging folders `.<name>.tmp-<pid>-<random>` and set-aside old outputs `.<name>.old-<pid>-<random>`
    whose process is gone are removed by the next writer (an old output whose replacement never
    arrived is put back first).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Iterable

from anchor_core import __version__
from anchor_core.errors import InputError
from anchor_core.paths import check_path_length

MARKER = ".anchor-output.json"
PARTS_VERBS = ("audit", "eval", "parity")  # the verbs that keep finished parts in `.<name>.parts` (anchor_core.parts)


_STAGING_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-[^/]*)?$")
_LEGACY_TMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-[a-z0-9_]{8}$")  # mkdtemp names of anchor < 0.1.1


# ---------------------------------------------------------------------------------------------
# The marker


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """MARKER's content in `folder`, or None when it has none (or an unreadable one)."""
    try:
        d = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("verb"), str) else None


def write_marker(folder: str | Path, verb: str) -> None:
    """Mark `folder` as written by `anchor <verb>` (this version)."""
    (Path(folder) / MARKER).write_text(json.dumps({"verb": verb, "version": __version__}) + "\n",
                                       encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# The guard


def _abs(p: str | Path) -> Path:
    """Absolute, with `~` expanded and `..` folded, symlinks resolved where they exist."""
    return Path(os.path.abspath(os.path.expanduser(str(p)))).resolve()


def _input_paths(inputs: Iterable[Any]) -> list[Path]:
    out = []
    for x in inputs:
        if x is None:
            continue
        s = str(x)
        check_path_length(s, "the input")  # before any stat: the kernel's ENAMETOOLONG is no traceback
        if not s or s.startswith("random:") or (s in ("default", "smollm2") and not Path(s).exists()):
            continue
        p = Path(os.path.expanduser(s))
        if not (p.exists() or p.is_symlink()):
            continue
        out.append(_abs(p))
    return out


def _within(a: Path, b: Path) -> bool:
    """`a` is `b` or lies inside it."""
    return a == b or b in a.parents


def _describe(folder: Path) -> str:
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return "its content cannot be listed"
    shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
    return f"it holds {len(names)} entr{'y' if len(names) == 1 else 'ies'} ({shown})"


def guard_out(out: str | Path, verb: str, *, inputs: Iterable[Any] = (), replace: bool = True) -> Path:
    """Check `--out` before any work starts; returns the resolved path or raises InputError.

    Refused always: `.`/the working directory or any of its parents, the home folder, `/`, a path
    whose parent is a file, an existing file, a folder that holds or lies inside any of `inputs`
    (paths of --data/--model/--run/policy files; None and names such as 'random:llama' or 'default'
    are skipped), a parent anchor cannot write.
    Allowed: a missing or empty folder, or one carrying MARKER whose verb is `verb`: a verb replaces
    (replace=True: it publishes a whole new folder) or resumes (replace=False: `anchor train`, the demo)
    only its own outputs, never another verb's (a training run's checkpoints are not an eval's to replace).
    """
    if out is None or str(out).strip() == "":
        raise InputError("--out: no folder given")
    given = str(out)
    check_path_length(given, "--out")  # a name no file system holds: refused before anything is made
    path = _abs(out)
    show = given if given == str(path) else f"{given} ({path})"
    if path == Path(path.anchor):
        raise InputError(f"--out {show}: refusing to write over the file system root")
    try:
        cwd = Path(os.getcwd()).resolve()
    except OSError:
        cwd = None
    if cwd is not None and _within(cwd, path):
        what = "the working directory" if path == cwd else "a parent of the working directory"
        raise InputError(f"--out {show} is {what}; name a new folder (e.g. --out runs/{verb})")
    home = Path(os.path.expanduser("~"))
    if str(home) not in ("~", "/") and path == _abs(home):
        raise InputError(f"--out {show} is the home folder; name a new folder inside it")
    for p in _input_paths(inputs):
        if _within(p, path):
            rel = "is" if p == path else "holds"
            raise InputError(f"--out {show} {rel} the input {p}; write the output to another folder")
        if _within(path, p):
            raise InputError(f"--out {show} lies inside the input {p}; write the output elsewhere")
    # the nearest existing ancestor must be a folder we can write into
    parent = path.parent
    while not parent.exists():
        if parent.is_symlink():
            raise InputError(f"--out {show}: {parent} is a broken symbolic link")
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"--out {show}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {show}: cannot write into {parent} (permission denied or read-only)")
    if path.is_symlink() and not path.exists():
        raise InputError(f"--out {show} is a broken symbolic link")
    if path.exists():
        if not path.is_dir():
            raise InputError(f"--out {show} exists and is not a folder; name a folder")
        if any(True for _ in _iter(path)):
            marker = read_marker(path)
            if marker is None:
                raise InputError(
                    f"--out {show} is a folder anchor did not write ({_describe(path)}; no {MARKER}): "
                    "it is never replaced; name a new or empty folder")
            if marker["verb"] != verb:  # a verb replaces (or resumes) only its own outputs
                raise InputError(
                    f"--out {show} holds the output of `anchor {marker['verb']}`, not of `anchor {verb}`; "
                    "name a new or empty folder")
    parts = path.parent / f".{path.name}.parts"
    if verb in PARTS_VERBS and parts.is_dir():  # a verb keeps (and removes) only its own parts
        marker = read_marker(parts)
        if marker is not None and marker["verb"] != verb:
            raise InputError(f"--out {show}: {parts} holds the kept parts of `anchor {marker['verb']}`, not of "
                             f"`anchor {verb}`; name another --out (or remove that folder)")
    return path


def _iter(folder: Path):
    try:
        with os.scandir(folder) as it:
            yield from it
    except OSError:
        return


def missing_folders(path: str | Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, closest first: what a later `mkdir(parents=True)`
    will create, so that a failed first attempt can remove exactly that (`remove_created`)."""
    out = []
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_created(created: list[Path]) -> None:
    """Undo `missing_folders`' creations: the closest (with what the verb wrote in it), then each parent
    while it is empty (never what someone else put there meanwhile)."""
    if not created:
        return
    if created[0].exists():
        rmtree(created[0])
    for p in created[1:]:
        try:
            p.rmdir()
        except OSError:
            return


# ---------------------------------------------------------------------------------------------
# Processes


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours counts)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The lock


def lock_path(out: str | Path) -> Path:
    out = Path(os.path.abspath(os.path.expanduser(str(out))))
    return out.with_name(f".{out.name}.lock")


_held: dict[str, list[Any]] = {}  # lock path -> [fd, depth]; re-entrant within this process
_held_guard = threading.Lock()


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    try:
        d = json.loads(text)
        return d if isinstance(d, dict) else {}
    except ValueError:
        m = re.match(r"\s*(\d+)", text)
        return {"pid": int(m.group(1))} if m else {}


class out_lock:
    """`with out_lock(out, verb):` one writer of `out` at a time.

    The lock file `.<name>.lock` beside `out` holds `{"pid", "verb"}` and an flock (the kernel
    drops it when the process ends, kill -9 included, so a lock left behind is simply taken over).
    A live holder is an InputError naming its pid. Re-entrant within one process; the file is
    removed on exit.
    """

    def __init__(self, out: str | Path, verb: str):
        self.path = lock_path(out)
        self.out = Path(out)
        self.verb = verb

    def __enter__(self) -> "out_lock":
        import fcntl

        key = str(self.path)
        with _held_guard:
            if key in _held:
                _held[key][1] += 1
                return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the folder: {e.strerror or e}", path=self.path.parent) from None
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise InputError(f"cannot create the lock file: {e.strerror or e}", path=self.path) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise InputError(f"cannot lock: {e.strerror or e}", path=self.path) from None
                holder = _read_holder(self.path)
                who = (f"pid {holder['pid']}" if "pid" in holder else "another process")
                what = f"anchor {holder['verb']}" if isinstance(holder.get("verb"), str) else "anchor"
                raise InputError(
                    f"--out {self.out}: another {what} ({who}) is writing this folder "
                    f"(lock {self.path.name}); wait for it to finish or stop it") from None
            # the file we locked must still be the one at the path (a releasing holder unlinks it)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps({"pid": os.getpid(), "verb": self.verb}) + "\n").encode())
            with _held_guard:
                _held[key] = [fd, 1]
            return self
        raise InputError("cannot take the lock (it keeps changing hands)", path=self.path)

    def __exit__(self, *exc: object) -> None:
        key = str(self.path)
        with _held_guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _held[key]
        try:
            os.unlink(self.path)  # while still holding the flock: a waiter re-checks the inode
        except OSError:
            pass
        os.close(entry[0])


def holds_lock(out: str | Path) -> bool:
    return str(lock_path(out)) in _held


# ---------------------------------------------------------------------------------------------
# Staging folders


def staging_prefix(out: str | Path, kind: str = "tmp") -> str:
    """`.<name>.tmp-<pid>-`: the name prefix of this process's staging folders for `out`."""
    return f".{Path(out).name}.{kind}-{os.getpid()}-"


def rmtree(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        try:
            p.unlink()
        except OSError:
            pass
    else:
        shutil.rmtree(p, ignore_errors=True)


def remove_stale_staging(out: str | Path) -> None:
    """Remove `.<name>.tmp-*` / `.<name>.old-*` beside `out` whose owning process is gone.

    An old output set aside by a publish that was killed before the new one arrived (so `out` is
    missing) is renamed back to `out` first. Staging folders of anchor < 0.1.1 (no pid in the
    name) are removed too.
    """
    out = Path(os.path.abspath(os.path.expanduser(str(out))))
    parent = out.parent
    if not parent.is_dir():
        return
    stale_old: list[Path] = []
    stale_tmp: list[Path] = []
    for entry in _iter(parent):
        m = _STAGING_RE.match(entry.name)
        if m and m.group("name") == out.name:
            if pid_alive(int(m.group("pid"))):
                continue
            (stale_old if m.group("kind") == "old" else stale_tmp).append(Path(entry.path))
        else:
            m = _LEGACY_TMP_RE.match(entry.name)
            if m and m.group("name") == out.name:
                stale_tmp.append(Path(entry.path))
    if stale_old and not (out.exists() or out.is_symlink()):
        newest = max(stale_old, key=lambda p: p.lstat().st_mtime)
        try:
            os.replace(newest, out)
            stale_old.remove(newest)
        except OSError:
            pass
    for p in stale_tmp + stale_old:
        rmtree(p)
