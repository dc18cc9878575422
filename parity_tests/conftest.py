"""Shared set-up of the parity suite.

Markers: `parity_full` (the whole matrix; also `slow`, so `make test` leaves it out), `model`
(needs the embedded SmolLM2 GGUF), `serial` (too large to run beside another worker). Cases are
grouped per inputs (`xdist_group`), so that under `--dist loadgroup` the oracle would run once per
inputs and policy in one worker; with pytest 9.2 and xdist 3.8 the groups are not kept together,
which costs time but not correctness (each worker caches its own oracle
runs). Memory is therefore kept apart by the `serial` marker, not by a group.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two xdist workers on two shared cores: one intra-op thread each.
    torch.set_num_threads(1)
# The engine matrix compiles FlexAttention for many shapes in one process; past the default
# limit (8) flex would silently fall back to uncompiled code.
torch._dynamo.config.recompile_limit = 64


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "parity_full: the whole parity matrix (slow; its own make target)")
    config.addinivalue_line("markers", "serial: too large to run beside another worker (make parity-all runs it alone)")


@pytest.fixture(autouse=True)
def _serial_lock(request):
    """A `serial` case holds an exclusive lock on a file for its run, so that under xdist (`make test-all`,
    or any `pytest -n`) two of them never run side by side whatever worker each lands on."""
    if request.node.get_closest_marker("serial") is None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / "anchor-parity-serial.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def have_smollm2() -> bool:
    from anchor_core.paths import DEFAULT_MODEL_FILE, cache_dir

    return (cache_dir() / "models" / DEFAULT_MODEL_FILE).is_file()


needs_smollm2 = pytest.mark.skipif(not have_smollm2(), reason="the embedded SmolLM2 GGUF is not cached (make install)")
