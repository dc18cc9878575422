"""The typed schema of `anchor train` configs (CONTRACT §8): YAML is data, this module is the schema.

    cfg = load_train_config("configs/train/tiny.yaml", ["steps=4", "rope.theta=5e6"])
    cfg.steps, cfg.variant, cfg.rope["base"], cfg.grad_accum(dp=2)

Every key is declared once in `SCHEMA` with its type, default and meaning; an unknown key, a wrong
type or a value out of range is an InputError naming the key and the file (or the command-line
override) it came from. Nested mappings (`rope`, `pack`) have their own key lists. Overrides are
`key=value` with dotted keys for nested ones (`rope.theta=5e6`, `pack.budget=20000`); values are
read as YAML (`true`, `0.1`, `[0.9, 0.95]`).

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

from anchor.errors import InputError
from anchor.spec import RopeSpec
from anchor.variants import VARIANTS

SCHEDULES = ("constant", "cosine", "linear")
DTYPES = ("float32", "bfloat16")
# "auto" (torchtrain.engines.AUTO) and torchtrain.engines.ENGINES; this module does not import torch.
_ENGINES = ("auto", "eager", "sdpa", "flex", "flash_varlen", "flash_varlen_emulated", "varlen")
_SEED_MAX = 2**32 - 1  # numpy's SeedSequence range for one int


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


# Checkers return the normalised value or raise ValueError("expected …").
def _int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
    def check(x: Any) -> int:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"expected an integer{_range(lo, hi)}")
        if (lo is not None and x < lo) or (hi is not None and x > hi):
            raise ValueError(f"expected an integer{_range(lo, hi)}")
        return x

    return check


def _float(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> Callable[[Any], float]:
    def check(x: Any) -> float:
        v = _number(x)
        bad = v is None or not math.isfinite(v)
        if not bad and lo is not None:
            bad = v <= lo if open_lo else v < lo  # type: ignore[operator]
        if not bad and hi is not None:
            bad = v > hi  # type: ignore[operator]
        if bad:
            what = f" > {lo:g}" if open_lo else _range(lo, hi)
            raise ValueError(f"expected a number{what}")
        return float(v)  # type: ignore[arg-type]

    return check


def _range(lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return ""


def _choice(options: Sequence[str]) -> Callable[[Any], str]:
    def check(x: Any) -> str:
        if x not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return x

    return check


def _bool(x: Any) -> bool:
    if not isinstance(x, bool):
        raise ValueError("expected true or false")
    return x


def _str(x: Any) -> str:
    if not isinstance(x, str) or not x:
        raise ValueError("expected a non-empty string")
    return x


def _opt_str(x: Any) -> str | None:
    return None if x is None else _str(x)


def _betas(x: Any) -> tuple[float, float]:
    if not isinstance(x, (list, tuple)) or len(x) != 2:
        raise ValueError("expected two numbers [beta1, beta2] in [0, 1)")
    out = tuple(_number(b) for b in x)
    if any(b is None or not 0.0 <= b < 1.0 for b in out):
        raise ValueError("expected two numbers [beta1, beta2] in [0, 1)")
    return out  # type: ignore[return-value]


def _str_list(x: Any) -> tuple[str, ...]:
    if not isinstance(x, (list, tuple)) or not all(isinstance(s, str) and s for s in x):
        raise ValueError("expected a list of strings")
    return tuple(x)


# The `rope:` mapping: overrides of the model's RoPE (CONTRACT §3); names as in anchor.spec.RopeSpec,
# with the contract's spellings `theta` (= base) and `scaling` (= kind).
ROPE_SCHEMA: dict[str, tuple[Callable[[Any], Any], str]] = {
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

# The `pack:` mapping: how a corpus given as `data` is packed on the fly (the `anchor pack`
# options that are not top-level keys here).
PACK_KEYS = ("mixture", "budget", "long_threshold", "upsample_factor", "mean_chunk", "skip_bad", "text_field",
             "domain_field", "seed")


def _steps(x: Any) -> tuple[int, ...]:
    if not isinstance(x, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in x):
        raise ValueError("expected a list of step numbers >= 1")
    return tuple(x)


def _rope(x: Any) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ValueError(f"expected a mapping with keys among {', '.join(ROPE_SCHEMA)}")
    return x


def _pack(x: Any) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise ValueError(f"expected a mapping with keys among {', '.join(PACK_KEYS)}")
    return x


# key -> (checker, default, meaning). `...` marks a required key.
SCHEMA: dict[str, tuple[Callable[[Any], Any], Any, str]] = {
    "model": (_str, ..., "HF folder, .gguf file, default, or random:<preset>"),
    "data": (_str, ..., "an `anchor pack` output folder, a corpus (file or folder) packed on the fly, or `corpus` "
                        "(the embedded default corpus)"),
    "seq_len": (_int(2), None, "slots per window T (taken from a pack output when omitted)"),
    "variant": (_choice(VARIANTS), "anchor", "attention variant (CONTRACT §2)"),
    "tags": (_bool, False, "domain tags before each document (packing on the fly)"),
    "interleave": (_bool, False, "interleaved document chunks (packing on the fly)"),
    "mask_cross_doc_loss": (_bool, False, "full: also mask cross-document predictions"),
    "pack": (_pack, {}, "packing options for a corpus packed on the fly"),
    "steps": (_int(1), ..., "optimizer steps"),
    "global_batch": (_int(1), 8, "windows per optimizer step"),
    "micro_batch": (_int(1), 1, "windows per forward on one data-parallel rank"),
    "lr": (_float(0.0, open_lo=True), 2e-5, "peak learning rate"),
    "warmup_steps": (_int(0), 0, "linear warmup steps (from lr/warmup_steps)"),
    "schedule": (_choice(SCHEDULES), "constant", "after warmup: constant, cosine or linear decay"),
    "min_lr_ratio": (_float(0.0, 1.0), 0.0, "cosine/linear: the final learning rate as a fraction of lr"),
    "weight_decay": (_float(0.0), 0.1, "AdamW decoupled weight decay"),
    "no_decay": (_str_list, ("bias", "norm"), "parameters whose name contains one of these get no weight decay"),
    "betas": (_betas, (0.9, 0.95), "AdamW betas"),
    "eps": (_float(0.0, open_lo=True), 1e-8, "AdamW eps"),
    "grad_clip": (_float(0.0), 1.0, "clip the global gradient norm to this (0 = off)"),
    "dtype": (_choice(DTYPES), "float32", "float32, or bfloat16 mixed precision (fp32 master weights)"),
    "engine": (_choice(_ENGINES), "auto", "attention engine; auto: flash_varlen on CUDA with flash-attn (bf16), "
                                          "else varlen (memory linear in T; RUN/config.yaml records which ran). "
                                          "eager and sdpa hold a dense T x T mask"),
    "zero_stage": (_int(0, 3), 0, "DeepSpeed ZeRO stage"),
    "sequence_parallel": (_int(1), 1, "Ulysses sequence-parallel degree"),
    "nproc": (_int(1), 1, "processes started on this machine (1 = this process)"),
    "seed": (_int(0, _SEED_MAX), 0, "seed of the data order and of random:<preset> weights"),
    "save_every": (_int(0), 0, "checkpoint every this many steps (0: only the final and the evaluation ones)"),
    "keep_last": (_int(0), 2, "regular checkpoints kept (0: all); evaluation checkpoints are always kept"),
    "eval_every": (_int(1), 10, "evaluation checkpoints: every this many steps ..."),
    "eval_window": (_int(0), 50, "... over the last this many steps (the paper: every 10 over the last 50)"),
    "activation_checkpointing": (_bool, False, "recompute layer activations in the backward"),
    "rope": (_rope, {}, "RoPE overrides: theta, scaling, factor, original_max_position, ..."),
    "dump_grads": (_steps, (), "steps whose whole averaged gradient (before clipping) is written to "
                                 "RUN/grads/step-N.safetensors"),
    "log_every": (_int(1), 1, "print a progress line every this many steps"),
    "tensorboard": (_bool, True, "write TensorBoard events under RUN/tensorboard when installed"),
}

# Keys that may change when a run is resumed (the rest must equal the run's config.yaml).
RESUMABLE_CHANGES = ("steps", "save_every", "keep_last", "log_every", "tensorboard", "nproc", "dump_grads")


@dataclass(frozen=True)
class TrainConfig:
    """A validated `anchor train` config; fields as in SCHEMA (nested mappings as dicts)."""

    model: str
    data: str
    steps: int
    seq_len: int | None = None
    variant: str = "anchor"
    tags: bool = False
    interleave: bool = False
    mask_cross_doc_loss: bool = False
    pack: dict[str, Any] = field(default_factory=dict)
    global_batch: int = 8
    micro_batch: int = 1
    lr: float = 2e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("bias", "norm")
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "float32"
    engine: str = "auto"
    zero_stage: int = 0
    sequence_parallel: int = 1
    nproc: int = 1
    seed: int = 0
    save_every: int = 0
    keep_last: int = 2
    eval_every: int = 10
    eval_window: int = 50
    activation_checkpointing: bool = False
    rope: dict[str, Any] = field(default_factory=dict)
    dump_grads: tuple[int, ...] = ()
    log_every: int = 1
    tensorboard: bool = True
    source: str = field(default="config", compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-able data (the run's config.yaml)."""
        d = {k: getattr(self, k) for k in SCHEMA}
        d["betas"], d["no_decay"], d["dump_grads"] = list(self.betas), list(self.no_decay), list(self.dump_grads)
        return d

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


