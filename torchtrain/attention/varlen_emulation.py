"""A pure-torch `flash_attn_varlen_func`: the documented semantics of FlashAttention-2, for CPU tests.

Legend: Nq/Nk total query/key rows, N query heads, K kv heads (N % K == 0), D head dim, S segments.

Semantics emulated (flash_attn 2.x `flash_attn_varlen_func` docstring):
- segment s holds query rows `cu_seqlens_q[s]:cu_seqlens_q[s+1]` and key rows
  `cu_seqlens_k[s]:cu_seqlens_k[s+1]`; nothing attends across segments;
- `causal=True` aligns the causal mask to the bottom-right corner: query i of a segment with
  `Lq` queries and `Lk` keys sees key j iff `j <= i + Lk - Lq`; a query row that sees no key
  outputs 0;
- `softmax_scale` defaults to `D**-0.5`; GQA: query head h uses kv head `h // (N // K)`.
Arithmetic follows FlashAttention-2: fp32 scores and softmax statistics, the unnormalised
probabilities rounded to the value dtype before p·v, fp32 accumulation, division by the fp32 row
sum at the end. Unlike the kernel it also accepts float32 inputs, and it is differentiable
through autograd (the kernel has its own backward).
"""

from __future__ import annotations

import torch


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Emulated varlen attention.

    Args:
      q: [Nq, N, D]; k, v: [Nk, K, D].
      cu_seqlens_q, cu_seqlens_k: int32 [S+1] segment boundaries.
      max_seqlen_q, max_seqlen_k: checked against the segments, as the kernel sizes its grid by them.
      dropout_p: must be 0 (no dropout here).
    Returns:
      out [Nq, N, D] in q's dtype.
    """
    if dropout_p:
        raise ValueError("the varlen emulation has no dropout")
    N, D = q.shape[1], q.shape[2]
    G = N // k.shape[1]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if max(b - a for a, b in zip(cq, cq[1:])) > max_seqlen_q or max(b - a for a, b in zip(ck, ck[1:])) > max_seqlen_k:
        raise ValueError("a segment is longer than max_seqlen_q/max_seqlen_k")
    outs = []
    for s in range(len(cq) - 1):
        qs = q[cq[s] : cq[s + 1]].float().transpose(0, 1)  # [N, Lq, D]
        ks = k[ck[s] : ck[s + 1]].float().transpose(0, 1).repeat_interleave(G, dim=0)  # [N, Lk, D]
        vs = v[ck[s] : ck[s + 1]].transpose(0, 1).repeat_interleave(G, dim=0)  # [N, Lk, D]
        Lq, Lk = qs.shape[1], ks.shape[1]
        scores = torch.einsum("NQD,NKD->NQK", qs, ks) * scale
        if causal:
            see = torch.arange(Lk, device=q.device)[None, :] <= torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
            scores = scores.masked_fill(~see, float("-inf"))
        row_max = scores.detach().amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(scores - row_max)  # masked entries: exp(-inf) = 0
        row_sum = p.sum(dim=-1, keepdim=True)
        pv = torch.einsum("NQK,NKD->NQD", p.to(v.dtype).float(), vs.float())
        o = torch.where(row_sum > 0, pv / row_sum.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(pv))
        outs.append(o.transpose(0, 1).to(q.dtype))
    return torch.cat(outs, dim=0)
