"""What the declared keys of `torchtrain.config.schema` give, and the helpers on dotted keys (`optim.lr`,
`model.rope.theta`) the rest of the package uses.

- The keys: every dotted key (`KEYS`), those a resumed run may change (`RESUMABLE_CHANGES`), the `data.pack:` keys
  (`PACK_KEYS`), what each key accepts in words (`expected`) and the key list of `TrainConfig.__doc__`
  (`describe_keys`). Importing this module checks every declaration (`check_declarations`).
- Dotted keys in nested mappings: the (dotted key, value) pairs of a mapping (`dotted_items`), a config's keys by
  section (`by_dotted_key`), a value set at a dotted key (`set_dotted`), a deep merge (`merge`).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Iterator, Literal, Mapping, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from anchor_core.data.config import PACK_SCHEMA
from anchor_core.errors import InputError
from anchor_core.limits import excerpt
from torchtrain.config.schema import EXPECTED_BY_TYPE, SECTIONS, TrainConfig, plain

# Mapping-valued keys inside a section: their own keys are dotted further (`model.rope.theta`).
NESTED: tuple[str, ...] = ("model.rope", "data.pack")
# dotted key -> its field
KEYS: dict[str, FieldInfo] = {f"{s}.{k}": f for s, cls in SECTIONS.items() for k, f in cls.model_fields.items()}
# Keys that may change when a run is resumed (the rest must equal the run's config.yaml).
RESUMABLE_CHANGES: tuple[str, ...] = tuple(k for k, f in KEYS.items() if f.json_schema_extra["resumable"])
# The `data.pack:` mapping: how a corpus given as `data.path` is packed on the fly (the `anchor pack`
# options that are not keys of their own here).
PACK_OPTIONS: dict[str, str] = {f.json_schema_extra["pack_option"]: k for k, f in KEYS.items()
                                if f.json_schema_extra["pack_option"]}
PACK_KEYS: tuple[str, ...] = tuple(k for k in PACK_SCHEMA if k not in PACK_OPTIONS)


def optional_inner(ann: Any) -> Any:
    """An `Optional[X]` annotation's X; any other annotation itself."""
    args = get_args(ann)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return ann


def base_type(ann: Any) -> Any:
    """The type under `Annotated[...]`: the one errors and the documentation describe."""
    return get_args(ann)[0] if get_origin(ann) is Annotated else ann


