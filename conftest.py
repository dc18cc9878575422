"""One JAX compilation cache for the whole test run (every xdist worker, every test).

The tests compile many identical XLA programs: the same decoder at the same sizes in several tests, and each
xdist worker compiling what the other already did. JAX's persistent cache (keyed by the program, the XLA
flags and the versions; a cached program is the compiled program itself, so no result changes) lets each be
compiled once per run. The folder is new for each run and removed after it, unless the user named one
(JAX_COMPILATION_CACHE_DIR); the audit's own tests that measure the cache set theirs. Programs compiled in
under 0.2 s are not kept (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS; the audit, which keeps every program
for a user, keeps these too in the tests: its numbers do not depend on it). ANCHOR_TEST_NO_JAX_CACHE=1
turns it off (to time the tests without it: the jaxref subset of tests/jaxref/test_{invariance,decoder_parity,
attention_blocks,train}.py took 345 s without and 279 s with it on 2 cores).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

_OWNED = "ANCHOR_TEST_JAX_CACHE_OWNER"
_PREFIX = "anchor-test-jax-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_folders_of_dead_runs() -> None:
    """A run killed before its end (kill -9) leaves its folder: the next run removes those whose process is gone."""
    for d in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*-*"):
        pid = d.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def pytest_configure(config):
    if os.environ.get("ANCHOR_TEST_NO_JAX_CACHE") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    _remove_folders_of_dead_runs()
    # the controller (or a run without xdist) makes the folder; the workers it starts inherit the variable
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ[_OWNED] = str(os.getpid())


def pytest_unconfigure(config):
    if os.environ.get(_OWNED) == str(os.getpid()):
        shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True)
        os.environ.pop(_OWNED)
