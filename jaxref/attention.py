"""Causal attention under a dtype policy: dense (Hugging Face eager/sdpa) and online (FlashAttention-2).

Legend: B batch, T query slots, S key slots, N query heads, K kv heads, G = N // K, D head dim.
Both paths take q [B,T,N,D], k/v [B,S,K,D] (already rotated) and the slot `doc_ids` [B,T],
and round exactly where the emulated stack rounds:

dense  (hf_bf16): s = (q·kᵀ in qk_acc) → logits dtype, × scale (fp32 product, rounded); softmax in
       `softmax` dtype (masked entries −inf), probabilities cast to pv_in; p·v in pv_acc.
online (fa2_bf16, paper_bf16): FlashAttention-2 over key blocks of `policy.kv_block`: fp32
       scores × scale, running max and sum in the softmax dtype, probabilities rounded to pv_in
       *before* p·v (the running sum uses the unrounded ones, as the kernel does), accumulation in
       pv_acc, division by the sum at the end.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxref.policy import DtypePolicy
from jaxref.variants import Variant, allowed


def wide(dtype) -> jnp.dtype:
    """The dtype torch computes 16-bit elementwise ops and matmul accumulations in: fp32 for 16-bit, else itself."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def scale_logits(s, logits_dtype, scale: float):
    """Round q·kᵀ to the logits dtype, then multiply by the (unrounded) scale and round once more.

    This is torch's `bf16_tensor * python_float`: the product is formed in fp32 and rounded, the
    scale itself is never rounded to bf16.
    """
    s = s.astype(logits_dtype)
    w = wide(logits_dtype)
    return (s.astype(w) * jnp.asarray(scale, w)).astype(logits_dtype)


