"""The `varlen` engine (torchtrain.attention.varlen_sdpa) against eager attention with the contract mask:
every variant and layout, odd lengths, GQA, float32 forward within 1e-6
and gradients within 1e-5 (max-abs error over the reference's max-abs), through each of its paths:
whole buckets, query chunks, long segments run whole, and the per-call autograd path used off the
CPU kernel. Model-level equality is in test_engines (ENGINES_HERE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.torchtrain.conftest import packed_batch
from torchtrain.attention import varlen_sdpa
from torchtrain.attention import eager_attention
from torchtrain.attention.variants import VARIANTS, dense_mask
from torchtrain.attention.varlen import varlen_segments
from torchtrain.attention.varlen_plan import CHUNK, VarlenPlan, bucket_lengths, plan
from torchtrain.attention.varlen_sdpa import varlen_sdpa_attention

LAYOUTS = ("cut", "padded", "interleaved")
D = 16
SCALE = D**-0.5


def _qkv(B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, T, D, generator=g).requires_grad_() for h in (6, 2, 2))


def _errors(variant: str, T: int, seed: int, **plan_kw) -> tuple[float, list[float], VarlenPlan]:
    batch = packed_batch(variant, T, layouts=LAYOUTS, seed=seed)
    q, k, v = _qkv(batch.doc_ids.shape[0], T, seed)
    ref = eager_attention(q, k, v, dense_mask(batch.doc_ids, variant)[:, None], SCALE)
    p = plan(varlen_segments(batch.doc_ids, variant), **plan_kw)
    out = varlen_sdpa_attention(q, k, v, p, SCALE)
    assert out.shape == ref.shape
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    g_ref = torch.autograd.grad(ref, (q, k, v), go)
    g_out = torch.autograd.grad(out, (q, k, v), go)
    fwd = float((out - ref).detach().abs().max())
    grads = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(g_out, g_ref)]
    return fwd, grads, p


def _check(variant, T, seed, **plan_kw):
    fwd, grads, p = _errors(variant, T, seed, **plan_kw)
    kinds = {"whole" if c.lq == c.lk else "masked" for c in p.calls}
    print(f"{variant} T={T} {plan_kw}: {len(p.calls)} calls ({', '.join(sorted(kinds))}); "
          f"max |fwd err| {fwd:.2e} (1e-6), grad errors q/k/v {', '.join(f'{e:.1e}' for e in grads)} (1e-5)")
    assert fwd <= 1e-6
    assert max(grads) <= 1e-5
    return p


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [97, 1025])
def test_varlen_equals_eager(variant, T):
    _check(variant, T, seed=T + 3)


@pytest.mark.parametrize("variant", ("anchor", "full"))
def test_long_segments_run_whole(variant):
    """Segments at least `long` keys run as one causal call (here long=100 so T=515 has some)."""
    p = _check(variant, 515, seed=5, long=100)
    assert any(c.lq == c.lk and c.lk >= 100 for c in p.calls)


@pytest.mark.parametrize("variant", ("anchor", "intra_doc"))
def test_chunked_segments(variant):
    """Small chunks (c=8) put most segments through bottom-right masked query chunks."""
    p = _check(variant, 515, seed=7, chunk=8)
    assert sum(c.lq != c.lk for c in p.calls) > 5


def test_autograd_path(monkeypatch):
    """Off the CPU kernel (CUDA's fallback) every call runs through autograd on leaf views."""
    monkeypatch.setattr(varlen_sdpa, "_use_cpu_kernel", lambda x: False)
    _check("anchor", 515, seed=11)
    _check("full", 97, seed=12)


def test_no_grad_forward_equals_grad_forward():
    batch = packed_batch("anchor", 515, layouts=LAYOUTS, seed=1)
    q, k, v = _qkv(batch.doc_ids.shape[0], 515, 1)
    p = plan(varlen_segments(batch.doc_ids, "anchor"))
    with torch.no_grad():
        a = varlen_sdpa_attention(q, k, v, p, SCALE)
    b = varlen_sdpa_attention(q, k, v, p, SCALE)
    assert torch.equal(a, b.detach())


def test_no_window_sized_tensor():
    """Masks are at most `chunk` rows by the longest segment; no T x T tensor is planned."""
    T = 1025
    batch = packed_batch("anchor", T, layouts=("cut",), seed=2)
    p = plan(varlen_segments(batch.doc_ids, "anchor"))
    longest = int(np.diff(p.cu_seqlens.numpy()).max())
    print("mask", None if p.mask is None else tuple(p.mask.shape), "longest segment", longest)
    assert p.mask is None or (p.mask.shape[0] <= CHUNK and p.mask.shape[1] <= longest)


def test_bucket_lengths():
    # 3 segments of 10 padded to 12 cost 3*(144-100) = 132 pairs <= 133: they join 12's bucket;
    # one of 3 would cost 144-9 = 135 > 133: a bucket of its own
    assert bucket_lengths(np.array([12, 10, 10, 10, 3]), pad_area=133) == {12: 12, 10: 12, 3: 3}
    assert bucket_lengths(np.array([12, 10, 10, 10]), pad_area=100) == {12: 12, 10: 10}
    assert bucket_lengths(np.array([5, 5]), pad_area=0) == {5: 5}


def test_bf16_close_to_fp32():
    """bf16 through the fused kernel: within twice eager bf16's own error against fp32 eager."""
    batch = packed_batch("anchor", 515, layouts=LAYOUTS, seed=9)
    q, k, v = (x.detach() for x in _qkv(batch.doc_ids.shape[0], 515, 9))
    mask = dense_mask(batch.doc_ids, "anchor")[:, None]
    ref = eager_attention(q, k, v, mask, SCALE)
    p = plan(varlen_segments(batch.doc_ids, "anchor"))
    base = (eager_attention(*(x.bfloat16() for x in (q, k, v)), mask, SCALE).float() - ref).norm() / ref.norm()
    err = (varlen_sdpa_attention(*(x.bfloat16() for x in (q, k, v)), p, SCALE).float() - ref).norm() / ref.norm()
    print(f"bf16 rel L2: varlen {err:.2e}, eager {base:.2e}")
    assert err <= 2 * base


# ---------------------------------------------------------------------------------------------
# CUDA (skipped here): the fused kernels the engine picks there, held against fp64 eager attention
# with the tolerance rule of the parity suite: at most twice eager attention's own error in the
# same dtype, plus a floor.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_CASES = [("torch_varlen", torch.bfloat16), ("flex", torch.float32), ("flex", torch.bfloat16),
              ("calls", torch.float32)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("backend,dtype", CUDA_CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CUDA_CASES])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_backends_equal_eager(backend, dtype, variant):
    if backend == "torch_varlen" and varlen_sdpa.torch_varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    T, seed = 1025, 13
    batch = packed_batch(variant, T, layouts=LAYOUTS, seed=seed)
    q, k, v = (x.detach().double().cuda() for x in _qkv(batch.doc_ids.shape[0], T, seed))
    mask = dense_mask(batch.doc_ids, variant)[:, None].cuda()
    p = plan(varlen_segments(batch.doc_ids.cuda(), variant))
    go = torch.randn(q.shape[0], T, q.shape[1], D, generator=torch.Generator().manual_seed(seed + 1)).double().cuda()

    def run(fn, dt):
        xs = [x.to(dt).requires_grad_() for x in (q, k, v)]
        out = fn(*xs)
        return out, torch.autograd.grad(out, xs, go.to(dt))

    ref, g_ref = run(lambda *x: eager_attention(*x, mask, SCALE), torch.float64)
    base, g_base = run(lambda *x: eager_attention(*x, mask, SCALE), dtype)
    out, g_out = run(lambda *x: varlen_sdpa_attention(*x, p, SCALE, backend=backend), dtype)
    floor = 1e-6 if dtype == torch.float32 else 1e-4
    errs = [(_rel(out, ref), _rel(base, ref))] + [(_rel(a, r), _rel(b, r)) for a, b, r in zip(g_out, g_base, g_ref)]
    print(f"{variant} {backend} {dtype}: rel L2 (engine, eager) out/dq/dk/dv "
          + ", ".join(f"({e:.1e}, {b:.1e})" for e, b in errs))
    for name, (e, b) in zip(("out", "dq", "dk", "dv"), errs):
        assert e <= 2 * b + floor, f"{name}: {e:.2e} > 2 x {b:.2e} + {floor:.0e}"


