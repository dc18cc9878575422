"""What the declared keys of `torchtrain.config.schema` give: every dotted key (`KEYS`), those a resumed run may
change (`RESUMABLE_CHANGES`), the `data.pack:` keys (`PACK_KEYS`), what each key accepts in words (`expected`) and
the key list of `TrainConfig.__doc__` (`describe_keys`). Importing it checks every declaration
(`check_declarations`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from anchor_core.data.config import PACK_SCHEMA
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


check_declarations(TrainConfig)
TrainConfig.__doc__ = f"{TrainConfig.__doc__}\n\n{describe_keys()}\n"
