"""Reading a config and checking it: the YAML file (or a shipped config's name) with the command-line overrides
merged over it (`load_train_config`), then the mapping checked against the declared keys and built into a
`TrainConfig` (`validate`): pydantic's first error as one line naming the dotted key and where its value came from;
the nested mappings (`model.rope`, `data.pack`); the checks across keys that need neither the world size nor a
model; then, with the world size, `check_world`.

A key renamed since an earlier release (`RENAMED`: `schedule.stages` is now `schedule.phases`) is read under its new
name for one release, with one warning line on stderr naming the new one and where the old one was given; both names
given is an InputError naming both. A run folder's config.yaml written before the rename is read the same way,
without the line (`current_keys`).

Overrides are `key=value` with the dotted key (`optim.lr=1e-5`, `data.pack.budget=20000`); values are read as
YAML, bounded as a file is (anchor_core.yamlfile: `true`, `0.1`, `[0.9, 0.95]`; `yes` is a string). An override
wins over the file; a key given twice, in the file or by two overrides, is refused in one line naming it, both
values and where each came from.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from anchor_core.data.config import PACK_SCHEMA, check_pack_options, validate_pack_config
from anchor_core.errors import InputError, warn_line
from anchor_core.export import shard_size_bytes
from anchor_core.limits import clip, excerpt
from anchor_core.shipped import resolve
from anchor_core.spec import RopeSpec
from anchor_core.yamlfile import parse_yaml, read_yaml_mapping_lines
from torchtrain.config.deepspeed_json import check_section as check_deepspeed_section
from torchtrain.config.keys import (PACK_KEYS, PACK_OPTIONS, base_type, dotted_items, expected, merge,
                                    optional_inner, set_dotted)
from torchtrain.config.schema import SECTIONS, LoggingConfig, Sources, TrainConfig, plain


# ---------------------------------------------------------------------------------------------
# Reading a file and the overrides over it

def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML, or a shipped config's name: `tiny`, `paper/<name>`; None: only the overrides), apply
    `key=value` overrides, validate. A key the file gives twice is an InputError naming it, both values and
    their lines (anchor_core.yamlfile); so is a key two overrides set."""
    path = None if path is None else resolve("train", path)
    base, lines = ({}, {}) if path is None else read_yaml_mapping_lines(path, what="train config")
    source = "command line" if path is None else str(path)
    updates, origins = parse_overrides(overrides)
    return validate(merge(base, updates), source=source, origins=origins, lines=lines)


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
        if parts[0] not in SECTIONS or len(parts) == 1 and not isinstance(value, dict) or "" in parts:
            raise InputError(f"override {excerpt(item)}: unknown key {excerpt(key)} (keys are dotted by section: "
                             f"{', '.join(f'{s}.<key>' for s in SECTIONS)})")
        for dotted, shown in _sets(key, value, text.strip()):
            for other, (other_shown, other_origin) in given.items():
                if dotted == other or dotted.startswith(other + ".") or other.startswith(dotted + "."):
                    named = min(dotted, other, key=len)
                    raise InputError(f"{named} is given twice: {other_shown} ({other_origin}) and {shown} "
                                     f"({origin}); give each key once")
            given[dotted] = (shown, origin)
            origins[dotted] = origin
        nested: dict[str, Any] = {}
        set_dotted(nested, key, value)
        updates = merge(updates, nested)
    return updates, origins


def _sets(key: str, value: Any, text: str) -> list[tuple[str, str]]:
    """The dotted keys an override `key=value` sets, each with its value as text: a mapping value merges into
    the config key by key (`optim={lr: 1e-5}` sets `optim.lr`), any other value sets `key` itself."""
    if not isinstance(value, dict):
        return [(key, clip(text) or "null")]
    return [(dotted, clip(_flow(v))) for dotted, v in dotted_items(value, key, parents=False)]


def _flow(value: Any) -> str:
    """A value as one line of YAML (flow style): `[0.9, 0.95]`, `1.0e-05`."""
    return " ".join(yaml.safe_dump(value, default_flow_style=True).split()).removesuffix(" ...")  # a scalar's "..."


# ---------------------------------------------------------------------------------------------
# Checking a mapping

