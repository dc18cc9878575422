"""The keys of an `anchor train` config (docs/DESIGN.md §8): one pydantic model per section, one field per key, and
the value types those keys accept.

    cfg.schedule.steps, cfg.model.variant, cfg.optim.lr, cfg.grad_accum(world=2)

Every key is declared once (`_key`): its type (the annotation: `Literal` choices, strict ints, finite
numbers), its default (none: required), its range (`ge`, `gt`, `le`) and its one-line meaning (`description`).
The value types are what a key accepts beyond pydantic's own strict types (finite YAML numbers, betas, sizes,
trackers), and `EXPECTED_BY_TYPE` what errors and the documentation say each accepts. Where each key's value came
from (`Sources`): a command-line override, a file and the key's line in it, or nowhere (a default); errors name it
(`TrainConfig.where`): `command-line override optim.lr=abc`, `tiny.yaml:23`. The rest of the package derives from
these declarations: the dotted keys and what each accepts (`torchtrain.config.keys`), reading files and overrides
and the checks across keys (`validation`).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt,
                      model_validator)

from anchor_core.engines import TRAIN_ENGINES
from anchor_core.limits import SEED_MAX
from anchor_core.variants import Variant


# ---------------------------------------------------------------------------------------------
# The value types

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
TRACKERS = ("tensorboard", "wandb", "mlflow")


def _tracker_names(x: Any) -> Any:
    """`logging.report_to`: a list of trackers, each once (a name given twice is one tracker); a bare name, as an
    override `logging.report_to=wandb` gives it, is a list of one."""
    if isinstance(x, str):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(dict.fromkeys(x)) if all(isinstance(n, str) for n in x) else x
    return x


TrackerNames = Annotated[tuple[Literal[TRACKERS], ...], BeforeValidator(_tracker_names)]  # type: ignore[valid-type]
Schedule = Literal["constant", "cosine", "linear"]
Dtype = Literal["float32", "bfloat16"]
TrainEngine = Literal[TRAIN_ENGINES]  # type: ignore[valid-type]  # auto, or an engine of anchor_core.engines
RopeScaling = Literal["default", "linear", "dynamic", "yarn", "llama3", "ntk"]
# parallel.timeout_s's bound: a week. torch.distributed holds the timeout as milliseconds in a 64-bit integer
# and Python's timedelta stops at 999999999 days; far larger values overflow in init_world.
TIMEOUT_MAX_S = 7 * 24 * 3600

# What errors and the documentation say a type accepts, where the annotation alone does not tell.
ShardSize = Union[StrictInt, Name]
EXPECTED_BY_TYPE: dict[Any, str] = {
    Betas: "two numbers [beta1, beta2] in [0, 1)",
    ShardSize: 'a size as transformers writes it ("5GB", "500MB", "2GiB") or a number of bytes',
    tuple[Name, ...]: "a list of non-empty strings",
    Steps: "a list of step numbers >= 1",
    tuple[Literal[TRACKERS], ...]: f"a list among {', '.join(TRACKERS)} (or one name)",  # type: ignore[valid-type]
}


def yaml_numbers(x: Any) -> Any:
    """`x` with every string that is a number in exponent form (`1e7`, `5e-3`: PyYAML reads those without a dot
    as strings) read as the number, an integer where it is whole; mappings and lists walked."""
    if isinstance(x, dict):
        return {k: yaml_numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [yaml_numbers(v) for v in x]
    if isinstance(x, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", x.strip()):
        v = float(x)
        return int(v) if v.is_integer() and math.isfinite(v) else v
    return x


# ---------------------------------------------------------------------------------------------
# The sections

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

    def renamed(self, old: str, new: str) -> "Sources":
        """These sources with the key `old` (and what lies below it) given as `new`: an old name read as the new one
        (torchtrain.config.validation.RENAMED), so that an error about the key names where the old name was given."""
        def name(k: str) -> str:
            return new + k[len(old):] if k == old or k.startswith((old + ".", old + "[")) else k

        return Sources(self.file, {name(k): v for k, v in self.lines.items()},
                       {name(k): v for k, v in self.overrides.items()})

    def without(self, keys: Sequence[str]) -> "Sources":
        """These sources with `keys` (and what lies below them) given by no one: changed by the program."""
        def kept(k: str) -> bool:
            return not any(k == c or k.startswith(c + ".") for c in keys)

        return Sources(self.file, {k: v for k, v in self.lines.items() if kept(k)},
                       {k: v for k, v in self.overrides.items() if kept(k)})


class _Section(BaseModel):
    """A section of keys: frozen, every key declared (`_key`), none other accepted."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class RopeConfig(_Section):
    """`model.rope:` overrides of the model's RoPE (docs/DESIGN.md §3); names as in anchor_core.spec.RopeSpec,
    with the config's spellings `theta` (= base) and `scaling` (= kind). Omitted: the model's."""

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
                                 "(torchtrain.model.tiling): its intermediate never held for the whole window")
    offload_checkpoints: StrictBool = _key(False, "CUDA, with activation_checkpointing: keep the layer inputs in "
                                           "pinned host memory between the forward and the backward")
    float8: Optional[Literal["rowwise", "tensorwise"]] = _key(
        None, "FP8 linear layers (torchao's float8 training recipe) in the decoder layers; the lm-head, attention "
              "and RoPE as without (torchtrain.model.float8)")
    float8_emulation: StrictBool = _key(False, "with float8: train torchao's emulation of the FP8 matmuls (the same "
                                        "numbers, slower), where the device has none (the CPU, a GPU before "
                                        "compute capability 8.9)")
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


