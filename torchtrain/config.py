"""The typed schema of `anchor train` configs (docs/DESIGN.md §8): YAML is data, this module is the schema.

    cfg = load_train_config("configs/train/tiny.yaml", ["steps=4", "rope.theta=5e6"])
    cfg.steps, cfg.variant, cfg.rope["base"], cfg.grad_accum(dp=2)

Every key is declared once, as a field of `TrainConfig` made by `key(default, check, doc)`: its type
(the annotation), its default (or REQUIRED), what it accepts (a `Check`: type and range or choices)
and its one-line meaning. Everything else is derived from those declarations: `SCHEMA`, the
unknown-key, type and range errors of `validate` (the one validation function), the keys a resumed
run may change (`RESUMABLE_CHANGES`), the `pack:` keys (`PACK_KEYS`), `to_dict` and the key list in
`TrainConfig.__doc__` (`describe_keys`). `check_declarations` refuses, at import, a field declared
without `key`.

An unknown key, a wrong type or a value out of range is an InputError naming the key and the file
(or the command-line override) it came from. Nested mappings (`rope`, `pack`) have their own key
lists. Overrides are `key=value` with dotted keys for nested ones (`rope.theta=5e6`,
`pack.budget=20000`); values are read as YAML (`true`, `0.1`, `[0.9, 0.95]`).

Batch arithmetic: `global_batch` windows per optimizer step = `micro_batch` windows per forward
on each data-parallel rank × `grad_accum` micro-steps × `dp` data-parallel ranks, with
`dp = world / sequence_parallel`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from anchor.data.config import PACK_SCHEMA, check_pack_options, validate_pack_config
from anchor.engines import TRAIN_ENGINES
from anchor.errors import InputError
from anchor.limits import SEED_MAX
from anchor.spec import RopeSpec
from anchor.variants import VARIANTS
from anchor.yamlfile import read_yaml_mapping

SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("float32", "bfloat16")
REQUIRED = ...  # the default of a key every config must give

# ---------------------------------------------------------------------------------------------
# Checks: what a key accepts


class Check:
    """What a key accepts: `check(x)` is the value as stored, or ValueError("expected <expected>").

    expected: the accepted values in words ("an integer >= 1"), quoted by errors and the
      documentation; a function of no arguments where it names a list made later (PACK_KEYS).
    convert: x -> the value as stored, or `Check.BAD`.
    """

    BAD = object()

    def __init__(self, expected: str | Callable[[], str], convert: Callable[[Any], Any]):
        self._expected = expected
        self.convert = convert

    @property
    def expected(self) -> str:
        return self._expected() if callable(self._expected) else self._expected

    def __call__(self, x: Any) -> Any:
        v = self.convert(x)
        if v is Check.BAD:
            raise ValueError(f"expected {self.expected}")
        return v

    def __repr__(self) -> str:
        return f"Check({self.expected!r})"


def _number(x: Any) -> float | None:
    """A YAML number, also `5e6` (PyYAML reads exponents without a dot as strings)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def _range(lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return ""


def _int(lo: int | None = None, hi: int | None = None) -> Check:
    def convert(x: Any) -> Any:
        if isinstance(x, bool) or not isinstance(x, int):
            return Check.BAD
        return Check.BAD if (lo is not None and x < lo) or (hi is not None and x > hi) else x

    return Check(f"an integer{_range(lo, hi)}", convert)


def _float(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> Check:
    def convert(x: Any) -> Any:
        v = _number(x)
        bad = v is None or not math.isfinite(v)
        if not bad and lo is not None:
            bad = v <= lo if open_lo else v < lo  # type: ignore[operator]
        if not bad and hi is not None:
            bad = v > hi  # type: ignore[operator]
        return Check.BAD if bad else float(v)  # type: ignore[arg-type]

    return Check(f"a number{f' > {lo:g}' if open_lo else _range(lo, hi)}", convert)


def _choice(options: Sequence[str]) -> Check:
    return Check(f"one of {', '.join(options)}", lambda x: x if x in options else Check.BAD)


def _betas_convert(x: Any) -> Any:
    if not isinstance(x, (list, tuple)) or len(x) != 2:
        return Check.BAD
    out = tuple(_number(b) for b in x)
    return Check.BAD if any(b is None or not 0.0 <= b < 1.0 for b in out) else out


def _mapping(keys: Callable[[], Sequence[str]]) -> Check:
    return Check(lambda: f"a mapping with keys among {', '.join(keys())}",
                 lambda x: x if isinstance(x, dict) else Check.BAD)


_BOOL = Check("true or false", lambda x: x if isinstance(x, bool) else Check.BAD)
_STR = Check("a non-empty string", lambda x: x if isinstance(x, str) and x else Check.BAD)
_BETAS = Check("two numbers [beta1, beta2] in [0, 1)", _betas_convert)
_STR_LIST = Check("a list of strings", lambda x: tuple(x) if isinstance(x, (list, tuple)) and all(
    isinstance(s, str) and s for s in x) else Check.BAD)
_STEPS = Check("a list of step numbers >= 1", lambda x: tuple(x) if isinstance(x, (list, tuple)) and not any(
    isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in x) else Check.BAD)

# The `rope:` mapping: overrides of the model's RoPE (docs/DESIGN.md §3); names as in anchor.spec.RopeSpec,
# with the contract's spellings `theta` (= base) and `scaling` (= kind).
ROPE_SCHEMA: dict[str, tuple[Check, str]] = {
    "theta": (_float(1.0, open_lo=True), "RoPE base (the paper: 1e6 at 32K, 5e6 at 64K, 1e7 at 128K, 5e7 at 256K)"),
    "scaling": (_choice(("default", "linear", "dynamic", "yarn", "llama3", "ntk")), "scaling kind"),
    "factor": (_float(1.0), "scaling factor"),
    "original_max_position": (_int(1), "pre-training length (dynamic, yarn, llama3)"),
    "low_freq_factor": (_float(0.0, open_lo=True), "llama3"),
    "high_freq_factor": (_float(0.0, open_lo=True), "llama3"),
    "beta_fast": (_float(0.0, open_lo=True), "yarn"),
    "beta_slow": (_float(0.0, open_lo=True), "yarn"),
    "attention_factor": (_float(0.0, open_lo=True), "yarn: overrides 0.1 ln(factor) + 1"),
}
_ROPE_FIELD = {"theta": "base", "scaling": "kind"}

# ---------------------------------------------------------------------------------------------
# The keys


def key(default: Any, check: Check, doc: str, *, resumable: bool = False, pack_option: bool = False) -> Any:
    """Declare a config key: a `TrainConfig` field carrying what the schema needs in its metadata.

    default: the value when the config omits the key, or REQUIRED; a dict is copied per config.
      A required key is a positional argument of `TrainConfig(...)`, the others keyword-only.
    check: what the key accepts (type and range or choices), e.g. `_int(0, 3)`.
    doc: its one-line meaning, quoted by errors and the documentation.
    resumable: a resumed run may change it (the other keys must equal the run's config.yaml).
    pack_option: it is also the `anchor pack` option of that name (anchor.data.config.PACK_SCHEMA),
      given at the top level, so `pack:` does not take it.
    """
    meta = {"key": True, "check": check, "doc": doc, "resumable": resumable, "pack_option": pack_option}
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), kw_only=True, metadata=meta)
    return field(default=default, kw_only=True, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    """A validated `anchor train` config; every field but `source` is a key (nested mappings as dicts).
    Keys, in the order errors list them and config.yaml is written:"""

    model: str = key(REQUIRED, _STR, "HF folder, .gguf file, default, or random:<preset>", pack_option=True)
    data: str = key(REQUIRED, _STR, "an `anchor pack` output folder, a corpus (file or folder) packed on the fly, "
                                    "or `corpus` (the embedded default corpus)", pack_option=True)
    seq_len: int | None = key(None, _int(2), "slots per window T (taken from a pack output when omitted)",
                              pack_option=True)
    variant: str = key("anchor", _choice(VARIANTS), "attention variant (docs/DESIGN.md §2)")
    tags: bool = key(False, _BOOL, "domain tags before each document (packing on the fly)", pack_option=True)
    interleave: bool = key(False, _BOOL, "interleaved document chunks (packing on the fly)", pack_option=True)
    mask_cross_doc_loss: bool = key(False, _BOOL, "full: also mask cross-document predictions")
    pack: dict[str, Any] = key({}, _mapping(lambda: PACK_KEYS), "packing options for a corpus packed on the fly")
    steps: int = key(REQUIRED, _int(1), "optimizer steps", resumable=True)
    global_batch: int = key(8, _int(1), "windows per optimizer step")
    micro_batch: int = key(1, _int(1), "windows per forward on one data-parallel rank")
    lr: float = key(2e-5, _float(0.0, open_lo=True), "peak learning rate")
    warmup_steps: int = key(0, _int(0), "linear warmup steps (from lr/warmup_steps)")
    schedule: str = key("constant", _choice(SCHEDULES), "after warmup: constant, cosine or linear decay")
    min_lr_ratio: float = key(0.0, _float(0.0, 1.0), "cosine/linear: the final learning rate as a fraction of lr")
    weight_decay: float = key(0.1, _float(0.0), "AdamW decoupled weight decay")
    no_decay: tuple[str, ...] = key(("bias", "norm"), _STR_LIST,
                                    "parameters whose name contains one of these get no weight decay")
    betas: tuple[float, float] = key((0.9, 0.95), _BETAS, "AdamW betas")
    eps: float = key(1e-8, _float(0.0, open_lo=True), "AdamW eps")
    grad_clip: float = key(1.0, _float(0.0), "clip the global gradient norm to this (0 = off)")
    dtype: str = key("float32", _choice(DTYPES), "float32, or bfloat16 mixed precision (fp32 master weights)")
    engine: str = key("auto", _choice(TRAIN_ENGINES), "attention engine; auto: flash_varlen on CUDA with flash-attn "
                      "(bf16), else varlen (memory linear in T; RUN/config.yaml records which ran). eager and sdpa "
                      "hold a dense T x T mask")
    zero_stage: int = key(0, _int(0, 3), "DeepSpeed ZeRO stage")
    sequence_parallel: int = key(1, _int(1), "Ulysses sequence-parallel degree")
    nproc: int = key(1, _int(1), "processes started on this machine (1 = this process)", resumable=True)
    seed: int = key(0, _int(0, SEED_MAX), "seed of the data order and of random:<preset> weights")
    save_every: int = key(0, _int(0), "checkpoint every this many steps (0: only the final and the evaluation ones)",
                          resumable=True)
    keep_last: int = key(2, _int(0), "regular checkpoints kept (0: all); evaluation checkpoints are always kept",
                         resumable=True)
    eval_every: int = key(10, _int(1), "evaluation checkpoints: every this many steps ...")
    eval_window: int = key(50, _int(0), "... over the last this many steps (the paper: every 10 over the last 50)")
    activation_checkpointing: bool = key(False, _BOOL, "recompute layer activations in the backward")
    rope: dict[str, Any] = key({}, _mapping(lambda: ROPE_SCHEMA),
                               "RoPE overrides: theta, scaling, factor, original_max_position, ...")
    dump_grads: tuple[int, ...] = key((), _STEPS, "steps whose whole averaged gradient (before clipping) is written "
                                      "to RUN/grads/step-N.safetensors", resumable=True)
    log_every: int = key(1, _int(1), "print a progress line every this many steps", resumable=True)
    tensorboard: bool = key(True, _BOOL, "write TensorBoard events under RUN/tensorboard when installed",
                            resumable=True)
    # not a key: where the config came from, named in errors
    source: str = field(default="config", compare=False, kw_only=True, metadata={"key": False})

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-able data (the run's config.yaml): every key, tuples as lists."""
        return {k: list(v) if isinstance(v, tuple) else v for k in SCHEMA for v in (getattr(self, k),)}

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def dp(self, world: int) -> int:
        """Data-parallel ranks of a world of `world` processes."""
        return world // self.sequence_parallel

    def grad_accum(self, world: int) -> int:
        """Micro-steps per optimizer step on each rank."""
        return self.global_batch // (self.micro_batch * self.dp(world))

    def rope_overrides(self) -> dict[str, Any]:
        """`rope:` as RopeSpec field names."""
        return {_ROPE_FIELD.get(k, k): v for k, v in self.rope.items()}

    def is_checkpoint_step(self, step: int) -> bool:
        """Steps that write a checkpoint: every `save_every`, the last, and the evaluation schedule."""
        return step == self.steps or (self.save_every > 0 and step % self.save_every == 0) or self.is_eval_step(step)

    def is_eval_step(self, step: int) -> bool:
        """The paper's evaluation schedule: every `eval_every` steps counted back from the last step,
        within the last `eval_window` steps (every 10 over the last 50: five checkpoints)."""
        return 0 < step <= self.steps and self.steps - step < self.eval_window and (self.steps - step) % self.eval_every == 0


def check_declarations(cls: type = TrainConfig) -> None:
    """Every field of `cls` is a key made by `key(...)` (a Check, a one-line doc, a default it accepts)
    or marked `{"key": False}`; else a TypeError naming the field. Run on TrainConfig at import."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("key") is False:
            continue
        if meta.get("key") is not True or not isinstance(meta.get("check"), Check) or not meta.get("doc"):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with torchtrain.config.key(default, check, doc): "
                            "a field that is not a key needs metadata={'key': False}")
        if not isinstance(meta["doc"], str) or "\n" in meta["doc"]:
            raise TypeError(f"{cls.__name__}.{f.name}: its doc must be one line of text")
        default = _default(f)
        if default is not REQUIRED and default is not None:
            try:
                ok = meta["check"](default) == default
            except ValueError:
                ok = False
            if not ok:
                raise TypeError(f"{cls.__name__}.{f.name}: its default {default!r} is not accepted by its check "
                                f"(expected {meta['check'].expected})")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


check_declarations(TrainConfig)

# Derived from the declarations
_KEYS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig) if f.metadata.get("key")}
# key -> (check, default, meaning); REQUIRED (`...`) marks a required key.
SCHEMA: dict[str, tuple[Check, Any, str]] = {
    name: (f.metadata["check"], _default(f), f.metadata["doc"]) for name, f in _KEYS.items()
}
# Keys that may change when a run is resumed (the rest must equal the run's config.yaml).
RESUMABLE_CHANGES: tuple[str, ...] = tuple(name for name, f in _KEYS.items() if f.metadata["resumable"])
# Mapping-valued keys: their own key lists, dotted overrides (`rope.theta=5e6`).
NESTED: tuple[str, ...] = tuple(name for name, (_, default, _doc) in SCHEMA.items() if isinstance(default, dict))
# The `pack:` mapping: how a corpus given as `data` is packed on the fly (the `anchor pack`
# options that are not top-level keys here).
PACK_KEYS: tuple[str, ...] = tuple(k for k in PACK_SCHEMA if not (k in _KEYS and _KEYS[k].metadata["pack_option"]))


def describe_keys() -> str:
    """Every key on a line: name (type; default; what it accepts): meaning."""
    lines = []
    for name, (check, default, doc) in SCHEMA.items():
        given = "required" if default is REQUIRED else f"default {default!r}"
        lines.append(f"  {name} ({_KEYS[name].type}; {given}; {check.expected}): {doc}")
    return "\n".join(lines)


TrainConfig.__doc__ = f"{TrainConfig.__doc__}\n\n{describe_keys()}\n"

# ---------------------------------------------------------------------------------------------
# Validation


def validate(d: Any, *, source: str = "config", origins: dict[str, str] | None = None) -> TrainConfig:
    """Check a mapping against the declared keys and build a TrainConfig: every check of a config
    that needs neither the world size nor a model (`check_world` and the trainer do the rest).

    Args:
      d: the mapping (YAML with overrides applied).
      source: the config file, named in errors.
      origins: key -> where its value came from (e.g. "command-line override lr=abc"), for errors.
    """
    origins = origins or {}
    if not isinstance(d, dict):
        raise InputError("a train config must be a mapping of keys to values", path=source)
    # each key: known, of its type, in its range
    out: dict[str, Any] = {}
    for key_, value in d.items():
        where = origins.get(str(key_), source)
        if key_ not in SCHEMA:
            raise InputError(f"unknown key {key_!r} (known: {', '.join(SCHEMA)})", path=where)
        check, _, what = SCHEMA[key_]
        try:
            out[key_] = check(value)
        except ValueError as e:
            raise InputError(f"{key_}: {e} ({what}), got {value!r}", path=where) from None
    for key_, (_, default, what) in SCHEMA.items():
        if default is REQUIRED and key_ not in out:
            raise InputError(f"missing required key {key_!r} ({what})", path=source)
    # the nested mappings
    rope = {}
    for key_, value in out.get("rope", {}).items():
        where = origins.get(f"rope.{key_}", source)
        if key_ not in ROPE_SCHEMA:
            raise InputError(f"unknown key 'rope.{key_}' (known: {', '.join(ROPE_SCHEMA)})", path=where)
        try:
            rope[key_] = ROPE_SCHEMA[key_][0](value)
        except ValueError as e:
            raise InputError(f"rope.{key_}: {e}, got {value!r}", path=where) from None
    if rope:
        out["rope"] = rope
        try:  # the combination must make a RoPE (e.g. yarn needs original_max_position)
            RopeSpec(**{"base": 10000.0, **{_ROPE_FIELD.get(k, k): v for k, v in rope.items()}})
        except InputError as e:
            raise InputError(f"rope: {e}", path=source) from None
    if "pack" in out:
        bad = [k for k in out["pack"] if k not in PACK_KEYS]
        if bad:
            raise InputError(f"unknown key 'pack.{bad[0]}' (known: {', '.join(PACK_KEYS)})",
                             path=origins.get(f"pack.{bad[0]}", source))
        out["pack"] = validate_pack_config(out["pack"], source=f"{source}: pack")
        try:  # ranges as `anchor pack` checks them, named as this config names them
            check_pack_options(out["pack"], names={k: f"pack.{k}" for k in PACK_SCHEMA})
        except InputError as e:
            raise InputError(str(e), path=source) from None
    cfg = TrainConfig(**out, source=source)
    # across keys: the batch arithmetic that needs no world size (under torchrun the launcher's
    # world replaces `nproc`: check_world)
    if cfg.global_batch % cfg.micro_batch:
        raise InputError(f"global_batch {cfg.global_batch} is not a multiple of micro_batch {cfg.micro_batch}",
                         path=source)
    return cfg


def check_world(cfg: TrainConfig, world: int) -> None:
    """The config fits a world of `world` processes: SP divides it, the global batch splits over it."""
    sp = cfg.sequence_parallel
    if world < sp:
        raise InputError(f"sequence_parallel {sp} needs at least {sp} processes, this run has {world} "
                         f"(set nproc, or launch more ranks)", path=cfg.source)
    if world % sp:
        raise InputError(f"{world} processes do not split into sequence-parallel groups of {sp}", path=cfg.source)
    dp = world // sp
    if cfg.global_batch % (cfg.micro_batch * dp):
        raise InputError(f"global_batch {cfg.global_batch} does not split into micro_batch {cfg.micro_batch} x "
                         f"{dp} data-parallel ranks", path=cfg.source)


def parse_overrides(items: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """`key=value` strings as a nested mapping, and the origin of each (dotted) key for errors."""
    import yaml

    updates: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"override {item!r} is not key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        parts = key.split(".")
        if len(parts) > 2 or parts[0] not in SCHEMA or (len(parts) == 2 and parts[0] not in NESTED):
            raise InputError(f"override {item!r}: unknown key {key!r} (known: {', '.join(SCHEMA)}; "
                             f"nested: {', '.join(f'{n}.<key>' for n in NESTED)})")
        origin = f"command-line override {item}"
        if len(parts) == 2:
            updates.setdefault(parts[0], {})[parts[1]] = value
        else:
            updates[key] = value
        origins[key] = origin
    return updates, origins


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML; None: only the overrides), apply `key=value` overrides, validate."""
    base = {} if path is None else read_yaml_mapping(path, what="train config")
    source = "command line" if path is None else str(path)
    updates, origins = parse_overrides(overrides)
    merged = dict(base)
    for key_, value in updates.items():
        if key_ in NESTED and isinstance(value, dict) and isinstance(merged.get(key_), dict):
            merged[key_] = {**merged[key_], **value}
        else:
            merged[key_] = value
    return validate(merged, source=source, origins=origins)
