"""The typed schema of `anchor train` configs (docs/DESIGN.md §8): YAML is data, this module is the schema.

    cfg = load_train_config("configs/train/tiny.yaml", ["schedule.steps=4", "model.rope.theta=5e6"])
    cfg = load_train_config("tiny")   # the same file by its shipped name (anchor_core.shipped)
    cfg.schedule.steps, cfg.model.variant, cfg.optim.lr, cfg.grad_accum(world=2)

A config is sectioned: `model`, `data`, `optim`, `schedule`, `parallel`, `checkpoint`, `logging`, `eval`,
each a pydantic model whose fields are its keys. Every key is declared once, as a field: its type (the
annotation: `Literal` choices, strict ints, finite numbers), its default (none: required), its range
(`ge`, `gt`, `le`) and its one-line meaning (`description`). pydantic validates; this module turns its
first error into one line (an InputError) naming the key's dotted path and where its value came from: the
command-line override (`command-line override optim.lr=abc`) or the file and the key's line
(`tiny.yaml:23`); an error across keys names where each came from (`TrainConfig.where`). Everything else
is derived from the fields: `KEYS` (every dotted key), the keys a resumed run may change
(`RESUMABLE_CHANGES`), the `data.pack:` keys (`PACK_KEYS`), `to_dict` and the key list in
`TrainConfig.__doc__` (`describe_keys`).

A flat key of the pre-sectioned format (`lr: 1e-5`, `lr=1e-5`) is refused in one line naming its
place in a section (`MOVED`: flat key -> dotted key, the one table); a run folder whose config.yaml
is flat is translated through the same table (`from_flat`).

Overrides are `key=value` with the dotted key (`optim.lr=1e-5`, `data.pack.budget=20000`); values are
read as YAML, bounded as a file is (anchor_core.yamlfile: `true`, `0.1`, `[0.9, 0.95]`; `yes` is a string). An
override wins over the file; a key given twice, in the file or by two overrides, is refused in one line naming
it, both values and where each came from. An error echoes at most an excerpt of a value
(anchor_core.limits.excerpt).

Batch arithmetic: `data.global_batch` windows per optimizer step = `data.micro_batch` windows per
forward on each data-parallel rank × `grad_accum` micro-steps × `dp` data-parallel ranks, with
`dp = world / parallel.sequence_parallel`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Sequence, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, \
    ValidationError
from pydantic.fields import FieldInfo

from anchor_core.data.config import PACK_SCHEMA, check_pack_options, validate_pack_config
from anchor_core.engines import TRAIN_ENGINES
from anchor_core.errors import InputError
from anchor_core.limits import EXCERPT, SEED_MAX, excerpt
from anchor_core.shipped import resolve
from anchor_core.spec import RopeSpec
from anchor_core.variants import Variant
from anchor_core.yamlfile import parse_yaml, read_yaml_mapping_lines

Schedule = Literal["constant", "cosine", "linear"]
Dtype = Literal["float32", "bfloat16"]
TrainEngine = Literal[TRAIN_ENGINES]  # type: ignore[valid-type]  # auto, or an engine of anchor_core.engines
RopeScaling = Literal["default", "linear", "dynamic", "yarn", "llama3", "ntk"]

# ---------------------------------------------------------------------------------------------
# Value types: what a key accepts beyond pydantic's own strict types


def _yaml_number(x: Any) -> float:
    """A finite YAML number, also `5e6` (PyYAML reads exponents without a dot as strings); never a bool."""
    if isinstance(x, bool):
        raise ValueError("a bool is not a number")
    if isinstance(x, str):
        try:
            x = float(x)
        except ValueError:
            raise ValueError("not a number") from None
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError("not a finite number")
    return float(x)


def _beta(x: Any) -> float:
    v = _yaml_number(x)
    if not 0.0 <= v < 1.0:
        raise ValueError("a beta is in [0, 1)")
    return v


Number = Annotated[float, BeforeValidator(_yaml_number)]
Name = Annotated[str, Field(strict=True, min_length=1)]
Betas = tuple[Annotated[float, BeforeValidator(_beta)], Annotated[float, BeforeValidator(_beta)]]
Steps = tuple[Annotated[StrictInt, Field(ge=1)], ...]

# What errors and the documentation say a type accepts, where the annotation alone does not tell.
_EXPECTED_BY_TYPE: dict[Any, str] = {
    Betas: "two numbers [beta1, beta2] in [0, 1)",
    tuple[Name, ...]: "a list of non-empty strings",
    Steps: "a list of step numbers >= 1",
}


def _key(default: Any, doc: str, *, resumable: bool = False, pack_option: str | None = None,
         **constraints: Any) -> Any:
    """A key's field: its default (`...`: required; a dict is copied per config), its one-line meaning and its
    range (`ge`, `gt`, `le`).

    resumable: a resumed run may change it (the other keys must equal the run's config.yaml).
    pack_option: the `anchor pack` option it also is (anchor_core.data.config.PACK_SCHEMA), so `data.pack:`
      does not take that option.
    """
    extra = {"resumable": resumable, "pack_option": pack_option}
    if isinstance(default, dict):
        return Field(default_factory=lambda: dict(default), description=doc, json_schema_extra=extra, **constraints)
    return Field(default, description=doc, json_schema_extra=extra, **constraints)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


# ---------------------------------------------------------------------------------------------
# The sections


class RopeConfig(_Section):
    """`model.rope:` overrides of the model's RoPE (docs/DESIGN.md §3); names as in anchor_core.spec.RopeSpec,
    with the contract's spellings `theta` (= base) and `scaling` (= kind). Omitted: the model's."""

    theta: Optional[Number] = _key(None, "RoPE base (the paper: 1e6 at 32K, 5e6 at 64K, 1e7 at 128K, 5e7 at 256K)",
                                   gt=1.0)
    scaling: Optional[RopeScaling] = _key(None, "scaling kind")
    factor: Optional[Number] = _key(None, "scaling factor", ge=1.0)
    original_max_position: Optional[StrictInt] = _key(None, "pre-training length (dynamic, yarn, llama3)", ge=1)
    low_freq_factor: Optional[Number] = _key(None, "llama3", gt=0.0)
    high_freq_factor: Optional[Number] = _key(None, "llama3", gt=0.0)
    beta_fast: Optional[Number] = _key(None, "yarn", gt=0.0)
    beta_slow: Optional[Number] = _key(None, "yarn", gt=0.0)
    attention_factor: Optional[Number] = _key(None, "yarn: overrides 0.1 ln(factor) + 1", gt=0.0)

    def given(self) -> dict[str, Any]:
        """The overrides the config gives, as it names them."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ModelConfig(_Section):
    """What is trained and how its attention runs."""

    name: Name = _key(..., "HF folder, .gguf file, default, or random:<preset>", pack_option="model")
    variant: Variant = _key("anchor", "attention variant (docs/DESIGN.md §2)")
    mask_cross_doc_loss: StrictBool = _key(False, "full: also mask cross-document predictions")
    engine: TrainEngine = _key("auto", "attention engine; auto: flash_varlen on CUDA with flash-attn (bf16), else "
                               "varlen (memory linear in T; RUN/config.yaml records which ran). eager and sdpa hold "
                               "a dense T x T mask")
    dtype: Dtype = _key("float32", "float32, or bfloat16 mixed precision (fp32 master weights)")
    activation_checkpointing: StrictBool = _key(False, "recompute layer activations in the backward")
    tiled_mlp: StrictBool = _key(False, "compute each layer's MLP in tiles of hidden_size slots over the sequence "
                                 "(torchtrain.tiling): its intermediate never held for the whole window")
    offload_checkpoints: StrictBool = _key(False, "CUDA, with activation_checkpointing: keep the layer inputs in "
                                           "pinned host memory between the forward and the backward")
    rope: RopeConfig = _key(RopeConfig(), "RoPE overrides: theta, scaling, factor, original_max_position, ...")


class DataConfig(_Section):
    """What the run trains on, in which windows and batches."""

    path: Name = _key(..., "an `anchor pack` output folder, a corpus (file or folder) packed on the fly, or `corpus` "
                      "(the embedded default corpus)", pack_option="data")
    seq_len: Optional[StrictInt] = _key(None, "slots per window T (taken from a pack output when omitted)", ge=2,
                                        pack_option="seq_len")
    tags: StrictBool = _key(False, "domain tags before each document (packing on the fly)", pack_option="tags")
    interleave: StrictBool = _key(False, "interleaved document chunks (packing on the fly)", pack_option="interleave")
    pack: dict[str, Any] = _key({}, "packing options for a corpus packed on the fly (the `anchor pack` options "
                                "not given above: mixture, budget, ...)")
    global_batch: StrictInt = _key(8, "windows per optimizer step", ge=1)
    micro_batch: StrictInt = _key(1, "windows per forward on one data-parallel rank", ge=1)
    seed: StrictInt = _key(0, "seed of the data order and of random:<preset> weights", ge=0, le=SEED_MAX)


class OptimConfig(_Section):
    """AdamW and its gradient clipping."""

    lr: Number = _key(2e-5, "peak learning rate", gt=0.0)
    weight_decay: Number = _key(0.1, "AdamW decoupled weight decay", ge=0.0)
    no_decay: tuple[Name, ...] = _key(("bias", "norm"), "parameters whose name contains one of these get no "
                                      "weight decay")
    betas: Betas = _key((0.9, 0.95), "AdamW betas")
    eps: Number = _key(1e-8, "AdamW eps", gt=0.0)
    grad_clip: Number = _key(1.0, "clip the global gradient norm to this (0 = off)", ge=0.0)


class ScheduleConfig(_Section):
    """How long the run trains and the learning rate over its steps."""

    steps: StrictInt = _key(..., "optimizer steps", ge=1, resumable=True)
    warmup_steps: StrictInt = _key(0, "linear warmup steps (from lr/warmup_steps)", ge=0)
    kind: Schedule = _key("constant", "after warmup: constant, cosine or linear decay")
    min_lr_ratio: Number = _key(0.0, "cosine/linear: the final learning rate as a fraction of optim.lr", ge=0.0, le=1.0)


class ParallelConfig(_Section):
    """Processes and how the model and the batch are split over them."""

    nproc: StrictInt = _key(1, "processes started on this machine (1 = this process)", ge=1, resumable=True)
    sequence_parallel: StrictInt = _key(1, "Ulysses sequence-parallel degree", ge=1)
    zero_stage: StrictInt = _key(0, "DeepSpeed ZeRO stage", ge=0, le=3)


class CheckpointConfig(_Section):
    """Regular checkpoints (the evaluation ones: `eval`)."""

    save_every: StrictInt = _key(0, "checkpoint every this many steps (0: only the final and the evaluation ones)",
                                 ge=0, resumable=True)
    keep_last: StrictInt = _key(2, "the newest checkpoints kept whole, to resume from (0: all); older regular ones are "
                                "deleted, older evaluation ones keep only their weights (hf/)", ge=0, resumable=True)


class LoggingConfig(_Section):
    """What the run reports besides RUN/metrics.jsonl."""

    every: StrictInt = _key(1, "print a progress line every this many steps", ge=1, resumable=True)
    tensorboard: StrictBool = _key(True, "write TensorBoard events under RUN/tensorboard when installed",
                                   resumable=True)
    dump_grads: Steps = _key((), "steps whose whole averaged gradient (before clipping) is written to "
                             "RUN/grads/step-N.safetensors", resumable=True)


class EvalConfig(_Section):
    """The evaluation checkpoints (the paper: every 10 steps over the last 50)."""

    every: StrictInt = _key(10, "evaluation checkpoints: every this many steps ...", ge=1)
    window: StrictInt = _key(50, "... over the last this many steps (the paper: every 10 over the last 50)", ge=0)


class TrainConfig(_Section):
    """A validated `anchor train` config: one field per section. `source` (not a key) is the file it came
    from, and `where(*keys)` where given keys came from (the override, or the file and the line), named in
    errors. Keys, in the order errors list them and config.yaml is written:"""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    _source: str = PrivateAttr("config")
    _sources: "Sources" = PrivateAttr(None)

    @property
    def source(self) -> str:
        return self._source

    def where(self, *keys: str) -> str:
        """Where the values of these dotted keys came from, for an error about them: `command-line override
        model.dtype=bfloat16`, `tiny.yaml:36`, several joined with "and"; the file when none was given."""
        return (self._sources or Sources(self._source)).where(*keys)

    def __eq__(self, other: object) -> bool:  # the keys, not where they came from
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # `data.pack` is a dict

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-able data (the run's config.yaml): every key by section, tuples as
        lists, `model.rope` with only the overrides given."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            values = getattr(self, section)
            out[section] = {k: _plain(getattr(values, k)) for k in type(values).model_fields}
        return out

    def replace(self, changes: Mapping[str, Any]) -> "TrainConfig":
        """This config with `changes` (dotted key -> value, e.g. {"model.engine": "varlen"}), validated."""
        d = self.to_dict()
        for dotted, value in changes.items():
            _set_dotted(d, dotted, _plain(value))
        sources = (self._sources or Sources(self._source)).without(changes)
        return validate(d, source=self.source, origins=sources.overrides, lines=sources.lines)

    def dp(self, world: int) -> int:
        """Data-parallel ranks of a world of `world` processes."""
        return world // self.parallel.sequence_parallel

    def grad_accum(self, world: int) -> int:
        """Micro-steps per optimizer step on each rank."""
        return self.data.global_batch // (self.data.micro_batch * self.dp(world))

    def rope_overrides(self) -> dict[str, Any]:
        """`model.rope:` as RopeSpec field names (empty: the model's RoPE)."""
        return {_ROPE_FIELD.get(k, k): v for k, v in self.model.rope.given().items()}

    def is_checkpoint_step(self, step: int) -> bool:
        """Steps that write a checkpoint: every `checkpoint.save_every`, the last, and the evaluation schedule."""
        every = self.checkpoint.save_every
        return step == self.schedule.steps or (every > 0 and step % every == 0) or self.is_eval_step(step)

    def is_eval_step(self, step: int) -> bool:
        """The paper's evaluation schedule: every `eval.every` steps counted back from the last step,
        within the last `eval.window` steps (every 10 over the last 50: five checkpoints)."""
        steps, left = self.schedule.steps, self.schedule.steps - step
        return 0 < step <= steps and left < self.eval.window and left % self.eval.every == 0


_ROPE_FIELD = {"theta": "base", "scaling": "kind"}


def _plain(v: Any) -> Any:
    if isinstance(v, RopeConfig):
        return v.given()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return dict(v)
    return v


def _set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[last] = value


# ---------------------------------------------------------------------------------------------
# Derived from the declarations

SECTIONS: dict[str, type[_Section]] = {name: f.annotation for name, f in TrainConfig.model_fields.items()}
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

# The one table of the pre-sectioned format: flat key -> its dotted key now. Used to refuse a flat key
# in a config or an override (naming its place) and to read a run folder's flat config.yaml.
MOVED: dict[str, str] = {
    "model": "model.name", "variant": "model.variant", "mask_cross_doc_loss": "model.mask_cross_doc_loss",
    "engine": "model.engine", "dtype": "model.dtype", "activation_checkpointing": "model.activation_checkpointing",
    "tiled_mlp": "model.tiled_mlp", "offload_checkpoints": "model.offload_checkpoints", "rope": "model.rope",
    "data": "data.path", "seq_len": "data.seq_len", "tags": "data.tags", "interleave": "data.interleave",
    "pack": "data.pack", "global_batch": "data.global_batch", "micro_batch": "data.micro_batch", "seed": "data.seed",
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "no_decay": "optim.no_decay", "betas": "optim.betas",
    "eps": "optim.eps", "grad_clip": "optim.grad_clip",
    "steps": "schedule.steps", "warmup_steps": "schedule.warmup_steps", "schedule": "schedule.kind",
    "min_lr_ratio": "schedule.min_lr_ratio",
    "nproc": "parallel.nproc", "sequence_parallel": "parallel.sequence_parallel", "zero_stage": "parallel.zero_stage",
    "save_every": "checkpoint.save_every", "keep_last": "checkpoint.keep_last",
    "log_every": "logging.every", "tensorboard": "logging.tensorboard", "dump_grads": "logging.dump_grads",
    "eval_every": "eval.every", "eval_window": "eval.window",
}


def _inner(ann: Any) -> Any:
    """An `Optional[X]` annotation's X; any other annotation itself."""
    args = get_args(ann)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return ann


def _base(ann: Any) -> Any:
    """The type under `Annotated[...]`: the one errors and the documentation describe."""
    return get_args(ann)[0] if get_origin(ann) is Annotated else ann


def _bound_text(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def expected(f: FieldInfo) -> str:
    """What a key accepts, in words ("an integer in [0, 3]"): from its annotation and its range."""
    ann = _inner(f.annotation)
    if ann in _EXPECTED_BY_TYPE:
        return _EXPECTED_BY_TYPE[ann]
    ann = _base(ann)
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
    return _plain(f.get_default(call_default_factory=True))


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
    a key declared by `_key` with a one-line description; else a TypeError naming the field. Run on
    TrainConfig at import (pydantic checks each default against its field when a section is built:
    `validate_default`)."""
    for section, f in cls.model_fields.items():
        model = _base(_inner(f.annotation))
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{cls.__name__}.{section} is not a section (a pydantic model of keys)")
        _check_keys(model)


def _check_keys(model: type[BaseModel]) -> None:
    for name, key in model.model_fields.items():
        if not isinstance(key.description, str) or not key.description or "\n" in key.description:
            raise TypeError(f"{model.__name__}.{name}: its description must be one line of text (the key's doc)")
        if not isinstance(key.json_schema_extra, dict) or "resumable" not in key.json_schema_extra:
            raise TypeError(f"{model.__name__}.{name} is not declared with torchtrain.config._key(default, doc)")
        inner = _base(_inner(key.annotation))
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            _check_keys(inner)


check_declarations(TrainConfig)
TrainConfig.__doc__ = f"{TrainConfig.__doc__}\n\n{describe_keys()}\n"

# ---------------------------------------------------------------------------------------------
# Where each key came from


class Sources:
    """Where each key of a config came from: the command-line overrides (dotted key -> `command-line override
    optim.lr=abc`, for every key an override sets), else the file and the key's line in it, else nowhere (a
    default). `file` alone is named where none of the keys an error is about was given."""

    def __init__(self, file: str, lines: Mapping[str, int] | None = None,
                 overrides: Mapping[str, str] | None = None):
        self.file = str(file)
        self.lines = dict(lines or {})
        self.overrides = dict(overrides or {})

    def places(self, dotted: str) -> list[str]:
        """Where `dotted` came from: the override that set it (or a value above it), else its line in the file;
        and the overrides that set keys below it (`model.rope` from `model.rope.scaling=yarn`)."""
        parts = dotted.split(".")
        above = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        out = [next((self.overrides[k] for k in above if k in self.overrides), None)]
        if out[0] is None and dotted in self.lines:
            out[0] = f"{self.file}:{self.lines[dotted]}"
        out += [o for k, o in self.overrides.items() if k.startswith(dotted + ".")]
        return list(dict.fromkeys(o for o in out if o is not None))

    def where(self, *keys: str) -> str:
        """The places of `keys` as the `path` of an InputError, joined with "and" where they are several (then a
        line of the file names its key); the file where none of them was given."""
        places: dict[str, str] = {}  # place -> the key it gave
        for key in keys:
            for place in self.places(key):
                places.setdefault(place, key)
        if len(places) <= 1:
            return next(iter(places), self.file)
        return " and ".join(f"{p} ({k})" if p.startswith(f"{self.file}:") else p for p, k in places.items())

    def without(self, keys: Sequence[str]) -> "Sources":
        """These sources with `keys` (and what lies below them) given by no one: changed by the program."""
        def kept(k: str) -> bool:
            return not any(k == c or k.startswith(c + ".") for c in keys)

        return Sources(self.file, {k: v for k, v in self.lines.items() if kept(k)},
                       {k: v for k, v in self.overrides.items() if kept(k)})


# ---------------------------------------------------------------------------------------------
# Validation


def _moved(key: str, value: Any) -> str | None:
    """The dotted place of a top-level key of the pre-sectioned format, or None. `model`, `data` and
    `schedule` are sections now: a flat one is the one whose value is neither a mapping nor empty."""
    if key not in MOVED or (key in SECTIONS and (value is None or isinstance(value, dict))):
        return None
    return MOVED[key]


def _moved_error(key: str, where: str) -> InputError:
    """`key` (flat, or dotted below a flat mapping: `pack.budget`) is a key of the pre-sectioned format."""
    head, dot, rest = key.partition(".")
    return InputError(f"{_cut(key)}: moved to {_cut(MOVED[head] + dot + rest)} (a flat key of the pre-sectioned "
                      f"format; keys are grouped by section: {', '.join(SECTIONS)})", path=where)


def _field_path(loc: Sequence[Any]) -> tuple[list[str], FieldInfo | None]:
    """The longest prefix of a pydantic error location that names a key (or a section), and its field."""
    cls: Any = TrainConfig
    path: list[str] = []
    field = None
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            break
        path.append(str(part))
        field = cls.model_fields[part]
        cls = _base(_inner(field.annotation))
    return path, field


def _lookup(d: Any, path: Sequence[str]) -> Any:
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _one_line(err: ValidationError, d: dict[str, Any], sources: Sources) -> InputError:
    """pydantic's first error as one line naming the dotted key and where it came from."""
    e = err.errors()[0]
    loc = [str(p) for p in e["loc"]]
    path, field = _field_path(loc)
    if e["type"] == "extra_forbidden":
        dotted, parent = ".".join(loc), ".".join(loc[:-1])
        known = SECTIONS if not parent else _base(_inner(_field_path(loc[:-1])[1].annotation)).model_fields
        return InputError(f"unknown key {excerpt(dotted)} (known{' in ' + parent if parent else ' sections'}: "
                          f"{', '.join(known)})", path=sources.where(dotted))
    dotted = ".".join(path)
    if e["type"] == "missing":  # named at its section, where the file gives one
        return InputError(f"missing required key {dotted!r} ({field.description})", path=sources.where(path[0]))
    what = f" ({field.description})" if field is not None and field.description else ""
    got = _lookup(d, path)
    yaml11 = isinstance(got, str) and got.lower() in ("yes", "no", "on", "off")  # read as strings: anchor_core.yamlfile
    hint = " (YAML 1.1's yes/no/on/off are strings here)" if yaml11 and field is not None and \
        expected(field) == "true or false" else ""
    return InputError(f"{dotted}: expected {expected(field) if field else 'a mapping'}{what}, got "
                      f"{excerpt(got)}{hint}", path=sources.where(dotted))


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
    for key, value in d.items():
        if _moved(key, value) is not None:
            raise _moved_error(key, sources.where(key))
    # every section present (an empty one, `optim:` alone, is None in YAML), so a missing required key is
    # named by its dotted path
    d = {**{s: {} for s in SECTIONS}, **{k: {} if k in SECTIONS and v is None else v for k, v in d.items()}}
    try:
        cfg = TrainConfig.model_validate(d)
    except ValidationError as e:
        raise _one_line(e, d, sources) from None
    cfg._source = source
    cfg._sources = sources
    _check_nested(cfg, sources)
    # across keys: the batch arithmetic that needs no world size (under torchrun the launcher's
    # world replaces `parallel.nproc`: check_world)
    if cfg.model.tiled_mlp and cfg.parallel.zero_stage == 3:
        # a tile's recomputation in the backward runs the MLP outside its module's call, where ZeRO-3 gathers
        # the partitioned weights
        raise InputError("model.tiled_mlp needs parallel.zero_stage 0 to 2 (ZeRO-3 partitions the MLP's weights "
                         "outside its forward)", path=cfg.where("model.tiled_mlp", "parallel.zero_stage"))
    if cfg.model.offload_checkpoints and not cfg.model.activation_checkpointing:
        raise InputError("model.offload_checkpoints needs model.activation_checkpointing: true (it moves the "
                         "checkpoints, the layer inputs, to host memory)",
                         path=cfg.where("model.offload_checkpoints", "model.activation_checkpointing"))
    if cfg.data.global_batch % cfg.data.micro_batch:
        raise InputError(f"data.global_batch {cfg.data.global_batch} is not a multiple of data.micro_batch "
                         f"{cfg.data.micro_batch}", path=cfg.where("data.global_batch", "data.micro_batch"))
    return cfg


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
    """The config fits a world of `world` processes: SP divides it, the global batch splits over it."""
    sp, mb, gb = cfg.parallel.sequence_parallel, cfg.data.micro_batch, cfg.data.global_batch
    if world < sp:
        raise InputError(f"parallel.sequence_parallel {sp} needs at least {sp} processes, this run has {world} "
                         f"(set parallel.nproc, or launch more ranks)",
                         path=cfg.where("parallel.sequence_parallel", "parallel.nproc"))
    if world % sp:
        raise InputError(f"{world} processes do not split into sequence-parallel groups of {sp}",
                         path=cfg.where("parallel.nproc", "parallel.sequence_parallel"))
    dp = world // sp
    if gb % (mb * dp):
        raise InputError(f"data.global_batch {gb} does not split into data.micro_batch {mb} x {dp} data-parallel "
                         f"ranks", path=cfg.where("data.global_batch", "data.micro_batch", "parallel.nproc",
                                                   "parallel.sequence_parallel"))


def from_flat(d: dict[str, Any], *, source: str = "config") -> dict[str, Any]:
    """A config of the pre-sectioned format (flat keys) as sections, through MOVED; an unknown flat key
    is one line naming it."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key not in MOVED:
            raise InputError(f"unknown key {excerpt(key)} in a config of the pre-sectioned format (known: "
                             f"{', '.join(MOVED)})", path=source)
        _set_dotted(out, MOVED[key], value)
    return out


def is_flat(d: Any) -> bool:
    """A mapping of the pre-sectioned format: some top-level key is a flat one."""
    return isinstance(d, dict) and any(_moved(k, v) is not None for k, v in d.items())


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
        origin = f"command-line override {_cut(item)}"
        # read as a file is (anchor_core.yamlfile: bounded, YAML 1.2's booleans); not YAML: the text itself
        value = parse_yaml(text, where=origin, text_if_invalid=True) if text.strip() else None
        parts = key.split(".")
        if len(parts) == 1 and _moved(key, value) is not None or len(parts) > 1 and parts[0] in MOVED \
                and parts[0] not in SECTIONS:
            raise _moved_error(key, origin)
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
        _merge(updates, _nest(parts, value))
    return updates, origins


def _leaves(key: str, value: Any, text: str) -> list[tuple[str, str]]:
    """The dotted keys an override `key=value` sets, each with its value as text: a mapping value merges into
    the config key by key (`optim={lr: 1e-5}` sets `optim.lr`), any other value sets `key` itself."""
    if not isinstance(value, dict):
        return [(key, _cut(text) or "null")]
    out: list[tuple[str, str]] = []
    for k, v in value.items():
        shown = " ".join(yaml.safe_dump(v, default_flow_style=True).split()).removesuffix(" ...")  # a scalar's "..."
        out += _leaves(f"{key}.{k}", v, _cut(shown))
    return out


def _cut(text: str) -> str:
    """Text of the command line as an error names it: at most EXCERPT characters (anchor_core.limits.excerpt)."""
    return text if len(text) <= EXCERPT else text[:EXCERPT - 3] + "..."


def _nest(parts: Sequence[str], value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _set_dotted(out, ".".join(parts), value)
    return out


def _merge(base: dict[str, Any], updates: Mapping[str, Any]) -> None:
    """`updates` into `base`: mappings merge key by key, any other value replaces."""
    for k, v in updates.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = dict(base[k])
            _merge(base[k], v)
        else:
            base[k] = v


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML, or a shipped config's name: `tiny`, `paper/<name>`; None: only the overrides), apply
    `key=value` overrides, validate. A key the file gives twice is an InputError naming it, both values and
    their lines (anchor_core.yamlfile); so is a key two overrides set."""
    path = None if path is None else resolve("train", path)
    base, lines = ({}, {}) if path is None else read_yaml_mapping_lines(path, what="train config")
    source = "command line" if path is None else str(path)
    for key, value in base.items():  # a flat file: named before an override can mask it
        if _moved(key, value) is not None:
            raise _moved_error(key, f"{source}:{lines[key]}" if key in lines else source)
    updates, origins = parse_overrides(overrides)
    merged = dict(base)
    _merge(merged, updates)
    return validate(merged, source=source, origins=origins, lines=lines)
