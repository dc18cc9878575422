"""torchao for the FP8 tests: `make install` puts it in .cache/fp8, beside the venv rather than in it (the Makefile
says why); these put that folder on the path of the test process (`use_torchao`) and of the runs it starts (`env`)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

FP8_PACKAGES = Path(__file__).resolve().parents[1] / ".cache" / "fp8"


def use_torchao() -> None:
    """torchao importable in this process (from the environment or .cache/fp8); the test skipped where neither has
    it (a checkout without `make install`)."""
    if importlib.util.find_spec("torchao") is not None:
        return
    if not (FP8_PACKAGES / "torchao").is_dir():
        pytest.skip("torchao is not installed (make install puts it in .cache/fp8; pip: anchor-toolkit[fp8])")
    sys.path.append(str(FP8_PACKAGES))
    importlib.invalidate_caches()


def env(base: dict[str, str]) -> dict[str, str]:
    """`base` with .cache/fp8 on PYTHONPATH, for an `anchor` process of an FP8 run."""
    path = os.pathsep.join(p for p in (base.get("PYTHONPATH", ""), str(FP8_PACKAGES)) if p)
    return {**base, "PYTHONPATH": path}
