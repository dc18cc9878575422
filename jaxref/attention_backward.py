"""A kernel's own attention backward, written out (`policy.backward`): FlashAttention-2's, FlexAttention's,
torch's fused CPU kernel's.

`kernel_backward` is `online_attention` with a custom VJP whose backward recomputes the probabilities from
the scores and the row's log-sum-exp (`_recomputed_probs`) and rounds dS, dQ, dK and dV where the kernel
rounds them, by blocks of query rows against every key; `_cpu_backward` is torch's CPU flash backward, which
adds each block's gradients into gradients held in 16 bits. Autodiff of the forward (`backward: autodiff`)
does none of these roundings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxref.attention_core import _group_queries, _heads_first, _mask, _qk, _ungroup, wide_einsum
from jaxref.attention_forward import online_attention
from jaxref.policy import DtypePolicy
from jaxref.variants import Variant


BACKWARD_ROWS = 64
"""Query rows per step of `kernel_backward`'s backward (a step holds their scores against every key)."""


def kernel_backward(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float, fused: bool | None = None):
    """`online_attention` whose gradient is a kernel's own backward, written out (`policy.backward`).

    Forward: `online_attention` (on the CPU the fused kernel where it covers the policy: the backward
    below does not differentiate it). Backward, FlashAttention-2's arithmetic (flash_bwd_kernel.h), by
    blocks of query rows against every key: the scores recomputed as the forward forms them (`_qk`),
    P = exp(s − lse) in the `softmax` dtype with lse the row's log-sum-exp; dV = Pᵀ·dO with P rounded to
    `pv_in`; dP = dO·vᵀ; D = rowsum(dO·O) with O the output rounded to `qk_in` (the kernel's output
    dtype); dS = P·(dP − D) rounded to `qk_in` before dQ = dS·k and dK = dSᵀ·q, each times the scale at
    the end; sums in `pv_acc`. "fa2" rounds each query head's dK and dV to `qk_in` / `pv_in` before its
    GQA group's sum (`dk_expanded` in flash_api.cpp); "flex" sums the group in the accumulator, inside
    the kernel, with D in fp32 (inductor's lowering types that sum bf16, but the kernel does not round it:
    FlexAttention's dQ lies 0.0009-0.0022 from this arithmetic's and 0.0035-0.0118 from it with D
    rounded, its dK 0.0007-0.0011 (0.0025-0.0052 with D rounded), its dV within 1e-4, rel. L2 over fp64's
    norm: experiments/attn_grad_diag/results/attn_grad_diag_h100*.json); "cpu" is torch's fused CPU kernel
    (`_cpu_backward`: the same arithmetic added into bf16 gradients block by block). The gradients of q,
    k and v come back in their own dtypes. Autodiff of the forward (`backward: autodiff`) does none of these roundings: its
    dS stays fp32 (experiments/attn_grad_diag/attn_grad_diag.py measures what that misses).
    """
    qk_in, pv_in, acc = (policy.dtype(s) for s in ("qk_in", "pv_in", "pv_acc"))
    B, T, N, D = q.shape
    K = k.shape[2]
    G = N // K
    R = cpu_backward_rows(T) if policy.backward == "cpu" else min(BACKWARD_ROWS, T)
    nb = -(-T // R)
    pad = nb * R - T

    def forward(q, k, v, doc_ids):
        return online_attention(q, k, v, doc_ids, variant, policy, scale, fused=fused)

    # doc_ids is an argument, not a closure: under jit and scan it is a tracer, which a custom_vjp
    # function may not close over; its cotangent is float0 (an integer input).
    @jax.custom_vjp
    def f(q, k, v, doc_ids):
        return forward(q, k, v, doc_ids)

    def f_fwd(q, k, v, doc_ids):
        out = forward(q, k, v, doc_ids)
        return out, (q, k, v, doc_ids, out)

    def f_bwd(res, g):
        q, k, v, doc_ids, out = res
        qg = _group_queries(q.astype(qk_in), K)  # [B,K,G,T,D]
        kh, vh = _heads_first(k.astype(qk_in)), _heads_first(v.astype(pv_in))  # [B,K,T,D]
        o = _group_queries(out.astype(qk_in), K).astype(acc)
        do = _group_queries(g.astype(acc), K)
        padded = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))  # noqa: E731
        qg, o, do = padded(qg), padded(o), padded(do)  # padded rows: dO = 0, nothing visible
        if policy.backward == "cpu":
            dq, dk, dv = _cpu_backward(qg, kh, vh, o, do, doc_ids, variant, policy, scale, R)
            return (_ungroup(dq[:, :, :, :T]).astype(q.dtype), jnp.transpose(dk, (0, 2, 1, 3)).astype(k.dtype),
                    jnp.transpose(dv, (0, 2, 1, 3)).astype(v.dtype), np.zeros(doc_ids.shape, jax.dtypes.float0))

        def step(carry, r0):
            dk, dv = carry
            qb, ob, dob = (jax.lax.dynamic_slice_in_dim(x, r0, R, axis=3) for x in (qg, o, do))
            p = _recomputed_probs(qb, kh, doc_ids, r0, T, variant, policy, scale)  # [B,K,G,R,T]
            dv = dv + wide_einsum("BKGRS,BKGRD->BKGSD", p.astype(pv_in), dob.astype(pv_in), acc)
            dp = wide_einsum("BKGRD,BKSD->BKGRS", dob.astype(pv_in), vh, acc)
            delta = jnp.sum(dob * ob, axis=-1, keepdims=True)
            ds = (p.astype(acc) * (dp - delta)).astype(qk_in)
            dq = wide_einsum("BKGRS,BKSD->BKGRD", ds, kh, acc) * jnp.asarray(scale, acc)
            dk = dk + wide_einsum("BKGRS,BKGRD->BKGSD", ds, qb, acc)
            return (dk, dv), dq

        zeros = jnp.zeros((B, K, G, T, D), acc)
        (dk, dv), dq = jax.lax.scan(step, (zeros, zeros), jnp.arange(nb) * R)
        dq = jnp.moveaxis(dq, 0, 3).reshape(B, K, G, nb * R, D)[:, :, :, :T]
        dk = dk * jnp.asarray(scale, acc)

        def group(x, dtype):  # [B,K,G,T,D] per query head -> [B,T,K,D] per kv head
            if policy.backward == "fa2":
                x = x.astype(dtype).astype(acc)
            return jnp.transpose(jnp.sum(x, axis=2).astype(dtype), (0, 2, 1, 3))

        return (_ungroup(dq).astype(q.dtype), group(dk, qk_in).astype(k.dtype), group(dv, pv_in).astype(v.dtype),
                np.zeros(doc_ids.shape, jax.dtypes.float0))

    f.defvjp(f_fwd, f_bwd)
    return f(q, k, v, doc_ids)