def validate(d: Any, *, source: str = "config", origins: Mapping[str, str] | None = None,
             lines: Mapping[str, int] | None = None) -> TrainConfig:
    """Check a mapping against the declared keys and build a TrainConfig: every check of a config
    that needs neither the world size nor a model (`check_world` and the trainer do the rest).

    Args:
      d: the mapping, by section (YAML with overrides applied).
      source: the config file, named in errors.
      origins: dotted key -> the override that set it (e.g. "command-line override optim.lr=abc").
      lines: dotted key -> its line in the file (the keys no override set).
    """
    sources = Sources(source, lines, origins)
    if not isinstance(d, dict):
        raise InputError("a train config must be a mapping of sections to keys", path=source)
    # every section present (an empty one, `optim:` alone, is None in YAML), so a missing required key is
    # named by its dotted path
    d = {**{s: {} for s in SECTIONS}, **{k: {} if k in SECTIONS and v is None else v for k, v in d.items()}}
    d, sources = _read_renamed(d, sources, warn=True)
    d = _fold_tensorboard(d, sources)
    try:
        cfg = TrainConfig.model_validate(d)
    except ValidationError as e:
        raise _one_line(e, d, sources) from None
    cfg._source = source
    cfg._sources = sources
    _check_finite(cfg)
    _check_nested(cfg, sources)
    # across keys: the batch arithmetic that needs no world size (under torchrun the launcher's
    # world replaces `parallel.nproc`: check_world)
    if cfg.model.offload_checkpoints and not cfg.model.activation_checkpointing:
        raise InputError("model.offload_checkpoints needs model.activation_checkpointing: true (it moves the "
                         "checkpoints, the layer inputs, to host memory)",
                         path=cfg.where("model.offload_checkpoints", "model.activation_checkpointing"))
    if cfg.data.global_batch % cfg.data.micro_batch:
        raise InputError(f"data.global_batch {cfg.data.global_batch} is not a multiple of data.micro_batch "
                         f"{cfg.data.micro_batch}", path=cfg.where("data.global_batch", "data.micro_batch"))
    if cfg.parallel.offload_optimizer and cfg.parallel.zero_stage < 1:
        raise InputError("parallel.offload_optimizer needs parallel.zero_stage 1 to 3 (the ZeRO optimizer holds the "
                         "states it moves to host memory)",
                         path=cfg.where("parallel.offload_optimizer", "parallel.zero_stage"))
    if cfg.parallel.offload_params and cfg.parallel.zero_stage != 3:
        raise InputError("parallel.offload_params needs parallel.zero_stage 3 (only ZeRO-3 partitions the parameters "
                         "it moves to host memory)", path=cfg.where("parallel.offload_params", "parallel.zero_stage"))
    try:  # transformers' notation, read as transformers reads it
        shard_size_bytes(cfg.checkpoint.max_shard_size, option="checkpoint.max_shard_size")
    except InputError as e:
        raise InputError(str(e), path=cfg.where("checkpoint.max_shard_size")) from None
    _check_phases(cfg)
    for seq_len in [p.seq_len for p in cfg.schedule.phases] or [cfg.data.seq_len]:
        if seq_len is not None:  # else the packed data gives it: prepare_run checks it then
            check_heldout_buckets(cfg, seq_len)
    check_deepspeed_section(cfg)  # last: it imports DeepSpeed when the section is given
    return cfg


def check_heldout_buckets(cfg: TrainConfig, seq_len: int) -> None:
    """`eval.heldout_buckets` splits a window's `seq_len` slots into slot ranges: at most one per slot."""
    buckets = cfg.eval.heldout_buckets
    if buckets > seq_len:
        raise InputError(f"eval.heldout_buckets {buckets} is more than the {seq_len} slots of a window (data.seq_len): "
                         "the held-out loss is given by at most one slot range per slot",
                         path=cfg.where("eval.heldout_buckets"))


def _check_finite(cfg: TrainConfig) -> None:
    """Every number of the config is finite, also in the mappings no key declares (`data.pack`, `deepspeed:`): a NaN
    or an infinity there would train on it, or write a deepspeed.json that is not JSON."""
    for dotted, value in dotted_items(cfg.to_dict(), lists=True):
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{dotted}: expected a finite number, got {value}", path=cfg.where(_key_of(dotted)))


def _fold_tensorboard(d: dict[str, Any], sources: Sources) -> dict[str, Any]:
    """`logging.tensorboard`, the older spelling, read into `logging.report_to` (the one key): false leaves
    tensorboard out of it, true changes nothing; the key itself is then left unset."""
    section = d.get("logging")
    if not isinstance(section, dict) or section.get("tensorboard") is None:
        return d
    section = dict(section)
    value = section.pop("tensorboard")
    if not isinstance(value, bool):
        raise InputError(f"logging.tensorboard: expected true or false (false: logging.report_to without tensorboard), "
                         f"got {excerpt(value)}", path=sources.where("logging.tensorboard"))
    if value is False:
        names = section.get("report_to", LoggingConfig.model_fields["report_to"].default)
        names = [names] if isinstance(names, str) else names
        if isinstance(names, (list, tuple)):
            section["report_to"] = [n for n in names if n != "tensorboard"]
    return {**d, "logging": section}


# A key's name in earlier releases -> its name now, each read under its new name for one release (module docstring).
RENAMED = {"schedule.stages": "schedule.phases"}


