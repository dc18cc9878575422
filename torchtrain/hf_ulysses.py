"""Sequence parallelism in Hugging Face's Trainer for the anchor_* attention functions: DeepSpeed's Ulysses
(ALST) as transformers and accelerate run it.

    args = TrainingArguments(..., deepspeed=ds_config,
                             parallelism_config=anchor_hf.ulysses(sp_size=2, seq_len=T, attn_implementation="anchor_varlen"))
    collator = anchor_hf.PackingCollator("anchor", T, tokenizer=tok, sp_size=2)

How Ulysses runs a step (deepspeed.runtime.sequence_parallel.ulysses_sp): its data loader adapter cuts every
[B, T] tensor of a batch along the sequence into sp_size slices, one per rank of the sequence-parallel group;
each rank embeds and rotates its T / sp_size slots at its slice of position_ids; before attention an
all-to-all gives every rank all T slots of H / sp_size heads, and the wrapper gathers position_ids, not
the other keywords. The variant's mask needs the whole window's doc_ids, so the anchor_* function that runs
inside the wrapper gathers them once per forward over the same group (`whole_window`), and checks what
it gathered before any mask is built:

  - the window is one the packer and make_batch produce (docs/DESIGN.md §1): slot 0 is the anchor (document
    0) in `anchor`, document 1 otherwise; document ids are numbered by first appearance, -1 padding;
    document 0 appears nowhere else;
  - the gathered position_ids are the variant's positions of these doc_ids (§2);
  - where the batch carries the labels (`shift_labels`, which the adapter derives from the collator's labels
    before cutting the batch), no prediction across a document boundary or from padding is trained on.

A rank holding another rank's slice, the slices out of order, or a slice of another window fails one of
these and stops every rank of the group with the same one-line InputError (each rank checks the same
gathered window). `variant` travels as a [B, T] tensor under sequence parallelism (PackingCollator's
sp_size), since the adapter cuts every tensor of the batch along its second dimension.

The gradients. transformers' Trainer under Ulysses (transformers.integrations.deepspeed.deepspeed_sp_compute_loss)
computes the step's loss on every rank of the group from all ranks' losses gathered with a differentiable
all_gather, whose backward sums over the ranks: each rank's own loss receives sp_size times its weight, and
DeepSpeed then sums the ranks' gradients (dividing by the data-parallel degree only). Every gradient comes out
sp_size times the sp_size = 1 gradient (github.com/deepspeedai/DeepSpeed/issues/5248): Adam's updates hide the factor, but the
reported grad_norm, gradient clipping (max_grad_norm acts at max_grad_norm / sp_size) and plain SGD do not.
`share_gradients(model)` (the `UlyssesGradients` Trainer callback calls it) makes the model's output loss pass
1 / sp_size of its gradient back, so the gradients are the sp_size = 1 ones; `whole_window` refuses to
train under Ulysses until it has been called.

accelerate checks the attention implementation Ulysses wraps against a list of built-in names; `ulysses`
builds accelerate's config with the anchor_* name set after that check, which is the name transformers'
attention lookup and DeepSpeed's wrapper use.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from anchor_core.data.batch import reset_positions
from anchor_core.errors import InputError
from anchor_core.machine import package_version

SP_STATE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"  # DeepSpeed's sequence-parallel groups
IGNORE_INDEX = -100
ACCELERATE_MIN = "1.12"  # accelerate's DeepSpeed sequence-parallel backend (ParallelismConfig sp_backend)


def sp_group() -> Any:
    """The sequence-parallel process group Ulysses runs in, or None when it does not run here."""
    state = sys.modules.get(SP_STATE)  # imported by DeepSpeed's Ulysses registration, not before
    if state is None or getattr(state, "_SEQUENCE_PARALLEL_GROUP", None) is None:
        return None
    return state.get_sequence_parallel_group()


def _gather(local: torch.Tensor, group: Any, what: str, T: int) -> torch.Tensor:
    world = torch.distributed.get_world_size(group)
    local = torch.as_tensor(local).long().contiguous()
    if local.ndim != 2 or local.shape[1] * world != T:
        raise InputError(f"{what} must be [B, T / sp_size] = [B, {T // world}] on each of the {world} sequence-parallel "
                         f"ranks (T = {T} slots), got {tuple(local.shape)}")
    parts = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=1)


class _Share(torch.autograd.Function):
    """The identity forward; backward passes `share` of the gradient."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, share: float) -> torch.Tensor:
        ctx.share = share
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.share, None


_SHARED: set[int] = set()  # id() of the models whose loss passes 1 / sp_size of its gradient back


def share_gradients(model: torch.nn.Module) -> torch.nn.Module:
    """Make `model`'s loss pass 1 / sp_size of its gradient back under Ulysses (module docstring), the same
    loss value: a forward hook on the model's output `loss`, whichever loss computed it (transformers' own, or
    TRL's fused lm-head loss); idempotent. Unwraps a DeepSpeed engine or another wrapper with `.module`."""
    while not hasattr(model, "loss_function") and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "loss_function"):
        raise InputError(f"share_gradients needs a transformers model (with loss_function), got {type(model).__name__}")
    if id(model) not in _SHARED:
        model.register_forward_hook(_share_loss)
        _SHARED.add(id(model))
    return model


def _share_loss(module: torch.nn.Module, args: Any, output: Any) -> Any:
    loss = getattr(output, "loss", None)
    group = sp_group()
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad or group is None:
        return output
    world = torch.distributed.get_world_size(group)
    if world > 1:
        output.loss = _Share.apply(loss, 1.0 / world)  # a ModelOutput: its "loss" item follows
    return output


