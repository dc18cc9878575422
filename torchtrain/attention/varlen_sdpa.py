"""The `varlen` engine: varlen segments through fused SDPA calls batched by shape (any device).

Legend: B batch, T slots, N query heads, K kv heads (N % K == 0), D head dim, H either,
S segments, R gathered rows, n segments in one call, L a segment's length, c = CHUNK.

Segments. The engine runs the segments of `torchtrain.attention.varlen.varlen_segments` (the same as
`flash_varlen`). A segment has `Lq` queries and `Lk >= Lq` keys with FlashAttention's bottom-right
causal alignment, and its queries are the last `Lq` of its keys (full, intra_doc(_reset),
padding: `Lq == Lk`; anchor: keys = [anchor] + queries). So every segment runs as a *square*
causal segment of its `L = Lk` key rows: the extra query row in front of a document is the
anchor, which there sees exactly itself, as in its own segment; that row's output is dropped.

Calls. q, k and v are gathered once into rows [R, H, D] (one `index_select` each); every SDPA call
reads strided views of them ([n, H, L, D]: n segments at one row stride) and one more
`index_select` puts the outputs back in slot order. Segments are batched by shape:
  whole (L <= c or L >= LONG)  one `is_causal` call per bucket of equal lengths. A segment may be
      right-padded to a longer bucket length to save a call (padded rows repeat its last slot:
      under the causal mask no real query sees them, and their outputs are dropped); lengths
      merge greedily, longest first, while count x (L^2 - l^2) <= PAD_AREA (about what one call
      costs in fixed overhead on this CPU).
  chunked (c < L < LONG)  query chunks of c rows: chunk j attends keys [0, (j+1)c) with the
      bottom-right causal mask [c, (j+1)c] (chunk 0: `is_causal`), and the last L mod c rows
      attend all L keys likewise. Segments with as many full chunks share a call per chunk; the
      masks are views of one bool [c, W] tensor.
Why chunks: torch's fused CPU kernel skips causal work in key blocks of 512 only, so a segment of
L <= 512 costs its whole square and L = 1000 about 1.5x its triangle; chunks of c rows leave about
c L / 2 pairs of excess per segment at nearly full speed, and from LONG on the kernel's own
skipping is as good. Measured on this CPU (fwd + bwd, ns per query-key pair and head of the
causal triangle; full causal SDPA at T = 8192: 13.7): L = 500: 26.6 whole, 17.6 chunked;
L = 1000: 19.2 and 16.3; L = 2000: 16.0 and 15.7; L = 4096: 14.5 and 15.4.

Cost. A step costs about sum over segments of L^2 / 2 + c L / 2 query-key pairs (plus the bucket
padding above), against T^2 / 2 for full causal attention. Every mask has at most c rows and
the longest segment's columns; nothing of size T x T exists anywhere.

Backward. One `torch.autograd.Function` (`_Calls`) holds the whole layer. On CPU it calls the
fused kernel's forward and backward ops directly (the backward takes the forward's
log-sum-exp); elsewhere each call runs through autograd on leaf views. Every call's gradients are
added into the gathered rows' gradients in place and gathered back to slots at the end (a slot's
several rows, the anchor's, are summed), so no full-size tensor is made per call.

CUDA. Where tensors are on CUDA the same square segments go to one fused kernel instead: PyTorch's
own varlen attention (`torch.nn.attention.varlen.varlen_attn`, FlashAttention-2 inside,
bf16/fp16, sm80+), else compiled FlexAttention on the packed square rows with a block mask from
the segment ids (block-diagonal causal: its sparsity skips the same blocks). The calls above are
the fallback where neither applies.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F

from torchtrain.attention.functions import call_flex, expand_kv
from torchtrain.attention.varlen_plan import Call, VarlenPlan

_FLEX_ROWS = 1024  # FlexAttention's packed length is rounded up to this (few distinct compiled shapes)
Backend = Literal["calls", "torch_varlen", "flex"]


# ---------------------------------------------------------------------------------------------
# The math


def _rows(x_BHTD: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D] (flattened slot `b*T + t` first). A view in transformers'
    models, whose q/k/v are [B, T, H, D] in memory; a copy otherwise."""
    B, H, T, D = x_BHTD.shape
    return x_BHTD.transpose(1, 2).reshape(B * T, H, D)


