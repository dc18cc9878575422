"""Next-token cross-entropy under the loss mask of CONTRACT §1."""

from __future__ import annotations

import torch

# Rows of logits per chunk: about 2^24 elements (128 MiB in float64) at a time, whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 24


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 on the CPU, float32 elsewhere.

    torch's CPU log-softmax sums a row of the vocabulary in float32 with errors up to 3.5e-5 per token at
    SmolLM2's 49K vocabulary (measured against float64; the [B, V, T] layout was 2.9e-4), and the
    gradient p - onehot carries them: the fp32 gradient parity of SmolLM2 (parity_tests/test_grads.py)
    put model.norm.weight 5.5e-4 off. CUDA's reductions are tree-shaped and accurate in float32.
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
