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

What each rank must be fed. The adapter treats the sequence-parallel group as data-parallel ranks: at each
refill it takes the batch each rank's own data loader gave, one per rank, and trains them one after another,
each on the whole group (rank r's batch at the r-th micro-step). So every rank must be given its own batch,
as accelerate shards a dataset over data-parallel ranks; ranks given the same batch train it sp_size times.
accelerate shards only over the processes it counts: on a GPU its DeepSpeed state counts every process, but on
a CPU it finds a backend only with TrainingArguments(use_cpu=True) and otherwise counts one process on every
rank, each of which then reads the whole dataset. `ulysses` cannot set use_cpu for the arguments it is passed
to: the environment variable that would (ACCELERATE_USE_CPU) also keeps accelerate's own state off DeepSpeed,
and accelerate then refuses the ParallelismConfig. So `UlyssesGradients` refuses, when the Trainer is built, a
run whose arguments count other than the processes torch.distributed runs (`check_world`), naming
use_cpu=True; and at the first refill it checks what each rank was given: each rank's batch digest,
all-gathered over the group (`check_feed`), must differ from the others' and hold as many rows.

On a CPU the adapter's slice of a [B, T] tensor stays a view (its `.cpu()` copies only from a GPU), which for
B > 1 is not contiguous, and transformers' causal-LM loss flattens shift_labels with `view`. Trainer copies the
batch only where its device is named "cpu:0" (use_cpu=True), not "cpu" (without it): `share_gradients` also
makes the forward's tensor arguments contiguous, so that the loss does not depend on that copy. DeepSpeed's wrapper needs sp_size to divide the model's
attention heads (and its key/value heads, or those to divide sp_size): `UlyssesGradients` checks the model
when the Trainer is built (`check_heads`), before DeepSpeed sees it.

A refusal is an InputError, the same on every rank of the group (each checks the same gathered data or the same
config); in a script that builds `ulysses`, an uncaught InputError ends each rank with its one line, as the
`anchor` command prints it, not a traceback per rank.
"""

from __future__ import annotations

import hashlib
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
ADAPTER_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"  # its loader adapter, imported by accelerate
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
    TRL's fused lm-head loss); and its forward's tensor arguments contiguous under Ulysses (the adapter's slices
    on a CPU are views). Idempotent. Unwraps a DeepSpeed engine or another wrapper with `.module`."""
    while not hasattr(model, "loss_function") and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "loss_function"):
        raise InputError(f"share_gradients needs a transformers model (with loss_function), got {type(model).__name__}")
    if id(model) not in _SHARED:
        model.register_forward_pre_hook(_contiguous_inputs, with_kwargs=True)
        model.register_forward_hook(_share_loss)
        _SHARED.add(id(model))
    return model