def _view(x_RHD: torch.Tensor, n: int, first: int, stride: int, length: int) -> torch.Tensor:
    """Rows `first + i*stride + [0, length)` (i < n) of x [R, H, D] as [n, H, length, D] (strided, no copy)."""
    R, H, D = x_RHD.shape
    return x_RHD.as_strided((n, H, length, D), (stride * H * D, D, H * D, 1), x_RHD.storage_offset() + first * H * D)


def _q_view(x: torch.Tensor, c: Call) -> torch.Tensor:
    return _view(x, c.n, c.q0, c.stride, c.lq)


def _k_view(x: torch.Tensor, c: Call) -> torch.Tensor:
    return _view(x, c.n, c.k0, c.stride, c.lk)


@functools.cache
def _cpu_kernel():
    """torch's fused CPU attention (forward, backward) as ops that return and take the
    log-sum-exp, or None where this torch lacks them."""
    try:
        return (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    except (AttributeError, RuntimeError):
        return None


def _use_cpu_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and _cpu_kernel() is not None


def _forward(p: VarlenPlan, qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, scale: float, graph: bool):
    """Every call on the gathered rows qg [R,N,D], kg/vg [R,K,D] -> (out [B*T,N,D] in slot order, saved).

    saved (with `graph`): per call, the CPU kernel's (out, log-sum-exp), or elsewhere the
    autograd leaves and output (q, k, v, out) of `F.scaled_dot_product_attention`; else [].
    """
    R, N, D = qg.shape
    out = qg.new_empty((p.out_index.shape[0] + 1, N, D))  # the last row takes the dropped rows
    saved = []
    cpu = _use_cpu_kernel(qg)
    for c, dst in zip(p.calls, p.dst):
        q, k, v = _q_view(qg, c), _k_view(kg, c), _k_view(vg, c)
        if cpu:
            o, lse = _cpu_kernel()[0](q, k, v, 0.0, c.lq == c.lk, attn_mask=p.additive_mask(c, qg.dtype), scale=scale)
            saved.append((o, lse))
        else:
            if graph:
                q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            with torch.set_grad_enabled(graph):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.bool_mask(c), is_causal=c.lq == c.lk,
                                                   scale=scale, enable_gqa=q.shape[1] != k.shape[1])
            saved.append((q, k, v, o))
        out.index_copy_(0, dst, o.detach().transpose(1, 2).reshape(-1, N, D))
    return out[:-1], saved if graph else []