def _recomputed_probs(qb, kh, doc_ids, r0, T: int, variant: Variant, policy: DtypePolicy, scale: float):
    """A kernel backward's P = exp(s − lse) for query rows r0 … r0+R−1 (qb [B,K,G,R,D]; rows past T, the
    padding of the last block, see nothing) against every key (kh [B,K,T,D]): the scores as the forward
    forms them (`_qk`), lse the row's log-sum-exp, both in the `softmax` dtype. Returns [B,K,G,R,T]."""
    q_slots = r0 + jnp.arange(qb.shape[3])
    visible = _mask(doc_ids, jnp.minimum(q_slots, T - 1), jnp.arange(T), variant) & (q_slots < T)[:, None]
    s = jnp.where(visible, _qk(qb, kh, policy, scale).astype(policy.dtype("softmax")), -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0)
    lse = mx + jnp.log(jnp.sum(jnp.exp(s - mx), axis=-1, keepdims=True))
    return jnp.where(visible, jnp.exp(s - lse), 0)


def cpu_backward_rows(T: int) -> int:
    """The query block of torch's CPU flash backward at T queries (flash_attention_backward_kernel_impl's
    dispatch: 256 from 768 on, 64 from 192, else 32); its key block is the policy's `kv_block` (512)."""
    return 256 if T >= 768 else 64 if T >= 192 else 32


def _cpu_backward(qg, kh, vh, o, do, doc_ids, variant: Variant, policy: DtypePolicy, scale: float, R: int):
    """torch's CPU flash backward (ATen/native/cpu/FlashAttentionKernel.cpp, `cpu_flash_attention_backward`):
    for each query head of a kv head's group in turn, each block of R query rows, each key block of
    `kv_block`: the FA-2 arithmetic of `kernel_backward` (dS rounded to `qk_in`, D from the rounded output),
    with dV, dQ and dK each added into a gradient held in `qk_in` (a gemm with beta = 1 on a bf16 output:
    one rounding per block and per head). qg, o, do [B,K,G,Tp,D] (Tp: T padded to whole blocks, dO = 0
    there); kh, vh [B,K,T,D]. Returns dq [B,K,G,Tp,D], dk and dv [B,K,T,D], in `qk_in`."""
    qk_in, pv_in, acc = (policy.dtype(s) for s in ("qk_in", "pv_in", "pv_acc"))
    B, K, G, Tp, D = qg.shape
    T = kh.shape[2]
    blk = min(policy.kv_block, T)
    key_blocks = [(n, min(n + blk, T)) for n in range(0, T, blk)]
    nb = Tp // R
    add = lambda a, x: (a.astype(acc) + x).astype(qk_in)  # noqa: E731  (into a bf16 gradient: rounded)
    sc = jnp.asarray(scale, acc)

    def step(carry, gm):
        dq, dk, dv = carry
        g, r0 = gm // nb, (gm % nb) * R
        qb, ob, dob = (jax.lax.dynamic_slice(x, (0, 0, g, r0, 0), (B, K, 1, R, D))[:, :, 0] for x in (qg, o, do))
        delta = jnp.sum(dob.astype(acc) * ob.astype(acc), axis=-1, keepdims=True)  # [B,K,R,1]
        p = _recomputed_probs(qb[:, :, None], kh, doc_ids, r0, T, variant, policy, scale)[:, :, 0].astype(acc)
        dq_b = jnp.zeros((B, K, R, D), qk_in)
        for n0, n1 in key_blocks:
            pb, kb, vb = p[..., n0:n1], kh[:, :, n0:n1], vh[:, :, n0:n1]
            dv = dv.at[:, :, n0:n1].set(add(dv[:, :, n0:n1], wide_einsum("BKRS,BKRD->BKSD", pb.astype(pv_in),
                                                                           dob.astype(pv_in), acc)))
            dp = wide_einsum("BKRD,BKSD->BKRS", dob.astype(pv_in), vb, acc)
            ds = (pb * (dp - delta)).astype(qk_in)
            dq_b = add(dq_b, sc * wide_einsum("BKRS,BKSD->BKRD", ds, kb, acc))
            dk = dk.at[:, :, n0:n1].set(add(dk[:, :, n0:n1], sc * wide_einsum("BKRS,BKRD->BKSD", ds, qb, acc)))
        dq = jax.lax.dynamic_update_slice(dq, dq_b[:, :, None], (0, 0, g, r0, 0))
        return (dq, dk, dv), None

    zeros = jnp.zeros((B, K, T, D), qk_in)
    (dq, dk, dv), _ = jax.lax.scan(step, (jnp.zeros((B, K, G, Tp, D), qk_in), zeros, zeros), jnp.arange(G * nb))
    return dq, dk, dv