def _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's `varlen_attn` semantics on the CPU (no enable_gqa; causal = window (-1, 0)):
    one SDPA call per segment, rows [L, H, D]."""
    assert window_size == (-1, 0) and key.shape[1] == query.shape[1]
    outs = []
    for a, b in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("variant", ("anchor", "full", "intra_doc"))
def test_fused_kernel_wiring_on_cpu(monkeypatch, variant):
    """The CUDA path's gather, GQA expansion, deterministic gather backward and scatter, run on the
    CPU through a per-segment stand-in for `varlen_attn`: equal to eager within the fp32 rule."""
    monkeypatch.setattr(varlen_sdpa, "torch_varlen_attn", lambda: _fake_varlen_attn)
    varlen_sdpa._varlen_params.cache_clear()
    try:
        batch = packed_batch(variant, 515, layouts=LAYOUTS, seed=21)
        q, k, v = _qkv(batch.doc_ids.shape[0], 515, 21)
        ref = eager_attention(q, k, v, dense_mask(batch.doc_ids, variant)[:, None], SCALE)
        p = plan(varlen_segments(batch.doc_ids, variant))
        out = varlen_sdpa_attention(q, k, v, p, SCALE, backend="torch_varlen")
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(22))
        errs = [float((a - b).abs().max() / b.abs().max()) for a, b in
                zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go))]
        fwd = float((out - ref).detach().abs().max())
        print(variant, "fwd", fwd, "grads", errs,
              "slots gathered twice or more:", 0 if p.square_dups is None else p.square_dups.shape[0])
        assert fwd <= 1e-6
        assert max(errs) <= 1e-5
        assert (p.square_dups is not None) == (variant == "anchor")
    finally:
        varlen_sdpa._varlen_params.cache_clear()


def test_gather_rows_backward_equals_index_select():
    """_GatherRows's fixed-order backward sums the same rows as index_select's (anchor: many)."""
    batch = packed_batch("anchor", 1025, layouts=("cut",), seed=4)
    p = plan(varlen_segments(batch.doc_ids, "anchor"))
    x = torch.randn(batch.doc_ids.numel(), 3, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(p.square_rows.shape[0], 3, 8, dtype=torch.float64)
    a, = torch.autograd.grad(varlen_sdpa._GatherRows.apply(x, p), x, g)
    b, = torch.autograd.grad(x.index_select(0, p.square_rows), x, g)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("checkpointed", (True, False))
def test_activation_checkpointing_drops_the_kernels_outputs(monkeypatch, checkpointed):
    """Under activation checkpointing the CPU kernel's per-call outputs (attention output, log-sum-exp) are
    dropped with the rest of the layer after its forward and recomputed in the backward, as every saved
    tensor is; without checkpointing they are kept for the backward. The gradients are the same either way."""
    if varlen_sdpa._cpu_kernel() is None:
        pytest.skip("this torch has no CPU flash-attention kernel: the per-call autograd path runs")
    import weakref

    from torch.utils.checkpoint import checkpoint

    made = []
    forward, backward = varlen_sdpa._cpu_kernel()

    def tracked(*a, **kw):
        out = forward(*a, **kw)
        made.extend(weakref.ref(t) for t in out[:2])
        return out

    monkeypatch.setattr(varlen_sdpa, "_cpu_kernel", lambda: (tracked, backward))
    batch = packed_batch("anchor", 515, layouts=LAYOUTS, seed=5)
    q, k, v = _qkv(batch.doc_ids.shape[0], 515, 5)
    p = plan(varlen_segments(batch.doc_ids, "anchor"))

    def layer(q, k, v):
        return varlen_sdpa_attention(q, k, v, p, SCALE) * 1.5

    out = checkpoint(layer, q, k, v, use_reentrant=False) if checkpointed else layer(q, k, v)
    first = list(made)
    assert first and all((r() is None) == checkpointed for r in first)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    grads = torch.autograd.grad(out, (q, k, v), go)
    made.clear()
    want = torch.autograd.grad(layer(q, k, v), (q, k, v), go)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))