def _gathered(p: VarlenPlan, q_r: torch.Tensor, k_r: torch.Tensor, v_r: torch.Tensor):
    """The rows the calls read: q, k and v at `p.rows`; under context parallelism q from the rank's rows
    (`p.q_gather`, a zero row for the keys-only rows), k and v from the whole window's."""
    kg, vg = k_r.index_select(0, p.rows), v_r.index_select(0, p.rows)
    if p.q_gather is None:
        return q_r.index_select(0, p.rows), kg, vg
    return torch.cat([q_r, q_r.new_zeros((1, *q_r.shape[1:]))]).index_select(0, p.q_gather), kg, vg


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """[n, H, L, D] -> [n*L, H, D] (a view where x is [n, L, H, D] in memory, as the kernel's outputs)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


class _Calls(torch.autograd.Function):
    """Gather -> the plan's calls -> scatter; the backward accumulates key gradients in the gathered rows.

    forward(q_r [B*T,N,D], k_r/v_r [B*T,K,D], plan, scale) -> out [B*T,N,D].
    """

    @staticmethod
    def forward(ctx, q_r, k_r, v_r, p: VarlenPlan, scale: float):  # type: ignore[override]
        qg, kg, vg = _gathered(p, q_r, k_r, v_r)
        out, per_call = _forward(p, qg, kg, vg, scale, graph=True)
        ctx.plan, ctx.scale = p, scale
        if _use_cpu_kernel(qg):
            # The kernel's (out, log-sum-exp) of every call go through save_for_backward, not a ctx attribute:
            # activation checkpointing then drops them with the rest of the layer and recomputes them (kept
            # as an attribute, every checkpointed layer would hold its attention output until its backward).
            ctx.per_call = None
            ctx.save_for_backward(qg, kg, vg, *(t for pair in per_call for t in pair))
        else:  # the autograd graphs of F.scaled_dot_product_attention, which the backward differentiates
            ctx.per_call = per_call
            ctx.save_for_backward(qg, kg, vg)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        p: VarlenPlan = ctx.plan
        qg, kg, vg, *kernel_saved = ctx.saved_tensors
        per_call = ctx.per_call if ctx.per_call is not None else list(zip(kernel_saved[0::2], kernel_saved[1::2]))
        BT, N, D = grad.shape
        grad = torch.cat([grad, grad.new_zeros(1, N, D)])  # dropped rows get no gradient
        dq = grad.new_empty(grad.shape)  # every slot is one call's query row exactly once
        # key rows are shared by chunks; one more zero row: the gradient of a slot no segment holds (a rank's share)
        dk, dv = (x.new_zeros((x.shape[0] + 1, *x.shape[1:])) for x in (kg, vg))
        cpu = _use_cpu_kernel(qg)
        for c, dst, saved in zip(p.calls, p.dst, per_call):
            g = grad.index_select(0, dst).view(c.n, c.lq, N, D).transpose(1, 2)
            if cpu:
                gq, gk, gv = _cpu_kernel()[1](
                    g, _q_view(qg, c), _k_view(kg, c), _k_view(vg, c), *saved, 0.0, c.lq == c.lk,
                    attn_mask=p.additive_mask(c, qg.dtype), scale=ctx.scale)
            else:
                with torch.enable_grad():
                    gq, gk, gv = torch.autograd.grad(saved[3], saved[:3], g)
            dq.index_copy_(0, dst, _rows_of(gq))
            _k_view(dk, c).add_(gk)
            _k_view(dv, c).add_(gv)
        ctx.per_call = None

        def to_slots(d: torch.Tensor) -> torch.Tensor:
            return d.index_select(0, p.key_index).index_add_(0, p.extra_slots, d.index_select(0, p.extra_rows))

        return dq[:-1], to_slots(dk), to_slots(dv), None, None


def calls_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPlan, scale: float) -> torch.Tensor:
    """The plan's SDPA calls. q [B,N,T,D], k/v [B,K,T,D] -> [B,T,N,D] (under context parallelism q [B,N,R,D] the
    rank's rows, k/v the whole window's, out [B,R,N,D]); differentiable."""
    B, N, T, D = q.shape
    q_r, k_r, v_r = _rows(q), _rows(k), _rows(v)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _Calls.apply(q_r, k_r, v_r, p, scale)
    else:
        out = _forward(p, *_gathered(p, q_r, k_r, v_r), scale, graph=False)[0]
    return out.view(B, T, N, D)


@functools.cache
def torch_varlen_attn():
    """`torch.nn.attention.varlen.varlen_attn` where the installed torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def cuda_backend(q: torch.Tensor) -> Backend:
    """Which path runs q [B,N,T,D]: the SDPA `calls` off CUDA; on CUDA torch's varlen kernel
    (FlashAttention-2: bf16/fp16, sm80+, D a multiple of 8 up to 256), else FlexAttention."""
    if q.device.type != "cuda":
        return "calls"
    D = q.shape[-1]
    if (torch_varlen_attn() is not None and q.dtype in (torch.bfloat16, torch.float16) and D % 8 == 0 and D <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):
        return "torch_varlen"
    try:
        from torch.nn.attention import flex_attention  # noqa: F401  (a plain `import torch.…` here would make `torch` local)
    except ImportError:
        return "calls"
    return "flex"


