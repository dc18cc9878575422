"""Context parallelism: the window's slots split over the ranks of a group, keys and values all-gathered.

Legend: B batch, T slots of the whole window, C the context-parallel degree (ranks of the group),
s = T / C slots per rank, N query heads, K kv heads, D head dim.

Layout (head-tail balancing). Rank r holds s slots of every window: a head chunk of h = floor(s / 2)
slots from the front of the window and a tail chunk of s - h slots from its back, in mirrored order:

    head chunks  [r h, (r + 1) h)                              r = 0 .. C-1, from the front
    tail chunks  [C h + (C-1-r)(s-h), C h + (C-r)(s-h))         so rank 0 holds the window's last slots

Under a causal mask the work of a query grows with its slot, so each rank's sum of slots, and with
it its attention work under the causal mask of a long window, is that of every other (equal for an
even s; for an odd s at most s·(C-1) apart, against about T·s/2 each). The window need only be
divisible by C: odd shares are split into halves one slot apart. A rank's slots are ascending
(`balanced_slots`); `order` concatenates the ranks' slots in rank order (the layout of an
all-gather) and `inverse` undoes it.

Attention. Everything outside attention (embeddings, RoPE on each slot's own position, norms, MLPs,
lm-head, loss) is per slot and runs on the rank's s slots. In each layer the rank's keys and values
[B,K,s,D] are all-gathered over the group and put back into slot order ([B,K,T,D]: the whole
window's, cheap under GQA where K is small); the rank's queries [B,N,s,D] then attend with the
mask rows of its own slots (`torchtrain.attention.engines.prepare_meta(rows=)`), exactly the keys
the variant allows wherever the documents fall. The anchor (slot 0, held by rank 0) is a key like
any other: every rank's queries see it through the gather. Backward: the gradient of the gathered
keys and values is summed over the group in float32, each rank keeping its own slots' sum (the
gather's adjoint, a reduce-scatter), so the anchor's key and value gradients reach rank 0 whole.
The attention output of each query is a full softmax row over every key it may see: no partial
results are merged, so forward values are those of one process up to the matmul blocking.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from anchor_core.errors import InputError
from torchtrain.attention import engines


def _degree(degree: object, key: str) -> int:
    if isinstance(degree, bool) or not isinstance(degree, (int, np.integer)) or degree < 1:
        raise InputError(f"{key} must be a positive integer, got {degree!r}")
    return int(degree)


def divisors_near(seq_len: int, degree: int) -> list[int]:
    """The degrees nearest `degree` (below first) that divide `seq_len`, at most two: what a refusal suggests."""
    below = next((d for d in range(degree - 1, 0, -1) if seq_len % d == 0), None)
    above = next((d for d in range(degree + 1, 2 * degree + 1) if seq_len % d == 0), None)
    return [d for d in (below, above) if d is not None and d > 1] or [1]


def check_context_parallel(seq_len: int, degree: object, key: str = "parallel.context_parallel") -> int:
    """The degree, or a one-line InputError naming `key` and a degree that works.

    The balancing needs only C | T (odd shares split in halves one slot apart), and every rank at
    least one slot."""
    C = _degree(degree, key)
    if seq_len % C:
        works = " or ".join(str(d) for d in divisors_near(seq_len, C))
        raise InputError(f"{key} {C} does not split seq_len {seq_len} into equal shares (use {works})")
    return C


@functools.lru_cache(maxsize=64)
def _layout(T: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    """(order [T]: the ranks' slots concatenated in rank order, inverse [T]: slot -> its place in order)."""
    check_context_parallel(T, C)
    s = T // C
    h = s // 2
    parts = []
    for r in range(C):
        tail0 = C * h + (C - 1 - r) * (s - h)
        parts.append(np.concatenate([np.arange(r * h, (r + 1) * h), np.arange(tail0, tail0 + s - h)]))
    order = np.concatenate(parts)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(T)
    order.flags.writeable = inverse.flags.writeable = False
    return order, inverse


def balanced_slots(T: int, degree: int, rank: int) -> np.ndarray:
    """int64 [T / degree]: the slots rank `rank` holds, ascending (module docstring)."""
    if not 0 <= rank < degree:
        raise InputError(f"rank {rank} outside 0..{degree - 1}")
    s = T // check_context_parallel(T, degree)
    return _layout(T, degree)[0][rank * s:(rank + 1) * s].copy()


def slot_order(T: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, inverse) of the module docstring: `x_all[..., inverse]` puts an all-gather in slot order."""
    order, inverse = _layout(T, check_context_parallel(T, degree))
    return order.copy(), inverse.copy()


def take_slots(x: Any, slots: np.ndarray | torch.Tensor, dim: int = 1) -> Any:
    """`x`'s entries at `slots` along `dim` (numpy arrays and torch tensors)."""
    if isinstance(x, torch.Tensor):
        return x.index_select(dim, torch.as_tensor(np.asarray(slots), dtype=torch.long, device=x.device))
    return np.take(x, np.asarray(slots), axis=dim)


class _GatherSlots(torch.autograd.Function):
    """x [B,H,s,D] of every rank -> [B,H,T,D] in slot order; backward: each rank's slots of the summed gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: "ContextParallel") -> torch.Tensor:  # type: ignore[override]
        ctx.cp, ctx.dtype = cp, x.dtype
        parts = [torch.empty_like(x) for _ in range(cp.degree)]
        dist.all_gather(parts, x.contiguous(), group=cp.group)
        return cp.to_slot_order(torch.cat(parts, dim=2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        cp: ContextParallel = ctx.cp
        T = grad.shape[2]
        order = torch.as_tensor(slot_order(T, cp.degree)[0], device=grad.device)
        in_rank_order = grad.float().index_select(2, order).contiguous()
        return cp.reduce_to_owner(in_rank_order).to(ctx.dtype), None


@dataclass(eq=False)
class ContextParallel:
    """The context-parallel group of one process: `group`, its size `degree` (C) and this process's `rank`.

    The engines' pre-hook puts it into every layer's `AttnMeta.cp` (with the mask rows of `slots`)."""

    group: Any
    degree: int
    rank: int

    def slots(self, T: int) -> np.ndarray:
        """This rank's slots of a T-slot window (`balanced_slots`)."""
        return balanced_slots(T, self.degree, self.rank)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B,H,s,D] this rank's slots -> [B,H,T,D] the whole window's, in slot order; differentiable."""
        return _GatherSlots.apply(x, self)

    def to_slot_order(self, x: torch.Tensor) -> torch.Tensor:
        """[B,H,T,D] in rank order (an all-gather's) -> slot order."""
        inverse = torch.as_tensor(slot_order(x.shape[2], self.degree)[1], device=x.device)
        return x.index_select(2, inverse)

    def reduce_to_owner(self, grad: torch.Tensor) -> torch.Tensor:
        """float32 [B,H,T,D] in rank order -> [B,H,s,D]: this rank's slots summed over the group
        (reduce-scatter where the backend has it, else all-reduce and keep this rank's part)."""
        s = grad.shape[2] // self.degree
        if dist.get_backend(self.group) == "nccl":
            out = torch.empty_like(grad[:, :, :s])
            chunks = torch.stack(grad.chunk(self.degree, dim=2)).contiguous()
            dist.reduce_scatter_tensor(out, chunks, group=self.group)
            return out
        dist.all_reduce(grad, group=self.group)
        return grad[:, :, self.rank * s:(self.rank + 1) * s]

    def attend(self, engine: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any,
               scale: float) -> torch.Tensor:
        """One layer's attention of this rank's queries: q [B,N,s,D], k/v [B,K,s,D] -> out [B,s,N,D].

        `meta` holds the mask rows of this rank's slots against the whole window's keys."""
        return engines.attend(engine, q, self.gather(k), self.gather(v), meta, scale)  # type: ignore[arg-type]


def rank_slots(T: int, context: int = 1, context_rank: int = 0, ulysses: int = 1, ulysses_rank: int = 0) -> np.ndarray:
    """int64 [T / (context * ulysses)]: the slots of a T-slot window one rank holds under Ulysses × context
    parallelism. Context parallelism splits the window into balanced shares (`balanced_slots`); Ulysses splits
    the rank's share into `ulysses` contiguous parts, its all-to-all gathering the share back in slot order."""
    share = balanced_slots(T, context, context_rank) if context > 1 else np.arange(T)
    if len(share) % ulysses:
        raise InputError(f"sequence_parallel {ulysses} does not divide the {len(share)} slots of a context-parallel share")
    part = len(share) // ulysses
    return share[ulysses_rank * part:(ulysses_rank + 1) * part]


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The model's context-parallel group, or None when context parallelism is off."""
    return getattr(model.base_model, engines.CP_ATTR, None)


def enable_context_parallel(model: nn.Module, group: Any) -> nn.Module:
    """Run the model's attention context-parallel over `group` (None or a group of one: off). Returns the model.

    After it, each rank calls `model(input_ids=<its slots of the window>, position_ids=<the positions at those
    slots>, doc_ids=<the WHOLE [B, T]>, variant=...)` with the slots of `rank_slots` and gets the logits of its
    slots. Works with every engine, and inside Ulysses (`enable_sequence_parallel` on the other
    axis of the ranks); idempotent."""
    if engines.engine_of(model) is None:
        raise InputError("context parallelism needs a model running a torchtrain engine (torchtrain.build_model)")
    decoder = model.base_model
    degree = 1 if group is None else dist.get_world_size(group)
    if degree <= 1:
        if hasattr(decoder, engines.CP_ATTR):
            delattr(decoder, engines.CP_ATTR)
        return model
    rank = dist.get_rank(group)
    if rank < 0:
        raise InputError("this process is not in the context-parallel group")
    current = getattr(decoder, engines.CP_ATTR, None)
    if current is None or current.group is not group:
        setattr(decoder, engines.CP_ATTR, ContextParallel(group, degree, rank))
    return model


def window_groups(world: Any) -> tuple[Any, Any]:
    """(Ulysses group, context-parallel group) of this rank within its window's `sp` ranks; None for a degree of
    one. `world`: a torchtrain.parallel.distributed.World (whose docstring gives the layout: a Ulysses group is
    consecutive ranks, the context-parallel peers of a rank share its `ulysses_rank`). Every rank creates every
    group, as torch requires."""
    def mine(ranks: list[int], held: Any) -> Any:  # every rank makes the group; it is this rank's where it is in it
        group = dist.new_group(ranks)
        return group if world.rank in ranks else held

    ulysses = context = None
    for d in range(world.dp):
        base = d * world.sp
        for c in range(world.cp if world.ulysses > 1 else 0):
            ulysses = mine([base + c * world.ulysses + u for u in range(world.ulysses)], ulysses)
        for u in range(world.ulysses if world.cp > 1 else 0):
            context = mine([base + c * world.ulysses + u for c in range(world.cp)], context)
    return ulysses, context
