"""Ulysses sequence parallelism around torchtrain's attention engines.

Legend: B batch, T slots of the whole window, P the SP degree (ranks of the group), s = T / P slots
per rank, N query heads, K kv heads, D head dim, H hidden size, V vocabulary.

Layout: rank r holds the contiguous slots [r s, (r + 1) s) of every window (`shard`). Everything
outside attention (embeddings, RoPE, norms, MLPs, lm-head, loss) is per slot and runs on the
rank's s slots. Inside each layer's attention function an all-to-all turns the sequence shards
q [B,N,s,D], k/v [B,K,s,D] into head shards over the whole window, q [B,N/P,T,D], k/v
[B,K'/P,T,D]; the engine (`torchtrain.attention.engines.attend`) runs as in one process, with the mask
metadata of the whole window; a second all-to-all turns its output [B,T,N/P,D] back into
[B,s,N,D]. The metadata is built once per forward step, from the whole doc_ids, by the engines'
forward pre-hook (every rank passes the same whole doc_ids).

KV heads: with K % P != 0 every kv head is first repeated r = lcm(K, P) / K times (K' = lcm(K, P),
`repeat_interleave`, so the copies of a head stay adjacent); query head h, which uses kv head
h // (N / K), then finds its copy on its own rank: contiguous head shards keep GQA groups whole
once K' % P == 0 (N % P == 0 and N % K == 0 give N % K' == 0). The copies' gradients add up in
the backward of the repeat. With K % P == 0 (K' = K) nothing is copied.

The all-to-all: DeepSpeed's `deepspeed.sequence.layer.DistributedAttention` (scatter_idx=2,
gather_idx=1, batch_dim_idx=0 on [B,s,H,D]) where DeepSpeed's communication is initialized
(`deepspeed.init_distributed`, as `deepspeed.initialize` does), else `torch.distributed`'s
`all_to_all_single` in the same layout (`impl="torch"`; nothing to compile, no DeepSpeed state).
Both exchange the same bytes, so the two give identical results.

Per rank:

    enable_sequence_parallel(model, group)
    hidden = final_hidden_states(model, model, input_ids=shard(tokens, rank, P),
                                 position_ids=shard(positions, rank, P),
                                 doc_ids=doc_ids, variant=variant)   # doc_ids: the WHOLE [B, T]
    ce_sum, count = next_token_loss_shard(hidden, tokens, loss_mask, rank, P,
                                          lm_head=model.get_output_embeddings())
    (ce_sum / count).backward()   # then all-reduce SUM the parameter gradients over the SP group

(`final_hidden_states` from torchtrain.model.loss: the final norm's output [B, s, H], the lm-head fused with
the loss so no [B, s, V] logits exist; `next_token_loss_shard(out.logits, tokens, loss_mask, rank, P)`
on ordinary logits gives the same.) torchtrain.training.trainer's micro-batches are exactly this: the fused
form, or the logits under ZeRO-3.

The loss of the window is the SUM over the SP group of `ce_sum`, divided by `count`; likewise the
gradient of the mean loss is the SUM over the group of each rank's gradient of `ce_sum / count`.
Under DeepSpeed, which averages gradients over its data-parallel group, that means: SP peers in
the reduce group and the local loss scaled by the number of ranks it averages over.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from anchor_core.errors import InputError
from torchtrain.attention import engines
from torchtrain.attention.functions import expand_kv
from torchtrain.model.loss import lm_head_cross_entropy, token_cross_entropy

Impl = Literal["auto", "deepspeed", "torch"]


def check_sequence_parallel(spec: Any, seq_len: int, degree: int) -> None:
    """Reject an SP degree that cannot split this model and window (one-line InputError).

    The degree must divide the window (`seq_len`) and the query heads (`spec.num_heads`). The kv
    heads need not be divisible: with `spec.num_kv_heads % degree != 0` each kv head is repeated
    lcm(K, degree) / K times before the all-to-all, so every rank's query heads find their kv heads
    (module docstring).

    Args:
      spec: an `anchor_core.spec.ModelSpec` (or anything with `num_heads`).
      seq_len: T, slots per window.
      degree: P, the SP degree.
    """
    if isinstance(degree, bool) or not isinstance(degree, (int, np.integer)) or degree < 1:
        raise InputError(f"sequence_parallel must be a positive integer, got {degree!r}")
    if seq_len % degree:
        raise InputError(f"sequence_parallel {degree} does not divide seq_len {seq_len}")
    if spec.num_heads % degree:
        raise InputError(f"sequence_parallel {degree} does not divide the model's {spec.num_heads} attention heads")


def kv_copies(num_heads: int, num_kv_heads: int, degree: int) -> int:
    """How many times each kv head is repeated before the all-to-all: lcm(K, P) / K (1 when P divides K)."""
    if num_heads % num_kv_heads or num_heads % degree:
        raise InputError(f"{num_heads} query heads do not split into {num_kv_heads} kv groups and {degree} ranks")
    return math.lcm(num_kv_heads, degree) // num_kv_heads


def shard(x: Any, rank: int, degree: int, dim: int = 1) -> Any:
    """Rank `rank`'s contiguous slice of `x` along `dim` (slots [rank s, (rank + 1) s), s = size / degree).

    Works on numpy arrays and torch tensors (a view, not a copy).
    """
    n = x.shape[dim]
    if n % degree:
        raise InputError(f"sequence_parallel {degree} does not divide the {n} slots to shard")
    if not 0 <= rank < degree:
        raise InputError(f"rank {rank} outside 0..{degree - 1}")
    s = n // degree
    index = [slice(None)] * x.ndim
    index[dim] = slice(rank * s, (rank + 1) * s)
    return x[tuple(index)]


def counted_predictions(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: which predictions of whole windows the loss counts (docs/DESIGN.md §1).

    The prediction at slot t (of token t+1) counts where loss_mask[:, t] is set; the last slot's
    never does (its target lies outside the window). `next_token_loss_shard` counts these; the
    trainer sums this rank's `shard` of them to normalise by the global batch's count.

    Args:
      loss_mask: int, float or bool [B, T], the whole window.
    """
    return torch.cat([loss_mask[:, :-1].bool(), torch.zeros_like(loss_mask[:, :1], dtype=torch.bool)], dim=1)


