"""One JAX compilation cache for the whole test run (every xdist worker, every test), and each test module's
memory given back when it ends.

The tests compile many identical XLA programs: the same decoder at the same sizes in several tests, and each
xdist worker compiling what the other already did. JAX's persistent cache (keyed by the program, the XLA
flags and the versions; a cached program is the compiled program itself, so no result changes) lets each be
compiled once per run. The folder is new for each run and removed after it, unless the user named one
(JAX_COMPILATION_CACHE_DIR); the audit's own tests that measure the cache set theirs. Programs compiled in
under 0.2 s are not kept (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS; the audit, which keeps every program
for a user, keeps these too in the tests: its numbers do not depend on it). ANCHOR_TEST_NO_JAX_CACHE=1
turns it off (to time the tests without it: the jaxref subset of tests/jaxref/test_{invariance,decoder_parity,
attention_blocks,train}.py took 345 s without and 279 s with it on 2 cores).

An xdist worker runs a few hundred test modules in one process, and two limits bind it. Memory: modules keep
models, logits and oracle taps in their own functools caches, and JAX keeps every program it compiled; kept for a
worker's life they reach about 11 GiB per worker over `make test`, on a machine of 24 GiB that two workers share.
Memory maps: XLA's CPU backend maps each compiled object's code, constants and data apart (six maps for a small
jitted function; a T=97 parity case adds about 300), and a process may hold vm.max_map_count of them (65,530 by
default); at the limit XLA's next mapping fails ("allocateMappedMemory failed with error: Cannot allocate memory")
and the worker dies. The whole parity matrix in one process reaches it. So `_release_module_memory` drops what a
module cached when it ends: its own functools caches (not the shared ones it imports), JAX's in-memory caches
(programs come back from the persistent cache above; releasing a program unmaps it), then the garbage and glibc's
free pages; and `_keep_maps_below_the_limit` drops JAX's caches after any test that leaves the process past half
its map limit.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

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


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Everything alive once the tests are collected (the imported libraries, the test modules, the items) lives
    for the whole process: `gc.freeze()` takes it out of the cyclic collector's reach, so each collection (the
    collector's own, and `_release_module_memory`'s at every module's end) walks only what the tests made since,
    about 7 ms where the whole heap of torch, transformers, JAX and DeepSpeed takes 0.3 s. Objects are still freed by
    their reference counts; only cycles among the frozen objects are never collected."""
    gc.collect()
    gc.freeze()


def module_caches(module) -> list[functools._lru_cache_wrapper]:
    """The functools caches a test module defines (those it imports from a conftest or the library are shared
    with other modules and keep their own bounds)."""
    return [v for v in vars(module).values()
            if isinstance(v, functools._lru_cache_wrapper) and getattr(v, "__module__", None) == module.__name__]


# glibc keeps freed small blocks in its arenas; malloc_trim(0) returns their whole pages to the system (None where
# the C library has no such call).
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


@pytest.fixture(autouse=True, scope="module")
def _release_module_memory(request):
    yield
    for cache in module_caches(request.module):
        cache.cache_clear()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def map_count() -> int | None:
    """The number of memory maps this process holds (lines of /proc/self/maps), None without procfs."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530  # the kernel's default


_MAX_MAPS = max_map_count()


@pytest.fixture(autouse=True)
def _keep_maps_below_the_limit():
    yield
    if "jax" not in sys.modules:  # nothing compiled: no maps to count
        return
    maps = map_count()
    if maps is not None and maps > _MAX_MAPS // 2:
        sys.modules["jax"].clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def _plain_linear_after_zero3():
    """`torch.nn.functional.linear` as torch defines it after every test. DeepSpeed's `zero.Init` (a ZeRO-3 build in
    the test's own process: tests/train/test_sharded_build.py) replaces it process-wide with its memory-efficient
    linear, which adds the bias after rounding the product; kept, every later test of the worker would run that,
    and the bit-exact checks of a biased projection in bf16 (parity_tests/test_fidelity.py on qwen2) fail by the
    order the tests happened to run in. A training run builds in its own process, where this cannot reach."""
    torch = sys.modules.get("torch")
    plain = torch.nn.functional.linear if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if plain is None:  # torch imported during the test: its own function is the C one
        plain = torch._C._nn.linear
    if torch.nn.functional.linear is not plain:
        torch.nn.functional.linear = plain