def _bound_text(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def expected(f: FieldInfo) -> str:
    """What a key accepts, in words ("an integer in [0, 3]"): from its annotation and its range."""
    ann = optional_inner(f.annotation)
    if ann in EXPECTED_BY_TYPE:
        return EXPECTED_BY_TYPE[ann]
    ann = base_type(ann)
    if get_origin(ann) is Literal:
        return f"one of {', '.join(map(str, get_args(ann)))}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return f"a mapping with keys among {', '.join(ann.model_fields)}"
    if ann is str:
        return "a non-empty string"
    if ann is bool:
        return "true or false"
    if ann is dict or get_origin(ann) is dict:
        return "a mapping"
    what = "an integer" if ann is int else "a number"
    bounds = {type(m).__name__: _bound_text(getattr(m, type(m).__name__.lower())) for m in f.metadata
              if isinstance(m, (annotated_types.Ge, annotated_types.Gt, annotated_types.Le))}
    if "Ge" in bounds and "Le" in bounds:
        return f"{what} in [{bounds['Ge']}, {bounds['Le']}]"
    if "Gt" in bounds:
        return f"{what} > {bounds['Gt']}"
    if "Ge" in bounds:
        return f"{what} >= {bounds['Ge']}"
    return what


def _default(f: FieldInfo) -> Any:
    if f.is_required():
        return ...
    return plain(f.get_default(call_default_factory=True))


def describe_keys() -> str:
    """Every key on a line: dotted name (default; what it accepts): meaning."""
    lines = []
    for name, f in KEYS.items():
        default = _default(f)
        given = "required" if default is ... else f"default {default!r}"
        lines.append(f"  {name} ({given}; {expected(f)}): {f.description}")
    return "\n".join(lines)


def check_declarations(cls: type[BaseModel] = TrainConfig) -> None:
    """Every field of `cls` is a section, and every field of a section (and of the mappings inside it)
    a key declared by `torchtrain.config.schema._key` with a one-line description; else a TypeError naming the
    field. Run on TrainConfig at import (pydantic checks each default against its field when a section is built:
    `validate_default`)."""
    for section, f in cls.model_fields.items():
        model = base_type(optional_inner(f.annotation))
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{cls.__name__}.{section} is not a section (a pydantic model of keys)")
        _check_keys(model)


def _check_keys(model: type[BaseModel]) -> None:
    for name, key in model.model_fields.items():
        if not isinstance(key.description, str) or not key.description or "\n" in key.description:
            raise TypeError(f"{model.__name__}.{name}: its description must be one line of text (the key's doc)")
        if not isinstance(key.json_schema_extra, dict) or "resumable" not in key.json_schema_extra:
            raise TypeError(f"{model.__name__}.{name} is not declared with "
                            "torchtrain.config.schema._key(default, doc)")
        inner = base_type(optional_inner(key.annotation))
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            _check_keys(inner)


# ---------------------------------------------------------------------------------------------
# Where each value came from

# ---------------------------------------------------------------------------------------------
# Dotted keys

def dotted_items(x: Any, prefix: str = "", *, depth: int | None = None, parents: bool = True, lists: bool = False,
                 string_keys: str | None = None) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key of the mapping `x` and of the mappings in it, each mapping before its keys:
    `a`, `a.b`, `a.b.c`; under `prefix` where one is given (`optim.lr` from `{"lr": ...}` with prefix `optim`).

    depth: the levels walked (1: the keys of `x` only; None: all).
    parents: also the mappings walked into (False: only the values below them; an empty mapping gives nothing).
    lists: also walk lists, an item named by its place from 1 (`schedule.phases[2].seq_len`).
    string_keys: the kind of mapping whose keys must be strings (`DeepSpeed`): another key is an InputError naming
      the mapping it is in. Without it, a key is named as str() writes it.
    """
    if isinstance(x, dict):
        children = ((_child_key(prefix, k, string_keys), v) for k, v in x.items())
    elif lists and isinstance(x, (list, tuple)):
        children = ((f"{prefix}[{i}]", v) for i, v in enumerate(x, 1))
    else:
        return
    for dotted, v in children:
        walked = (depth is None or depth > 1) and (isinstance(v, dict) or lists and isinstance(v, (list, tuple)))
        if parents or not walked:
            yield dotted, v
        if walked:
            yield from dotted_items(v, dotted, depth=None if depth is None else depth - 1, parents=parents,
                                    lists=lists, string_keys=string_keys)


def _child_key(prefix: str, key: Any, string_keys: str | None) -> str:
    """`prefix.key` (`key` alone without a prefix); a key that is not a string refused where `string_keys` says."""
    if string_keys is not None and not isinstance(key, str):
        raise InputError(f"{prefix}: {string_keys} keys are strings, got {excerpt(key)}")
    return f"{prefix}.{key}" if prefix else str(key)


def by_dotted_key(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config by section as dotted key -> value (`optim.lr`), one level: `model.rope` and `data.pack` stay whole
    mappings; a top-level value that is not a mapping (not a section) gives no key."""
    return {k: v for section, keys in config.items() if isinstance(keys, dict)
            for k, v in dotted_items(keys, str(section), depth=1)}


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """d[a][b][c] = value for `a.b.c`, making the mappings on the way."""
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[last] = value


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `extra` deep-merged over it: mappings merge key by key, any other value replaces;
    neither argument is changed, nor shares a value with the result."""
    out = copy.deepcopy(dict(base))
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


check_declarations(TrainConfig)
TrainConfig.__doc__ = f"{TrainConfig.__doc__}\n\n{describe_keys()}\n"