def _mine(x: Any, rank: int, degree: int, slots: Any) -> Any:
    """This rank's slots of x [B, T]: `slots` where given (context parallelism: `torchtrain.parallel.context.rank_slots`),
    else its contiguous `shard`."""
    if slots is None:
        return shard(x, rank, degree)
    if isinstance(x, torch.Tensor):
        return x.index_select(1, torch.as_tensor(np.asarray(slots), dtype=torch.long, device=x.device))
    return np.take(x, np.asarray(slots), axis=1)


def rank_inputs(batch: Any, tokens: torch.Tensor, rows: slice, rank: int, degree: int, device: torch.device,
                variant: str, slots: Any = None) -> dict[str, Any]:
    """The model's keyword inputs for this rank's slice of windows `rows` of a make_batch Batch: its shard of the
    tokens and positions (its `slots` under context parallelism), the whole windows' doc_ids (every rank holds them)."""
    return {"input_ids": _mine(tokens[rows], rank, degree, slots).to(device),
            "position_ids": torch.as_tensor(_mine(batch.positions[rows], rank, degree, slots), dtype=torch.long).to(device),
            "doc_ids": torch.as_tensor(batch.doc_ids[rows], dtype=torch.long).to(device),
            "variant": variant}


def next_token_loss_shard(
    states: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor, rank: int, degree: int,
    lm_head: nn.Module | None = None, slots: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the next-token loss of docs/DESIGN.md §1 under sequence parallelism.

    Targets are the WHOLE window's tokens shifted by one, then sharded: the prediction at a shard's
    last slot is of the next shard's first token. With `lm_head`, `states` are the final hidden
    states (`torchtrain.model.loss.final_hidden_states`) and the lm-head is fused with the cross-entropy
    (`torchtrain.model.loss.linear_cross_entropy`): no [B, s, V] logits or logit gradient is ever
    materialised. Without it, `states` are the logits. Either way every slot's cross-entropy depends
    on its own row only, so a shard's rows give those of the whole window.

    Args:
      states: [B, s, V] this rank's logits, or [B, s, H] its final hidden states with `lm_head`.
      tokens, loss_mask: int [B, T], the whole window.
      rank, degree: this rank in the SP group, and P, the group's size.
      lm_head: the model's output projection (`model.get_output_embeddings()`, tied or not), or None.
      slots: under context parallelism the window slots this rank holds (`torchtrain.parallel.context.rank_slots`),
        its shard otherwise.
    Returns:
      (ce_sum, count): float32 sum of cross-entropy over this shard's counted predictions (with a
      graph), and the int64 count of counted predictions of the whole window (the same on every
      rank). The window's mean loss is the sum over the SP group of ce_sum, divided by count.
    """
    ce, mine, count = next_token_ce_shard(states, tokens, loss_mask, rank, degree, lm_head, slots)
    return (ce * mine).sum(), count


def next_token_ce_shard(
    states: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor, rank: int, degree: int,
    lm_head: nn.Module | None = None, slots: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`next_token_loss_shard` slot by slot: (ce [B, s] float32, this shard's counted predictions [B, s], the
    whole window's count). The held-out loss by position reads it (torchtrain.training.heldout)."""
    tokens = torch.as_tensor(tokens, device=states.device)
    loss_mask = torch.as_tensor(loss_mask, device=states.device)
    targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1).long()  # the last slot never counts
    counted = counted_predictions(loss_mask)
    mine_targets = _mine(targets, rank, degree, slots)
    if lm_head is None:
        ce = token_cross_entropy(states, mine_targets)  # [B, s], the same rows as the whole window's
    else:
        B, s, H = states.shape
        ce = lm_head_cross_entropy(lm_head, states.reshape(B * s, H), mine_targets.reshape(B * s)).view(B, s)
    return ce, _mine(counted, rank, degree, slots), counted.sum()


