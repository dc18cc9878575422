"""The DeepSpeed JSON of a run (docs/DESIGN.md §8): the keys the trainer sets from the config (`generated`), the
config key that sets each (`SET_BY`), and the `deepspeed:` section deep-merged over them (`deepspeed_config`).

    deepspeed_config(cfg, world)   # what deepspeed.initialize gets and RUN/deepspeed.json records
    check_section(cfg)             # at validation: the `deepspeed:` section, refused in one line where it must be

A key of `deepspeed:` that the trainer sets (or an alias of one, or a mapping or value over one) is refused naming
the config key that sets it. The rest is checked by DeepSpeed's own validation before any work: its pydantic
models forbid unknown keys below `zero_optimization`, `comms_logger`, ...; a top-level key DeepSpeed never
reads (it would ignore it silently) is refused too, as is any other error DeepSpeed raises on the merged config.
"""

from __future__ import annotations

import collections.abc
import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Iterator

import torch

from anchor_core.errors import InputError
from anchor_core.limits import clip, excerpt
from anchor_core.weights import load_spec
from torchtrain.config.keys import dotted_items, merge

if TYPE_CHECKING:
    from torchtrain.config.schema import TrainConfig

# DeepSpeed key (dotted) -> what sets it. A key is set with everything below it; a value or mapping given over one
# of these (`zero_optimization: 1`, `bf16: {}`) is refused as well. Aliases DeepSpeed reads for the same setting are
# listed: they would bypass the trainer's value. `generated` sets nothing outside this table (tested).
SET_BY: dict[str, str] = {
    "train_batch_size": "data.global_batch",
    "train_micro_batch_size_per_gpu": "data.micro_batch",
    "gradient_accumulation_steps": "data.global_batch and data.micro_batch (per process count)",
    "gradient_clipping": "optim.grad_clip",
    "optimizer": "the optim section (the trainer's AdamW)",
    "scheduler": "the schedule section",
    "bf16": "model.dtype",
    "bfloat16": "model.dtype",
    "fp16": "model.dtype",
    "torch_autocast": "model.dtype",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_optimizer.pin_memory": "parallel.offload_optimizer",
    "zero_optimization.offload_param.device": "parallel.offload_params",
    "zero_optimization.offload_param.pin_memory": "parallel.offload_params",
    "zero_optimization.cpu_offload": "parallel.offload_optimizer",
    "zero_optimization.cpu_offload_param": "parallel.offload_params",
    "zero_optimization.cpu_offload_use_pin_memory": "parallel.offload_optimizer and parallel.offload_params",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "the trainer (its checkpoints gather the weights)",
    "zero_optimization.gather_16bit_weights_on_model_save": "the trainer (its checkpoints gather the weights)",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "the trainer (its checkpoints gather the weights)",
    "zero_allow_untested_optimizer": "the trainer (its own AdamW)",
    "zero_force_ds_cpu_optimizer": "parallel.offload_optimizer (DeepSpeed's CPU Adam)",
    "sequence_parallel_size": "parallel.sequence_parallel",
    "steps_per_print": "logging.every",
    "wall_clock_breakdown": "the trainer (metrics.jsonl times each step)",
    "checkpoint.load_universal": "the trainer (a resume with another parallel.nproc: torchtrain.training.universal)",
}

# DeepSpeed keys the trainer sizes from the model as transformers' Trainer fills DeepSpeed's "auto" values
# (integrations/deepspeed.py: hidden_size², 0.9 hidden_size², 10 hidden_size); a `deepspeed:` value wins. DeepSpeed's
# own defaults (5e8 elements) make ZeRO-3 hold a 1 GB bf16 reduce buffer per rank whatever the model's size, more
# than a 0.5B model's whole share of weights on 2 ranks (results/memory/sharded_build_cpu.json).
SIZED_BY_MODEL = ("zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
                  "zero_optimization.stage3_prefetch_bucket_size",
                  "zero_optimization.stage3_param_persistence_threshold")


