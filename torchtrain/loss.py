"""Next-token cross-entropy under the loss mask of CONTRACT §1."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), tokens[:, 1:].long(), reduction="none")  # [B, T-1]
    total = (ce * counted).sum()
    return total / count.clamp_min(1), count
