"""The configs that ship inside the package (`anchor_core/configs/`, the checkout's `configs/`), found by name.

    resolve("train", "tiny")              # -> .../anchor_core/configs/train/tiny.yaml
    resolve("train", "paper/llama2_7b_64k_anchor")
    resolve("train", "runs/my.yaml")      # a path is a path: returned as given
    names("train")                        # ['paper/llama2_7b_128k_anchor', ..., 'smollm2_2k', 'tiny']

A shipped config's name is its path under its kind's folder without `.yaml`. Resolution: an existing path
first (a user's own file always wins over a shipped name), else a shipped name; a value ending in `.yaml` or
`.yml` is a path, so a missing one is the reader's "cannot read" error naming the file. Anything else is an
InputError listing the shipped names of that kind. The files travel as package data (pyproject.toml's
`[tool.setuptools.package-data]`), so a pip-installed wheel finds them without a checkout. A shipped config
renamed since an earlier release (`RENAMED`) is still found by its old name for one release, with one warning line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from anchor_core.errors import InputError, warn_line
from anchor_core.paths import check_path_length

Kind = Literal["train", "data", "policies", "eval"]
KINDS: tuple[Kind, ...] = get_args(Kind)
ROOT = Path(__file__).resolve().parent / "configs"
WHAT: dict[Kind, str] = {"train": "train config", "data": "data config", "policies": "dtype policy",
                         "eval": "lm-eval task"}
YAML_SUFFIXES = (".yaml", ".yml")
# A shipped config's name in earlier releases -> its name now, by kind: found by either for one release.
RENAMED: dict[Kind, dict[str, str]] = {"train": {"tiny_stages": "tiny_phases"}}


def resolve(kind: Kind, name_or_path: str | Path, option: str = "--config") -> Path:
    """The file a `--config`-like value names: an existing path, a path-like value as given, else the shipped
    config of that name; an unknown name is an InputError naming the value and listing `names(kind)`, and so is a
    path no file system could hold (naming `option`)."""
    check_path_length(name_or_path, option)
    path = Path(name_or_path)
    if path.exists() or path.suffix in YAML_SUFFIXES:
        return path
    found = find(kind, path.as_posix())
    new = RENAMED.get(kind, {}).get(path.as_posix())
    if found is None and new is not None:
        warn_line(f"{path.as_posix()} is the older name of the shipped {WHAT[kind]} {new}, read as {new} for one "
                  f"release: give {new}", path=option)
        found = find(kind, new)
    if found is None:
        raise InputError(f"no such file, and no shipped {WHAT[kind]} of that name "
                         f"(shipped: {', '.join(names(kind))})", path=name_or_path)
    return found


def find(kind: Kind, name: str) -> Path | None:
    """The shipped config `name` of `kind` (a name as `names` lists it), or None."""
    return folder(kind) / f"{name}.yaml" if name in names(kind) else None


def names(kind: Kind) -> list[str]:
    """The shipped configs of `kind`, by name (their paths under `folder(kind)` without `.yaml`), sorted."""
    return sorted(p.relative_to(folder(kind)).with_suffix("").as_posix() for p in folder(kind).rglob("*.yaml"))


def folder(kind: Kind) -> Path:
    """The folder of the shipped configs of `kind` (the lm-eval tasks' also holds their harness_utils.py)."""
    if kind not in KINDS:
        raise ValueError(f"unknown config kind {kind!r} (known: {', '.join(KINDS)})")
    return ROOT / kind