class PhaseConfig(_Section):
    """One phase of `schedule.phases` (torchtrain.training.phases): its steps train on windows of its length, packed
    for it, with its RoPE base and peak learning rate."""

    steps: StrictInt = _key(..., "optimizer steps of this phase", ge=1)
    seq_len: StrictInt = _key(..., "slots per window of this phase (its windows packed from data.path)", ge=2)
    rope_theta: Optional[Number] = _key(None, "RoPE base in this phase (omitted: model.rope.theta, or the model's)",
                                        gt=1.0)
    lr: Optional[Number] = _key(None, "peak learning rate in this phase, under the schedule's shape (omitted: "
                                "optim.lr)", gt=0.0)

    def given(self) -> dict[str, Any]:
        """The phase as the config gives it (the optional keys only where given)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


Phases = tuple[PhaseConfig, ...]
EXPECTED_BY_TYPE[Phases] = "a list of phases, each a mapping {steps, seq_len} with optional rope_theta and lr"


class ScheduleConfig(_Section):
    """How long the run trains and the learning rate over its steps."""

    steps: StrictInt = _key(..., "optimizer steps", ge=1, resumable=True)
    warmup_steps: StrictInt = _key(0, "linear warmup steps (from lr/warmup_steps)", ge=0)
    kind: Schedule = _key("constant", "after warmup: constant, cosine or linear decay")
    min_lr_ratio: Number = _key(0.0, "cosine/linear: the final learning rate as a fraction of optim.lr", ge=0.0, le=1.0)
    phases: Phases = _key((), "a length schedule: phases run one after the other in one run, their steps summing "
                          "to schedule.steps (data.path a corpus, data.seq_len omitted; torchtrain.training.phases)")


class ParallelConfig(_Section):
    """Processes and how the model and the batch are split over them."""

    nproc: StrictInt = _key(1, "processes started on this machine (1 = this process)", ge=1, resumable=True)
    sequence_parallel: StrictInt = _key(1, "Ulysses sequence-parallel degree: attention heads split over this many "
                                        "ranks (it must divide the query heads)", ge=1, resumable=True)
    context_parallel: StrictInt = _key(1, "context-parallel degree: each window's slots split over this many ranks, "
                                       "keys and values all-gathered (any head count; torchtrain.parallel.context). "
                                       "A window is split over sequence_parallel x context_parallel ranks", ge=1,
                                       resumable=True)
    zero_stage: StrictInt = _key(0, "DeepSpeed ZeRO stage", ge=0, le=3)
    offload_optimizer: StrictBool = _key(False, "ZeRO 1-3: the optimizer states and fp32 master weights in host "
                                         "memory, stepped there by DeepSpeed's CPU Adam (built once, C++)")
    offload_params: StrictBool = _key(False, "ZeRO-3: the parameters in host memory, brought to the device as "
                                      "each layer runs")
    timeout_s: StrictInt = _key(600, "seconds a rank waits in a collective for the others before the run stops "
                                "(long enough for the slowest checkpoint write); a dead node ends its peers within a "
                                "minute whatever this is (torchtrain.parallel.distributed.Watchdog)", ge=1,
                                le=TIMEOUT_MAX_S, resumable=True)


class CheckpointConfig(_Section):
    """Regular checkpoints (the evaluation ones: `eval`)."""

    save_every: StrictInt = _key(0, "checkpoint every this many steps (0: only the final and the evaluation ones)",
                                 ge=0, resumable=True)
    keep_last: StrictInt = _key(2, "the newest checkpoints kept whole, to resume from (0: all); older regular ones are "
                                "deleted, older evaluation ones keep only their weights (hf/)", ge=0, resumable=True)
    max_shard_size: ShardSize = _key("50GB", "hf/'s largest safetensors file; past it the weights are sharded with an "
                                     "index, as transformers' save_pretrained (its default)", resumable=True)
    export_dtype: Literal["auto", "float32", "bfloat16"] = _key("auto", "hf/'s weights: auto (the training dtype), "
                                                                "float32 or bfloat16", resumable=True)


class LoggingConfig(_Section):
    """What the run reports besides RUN/metrics.jsonl."""

    every: StrictInt = _key(1, "print a progress line every this many steps", ge=1, resumable=True)
    tensorboard: Optional[StrictBool] = _key(None, "the older spelling of logging.report_to for TensorBoard, read "
                                             "into it: false leaves tensorboard out of report_to", resumable=True)
    dump_grads: Steps = _key((), "steps whose whole averaged gradient (before clipping) is written to "
                             "RUN/grads/step-N.safetensors", resumable=True)
    report_to: TrackerNames = _key(("tensorboard",), "trackers each step's metrics go to "
                                   "(torchtrain.training.trackers)", resumable=True)
    project: Name = _key("anchor", "the W&B project and MLflow experiment the run is logged in")


class EvalConfig(_Section):
    """The evaluation checkpoints (the paper: every 10 steps over the last 50)."""

    every: StrictInt = _key(10, "evaluation checkpoints: every this many steps ...", ge=1)
    window: StrictInt = _key(50, "... over the last this many steps (the paper: every 10 over the last 50)", ge=0)
    heldout_windows: StrictInt = _key(0, "windows held out of training (a seeded draw), their loss logged every "
                                      "eval.every steps (0: none; with heldout_data: its first this many, 0 all)", ge=0)
    heldout_data: Optional[Name] = _key(None, "an `anchor pack` folder at the run's length to hold out instead")
    heldout_buckets: StrictInt = _key(8, "slot ranges the held-out loss is also given by", ge=1, resumable=True)


class DeepSpeedSection(_Section):
    """`deepspeed:` further DeepSpeed config keys, deep-merged over the config the trainer generates
    (torchtrain.config.deepspeed_json): any key of DeepSpeed's JSON but those the trainer sets from the keys above."""

    model_config = ConfigDict(frozen=True, extra="allow", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _numbers(cls, d: Any) -> Any:
        return yaml_numbers(d) if isinstance(d, dict) else d

    def given(self) -> dict[str, Any]:
        """The section's DeepSpeed keys, as given (a copy)."""
        return copy.deepcopy(dict(self.model_extra or {}))


EXPECTED_BY_TYPE[DeepSpeedSection] = "a mapping of DeepSpeed config keys"


class TrainConfig(_Section):
    """A validated `anchor train` config: one field per section. `source` (not a key) is the file it came
    from, and `where(*keys)` where given keys came from (the override, or the file and the line), named in
    errors; `torchtrain.config.with_changes` makes a changed copy, validated. The last section, `deepspeed:` (default
    empty), holds further DeepSpeed config keys merged into the generated one (`deepspeed: {zero_optimization:
    {stage3_prefetch_bucket_size: 1e7}}`); a key the trainer sets is refused naming the key below that sets it, an
    unknown one by DeepSpeed's own validation. Keys, in the order errors list them and config.yaml is written:"""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    deepspeed: DeepSpeedSection = DeepSpeedSection()
    _source: str = PrivateAttr("config")
    _sources: Optional[Sources] = PrivateAttr(None)

    @property
    def source(self) -> str:
        return self._source

    def where(self, *keys: str) -> str:
        """Where the values of these dotted keys came from, for an error about them: `command-line override
        model.dtype=bfloat16`, `tiny.yaml:36`, several joined with "and"; the file when none was given."""
        return self._source if self._sources is None else self._sources.where(*keys)

    def __eq__(self, other: object) -> bool:  # the keys, not where they came from
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # `data.pack` is a dict

    def to_dict(self) -> dict[str, Any]:
        """The config as plain YAML-able data (the run's config.yaml): every key by section, tuples as
        lists, `model.rope` with only the overrides given."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            values = getattr(self, section)
            out[section] = values.given() if isinstance(values, DeepSpeedSection) else \
                {k: plain(getattr(values, k)) for k in type(values).model_fields}
        return out

    def sequence_degree(self) -> int:
        """The ranks one window is split over: Ulysses x context parallel."""
        return self.parallel.sequence_parallel * self.parallel.context_parallel

    def dp(self, world: int) -> int:
        """Data-parallel ranks of a world of `world` processes."""
        return world // self.sequence_degree()

    def grad_accum(self, world: int) -> int:
        """Micro-steps per optimizer step on each rank."""
        return self.data.global_batch // (self.data.micro_batch * self.dp(world))

    def rope_overrides(self) -> dict[str, Any]:
        """`model.rope:` as RopeSpec field names (empty: the model's RoPE)."""
        return {ROPE_FIELD.get(k, k): v for k, v in self.model.rope.given().items()}

    def is_checkpoint_step(self, step: int) -> bool:
        """Steps that write a checkpoint: every `checkpoint.save_every`, the last, and the evaluation schedule."""
        every = self.checkpoint.save_every
        return step == self.schedule.steps or (every > 0 and step % every == 0) or self.is_eval_step(step)

    def is_eval_step(self, step: int) -> bool:
        """The paper's evaluation schedule: every `eval.every` steps counted back from the last step,
        within the last `eval.window` steps (every 10 over the last 50: five checkpoints)."""
        steps, left = self.schedule.steps, self.schedule.steps - step
        return 0 < step <= steps and left < self.eval.window and left % self.eval.every == 0


ROPE_FIELD = {"theta": "base", "scaling": "kind"}  # `model.rope:` names -> anchor_core.spec.RopeSpec fields


def plain(v: Any) -> Any:
    """A key's value as YAML-able data: `model.rope` as the overrides it gives, tuples as lists."""
    if isinstance(v, (RopeConfig, PhaseConfig)):
        return v.given()
    if isinstance(v, tuple):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return dict(v)
    return v


# section name -> its model, in the order errors list the keys and config.yaml is written
SECTIONS: dict[str, type[_Section]] = {name: f.annotation for name, f in TrainConfig.model_fields.items()}
