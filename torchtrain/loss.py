"""Next-token cross-entropy under the loss mask of CONTRACT §1."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-slot cross-entropy in float32: logits [B, T, V], targets int [B, T] -> [B, T].

    The classes go last ([B*T, V] rows): with the classes in dim 1 ([B, V, T], F.cross_entropy's
    N-d layout) torch's CPU log-softmax sums the vocabulary in a plain fp32 loop, 2.9e-4 off per token
    at SmolLM2's 49K vocabulary (the mean loss 1.5e-4 relative, found by parity_tests/test_grads.py);
    the row layout sums accurately (5.8e-6).
    """
    B, T, V = logits.shape
    return F.cross_entropy(logits.float().reshape(B * T, V), targets.long().reshape(B * T), reduction="none").view(B, T)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the counted predictions, and how many were counted.

    The prediction at slot t (logits[:, t]) of tokens[:, t+1] counts where loss_mask[:, t] == 1;
    the last slot never counts. Cross-entropy is computed in float32.

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
