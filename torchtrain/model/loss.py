"""Next-token cross-entropy under the loss mask of docs/DESIGN.md §1, from logits or fused with the lm-head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Rows of logits per chunk: about 2^24 elements (128 MiB in float64) at a time, whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 24


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 on the CPU, float32 elsewhere.

    torch's CPU log-softmax sums a row of the vocabulary in float32 with errors up to 3.5e-5 per token at
    SmolLM2's 49K vocabulary (measured against float64; 2.9e-4 in the [B, V, T] layout), and the
    gradient p - onehot carries them: with a float32 sum, the fp32 gradient parity of SmolLM2
    (parity_tests/test_grads.py) puts model.norm.weight 5.5e-4 off. CUDA's reductions are tree-shaped
    and accurate in float32.
    """
    return torch.float64 if device.type == "cpu" else torch.float32


class _TokenCrossEntropy(torch.autograd.Function):
    """-log softmax(logits)[target] per row, chunked over rows with the softmax recomputed in the backward.

    Only the logits (in their own dtype) and one log-sum-exp per row are kept for the backward: no
    [N, V] float32 copy or log-probability tensor, so a 32K window of a 49K vocabulary costs one chunk
    of float64 on top of its logits.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [N, V], int64 [N] -> fp32 [N]
        N, V = logits.shape
        acc = _accumulation_dtype(logits.device)
        rows = max(1, _CHUNK_ELEMENTS // max(V, 1))
        lse = torch.empty(N, dtype=acc, device=logits.device)
        for s in range(0, N, rows):
            lse[s:s + rows] = torch.logsumexp(logits[s:s + rows].to(acc), dim=1)
        picked = logits.gather(1, targets[:, None]).squeeze(1).to(acc)
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return (lse - picked).float()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        acc, rows = lse.dtype, ctx.rows
        grad = torch.empty_like(logits)
        g = grad_out.to(acc)
        for s in range(0, logits.shape[0], rows):
            e = s + rows
            p = torch.exp(logits[s:e].to(acc) - lse[s:e, None])
            p.scatter_add_(1, targets[s:e, None], torch.full_like(lse[s:e, None], -1.0))
            grad[s:e] = p.mul_(g[s:e, None])
        return grad, None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-slot cross-entropy in float32: logits [B, T, V] (any float dtype), targets int [B, T] -> [B, T].

    Each row's log-sum-exp is accumulated in float64 on the CPU and float32 on CUDA
    (`_accumulation_dtype`), chunked over rows; the gradient is returned in the logits' dtype. Rows are
    independent, so a sequence-parallel shard's rows give bitwise the whole window's.
    """
    B, T, V = logits.shape
    targets = targets.long().reshape(B * T)
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"token_cross_entropy: targets outside the vocabulary [0, {V})")
    return _TokenCrossEntropy.apply(logits.reshape(B * T, V), targets).view(B, T)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the counted predictions, and how many were counted.

    The prediction at slot t (logits[:, t]) of tokens[:, t+1] counts where loss_mask[:, t] == 1;
    the last slot never counts. Cross-entropy as `token_cross_entropy` (float32 out).

    Args:
      logits: [B, T, V]; tokens: int [B, T]; loss_mask: int or bool [B, T].
    Returns:
      (loss, count): float32 scalar (0 with a graph when nothing counts), int64 scalar.
    """
    counted = loss_mask[:, :-1].bool()
    count = counted.sum()
    ce = token_cross_entropy(logits[:, :-1], tokens[:, 1:])  # [B, T-1]
    total = (ce * counted).sum()
    return total / count.clamp_min(1), count


# ---------------------------------------------------------------------------------------------
# The lm-head fused with the cross-entropy: logits [N, V] are never materialised.


def chunk_working_bytes(rows: int, vocab: int, logit_bytes: int, *, cpu: bool = True) -> int:
    """The most the fused loss's backward over `rows` rows holds at once for one chunk (`linear_cross_entropy`):
    the chunk's logits (`logit_bytes` per value), their copy in the accumulation dtype and the difference from
    the log-sum-exp, while the softmax replaces it (float64 on the CPU, float32 elsewhere)."""
    acc = 8 if cpu else 4
    return min(rows, _rows_per_chunk(vocab)) * vocab * (logit_bytes + 2 * acc)


def _rows_per_chunk(V: int) -> int:
    """Rows of a chunk at most: a chunk's logits hold about `_CHUNK_ELEMENTS` values, whatever the vocabulary."""
    return max(1, _CHUNK_ELEMENTS // max(V, 1))


def _chunks(N: int, V: int) -> list[tuple[int, int]]:
    """Row ranges [s, e) covering N rows: as few chunks as `_rows_per_chunk(V)` allows, of equal size (±1).

    Equal sizes, not full chunks and a remainder: the CPU's BLAS multiplies fewer than about 12 rows
    with other kernels (rows 1-3, 5-7, 9-11 differ in the last bit from the same rows inside a larger
    product, measured with torch 2.13 on this AVX2 CPU), so a remainder of a few rows would make those
    rows' results depend on where the chunking fell; equal chunks stay large whenever N is.
    """
    if N == 0:
        return []
    n = -(-N // _rows_per_chunk(V))
    base, extra = divmod(N, n)
    bounds, s = [], 0
    for i in range(n):
        e = s + base + (i < extra)
        bounds.append((s, e))
        s = e
    return bounds


def _weight_grad_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of each chunk's d(logits)ᵀ @ hidden, the weight gradient's contribution.

    On the CPU float32: bf16 values are exact in float32, the product is accumulated in float32 with
    no per-chunk rounding, and float32 matmuls are faster than bf16 ones on CPUs without AMX. On CUDA
    the hidden's own dtype (tensor cores; the GEMM accumulates in float32 inside), each chunk's
    product cast to float32 before it is added.
    """
    return torch.float32 if device.type == "cpu" else dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """-log softmax(hidden @ weightᵀ + bias)[target] per row, chunked over rows, logits recomputed in the backward.

    Saved for the backward: hidden [N, H], weight [V, H], bias, targets [N] and one log-sum-exp per
    row; one chunk (`_chunks`) of logits exists at a time, in the forward and in the backward. Rows
    never mix, and chunks are never small, so a row gets the same loss and hidden gradient whichever
    chunk it falls in (bitwise on this CPU; see `_chunks`); only the weight gradient's sum over
    chunks depends on the chunking.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                targets: torch.Tensor) -> torch.Tensor:  # [N, H], [V, H], [V] | None, int64 [N] -> fp32 [N]
        N, V = hidden.shape[0], weight.shape[0]
        acc = _accumulation_dtype(hidden.device)
        chunks = _chunks(N, V)
        lse = torch.empty(N, dtype=acc, device=hidden.device)
        picked = torch.empty(N, dtype=acc, device=hidden.device)
        for s, e in chunks:
            logits = F.linear(hidden[s:e], weight, bias)  # [n, V] in the hidden's dtype, as nn.Linear
            lse[s:e] = torch.logsumexp(logits.to(acc), dim=1)
            picked[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1).to(acc)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunks = chunks
        return (lse - picked).float()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = lse.dtype
        wdt = _weight_grad_dtype(hidden.device, hidden.dtype)
        g = grad_out.to(acc)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_bias and bias is not None else None
        for s, e in ctx.chunks:
            h = hidden[s:e]
            d = torch.exp(F.linear(h, weight, bias).to(acc) - lse[s:e, None])  # softmax [n, V]
            d.scatter_add_(1, targets[s:e, None], torch.full_like(lse[s:e, None], -1.0))
            # d(loss)/d(logits) in the logits' dtype, as the unfused path hands it to nn.Linear's backward
            d = d.mul_(g[s:e, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s:e] = d @ weight
            if grad_weight is not None:
                grad_weight += (d.t().to(wdt) @ h.to(wdt)).float()
            if grad_bias is not None:
                grad_bias += d.sum(0, dtype=torch.float32)
        return (grad_hidden,
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`token_cross_entropy(F.linear(hidden, weight, bias), targets)` without the logits.

    The lm-head and the cross-entropy fused and chunked over rows (as Liger-Kernel's fused linear
    cross-entropy and Apple's cut-cross-entropy): a chunk of about `_CHUNK_ELEMENTS` logits exists at a
    time, computed in the hidden's dtype as nn.Linear would, each row's log-sum-exp accumulated in
    `_accumulation_dtype` (float64 on the CPU, float32 on CUDA); the backward recomputes each chunk's
    logits. Gradients: hidden's in its dtype; weight's (and bias's) summed over chunks in float32,
    then cast to the weight's dtype.

    Args:
      hidden: [N, H] final hidden states (after the final norm); weight: [V, H] the lm-head's (tied
        or not); targets: int [N] in [0, V); bias: [V] or None.
    Returns:
      float32 [N], the cross-entropy of every row (no reduction, no mask).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "are not [N, H] and [V, H]")
    V = weight.shape[0]
    targets = targets.long().reshape(-1)
    if targets.numel() != hidden.shape[0]:
        raise ValueError(f"linear_cross_entropy: {targets.numel()} targets for {hidden.shape[0]} rows")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"linear_cross_entropy: targets outside the vocabulary [0, {V})")
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets)


def lm_head_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`linear_cross_entropy` of hidden [N, H] with the weight (and bias) of the lm-head module `head`, tied to
    the input embedding or not: fp32 [N].

    Under DeepSpeed ZeRO-3 (the weight partitioned, marked with `ds_id`) the weight is whole only inside the
    module's call, where ZeRO-3's hooks gather it, and in the module's backward, where they gather it again.
    There the fused loss runs as the call of `head` itself (its `forward` replaced for that call): the
    pre-forward hook gathers the weight, the output's backward hook gathers it again before
    `_LinearCrossEntropy.backward` reads it, and the weight's gradient, returned through autograd with the
    weight's whole shape, is accumulated in `weight.grad` where ZeRO-3's reduction hook partitions it. (The
    weight gathered with `deepspeed.zero.GatheredParameters` around the loss instead would be released
    before the backward, which needs it whole. DeepSpeed's `TiledFusedLogitsLoss` runs its backward inside
    its forward with an incoming gradient of 1, so the weight's gradient would miss the factor the trainer
    multiplies the loss by, `world / global count`.) The arithmetic is the same at every ZeRO stage.
    """
    bias = getattr(head, "bias", None)
    if not hasattr(head.weight, "ds_id"):
        return linear_cross_entropy(hidden, head.weight, targets, bias)
    saved = head.__dict__.get("forward")
    head.forward = lambda h: linear_cross_entropy(h, head.weight, targets, bias)
    try:
        return head(hidden)
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def head_cross_entropy(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-slot cross-entropy through the model's lm-head: hidden [B, T, H], targets int [B, T] -> fp32 [B, T].

    `lm_head_cross_entropy` with `model.get_output_embeddings()`, tied to the input embedding or not, at
    any ZeRO stage.
    """
    head = model.get_output_embeddings()
    B, T, H = hidden.shape
    return lm_head_cross_entropy(head, hidden.reshape(B * T, H), targets.reshape(B * T)).view(B, T)


def final_hidden_states(forward: Callable[..., Any], model: nn.Module, **inputs: Any) -> torch.Tensor:
    """Run the model with its lm-head projecting no slot; return the final norm's output [B, T, H].

    `forward` is the model itself or a wrapper that calls it (a DeepSpeed engine, whose module hooks
    then fire as in any forward); `model` is the transformers causal LM inside it. transformers'
    `logits_to_keep` (a 1-D index tensor, here empty) slices the hidden states before the lm-head, so
    the output's logits are [B, 0, V]; a forward hook on `model.base_model.norm` catches the hidden
    states on their way there, in the graph. Feed them to `head_cross_entropy`.

    Args:
      forward: callable taking the model's keyword inputs; model: a torchtrain.build_model model;
      inputs: the keyword inputs (input_ids [B, T], position_ids, doc_ids, variant, ...).
    """
    caught: list[torch.Tensor] = []
    handle = model.base_model.norm.register_forward_hook(lambda _module, _args, out: caught.append(out))
    try:
        device = inputs["input_ids"].device
        out = forward(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    if len(caught) != 1 or out.logits.shape[1] != 0:
        raise RuntimeError(f"final_hidden_states: the final norm ran {len(caught)} times and the lm-head "
                           f"returned logits {tuple(out.logits.shape)}; expected once and [B, 0, V]")
    return caught[0]