def _where(source: str, key: str) -> str:
    return f"{source}: {key}"


def validate(d: Any, *, source: str = "config", origins: dict[str, str] | None = None) -> TrainConfig:
    """Check a mapping against SCHEMA and build a TrainConfig.

    Args:
      d: the mapping (YAML with overrides applied).
      source: the config file, named in errors.
      origins: key -> where its value came from (e.g. "command-line override lr=abc"), for errors.
    """
    origins = origins or {}
    if not isinstance(d, dict):
        raise InputError("a train config must be a mapping of keys to values", path=source)
    out: dict[str, Any] = {}
    for key, value in d.items():
        where = origins.get(str(key), source)
        if key not in SCHEMA:
            raise InputError(f"unknown key {key!r} (known: {', '.join(SCHEMA)})", path=where)
        check, _, what = SCHEMA[key]
        try:
            out[key] = check(value)
        except ValueError as e:
            raise InputError(f"{key}: {e} ({what}), got {value!r}", path=where) from None
    for key, (_, default, _what) in SCHEMA.items():
        if default is ... and key not in out:
            raise InputError(f"missing required key {key!r} ({SCHEMA[key][2]})", path=source)
    rope = {}
    for key, value in out.get("rope", {}).items():
        where = origins.get(f"rope.{key}", source)
        if key not in ROPE_SCHEMA:
            raise InputError(f"unknown key 'rope.{key}' (known: {', '.join(ROPE_SCHEMA)})", path=where)
        try:
            rope[key] = ROPE_SCHEMA[key][0](value)
        except ValueError as e:
            raise InputError(f"rope.{key}: {e}, got {value!r}", path=where) from None
    if rope:
        out["rope"] = rope
        try:  # the combination must make a RoPE (e.g. yarn needs original_max_position)
            RopeSpec(**{"base": 10000.0, **{_ROPE_FIELD.get(k, k): v for k, v in rope.items()}})
        except InputError as e:
            raise InputError(f"rope: {e}", path=source) from None
    if "pack" in out:
        from anchor.data.config import validate_pack_config

        bad = [k for k in out["pack"] if k not in PACK_KEYS]
        if bad:
            raise InputError(f"unknown key 'pack.{bad[0]}' (known: {', '.join(PACK_KEYS)})",
                             path=origins.get(f"pack.{bad[0]}", source))
        out["pack"] = validate_pack_config(out["pack"], source=f"{source}: pack")
    cfg = TrainConfig(**out, source=source)
    _check_batch(cfg)
    return cfg