class UlyssesGradients(TrainerCallback):
    """Trainer callback: `share_gradients` on the model before the first step (module docstring)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        share_gradients(model)


def whole_window(doc_ids: Any, variant: str, T: int, kwargs: dict[str, Any]) -> torch.Tensor:
    """The whole window's doc_ids [B, T] from this rank's slice [B, T / sp_size], gathered over the
    sequence-parallel group and checked (module docstring); an InputError where no group runs, or where a
    model trains under it without `share_gradients`."""
    group = sp_group()
    ids = torch.as_tensor(doc_ids)
    if group is None:
        raise InputError(f"doc_ids must be [B, T] with T = {T} slots (the model's input), got {tuple(ids.shape)}")
    if torch.is_grad_enabled() and not _SHARED:
        raise InputError("sequence parallelism: Trainer's Ulysses loss gives every gradient sp_size times over "
                         "(torchtrain.hf_ulysses): pass callbacks=[torchtrain.hf.UlyssesGradients()] to the Trainer, "
                         "or call torchtrain.hf.share_gradients(model) before training")
    whole = _gather(ids, group, "doc_ids", T)
    labels = kwargs.get("shift_labels")
    check_window(whole.cpu().numpy(), variant, kwargs.get("position_ids"),
                 None if labels is None else _gather(labels, group, "shift_labels", T).cpu().numpy(),
                 torch.distributed.get_world_size(group))
    return whole


def check_window(doc: np.ndarray, variant: str, positions: Any, shift_labels: np.ndarray | None, world: int) -> None:
    """A gathered window against the packer's rules, its positions and its labels (module docstring)."""
    B, T = doc.shape
    where = _first_bad(doc, variant)
    if where is None and positions is not None:
        pos = torch.as_tensor(positions).cpu().numpy()
        want = (reset_positions(doc) if variant == "intra_doc_reset"
                else np.broadcast_to(np.arange(T), doc.shape))
        if pos.shape[-1] == T:
            where = _first(np.broadcast_to(pos, doc.shape) != want, "the gathered position_ids are not the variant's "
                           "positions of these doc_ids")
    if where is None and shift_labels is not None:
        boundary = np.zeros_like(doc, dtype=bool)
        if variant != "full":
            boundary[:, :-1] = doc[:, 1:] != doc[:, :-1]
        where = _first((shift_labels != IGNORE_INDEX) & (boundary | (doc < 0)),
                       "a prediction across a document boundary or from padding is trained on")
    if where is not None:
        (row, slot), problem = where
        raise InputError(f"sequence parallelism: the doc_ids gathered over the {world} ranks are not one window of "
                         f"the {variant} variant: {problem} (row {row}, slot {slot}, in rank {slot // (T // world)}'s "
                         "slice); every rank must hold its own slice of the same window (docs/guides/hf-trainer.md)")


def _first(bad: np.ndarray, problem: str) -> tuple[tuple[int, int], str] | None:
    hits = np.argwhere(bad)
    return None if hits.size == 0 else ((int(hits[0, 0]), int(hits[0, 1])), problem)


def _first_bad(doc: np.ndarray, variant: str) -> tuple[tuple[int, int], str] | None:
    first = 0 if variant == "anchor" else 1
    start = np.zeros_like(doc, dtype=bool)
    start[:, 0] = doc[:, 0] != first
    if (hit := _first(start, f"slot 0 is not document {first}")) is not None:
        return hit
    if (hit := _first(doc < -1, "a doc id below -1")) is not None:
        return hit
    seen = np.maximum.accumulate(doc, axis=1)
    new = np.zeros_like(doc, dtype=bool)
    new[:, 1:] = doc[:, 1:] > seen[:, :-1] + 1
    if (hit := _first(new, "a document numbered out of order of first appearance")) is not None:
        return hit
    zero = doc == 0
    zero[:, 0] = False
    return _first(zero, "document 0 (the anchor) past slot 0")


def parallelism_config(sp_size: int, seq_len: int | None, attn_implementation: str) -> Any:
    """accelerate's ParallelismConfig for DeepSpeed's Ulysses around the registered attention function
    `attn_implementation` (torchtrain.hf.ulysses checks the name). Refused in one line where the installed
    accelerate has no DeepSpeed sequence-parallel backend."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise InputError(f"sp_size must be an int >= 1, got {sp_size!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len % sp_size):
        raise InputError(f"seq_len must be an int divisible by sp_size {sp_size}, got {seq_len!r}")
    try:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig
    except ImportError:
        raise InputError(f"sequence parallelism in Trainer needs accelerate >= {ACCELERATE_MIN} (its DeepSpeed "
                         f"sequence-parallel backend); installed: accelerate {package_version('accelerate') or 'none'}") from None
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=seq_len, sp_seq_length_is_variable=seq_len is None,
                                              sp_attn_implementation="sdpa")
    handler.sp_attn_implementation = attn_implementation  # after accelerate's check of built-in names
    _start_deepspeed_comm()
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=handler)


def _start_deepspeed_comm() -> None:
    """On CPU accelerate starts torch.distributed but not DeepSpeed's communication, which Ulysses' groups
    are made with: start it (gloo) in a process launched by torchrun. On GPUs accelerate starts it."""

    if "LOCAL_RANK" not in os.environ or torch.cuda.is_available():
        return
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
