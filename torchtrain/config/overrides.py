"""Reading a config: the YAML file (or a shipped config's name) and the command-line overrides merged over it
(`load_train_config`), each key's origin kept for errors.

Overrides are `key=value` with the dotted key (`optim.lr=1e-5`, `data.pack.budget=20000`); values are read as
YAML, bounded as a file is (anchor_core.yamlfile: `true`, `0.1`, `[0.9, 0.95]`; `yes` is a string). An override
wins over the file; a key given twice, in the file or by two overrides, is refused in one line naming it, both
values and where each came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from anchor_core.errors import InputError
from anchor_core.limits import clip, excerpt
from anchor_core.shipped import resolve
from anchor_core.yamlfile import parse_yaml, read_yaml_mapping_lines
from torchtrain.config.migration import MOVED, moved_error, moved_to
from torchtrain.config.schema import SECTIONS, TrainConfig, set_dotted
from torchtrain.config.validation import validate

def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML, or a shipped config's name: `tiny`, `paper/<name>`; None: only the overrides), apply
    `key=value` overrides, validate. A key the file gives twice is an InputError naming it, both values and
    their lines (anchor_core.yamlfile); so is a key two overrides set."""
    path = None if path is None else resolve("train", path)
    base, lines = ({}, {}) if path is None else read_yaml_mapping_lines(path, what="train config")
    source = "command line" if path is None else str(path)
    for key, value in base.items():  # a flat file: named before an override can mask it
        if moved_to(key, value) is not None:
            raise moved_error(key, f"{source}:{lines[key]}" if key in lines else source)
    updates, origins = parse_overrides(overrides)
    merged = dict(base)
    merge(merged, updates)
    return validate(merged, source=source, origins=origins, lines=lines)


def parse_overrides(items: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`key=value` strings (dotted keys) as a nested mapping, and the override each dotted key came from (every
    key an override sets: `optim={lr: 1e-5}` sets `optim.lr`). A key two overrides set is an InputError naming
    it, both values and both overrides."""
    updates: dict[str, Any] = {}
    origins: dict[str, str] = {}
    given: dict[str, tuple[str, str]] = {}  # dotted key an override set -> (its value's text, the override)
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"override {excerpt(item)} is not key=value")
        origin = f"command-line override {clip(item)}"
        # read as a file is (anchor_core.yamlfile: bounded, YAML 1.2's booleans); not YAML: the text itself
        value = parse_yaml(text, where=origin, text_if_invalid=True) if text.strip() else None
        parts = key.split(".")
        if len(parts) == 1 and moved_to(key, value) is not None or len(parts) > 1 and parts[0] in MOVED \
                and parts[0] not in SECTIONS:
            raise moved_error(key, origin)
        if parts[0] not in SECTIONS or len(parts) == 1 and not isinstance(value, dict) or "" in parts:
            raise InputError(f"override {excerpt(item)}: unknown key {excerpt(key)} (keys are dotted by section: "
                             f"{', '.join(f'{s}.<key>' for s in SECTIONS)})")
        for dotted, shown in _leaves(key, value, text.strip()):
            for other, (other_shown, other_origin) in given.items():
                if dotted == other or dotted.startswith(other + ".") or other.startswith(dotted + "."):
                    named = min(dotted, other, key=len)
                    raise InputError(f"{named} is given twice: {other_shown} ({other_origin}) and {shown} "
                                     f"({origin}); give each key once")
            given[dotted] = (shown, origin)
            origins[dotted] = origin
        merge(updates, _nest(parts, value))
    return updates, origins


def _leaves(key: str, value: Any, text: str) -> list[tuple[str, str]]:
    """The dotted keys an override `key=value` sets, each with its value as text: a mapping value merges into
    the config key by key (`optim={lr: 1e-5}` sets `optim.lr`), any other value sets `key` itself."""
    if not isinstance(value, dict):
        return [(key, clip(text) or "null")]
    out: list[tuple[str, str]] = []
    for k, v in value.items():
        shown = " ".join(yaml.safe_dump(v, default_flow_style=True).split()).removesuffix(" ...")  # a scalar's "..."
        out += _leaves(f"{key}.{k}", v, clip(shown))
    return out


def _nest(parts: Sequence[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    set_dotted(out, ".".join(parts), value)
    return out


def merge(base: dict[str, Any], updates: Mapping[str, Any]) -> None:
    """`updates` into `base`: mappings merge key by key, any other value replaces."""
    for k, v in updates.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = dict(base[k])
            merge(base[k], v)
        else:
            base[k] = v