def _check_batch(cfg: TrainConfig) -> None:
    """Batch arithmetic that needs neither the world size nor a model (`check_world` does the rest:
    under torchrun the launcher's world replaces `nproc`)."""
    src = cfg.source
    if cfg.global_batch % cfg.micro_batch:
        raise InputError(f"global_batch {cfg.global_batch} is not a multiple of micro_batch {cfg.micro_batch}",
                         path=src)


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
        if len(parts) > 2 or parts[0] not in SCHEMA or (len(parts) == 2 and parts[0] not in ("rope", "pack")):
            raise InputError(f"override {item!r}: unknown key {key!r} (known: {', '.join(SCHEMA)}; "
                             "nested: rope.<key>, pack.<key>)")
        origin = f"command-line override {item}"
        if len(parts) == 2:
            updates.setdefault(parts[0], {})[parts[1]] = value
        else:
            updates[key] = value
        origins[key] = origin
    return updates, origins


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; unreadable, non-UTF-8 or malformed files are one-line InputErrors."""
    import yaml

    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=path) from None
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start})", path=path) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError(f"invalid YAML: {' '.join(str(e).split())}", path=path) from None


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read `path` (YAML; None: only the overrides), apply `key=value` overrides, validate."""
    base = {} if path is None else read_yaml(path)
    source = "command line" if path is None else str(path)
    if base is None:
        base = {}
    if not isinstance(base, dict):
        raise InputError("a train config must be a mapping of keys to values", path=source)
    updates, origins = parse_overrides(overrides)
    merged = dict(base)
    for key, value in updates.items():
        if key in ("rope", "pack") and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return validate(merged, source=source, origins=origins)
