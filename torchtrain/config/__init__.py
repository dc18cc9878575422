"""The typed config of `anchor train` (docs/DESIGN.md §8): YAML is data, this package is the schema.

    cfg = load_train_config("configs/train/tiny.yaml", ["schedule.steps=4", "model.rope.theta=5e6"])
    cfg = load_train_config("tiny")   # the same file by its shipped name (anchor_core.shipped)
    cfg.schedule.steps, cfg.model.variant, cfg.optim.lr, cfg.grad_accum(world=2)
    with_changes(cfg, {"model.engine": "varlen"})   # a changed copy, validated

A config is sectioned: `model`, `data`, `optim`, `schedule`, `parallel`, `checkpoint`, `logging`, `eval`, each a
pydantic model whose fields are its keys, and `deepspeed`, further DeepSpeed keys. One module per concern:
  schema      the sections and their keys, each declared once: type, default, range, one-line meaning; the value
              types keys accept beyond pydantic's own (finite YAML numbers, betas, sizes); where each key's value
              came from (an override, a file's line), named in every error
  keys        what the declarations give: every dotted key, those a resume may change, what each accepts in words;
              the helpers on dotted keys (the pairs of a nested mapping, a config by dotted key, a deep merge)
  validation  reading a file and the `key=value` overrides over it; the keys renamed since an earlier release
              (`RENAMED`, read under their new names for one release); pydantic's first error as one line; the
              nested mappings; the checks across keys; the world size
  deepspeed_json  the DeepSpeed config a run gets: the trainer's keys, the `deepspeed:` section merged and checked

pydantic validates; an error is one line (an InputError) naming the key's dotted path and where its value came
from: the command-line override (`command-line override optim.lr=abc`) or the file and the key's line
(`tiny.yaml:23`); an error across keys names where each came from (`TrainConfig.where`). An error echoes at most
an excerpt of a value (anchor_core.limits.excerpt).

Batch arithmetic: `data.global_batch` windows per optimizer step = `data.micro_batch` windows per forward on each
data-parallel rank x `grad_accum` micro-steps x `dp` data-parallel ranks, with
`dp = world / parallel.sequence_parallel`.
"""

import warnings
from typing import Any

from torchtrain.config.keys import (
    KEYS,
    NESTED,
    PACK_KEYS,
    PACK_OPTIONS,
    RESUMABLE_CHANGES,
    by_dotted_key,
    check_declarations,
    describe_keys,
    expected,
)
from torchtrain.config.schema import (
    SECTIONS,
    Sources,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PhaseConfig,
    RopeConfig,
    ScheduleConfig,
    TrainConfig,
)
from torchtrain.config.validation import (RENAMED, check_world, current_keys, load_train_config, parse_overrides,
                                          validate, with_changes)

__all__ = [
    "KEYS", "NESTED", "PACK_KEYS", "PACK_OPTIONS", "RENAMED", "RESUMABLE_CHANGES", "SECTIONS", "CheckpointConfig",
    "DataConfig", "EvalConfig", "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PhaseConfig",
    "RopeConfig", "ScheduleConfig", "Sources", "TrainConfig", "by_dotted_key", "check_declarations", "check_world",
    "current_keys", "describe_keys", "expected", "load_train_config", "parse_overrides", "validate", "with_changes",
]


def __getattr__(name: str) -> Any:
    """`StageConfig`, the name of `PhaseConfig` in earlier releases, for one release (with a DeprecationWarning)."""
    if name != "StageConfig":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("torchtrain.config.StageConfig is now torchtrain.config.PhaseConfig; the old name goes in the next "
                  "release", DeprecationWarning, stacklevel=2)
    return PhaseConfig