def quiet_deepspeed_import() -> None:
    """Without CUDA, name DeepSpeed's accelerator (`cpu`, what its auto-detection picks) before it is
    imported: its auto-detection prints a WARNING in every process ("Setting accelerator to CPU. If you have
    GPU ..."), twice on every 2-process run, and nothing else differs."""
    if "deepspeed" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def bucket_sizes(hidden_size: int, zero_stage: int) -> dict[str, int]:
    """The `SIZED_BY_MODEL` keys of a ZeRO stage for a model of this hidden size (elements)."""
    if zero_stage == 0:
        return {}
    square = hidden_size * hidden_size
    if zero_stage < 3:
        return {"reduce_bucket_size": square, "allgather_bucket_size": square}
    return {"reduce_bucket_size": square, "stage3_prefetch_bucket_size": int(0.9 * square),
            "stage3_param_persistence_threshold": 10 * hidden_size}


# DeepSpeed's own reduce bucket (elements), which `check_offload_buckets` holds the model's parameters against.
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def offload_sized(cfg: TrainConfig) -> bool:
    """ZeRO-3 with the optimizer offloaded: where micro-steps accumulate, DeepSpeed's own bucket sizes are kept (its
    CPU-offload path accumulates gradients correctly only where one reduce bucket holds them all:
    `check_offload_buckets`); without accumulation the model's sizes serve, and the results match."""
    return cfg.parallel.zero_stage == 3 and cfg.parallel.offload_optimizer


def check_offload_buckets(cfg: TrainConfig, world: int, parameters: int) -> None:
    """Measured with DeepSpeed 0.19.8: at ZeRO-3 with the optimizer offloaded and more than one micro-step per
    optimizer step, the losses leave those of the same run without offload from the second step on (by 1-5% on
    random:llama at 2 processes) whenever the gradients span more than one reduce bucket, and match them (1e-7) when
    one bucket holds them all or nothing accumulates. Such a run is refused in one line, with the two ways out."""
    if not offload_sized(cfg) or cfg.grad_accum(world) <= 1:
        return
    zero = cfg.deepspeed.given().get("zero_optimization", {})
    bucket = int(zero.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET))
    if parameters > bucket:
        raise InputError(f"parallel.offload_optimizer at ZeRO-3 with gradient accumulation ({cfg.grad_accum(world)} "
                         f"micro-steps) needs DeepSpeed's reduce bucket to hold every gradient: {parameters:,} "
                         f"parameters > reduce_bucket_size {bucket:,} (DeepSpeed's ZeRO-3 offload accumulates "
                         "gradients wrongly across buckets); set deepspeed.zero_optimization.reduce_bucket_size to "
                         "at least the parameter count, or data.micro_batch so that nothing accumulates",
                         path=cfg.where("parallel.offload_optimizer"))


def _hidden_size(cfg: TrainConfig) -> int | None:
    """The model's hidden size, or None where `model.name` names nothing readable yet (a config validated before
    its model exists: the run itself refuses it)."""
    try:
        return load_spec(cfg.model.name).hidden_size
    except (InputError, OSError, ValueError):
        return None