# ---------------------------------------------------------------------------------------------
# The all-to-all


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` in P parts along scatter_dim, send part j to rank j, concatenate the received
    parts along gather_dim in rank order."""
    P = dist.get_world_size(group)
    send = torch.stack(x.chunk(P, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable `_all_to_all`: the backward is the inverse exchange (dims swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, engine: str, meta: engines.AttnMeta,
                     scale: float) -> torch.Tensor:
    """The engine on head shards of the whole window: q [B,T,N/P,D], k/v [B,T,K'/P,D] -> [B,T,N/P,D]. Under
    context parallelism too, T is the context-parallel rank's share, whose keys and values `meta.cp` gathers."""
    attend = engines.attend if meta.cp is None else meta.cp.attend
    return attend(engine, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), meta, scale)  # type: ignore[arg-type]


def _deepspeed_comm_ready() -> bool:
    comm = sys.modules.get("deepspeed.comm")
    return comm is not None and comm.is_initialized()


@dataclass(eq=False)
class Ulysses:
    """The SP context the engines' pre-hook puts into every layer's `AttnMeta.sp`.

    group: the SP process group; degree: its size P; rank: this process's rank in it;
    impl: "deepspeed" or "torch" (module docstring).
    """

    group: Any
    degree: int
    rank: int
    impl: Literal["deepspeed", "torch"]
    _ds: nn.Module | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.impl == "deepspeed":
            from deepspeed.sequence.layer import DistributedAttention

            self._ds = DistributedAttention(_local_attention, self.group, scatter_idx=2, gather_idx=1)

    def attend(self, engine: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: engines.AttnMeta,
               scale: float) -> torch.Tensor:
        """One layer's attention on this rank's slots: q [B,N,s,D], k/v [B,K,s,D] -> out [B,s,N,D]."""
        N, K = q.shape[1], k.shape[1]
        if N % self.degree:
            raise InputError(f"sequence_parallel {self.degree} does not divide the model's {N} attention heads")
        copies = kv_copies(N, K, self.degree)
        if copies > 1:
            k, v = expand_kv(k, copies), expand_kv(v, copies)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, s, H, D]
        if self._ds is not None:
            return self._ds(q, k, v, 0, None, engine=engine, meta=meta, scale=scale)
        q, k, v = (self.seq_to_heads(x) for x in (q, k, v))
        return self.heads_to_seq(_local_attention(q, k, v, engine=engine, meta=meta, scale=scale))

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, s, H, D] sequence shard -> [B, T, H/P, D] head shard."""
        return _AllToAll.apply(x, self.group, 2, 1)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H/P, D] head shard -> [B, s, H, D] sequence shard."""
        return _AllToAll.apply(x, self.group, 1, 2)


def sequence_parallel_of(model: nn.Module) -> Ulysses | None:
    """The model's SP context, or None when sequence parallelism is off."""
    return getattr(model.base_model, engines.SP_ATTR, None)


def enable_sequence_parallel(model: nn.Module, group: Any, impl: Impl = "auto") -> nn.Module:
    """Run the model's attention Ulysses-parallel over `group` (None or a group of one: off). Returns the model.

    After it, each rank calls `model(input_ids=<[B, T/P] shard>, position_ids=<its shard of the
    GLOBAL positions>, doc_ids=<the WHOLE [B, T]>, variant=...)` and gets its logits [B, T/P, V].
    Works with every torchtrain engine; idempotent; `set_engine` afterwards keeps SP. Taps raise
    under SP.

    Args:
      model: a model from torchtrain.build_model.
      group: a torch.distributed ProcessGroup (this process must belong to it).
      impl: "deepspeed" (DistributedAttention; needs deepspeed.init_distributed first), "torch"
        (torch.distributed.all_to_all_single), or "auto": deepspeed where its communication is
        initialized, else torch.
    """
    if engines.engine_of(model) is None:
        raise InputError("sequence parallelism needs a model running a torchtrain engine (torchtrain.build_model)")
    decoder = model.base_model
    degree = 1 if group is None else dist.get_world_size(group)
    if degree <= 1:
        if hasattr(decoder, engines.SP_ATTR):
            delattr(decoder, engines.SP_ATTR)
        return model
    rank = dist.get_rank(group)
    if rank < 0:
        raise InputError("this process is not in the sequence-parallel group")
    heads = model.config.num_attention_heads
    if heads % degree:
        raise InputError(f"sequence_parallel {degree} does not divide the model's {heads} attention heads")
    if impl == "auto":
        impl = "deepspeed" if _deepspeed_comm_ready() else "torch"
    elif impl == "deepspeed" and not _deepspeed_comm_ready():
        raise InputError("impl='deepspeed' needs DeepSpeed's communication: call deepspeed.init_distributed() first")
    elif impl not in ("deepspeed", "torch"):
        raise InputError(f"unknown sequence-parallel impl {impl!r} (auto, deepspeed, torch)")
    current = getattr(decoder, engines.SP_ATTR, None)
    if current is None or current.group is not group or current.impl != impl:
        setattr(decoder, engines.SP_ATTR, Ulysses(group, degree, rank, impl))
    return model


def disable_sequence_parallel(model: nn.Module) -> nn.Module:
    """Back to one process per window. Returns the model."""
    return enable_sequence_parallel(model, None)
