"""The oracle's forward attention paths: dense (Hugging Face eager/sdpa) and online (FlashAttention-2).

`dense_attention` takes the exact softmax over whole rows and `online_attention` runs FlashAttention-2's
arithmetic over key blocks of `policy.kv_block`, each rounding where the emulated stack rounds (the module
docstring of `jaxref.attention` says where). On the CPU the fused C++ kernel (`jaxref.kernels`) runs instead
where it covers the policy and `fused` allows it (`kernel_args`); `blocked_dense_attention` and
`blocked_online_attention` are the JAX paths, on every platform and under every policy, by blocks of query rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxref import kernels
from jaxref.attention_core import (
    _by_row_blocks,
    _group_queries,
    _heads_first,
    _mask,
    _pv,
    _qk,
    round_probs,
    _ungroup,
    softmax_probs,
)
from jaxref.fexp import _softmax_exp
from jaxref.policy import ONE_BLOCK, DtypePolicy
from jaxref.variants import Variant


ATTENTION_STAGES = ("qk_in", "qk_acc", "logits", "softmax", "pv_in", "pv_acc")
_KERNEL_DTYPES = {"qk_in": ("float32", "bfloat16"), "qk_acc": ("float32",), "logits": ("float32", "bfloat16"),
                  "softmax": ("float32",), "pv_in": ("float32", "bfloat16"), "pv_acc": ("float32",)}


def kernel_args(q, k, policy: DtypePolicy, fused: bool | None = None) -> dict | None:
    """The fused C++ kernel's arguments for this attention on the CPU, or None where it does not apply.

    It applies when `fused` allows it (None: the user's default, `kernels.enabled()`), the kernel is
    built, the attention is self-attention (as many keys as queries), and either the attention is
    dense with every attention stage fp32, or online with every stage one the kernel rounds to (fp32
    softmax and accumulators; operands and logits fp32 or bf16; no FP8, whose probabilities it cannot
    round), the exact exponential and a key block that is a multiple of 16 or the whole window. Returns {logits_bf16, pv_bf16, kv_block}
    (kv_block 0: dense).
    """
    if fused is None:
        fused = kernels.enabled()
    if not (fused and q.shape[1] == k.shape[1] and policy.probs is None
            and all(getattr(policy, s) in ok for s, ok in _KERNEL_DTYPES.items())):
        return None
    kv_block = 0
    if policy.attention == "dense" and not all(getattr(policy, s) == "float32" for s in ATTENTION_STAGES):
        return None  # hf_bf16 and the like: the JAX path is torch's eager arithmetic bit for bit
    if policy.attention == "online":
        T = q.shape[1]
        if policy.exp != "exact" or not (policy.kv_block >= T or policy.kv_block % 16 == 0):
            return None
        kv_block = min(policy.kv_block, ONE_BLOCK)
    if not kernels.available():
        return None
    return {"logits_bf16": policy.logits == "bfloat16", "pv_bf16": policy.pv_in == "bfloat16", "kv_block": kv_block}


def _on_kernel(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float, args: dict, jax_path):
    """The kernel on the CPU, `jax_path(q, k, v, doc_ids)` on other platforms (same arithmetic, up to
    rounding): operands rounded to the policy's qk_in / pv_in first, as the JAX paths round them."""
    qk_in, pv_in = policy.dtype("qk_in"), policy.dtype("pv_in")

    def cpu(q, k, v, d):
        return kernels.causal_attention(q.astype(qk_in), k.astype(qk_in), v.astype(pv_in), d, variant, scale, **args)

    return jax.lax.platform_dependent(q, k, v, doc_ids, cpu=cpu, default=jax_path)


def dense_attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float, *,
                    fused: bool | None = None):
    """Dense masked attention (exact softmax over whole rows). Returns ctx [B,T,N,D] in the `pv_acc` dtype.

    Rows go by blocks (`_by_row_blocks`), each against the keys up to the end of its class: the
    keys skipped are masked for the whole block and would contribute exp(−inf) = 0, so each row's
    softmax and p·v are the dense ones. With every attention stage fp32, on the CPU, the same
    arithmetic runs in the fused kernel instead when `fused` allows it (`kernel_args`; None: the
    user's default, `kernels.enabled()`; it differs from this path by rounding only, as
    tests/jaxref/test_fused_attention.py measures). The kernel has no VJP: pass `fused=False` to
    trace a function that will be differentiated.
    """
    args = kernel_args(q, k, policy, fused)
    if args is not None and args["kv_block"] == 0:
        return _on_kernel(q, k, v, doc_ids, variant, policy, scale, args,
                          lambda q, k, v, d: blocked_dense_attention(q, k, v, d, variant, policy, scale))
    return blocked_dense_attention(q, k, v, doc_ids, variant, policy, scale)


