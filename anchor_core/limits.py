"""Range checks for sizes and seeds, made before anything is allocated.

    check_seed(seed, "--seed")                                  # 0 <= seed < 2**32 (numpy, torch, jax)
    check_int(seq_len, "--seq-len", lo=2)
    check_memory(100 * seq_len, "--seq-len 1000000000")         # InputError if it cannot fit
    check_disk(bytes_needed, out_parent, "the packed windows")
    raise InputError(f"got {excerpt(value)}")                   # a value echoed in at most 80 characters

`name` is what the message calls the value: a flag (`--seq-len`) or, for a value read from a
config file, `FILE: key` (see `option_name`).
"""

from __future__ import annotations

import math
import os
import reprlib
import shutil
from pathlib import Path

from anchor_core.errors import InputError

SEED_MAX = 2**32 - 1  # numpy's legacy seeding, torch.manual_seed and jax.random.key all take these
INT_MAX = 2**62  # sizes beyond this overflow int64 arithmetic somewhere


def option_name(key: str, flag: str, config: str | Path | None = None) -> str:
    """`--seq-len`, or `d.yaml: seq_len` when the value came from the config file `d.yaml`."""
    return f"{config}: {key}" if config is not None else flag


EXCERPT = 80  # characters of a value an error message echoes at most


class _Repr(reprlib.Repr):
    """reprlib's bounded repr (a few items of each container, a few levels deep), and an integer too long for
    Python's str() (more than 4300 digits) by its size."""

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:
            return f"<an integer of {x.bit_length()} bits>"


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, EXCERPT, EXCERPT


def clip(text: str, limit: int = EXCERPT) -> str:
    """`text` as an error names a piece of the command line: at most `limit` characters, cut with "..."."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def excerpt(value: object, limit: int = EXCERPT) -> str:
    """repr(value) in at most `limit` characters, cut with "..." where longer: what an error message echoes of
    a value a user gave, however large (a long string, a list of a million items, a huge integer), so that
    the message stays one short line. Made without the whole repr: its cost does not grow with the value."""
    if isinstance(value, str):
        text = repr(value[:limit])  # the repr of a prefix: a huge string is not copied whole
        whole = len(value) <= limit
    else:
        text, whole = _REPR.repr(value), True
    if whole and len(text) <= limit:
        return text
    return text[:max(0, limit - 3)] + "..."


def _bound(x: float) -> str:
    """A range's bound as a message shows it: 1000, 0.001, 1e+20."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def check_int(value: object, name: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, got {excerpt(value)}")
    if lo is not None and value < lo:
        raise InputError(f"{name} must be at least {lo}, got {excerpt(value)}")
    hi = INT_MAX if hi is None else hi
    if value > hi:
        raise InputError(f"{name} must be at most {hi}, got {excerpt(value)}")
    return value


def check_float(value: object, name: str, *, lo: float | None = None, hi: float | None = None) -> float:
    """`value` as a finite float within [lo, hi]; an integer too large for a float is refused as beyond `hi`
    (or as not finite where there is no `hi`), not an OverflowError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number, got {excerpt(value)}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond 1.8e308: beyond any bound
        v = math.inf if value > 0 else -math.inf  # type: ignore[operator]
    else:
        if not math.isfinite(v):
            raise InputError(f"{name} must be a finite number, got {excerpt(value)}")
    if lo is not None and v < lo:
        raise InputError(f"{name} must be at least {_bound(lo)}, got {excerpt(value)}")
    if hi is not None and v > hi:
        raise InputError(f"{name} must be at most {_bound(hi)}, got {excerpt(value)}")
    if not math.isfinite(v):
        raise InputError(f"{name} must be a finite number, got {excerpt(value)}")
    return v


def check_seed(value: object, name: str = "--seed") -> int:
    """A seed every random generator of the toolkit accepts: 0 <= seed <= 2**32 - 1."""
    return check_int(value, name, lo=0, hi=SEED_MAX)


def gib(n: float) -> str:
    if n >= 2**28:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, bounded by a cgroup limit if there is one."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                avail = min(avail, int(limit) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return max(0, int(avail))


def peak_rss() -> int | None:
    """This process's resident high-water mark in bytes (VmHWM of /proc/self/status), or None without procfs. It
    starts anew with the process's program (getrusage's ru_maxrss survives exec: a process started by a larger
    one would report its parent's peak), and `echo 5 > /proc/self/clear_refs` resets it to the current RSS."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def check_memory(need: float, what: str) -> None:
    """InputError when `need` bytes exceed 90% of the memory available now."""
    avail = available_memory()
    if need > 0.9 * avail:
        raise InputError(f"{what} needs about {gib(need)} of memory; {gib(avail)} is available here")


def free_disk(folder: str | Path) -> int:
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 1 << 62


def check_disk(need: float, folder: str | Path, what: str, *, name: str | Path | None = None) -> None:
    """InputError (naming `name`, default `folder`) when `need` bytes exceed the free space of the file
    system holding `folder`."""
    free = free_disk(folder)
    if need > free:
        raise InputError(f"{what} needs about {gib(need)} of disk; {gib(free)} is free",
                         path=folder if name is None else name)
