"""The attention math of each engine: pure functions, no model, no registry.

Legend: B batch, T slots, N query heads, K kv heads (GQA: N % K == 0, not expanded on input),
D head dim. Every function takes transformers' layout q [B,N,T,D], k/v [B,K,T,D] (already
RoPE-rotated) and returns transformers' attention-function layout out [B,T,N,D].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from anchor_core.errors import UnavailableError
from torchtrain.attention.varlen import VarlenSegments


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: repeat each kv head `groups` times side by side along dim 1, [B,K,...] -> [B,K*groups,...]
    ([B,K,T,D] as transformers' `repeat_kv`; varlen rows [R,K,D]). By expand and reshape, not
    `repeat_interleave`: the same values, and a backward that sums a head's copies in a fixed order
    (repeat_interleave's CUDA backward adds with atomics, so runs differ in the last bits)."""
    if groups == 1:
        return x
    B, K, *rest = x.shape
    return x.unsqueeze(2).expand(B, K, groups, *rest).reshape(B, K * groups, *rest)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_B1TT: torch.Tensor, scale: float) -> torch.Tensor:
    """Hugging Face eager arithmetic with a boolean mask: q·kᵀ·scale and p·v in the input dtype,
    softmax in fp32 cast back to the input dtype (`eager_attention_forward` of modeling_llama)."""
    groups = q.shape[1] // k.shape[1]
    s = torch.matmul(q, expand_kv(k, groups).transpose(2, 3)) * scale
    s = s.masked_fill(~mask_B1TT, float("-inf"))
    p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, expand_kv(v, groups)).transpose(1, 2).contiguous()


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_B1TT: torch.Tensor, scale: float) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with a boolean mask (True = attend) and native GQA."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TT, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


@functools.cache
def compiled_flex_attention():
    """`torch.compile(flex_attention, dynamic=False)`: dynamic shapes fail in the CPU code generator."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's CUDA kernel refuses smaller head dims ("NYI: … at least 16")


def call_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
    """The compiled FlexAttention call (GQA on). On CUDA a head dim under 16 (the random presets)
    is zero-padded to 16: padded q/k dims add 0 to every dot product, padded v dims are dropped."""
    D = q.shape[-1]
    pad = FLEX_MIN_HEAD_DIM - D if q.device.type == "cuda" and D < FLEX_MIN_HEAD_DIM else 0
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, pad)) for x in (q, k, v))
    out = compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return out[..., :D] if pad else out


class _FlexForwardOnly(torch.autograd.Function):
    """FlexAttention on CPU: the forward runs, the backward (which FlexAttention lacks on CPU) refuses."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale):  # type: ignore[override]
        return call_flex(q.detach(), k.detach(), v.detach(), block_mask, scale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise UnavailableError(
            "engine 'flex' has no backward on CPU (FlexAttention limitation); "
            "train with engine='sdpa' or 'eager' on CPU, or run flex on CUDA"
        )


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
    """Compiled FlexAttention with a precomputed `BlockMask`; differentiable on CUDA only."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad and q.device.type == "cpu":
        out = _FlexForwardOnly.apply(q, k, v, block_mask, scale)
    else:
        out = call_flex(q, k, v, block_mask, scale)
    return out.transpose(1, 2).contiguous()


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: VarlenSegments, scale: float, varlen_fn) -> torch.Tensor:
    """Gather the batch into varlen segments, run `varlen_fn` (flash_attn's or the emulation), scatter back.

    varlen_fn: `flash_attn_varlen_func`-compatible; gets q [Nq,N,D], k/v [Nk,K,D] and returns [Nq,N,D].
    """
    B, N, T, D = q.shape
    K, S = k.shape[1], k.shape[2]  # S = T, or the whole window's under context parallelism (T its rows)
    q_rows = q.transpose(1, 2).reshape(B * T, N, D).index_select(0, seg.q_index)
    k_rows = k.transpose(1, 2).reshape(B * S, K, D).index_select(0, seg.kv_index)
    v_rows = v.transpose(1, 2).reshape(B * S, K, D).index_select(0, seg.kv_index)
    out = varlen_fn(
        q_rows, k_rows, v_rows, seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q, seg.max_seqlen_k,
        dropout_p=0.0, softmax_scale=scale, causal=True,
    )
    return out.index_select(0, seg.q_inverse).reshape(B, T, N, D)