def _group_queries(q, K: int):
    """q [B,T,N,D] → [B,K,G*T,D]: the G query heads of each kv head stacked along the rows, so
    q·kᵀ is one matmul per kv head and its [.., G*T, S] result reshapes to [B,K,G,T,S] for free
    (a layout with T before G would cost a transpose of the whole score tensor)."""
    B, T, N, D = q.shape
    return jnp.transpose(q.reshape(B, T, K, N // K, D), (0, 2, 3, 1, 4)).reshape(B, K, (N // K) * T, D)


def _heads_first(x):
    """k or v [B,S,K,D] → [B,K,S,D]."""
    return jnp.transpose(x, (0, 2, 1, 3))


def _pv(p, v, pv_dtype, acc_dtype):
    """p [B,K,G,T,S] · v [B,S,K,D] → ctx [B,T,K*G,D] (operands in pv_dtype, accumulation in acc_dtype)."""
    B, K, G, T, S = p.shape
    D = v.shape[-1]
    ctx = jnp.einsum("BKMS,BKSD->BKMD", p.reshape(B, K, G * T, S).astype(pv_dtype),
                     _heads_first(v).astype(pv_dtype), preferred_element_type=acc_dtype)
    return jnp.transpose(ctx.reshape(B, K, G, T, D), (0, 3, 1, 2, 4)).reshape(B, T, K * G, D)


def scores(q, k, policy: DtypePolicy, scale: float):
    """Scaled attention logits. q [B,T,N,D], k [B,S,K,D] → [B,K,G,T,S] in the `logits` dtype."""
    B, T, N, D = q.shape
    K, S = k.shape[2], k.shape[1]
    qg = _group_queries(q.astype(policy.dtype("qk_in")), K)
    s = jnp.einsum("BKMD,BKSD->BKMS", qg, _heads_first(k.astype(policy.dtype("qk_in"))),
                   preferred_element_type=policy.dtype("qk_acc"))
    return scale_logits(s.reshape(B, K, N // K, T, S), policy.dtype("logits"), scale)


def _mask(doc_ids, q_slots, k_slots, variant: Variant):
    """bool [B,1,1,Tq,Sk] for query slots `q_slots` and key slots `k_slots` (index vectors)."""
    dq = doc_ids[:, q_slots][:, :, None]
    dk = doc_ids[:, k_slots][:, None, :]
    m = allowed(dq, dk, q_slots[:, None], k_slots[None, :], variant)
    return m[:, None, None]


def softmax_probs(s, mask, policy: DtypePolicy):
    """Masked softmax of logits [B,K,G,T,S] in the `softmax` dtype; returns probabilities in that dtype."""
    sm = policy.dtype("softmax")
    x = jnp.where(mask, s.astype(sm), -jnp.inf)
    x = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def dense_attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float):
    """Dense masked attention. Returns ctx [B,T,N,D] in the `pv_acc` dtype."""
    B, T, N, D = q.shape
    K = k.shape[2]
    slots = jnp.arange(T)
    s = scores(q, k, policy, scale)
    p = softmax_probs(s, _mask(doc_ids, slots, slots, variant), policy)
    return _pv(p, v, policy.dtype("pv_in"), policy.dtype("pv_acc"))


def online_attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float):
    """FlashAttention-2 forward arithmetic over key blocks. Returns ctx [B,T,N,D] in `pv_acc`."""
    B, T, N, D = q.shape
    K = k.shape[2]
    G = N // K
    blk = policy.kv_block
    nblk = math.ceil(T / blk)
    pad = nblk * blk - T
    sm, acc_t, pv = policy.dtype("softmax"), policy.dtype("pv_acc"), policy.dtype("pv_in")
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, nblk, blk, K, D)
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, nblk, blk, K, D)
    # Padded key slots get doc -1 and slot index >= T: never visible to a real query.
    docs = jnp.pad(doc_ids, ((0, 0), (0, pad)), constant_values=-1)
    q_slots = jnp.arange(T)
    qg = _group_queries(q.astype(policy.dtype("qk_in")), K)  # [B,K,G*T,D]

    def step(carry, xs):
        m, l, acc = carry
        kb, vb, b = xs
        k_slots = b * blk + jnp.arange(blk)
        s = jnp.einsum("BKMD,BKSD->BKMS", qg, _heads_first(kb.astype(policy.dtype("qk_in"))),
                       preferred_element_type=policy.dtype("qk_acc")).reshape(B, K, G, T, blk)
        s = scale_logits(s, policy.dtype("logits"), scale)
        dq = doc_ids[:, :, None]
        dk = jax.lax.dynamic_slice_in_dim(docs, b * blk, blk, axis=1)[:, None, :]
        mask = allowed(dq, dk, q_slots[:, None], k_slots[None, :], variant)[:, None, None]
        s = jnp.where(mask, s.astype(sm), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # Rows with nothing visible yet keep m = -inf; use 0 there so exp() gives 0, not NaN.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, jnp.zeros_like(m_new))
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * corr + jnp.sum(p, axis=-1)
        upd = jnp.einsum("BKMS,BKSD->BKMD", p.reshape(B, K, G * T, blk).astype(pv), _heads_first(vb).astype(pv),
                         preferred_element_type=acc_t).reshape(B, K, G, T, D)
        acc = acc * corr[..., None].astype(acc_t) + upd
        return (m_new, l, acc), None

    m0 = jnp.full((B, K, G, T), -jnp.inf, dtype=sm)
    l0 = jnp.zeros((B, K, G, T), dtype=sm)
    a0 = jnp.zeros((B, K, G, T, D), dtype=acc_t)
    xs = (jnp.moveaxis(kp, 1, 0), jnp.moveaxis(vp, 1, 0), jnp.arange(nblk))
    (m, l, acc), _ = jax.lax.scan(step, (m0, l0, a0), xs)
    out = acc / l[..., None].astype(acc_t)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, D)


def attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float):
    """Dispatch on `policy.attention`. Returns ctx [B,T,N,D] in `pv_acc`."""
    if policy.attention == "online":
        return online_attention(q, k, v, doc_ids, variant, policy, scale)
    return dense_attention(q, k, v, doc_ids, variant, policy, scale)


def row_scores_probs(q, k, doc_ids, rows, variant: Variant, policy: DtypePolicy, scale: float):
    """Logits and probabilities of chosen query rows only (bounded memory at long T).

    Args: q [B,T,N,D], k [B,S,K,D], rows int [R]. Returns (scores, probs) each [B,N,R,S]: scores
    unmasked (q·kᵀ·scale in the logits dtype), probabilities 0 where masked.
    """
    B, T, N, D = q.shape
    rows = jnp.asarray(rows)
    s = scores(q[:, rows], k, policy, scale)  # [B,K,G,R,S]
    p = softmax_probs(s, _mask(doc_ids, rows, jnp.arange(k.shape[1]), variant), policy)
    R, S = rows.shape[0], k.shape[1]
    return s.reshape(B, N, R, S), p.reshape(B, N, R, S)


def full_probs(q, k, doc_ids, variant: Variant, policy: DtypePolicy, scale: float):
    """All probabilities and logits, for probes that reduce them at once: ([B,N,T,S], [B,N,T,S])."""
    B, T, N, D = q.shape
    slots = jnp.arange(T)
    s = scores(q, k, policy, scale)
    p = softmax_probs(s, _mask(doc_ids, slots, jnp.arange(k.shape[1]), variant), policy)
    return s.reshape(B, N, T, -1), p.reshape(B, N, T, -1)