def current_keys(d: Any) -> Any:
    """A config by section (a run folder's config.yaml) with the old names of RENAMED under their new ones, without
    a word: anchor wrote it, the user has nothing to rename."""
    return _read_renamed(d, Sources("config"), warn=False)[0]


def _read_renamed(d: Any, sources: Sources, *, warn: bool) -> tuple[Any, Sources]:
    """`d` with each old name of RENAMED it gives under the new name, and `sources` likewise (an error about the key
    names where the old name was given); with `warn`, one line on stderr for each. Both names given is an
    InputError naming both."""
    if not isinstance(d, dict):
        return d, sources
    for old, new in RENAMED.items():
        section, old_key = old.split(".")
        new_key = new.split(".")[1]
        keys = d.get(section)
        if not isinstance(keys, dict) or old_key not in keys:
            continue
        if new_key in keys:
            raise InputError(f"{old} and {new} are both given; {old} is the older name of {new}: give {new} only",
                             path=sources.where(old, new))
        if warn:
            warn_line(f"{old} is the older name of {new}, read as {new} for one release: rename the key",
                      path=sources.where(old))
        d = {**d, section: {new_key if k == old_key else k: v for k, v in keys.items()}}
        sources = sources.renamed(old, new)
    return d, sources


def _check_phases(cfg: TrainConfig) -> None:
    """`schedule.phases` covers `schedule.steps`, and each phase gives its own length (torchtrain.training.phases)."""
    phases = cfg.schedule.phases
    if not phases:
        return
    total = sum(p.steps for p in phases)
    if total != cfg.schedule.steps:
        raise InputError(f"the steps of schedule.phases sum to {total}, schedule.steps is {cfg.schedule.steps}: they "
                         "must be equal", path=cfg.where("schedule.phases", "schedule.steps"))
    if cfg.data.seq_len is not None:
        raise InputError(f"data.seq_len {cfg.data.seq_len} with schedule.phases: each phase gives its own seq_len; "
                         "omit data.seq_len", path=cfg.where("data.seq_len", "schedule.phases"))
    if cfg.eval.heldout_data is not None:
        raise InputError("eval.heldout_data holds windows of one length, schedule.phases trains on several: hold out "
                         "eval.heldout_windows of each phase's windows instead",
                         path=cfg.where("eval.heldout_data", "schedule.phases"))


def _check_nested(cfg: TrainConfig, sources: Sources) -> None:
    """`model.rope` makes a RoPE; `data.pack` holds `anchor pack` options in their ranges."""
    rope = cfg.rope_overrides()
    if rope:
        try:  # the combination must make a RoPE (e.g. yarn needs original_max_position)
            RopeSpec(**{"base": 10000.0, **rope})
        except InputError as e:
            raise InputError(f"model.rope: {e}", path=sources.where("model.rope")) from None
    pack = cfg.data.pack
    if not pack:
        return
    bad = [k for k in pack if k not in PACK_KEYS]
    if bad:
        hint = f"; give it as {PACK_OPTIONS[bad[0]]}" if bad[0] in PACK_OPTIONS else ""
        raise InputError(f"unknown key 'data.pack.{bad[0]}' (known: {', '.join(PACK_KEYS)}{hint})",
                         path=sources.where(f"data.pack.{bad[0]}"))
    for k, v in pack.items():  # types as `anchor pack` reads them
        try:
            validate_pack_config({k: v})
        except InputError:
            raise InputError(f"data.pack.{k}: expected {_pack_expected(k)}, got {excerpt(v)}",
                             path=sources.where(f"data.pack.{k}")) from None
    try:  # ranges as `anchor pack` checks them, named as this config names them
        check_pack_options(pack, names={k: f"data.pack.{k}" for k in PACK_SCHEMA})
    except InputError as e:
        if e.path is not None:
            raise
        named = [f"data.pack.{k}" for k in pack if re.search(rf"\b{k}\b", str(e))]
        raise InputError(str(e), path=sources.where(*(named or ["data.pack"]))) from None


def _pack_expected(key: str) -> str:
    """What a `data.pack:` key accepts, in words: its types (anchor_core.data.config.PACK_SCHEMA) and meaning."""
    types, doc = PACK_SCHEMA[key]
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    kinds = [words[t] for t in types if not (t is int and float in types)]
    return f"{' or '.join(kinds)} ({doc})"