def _contiguous_inputs(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    if sp_group() is None:
        return args, kwargs
    return (tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args),
            {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


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
    """Trainer callback (module docstring): when the Trainer is built, `check_heads` on the model against the
    arguments' sp_size and `check_world` on the processes the arguments count; before the first step,
    `share_gradients` on the model and `check_feed` on the first batch each rank's data loader gives DeepSpeed's
    Ulysses loader adapter."""

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        pc = getattr(args, "parallelism_config", None)
        if (getattr(pc, "cp_size", 1) or 1) > 1:
            raise InputError(f"parallelism_config cp_size {pc.cp_size}: accelerate's context parallelism drops the "
                             "document and anchor masks of the anchor_* attention; split a window with sp_size "
                             "(torchtrain.hf.ulysses) or anchor train's parallel.context_parallel")
        if getattr(pc, "sp_backend", None) == "deepspeed" and getattr(pc, "sp_size", 1) > 1:
            if model is not None:
                check_heads(getattr(model, "config", None), pc.sp_size)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                check_world(args.world_size, torch.distributed.get_world_size(), pc.sp_size)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        share_gradients(model)
        adapter = sys.modules.get(ADAPTER_MODULE)
        if adapter is not None and isinstance(train_dataloader, adapter.UlyssesSPDataLoaderAdapter):
            train_dataloader.iter = _CheckedFeed(train_dataloader.iter, train_dataloader.sp_group,
                                                 train_dataloader.device)


class _CheckedFeed:
    """The iterator DeepSpeed's loader adapter draws each rank's own batches from: its first batch `check_feed`ed."""

    def __init__(self, batches: Any, group: Any, device: Any):
        self.batches, self.group, self.device, self.checked = batches, group, device, False

    def __iter__(self) -> _CheckedFeed:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        if not self.checked:
            self.checked = True
            check_feed(batch, self.group, self.device)
        return batch


def batch_digest(batch: Any) -> tuple[int, int]:
    """(rows, a 62-bit digest of every tensor of the batch: its key, dtype, shape and values)."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise InputError(f"sequence parallelism: each batch must be a dict of [B, T] tensors with input_ids, got "
                         f"{type(batch).__name__}")
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor)):
        t = batch[key].detach()
        h.update(f"{key} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int(batch["input_ids"].shape[0]), int.from_bytes(h.digest(), "big") >> 2  # fits int64


def check_feed(batch: Any, group: Any, device: Any = "cpu") -> None:
    """Each rank's batch against the others' in the sequence-parallel group (module docstring): every rank
    computes the same verdict from the all-gathered (rows, digest) and refuses with the same InputError."""
    world = torch.distributed.get_world_size(group)
    mine = torch.tensor(batch_digest(batch), dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(parts, mine, group=group)
    ranks = [torch.distributed.get_global_rank(group, i) for i in range(world)]
    problem = feed_problem([(int(p[0]), int(p[1])) for p in parts], ranks)
    if problem is not None:
        raise InputError(problem)


def feed_problem(fed: list[tuple[int, int]], ranks: list[int]) -> str | None:
    """The one-line refusal of the first batches `fed` to the group's ranks ((rows, digest) each), or None."""
    rows = [r for r, _ in fed]
    if len(set(rows)) > 1:
        return (f"sequence parallelism: the ranks {', '.join(map(str, ranks))} of a sequence-parallel group were "
                f"given batches of {', '.join(map(str, rows))} rows at the first step; DeepSpeed's Ulysses loader "
                "needs the same rows on every rank: give every rank per_device_train_batch_size windows of seq_len "
                "slots (PackedWindows with PackingCollator(..., windows=True); dataloader_drop_last=True)")
    seen: dict[int, int] = {}
    for rank, (_, digest) in zip(ranks, fed):
        if digest in seen:
            return (f"sequence parallelism: ranks {seen[digest]} and {rank} of a sequence-parallel group were given "
                    f"the same batch at the first step; DeepSpeed's Ulysses loader trains each rank's batch in turn "
                    f"on the whole group, so every batch would train {len(ranks)} times: feed each rank its own "
                    "batches, as accelerate shards a dataset over data-parallel ranks (Trainer's own train data "
                    "loader does; on a CPU with TrainingArguments(use_cpu=True))")
        seen[digest] = rank
    return None


def check_world(counted: int, world: int, sp_size: int) -> None:
    """The processes TrainingArguments (accelerate) count against torch.distributed's world (module docstring)."""
    if counted != world:
        raise InputError(f"sequence parallelism: Trainer's arguments count {counted} of the {world} processes, so the "
                         f"ranks of a sequence-parallel group would be fed the same batches and DeepSpeed's Ulysses "
                         f"loader would train each {sp_size} times: on a CPU pass TrainingArguments(use_cpu=True) "
                         "(accelerate finds no other backend there)")


def check_heads(config: Any, sp_size: int) -> None:
    """DeepSpeed's Ulysses wrapper's condition on the model's heads (module docstring), as one InputError."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return  # not a config DeepSpeed reads heads from: its own check speaks
    kv = getattr(text, "num_key_value_heads", None) or heads

    def fits(sp: int) -> bool:
        return heads % sp == 0 and (kv % sp == 0 or sp % kv == 0)

    if not fits(sp_size):
        problem = (f"sp_size {sp_size} does not divide the model's {heads} attention heads" if heads % sp_size else
                   f"sp_size {sp_size} and the model's {kv} key/value heads do not divide one another")
        sizes = [sp for sp in range(1, heads + 1) if fits(sp)]
        raise InputError(f"{problem} (Ulysses gives each rank heads / sp_size attention heads and splits or "
                         f"replicates the key/value heads): use sp_size {', '.join(map(str, sizes))} in "
                         "torchtrain.hf.ulysses, PackingCollator and the launch")


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
                         "(torchtrain.hf.trainer_sp): pass callbacks=[torchtrain.hf.UlyssesGradients()] to the Trainer, "
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
    _one_line_input_errors()
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=handler)


def _start_deepspeed_comm() -> None:
    """On CPU accelerate starts torch.distributed but not DeepSpeed's communication, which Ulysses' groups
    are made with: start it (gloo) in a process launched by torchrun. On GPUs accelerate starts it."""

    if "LOCAL_RANK" not in os.environ or torch.cuda.is_available():
        return
    import deepspeed

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def _one_line_input_errors() -> None:
    """An uncaught InputError ends the script with its one line on stderr (exit status 1), every other exception
    as before (module docstring). Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "anchor_input_errors", False):
        return

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if isinstance(error, InputError):
            rank = os.environ.get("RANK")
            print(f"{os.path.basename(sys.argv[0]) or 'python'}: error{'' if rank is None else f' (rank {rank})'}: "
                  f"{error}", file=sys.stderr, flush=True)
        else:
            previous(kind, error, tb)

    hook.anchor_input_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook
