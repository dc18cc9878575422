"""The pre-sectioned config format (flat keys: `lr: 1e-5`, `lr=1e-5`): `MOVED`, the one table from each flat key
to its dotted key now. A flat key in a config or an override is refused in one line naming its place in a section
(`moved_error`); a run folder whose config.yaml is flat is read through the same table (`from_flat`).
"""

from __future__ import annotations

from typing import Any

from anchor_core.errors import InputError
from anchor_core.limits import clip, excerpt
from torchtrain.config.schema import SECTIONS, set_dotted

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


def moved_to(key: str, value: Any) -> str | None:
    """The dotted place of a top-level key of the pre-sectioned format, or None. `model`, `data` and
    `schedule` are sections now: a flat one is the one whose value is neither a mapping nor empty."""
    if key not in MOVED or (key in SECTIONS and (value is None or isinstance(value, dict))):
        return None
    return MOVED[key]


def moved_error(key: str, where: str) -> InputError:
    """`key` (flat, or dotted below a flat mapping: `pack.budget`) is a key of the pre-sectioned format."""
    head, dot, rest = key.partition(".")
    return InputError(f"{clip(key)}: moved to {clip(MOVED[head] + dot + rest)} (a flat key of the pre-sectioned "
                      f"format; keys are grouped by section: {', '.join(SECTIONS)})", path=where)


def from_flat(d: dict[str, Any], *, source: str = "config") -> dict[str, Any]:
    """A config of the pre-sectioned format (flat keys) as sections, through MOVED; an unknown flat key
    is one line naming it."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key not in MOVED:
            raise InputError(f"unknown key {excerpt(key)} in a config of the pre-sectioned format (known: "
                             f"{', '.join(MOVED)})", path=source)
        set_dotted(out, MOVED[key], value)
    return out


def is_flat(d: Any) -> bool:
    """A mapping of the pre-sectioned format: some top-level key is a flat one."""
    return isinstance(d, dict) and any(moved_to(k, v) is not None for k, v in d.items())