def check_world(cfg: TrainConfig, world: int) -> None:
    """The config fits a world of `world` processes: a window's ranks (Ulysses x context parallel) divide it, the
    global batch splits over the rest."""
    sp, mb, gb = cfg.sequence_degree(), cfg.data.micro_batch, cfg.data.global_batch
    cp = cfg.parallel.context_parallel
    keys = ("parallel.sequence_parallel", "parallel.context_parallel") if cp > 1 else ("parallel.sequence_parallel",)
    what = (f"parallel.sequence_parallel {cfg.parallel.sequence_parallel} x parallel.context_parallel {cp}" if cp > 1
            else f"parallel.sequence_parallel {sp}")
    if world < sp:
        raise InputError(f"{what} needs at least {sp} processes, this run has {world} "
                         f"(set parallel.nproc, or launch more ranks)", path=cfg.where(*keys, "parallel.nproc"))
    if world % sp:
        groups = f"groups of {sp} ranks a window ({what})" if cp > 1 else f"sequence-parallel groups of {sp}"
        raise InputError(f"{world} processes do not split into {groups}", path=cfg.where("parallel.nproc", *keys))
    dp = world // sp
    if gb % (mb * dp):
        raise InputError(f"data.global_batch {gb} does not split into data.micro_batch {mb} x {dp} data-parallel "
                         f"ranks", path=cfg.where("data.global_batch", "data.micro_batch", "parallel.nproc", *keys))


def _field_path(loc: Sequence[Any]) -> tuple[list[str], FieldInfo | None, Any]:
    """The longest prefix of a pydantic error location that names a key (or a section), its field, and the model
    whose keys come next; an item of a list of mappings (`schedule.phases`) is named by its index from 1:
    `schedule.phases[2].seq_len`."""
    cls: Any = TrainConfig
    path: list[str] = []
    field = None
    for part in loc:
        items = get_args(cls) if get_origin(cls) is tuple else ()
        if isinstance(part, int) and len(items) == 2 and items[1] is Ellipsis and _is_model(items[0]):
            path[-1] += f"[{part + 1}]"
            cls = items[0]
            continue
        if not _is_model(cls) or part not in cls.model_fields:
            break
        path.append(str(part))
        field = cls.model_fields[part]
        cls = base_type(optional_inner(field.annotation))
    return path, field, cls


def _is_model(x: Any) -> bool:
    return isinstance(x, type) and issubclass(x, BaseModel)


def _lookup(d: Any, path: Sequence[str]) -> Any:
    for p in path:
        key, _, index = p.partition("[")
        d = d.get(key) if isinstance(d, dict) else None
        if index:  # an item of a list: `phases[2]` (from 1)
            i = int(index.rstrip("]")) - 1
            d = d[i] if isinstance(d, list) and i < len(d) else None
    return d


def _key_of(dotted: str) -> str:
    """The declared key a dotted name lies under: `schedule.phases` for `schedule.phases[2].seq_len`."""
    return re.sub(r"\[\d+\].*$", "", dotted)


def _one_line(err: ValidationError, d: dict[str, Any], sources: Sources) -> InputError:
    """pydantic's first error as one line naming the dotted key and where it came from."""
    e = err.errors()[0]
    loc = list(e["loc"])
    path, field, model = _field_path(loc)
    if e["type"] == "extra_forbidden":
        parents, _, model = _field_path(loc[:-1])  # the mapping the unknown key is in
        dotted, parent = ".".join([*parents, str(loc[-1])]), ".".join(parents)
        known = SECTIONS if not parent else model.model_fields
        return InputError(f"unknown key {excerpt(dotted)} (known{' in ' + parent if parent else ' sections'}: "
                          f"{', '.join(known)})", path=sources.where(_key_of(dotted)))
    dotted = ".".join(path)
    if e["type"] == "missing":  # named at its section, where the file gives one
        return InputError(f"missing required key {dotted!r} ({field.description})", path=sources.where(path[0]))
    what = f" ({field.description})" if field is not None and field.description else ""
    accepts = expected(field) if field else "a mapping"
    if path and path[-1].endswith("]"):  # an item of a list of mappings that is not one
        what, accepts = "", f"a mapping with keys among {', '.join(model.model_fields)}"
    got = _lookup(d, path)
    yaml11 = isinstance(got, str) and got.lower() in ("yes", "no", "on", "off")  # read as strings: anchor_core.yamlfile
    hint = " (YAML 1.1's yes/no/on/off are strings here)" if yaml11 and field is not None and \
        expected(field) == "true or false" else ""
    return InputError(f"{dotted}: expected {accepts}{what}, got {excerpt(got)}{hint}",
                      path=sources.where(_key_of(dotted)))


def with_changes(cfg: TrainConfig, changes: Mapping[str, Any]) -> TrainConfig:
    """`cfg` with `changes` (dotted key -> value, e.g. {"model.engine": "varlen"}), validated; the changed keys are
    named in errors as given by no one (the program changed them)."""
    d = cfg.to_dict()
    for dotted, value in changes.items():
        set_dotted(d, dotted, plain(value))
    sources = (cfg._sources or Sources(cfg.source)).without(changes)
    return validate(d, source=cfg.source, origins=sources.overrides, lines=sources.lines)