def generated(cfg: TrainConfig, world: int | None) -> dict[str, Any]:
    """The keys the trainer sets for a run of `world` processes (None: the batch totals left to DeepSpeed, which
    derives them from the micro batch and its own world: what `check_section` validates in any process).

    DeepSpeed's data-parallel world is every rank (see torchtrain.parallel.distributed), so its batch is counted in
    per-rank slices: `train_batch_size = micro_batch * grad_accum * world`. Clipping is always explicit
    (DeepSpeed's default is 1.0, not off). Offload moves to host memory (`device: cpu`), pinned where CUDA runs.
    The communication buckets are sized from the model (`SIZED_BY_MODEL`).
    """
    zero: dict[str, Any] = {"stage": cfg.parallel.zero_stage}
    hidden = _hidden_size(cfg)
    if hidden is not None and not (offload_sized(cfg) and (world is None or cfg.grad_accum(world) > 1)):
        zero.update(bucket_sizes(hidden, cfg.parallel.zero_stage))
    if cfg.parallel.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if cfg.parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.parallel.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    batch: dict[str, Any] = {} if world is None else {
        "train_batch_size": cfg.data.micro_batch * cfg.grad_accum(world) * world,
        "gradient_accumulation_steps": cfg.grad_accum(world)}
    return {
        **batch,
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def deepspeed_config(cfg: TrainConfig, world: int | None) -> dict[str, Any]:
    """`generated` with the `deepspeed:` section deep-merged over it (mappings key by key, other values replace)."""
    return merge(generated(cfg, world), cfg.deepspeed.given())


def check_section(cfg: TrainConfig) -> None:
    """The `deepspeed:` section sets no key the trainer sets, and DeepSpeed accepts it merged over the trainer's keys;
    else an InputError naming the dotted key (`deepspeed.zero_optimization.stage`) and where it was given."""
    given = cfg.deepspeed.given()
    if not given:
        return
    for dotted, value in dotted_items(given, "deepspeed", string_keys="DeepSpeed"):
        owner = _set_by(dotted.removeprefix("deepspeed."), value)
        if owner is not None:
            key, by = owner
            shown = f"deepspeed.{key}" + ("" if dotted == f"deepspeed.{key}" else f" (given as {dotted})")
            raise InputError(f"{shown}: set by {by}; give that key instead", path=cfg.where(dotted))
    zero = given.get("zero_optimization", {})
    offloads = (("offload_optimizer", "parallel.offload_optimizer"), ("offload_param", "parallel.offload_params"))
    for ds_key, key in offloads:
        if ds_key in zero and not getattr(cfg.parallel, key.split(".")[1]):  # it would tune an offload that is off
            dotted = f"deepspeed.zero_optimization.{ds_key}"
            raise InputError(f"{dotted} needs {key}: true (it tunes that offload)", path=cfg.where(dotted, key))
    base = generated(cfg, None)
    for key in given:  # one top-level key at a time: DeepSpeed's errors do not say under which key they arose
        read = _validate(merge(base, {key: given[key]}), f"deepspeed.{key}", cfg)
        if key not in read:
            raise InputError(f"deepspeed.{key}: not a key DeepSpeed {_version()} reads (it would ignore it)",
                             path=cfg.where(f"deepspeed.{key}"))
    _validate(merge(base, given), "deepspeed", cfg)  # the keys together


def _set_by(key: str, value: Any) -> tuple[str, str] | None:
    """The trainer's key that `key` (dotted below `deepspeed`) sets or replaces, and what sets it; None if neither."""
    for owned, by in SET_BY.items():
        if key == owned or key.startswith(owned + "."):
            return owned, by
        if owned.startswith(key + ".") and not isinstance(value, dict):  # a value in place of the mapping above it
            return owned, by
    return None


def _validate(ds: dict[str, Any], named: str, cfg: TrainConfig) -> set[str]:
    """DeepSpeed's own validation of the JSON `ds` (deepspeed.runtime.config.DeepSpeedConfig); its first error as one
    InputError naming `named` (and, for a pydantic error, the key below it). Returns the top-level keys it read."""
    from pydantic import ValidationError

    config = _deepspeed_config_class()
    read: set[str] = set()
    try:
        with _quiet():
            config(_Reads(ds, read))
    except ValidationError as e:
        err = e.errors()[0]
        dotted = ".".join([named, *map(str, err["loc"])])
        what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        got = "" if err["type"] == "extra_forbidden" else f", got {excerpt(err.get('input'))}"
        raise InputError(f"{dotted}: refused by DeepSpeed {_version()} ({e.title}): {what}{got}",
                         path=cfg.where(dotted)) from None
    except Exception as e:  # DeepSpeed's asserts and config errors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"{named}: refused by DeepSpeed {_version()}: {clip(first, 300)}",
                         path=cfg.where(named)) from None
    return read


class _Reads(dict):
    """A dict that records which of its keys were looked up: DeepSpeedConfig reads the top-level keys it knows and
    ignores any other. Shared by DeepSpeed's shallow copies of it (`read` is an attribute, copied by reference)."""

    def __init__(self, d: dict[str, Any], read: set[str]):
        super().__init__(d)
        self.read = read

    def __getitem__(self, k: Any) -> Any:
        self.read.add(k)
        return super().__getitem__(k)

    def __contains__(self, k: Any) -> bool:
        self.read.add(k)
        return super().__contains__(k)

    def get(self, k: Any, default: Any = None) -> Any:
        self.read.add(k)
        return super().get(k, default)

    def keys(self) -> collections.abc.KeysView:  # type: ignore[override]  # `k in d.keys()` is a lookup too
        return collections.abc.KeysView(self)


def _deepspeed_config_class() -> Any:
    quiet_deepspeed_import()
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's INFO lines (its world size, each config's values) left out while the section is checked."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _version() -> str:
    import deepspeed

    return deepspeed.__version__

