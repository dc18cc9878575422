"""Shared fixtures of the data-pipeline tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from anchor_core.paths import DEFAULT_MODEL_FILE, cache_dir


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The embedded SmolLM2 GGUF; tests that need it are skipped where `make install` has not run."""
    path = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if not path.is_file():
        pytest.skip(f"{path} is missing (run `make install`)")
    return path