def blocked_dense_attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float):
    """`dense_attention` in JAX, by blocks of query rows (every policy, every platform)."""
    qk_in, pv_in, pv_acc = policy.dtype("qk_in"), policy.dtype("pv_in"), policy.dtype("pv_acc")
    qg = _group_queries(q.astype(qk_in), k.shape[2])  # [B,K,G,T,D]
    kh, vh = _heads_first(k.astype(qk_in)), _heads_first(v.astype(pv_in))

    def make_block(R, e):
        kc, vc, k_slots = kh[:, :, :e], vh[:, :, :e], jnp.arange(e)

        def block(r0):
            s = _qk(jax.lax.dynamic_slice_in_dim(qg, r0, R, axis=3), kc, policy, scale)
            p = softmax_probs(s, _mask(doc_ids, r0 + jnp.arange(R), k_slots, variant), policy)
            return _pv(round_probs(p, policy), vc, pv_in, pv_acc)

        return block

    return _ungroup(_by_row_blocks(q.shape[1], make_block))


def online_attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float, *,
                     fused: bool | None = None):
    """FlashAttention-2 forward arithmetic over key blocks. Returns ctx [B,T,N,D] in `pv_acc`.

    On the CPU it runs in the fused kernel when `fused` allows it and the kernel covers the policy
    (`kernel_args`), as `dense_attention` does; else `blocked_online_attention`.
    """
    args = kernel_args(q, k, policy, fused)
    if args is not None and args["kv_block"] > 0:
        return _on_kernel(q, k, v, doc_ids, variant, policy, scale, args,
                          lambda q, k, v, d: blocked_online_attention(q, k, v, d, variant, policy, scale))
    return blocked_online_attention(q, k, v, doc_ids, variant, policy, scale)


def blocked_online_attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float):
    """`online_attention` in JAX (every policy, every platform).

    Rows go by blocks (`_by_row_blocks`), as the kernel's outer loop does; each block runs over the
    key blocks up to the end of its class. A key block masked for a whole row leaves that row's
    running max, sum and accumulator as they were (p = 0, correction exp(0) = 1), so skipping the
    key blocks after a class changes nothing but the matmul kernels' summation order (an ulp).
    """
    B, T, N, D = q.shape
    K = k.shape[2]
    blk = min(policy.kv_block, T)  # a block longer than the window is the window (no padding)
    nblk = math.ceil(T / blk)
    pad = nblk * blk - T
    sm, acc_t, pv = policy.dtype("softmax"), policy.dtype("pv_acc"), policy.dtype("pv_in")
    qk_in = policy.dtype("qk_in")
    # [nblk, B,K,blk,D] key/value blocks. Padded key slots get doc -1 and slot index >= T: never
    # visible to a real query.
    kp = jnp.moveaxis(_heads_first(jnp.pad(k.astype(qk_in), ((0, 0), (0, pad), (0, 0), (0, 0))))
                      .reshape(B, K, nblk, blk, D), 2, 0)
    vp = jnp.moveaxis(_heads_first(jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))).reshape(B, K, nblk, blk, D), 2, 0)
    docs = jnp.pad(doc_ids, ((0, 0), (0, pad)), constant_values=-1)
    qg = _group_queries(q.astype(qk_in), K)  # [B,K,G,T,D]

    def make_block(R, e):
        n = math.ceil(e / blk)
        xs = (kp[:n], vp[:n], jnp.arange(n))

        def block(r0):
            qb = jax.lax.dynamic_slice_in_dim(qg, r0, R, axis=3)
            q_slots = r0 + jnp.arange(R)

            def step(carry, x):
                m, l, acc = carry
                kb, vb, b = x
                mask = _mask(docs, q_slots, b * blk + jnp.arange(blk), variant)
                s = jnp.where(mask, _qk(qb, kb, policy, scale).astype(sm), -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                # Rows with nothing visible yet keep m = -inf; use 0 there so exp() gives 0, not NaN.
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, jnp.zeros_like(m_new))
                p = _softmax_exp(s - m_safe[..., None], policy, jnp.minimum(blk, T - b * blk))
                corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
                l = l * corr + jnp.sum(p, axis=-1)
                acc = acc * corr[..., None].astype(acc_t) + _pv(round_probs(p, policy), vb, pv, acc_t)
                return (m_new, l, acc), None

            G = N // K
            m0 = jnp.full((B, K, G, R), -jnp.inf, dtype=sm)
            l0 = jnp.zeros((B, K, G, R), dtype=sm)
            a0 = jnp.zeros((B, K, G, R, D), dtype=acc_t)
            (m, l, acc), _ = jax.lax.scan(step, (m0, l0, a0), xs)
            return acc / l[..., None].astype(acc_t)

        return block

    return _ungroup(_by_row_blocks(T, make_block))