class _GatherRows(torch.autograd.Function):
    """`x[p.square_rows]` for x [B*T, H, D] whose backward is deterministic on CUDA.

    `index_select`'s CUDA backward scatters with atomic adds, so the anchor's gradient (its row is
    gathered once per document) summed in a different order from run to run, and a resumed run
    departed from the uninterrupted one in the last bits. Here each slot takes its first row's
    gradient by a gather, and the slots gathered more than once add their other rows in a fixed
    order (a sum over a padded [n, m] matrix), written back at distinct indices."""

    @staticmethod
    def forward(ctx, x, p: VarlenPlan):  # type: ignore[override]
        ctx.p = p
        return x.index_select(0, p.square_rows)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        p = ctx.p
        out = g.index_select(0, p.square_first)
        if p.square_dups is not None:
            padded = torch.cat([g, g.new_zeros((1, *g.shape[1:]))])
            extra = padded[p.square_dups].sum(dim=1)
            out[p.square_dup_slots] = out[p.square_dup_slots] + extra
        return out, None


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPlan, scale: float) -> torch.Tensor:
    """All square segments in one `varlen_attn` call (causal = window (-1, 0)); -> [B,T,N,D]."""
    B, N, T, D = q.shape
    K = k.shape[1]
    q_r, k_r, v_r = (_GatherRows.apply(_rows(x), p) for x in (q, k, v))  # [R, H, D]
    params = _varlen_params()
    kw: dict[str, Any] = {"scale": scale}
    if N != K:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # torch <= 2.11: no GQA flag; each kv head serves N/K query heads side by side
            k_r, v_r = (expand_kv(x, N // K) for x in (k_r, v_r))
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal
    else:
        kw["is_causal"] = True
    out = torch_varlen_attn()(q_r, k_r, v_r, p.cu_seqlens, p.cu_seqlens, p.max_seqlen, p.max_seqlen, **kw)
    return out.index_select(0, p.square_out).view(B, T, N, D)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names of the installed `varlen_attn` (they changed between torch releases)."""
    import inspect

    return frozenset(inspect.signature(torch_varlen_attn()).parameters)


def flex_block_mask(p: VarlenPlan, device: torch.device) -> tuple[Any, int]:
    """Block mask of the packed square rows (block-diagonal causal), cached on the plan.

    Rows are padded to a multiple of `_FLEX_ROWS` (so few shapes compile); each padding row is a
    segment of its own. Returns (block_mask, padded row count).
    """
    key = str(device)
    if key not in p._flex_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        R = int(p.square_rows.shape[0])
        R_pad = -(-R // _FLEX_ROWS) * _FLEX_ROWS
        lens = torch.diff(p.cu_seqlens.long()).to(device)
        seg_id = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens)
        seg_id = torch.cat([seg_id, -1 - torch.arange(R_pad - R, device=device)])  # padding: one segment per row

        def same_segment_causal(b, h, q_idx, kv_idx):
            return (seg_id[q_idx] == seg_id[kv_idx]) & (kv_idx <= q_idx)

        block_mask = create_block_mask(same_segment_causal, 1, None, R_pad, R_pad, device=device,
                                       _compile=device.type == "cuda")
        p._flex_mask[key] = (block_mask, R_pad)
    return p._flex_mask[key]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPlan, scale: float) -> torch.Tensor:
    """Compiled FlexAttention on the packed square rows [1, H, R_pad, D]; -> [B,T,N,D]."""
    B, N, T, D = q.shape
    block_mask, R_pad = flex_block_mask(p, q.device)
    R = int(p.square_rows.shape[0])

    def packed(x: torch.Tensor) -> torch.Tensor:  # [B,H,T,D] -> [1, H, R_pad, D]
        r = _GatherRows.apply(_rows(x), p)
        r = F.pad(r, (0, 0, 0, 0, 0, R_pad - R))
        return r.transpose(0, 1).unsqueeze(0)

    out = call_flex(packed(q), packed(k), packed(v), block_mask, scale)
    return out[0].transpose(0, 1).index_select(0, p.square_out).view(B, T, N, D)


def varlen_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: VarlenPlan, scale: float,
                          backend: Backend | None = None) -> torch.Tensor:
    """The `varlen` engine: q [B,N,T,D], k/v [B,K,T,D] (RoPE applied) -> out [B,T,N,D]; differentiable.

    backend: None picks `cuda_backend(q)`; tests force one (`flex` runs forward-only on CPU).
    """
    backend = backend or (cuda_backend(q) if p.q_gather is None else "calls")  # a rank's share: the calls only
    if backend == "torch_varlen":
        return _torch_varlen(q, k, v, p, scale)
    if backend == "flex":
        return _flex(q, k, v, p, scale)
    return calls_attention(q, k, v, p, scale)
