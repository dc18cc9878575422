"""Causal attention under a dtype policy: dense (Hugging Face eager/sdpa) and online (FlashAttention-2).

Legend: B batch, T query slots, S key slots, N query heads, K kv heads, G = N // K, D head dim.
Both paths take q [B,T,N,D], k/v [B,S,K,D] (already rotated) and the slot `doc_ids` [B,T],
and round exactly where the emulated stack rounds:

dense  (fp64, fp32, hf_bf16): s = (q·kᵀ in qk_acc) → logits dtype, × scale (fp32 product, rounded);
       softmax over the whole row in the `softmax` dtype (masked entries −inf), probabilities cast
       to pv_in; p·v in pv_acc. Computed by blocks of query rows, skipping keys after a block.
online (fa2_bf16, paper_bf16): FlashAttention-2 over key blocks of `policy.kv_block`: fp32
       scores × scale, running max and sum in the softmax dtype, probabilities rounded to pv_in
       *before* p·v (the running sum uses the unrounded ones, as the kernel does), accumulation in
       pv_acc, division by the sum at the end.

On the CPU the fused C++ kernel (`jaxref.kernels`) runs instead where it covers the policy
(`kernel_args`): the dense path of the all-fp32 attention (`fp32`), and the online path with fp32
softmax and accumulators, operands and logits in fp32 or bf16 and the exact exponential (`fa2_bf16`,
`paper_bf16`). `hf_bf16`'s dense path stays in JAX: it is bit for bit torch's eager bf16 attention
(parity_tests/test_fidelity.py), which the kernel's exponential and sums are not. The kernel is
chosen by an argument, `fused`, passed down from the caller (`jaxref.executor` resolves it once per
forward); `fused=None` at these public functions means the user's default,
`jaxref.kernels.enabled()` (off under `JAXREF_FUSED_ATTENTION=0`).

The pieces live beside this module: `attention_core` (the shared arithmetic: matmuls, scores, mask,
softmax, row blocks), `fexp` (torch's fast exponential), `attention_forward` (the dense and online paths and
the kernel's cover) and `attention_backward` (`kernel_backward`). This module dispatches on the policy
(`attention`) and holds the probes of chosen rows (`row_scores_probs`, `full_probs`); their names that other
code imports from here are imported here.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxref.attention_backward import (  # noqa: F401 (re-exported)
    BACKWARD_ROWS,
    cpu_backward_rows,
    kernel_backward,
)
from jaxref.attention_core import (  # noqa: F401 (re-exported)
    KEY_CLASSES,
    ROW_BLOCK,
    _by_row_blocks,
    _group_queries,
    _heads_first,
    _mask,
    _pv,
    _qk,
    _row_block_plan,
    _ungroup,
    fp8_operands,
    round_probs,
    scale_logits,
    scores,
    softmax_probs,
    wide,
    wide_einsum,
)
from jaxref.attention_forward import (  # noqa: F401 (re-exported)
    ATTENTION_STAGES,
    blocked_dense_attention,
    blocked_online_attention,
    dense_attention,
    kernel_args,
    online_attention,
)
from jaxref.fexp import fexp_u20  # noqa: F401 (re-exported)
from jaxref.policy import DtypePolicy
from jaxref.variants import Variant


def attention(q, k, v, doc_ids, variant: Variant, policy: DtypePolicy, scale: float, *, fused: bool | None = None):
    """Dispatch on `policy.attention` (and `policy.backward`). Returns ctx [B,T,N,D] in `pv_acc`.

    `fused`: allow the fused CPU kernel where it covers the policy (`kernel_args`; None: the user's
    default, `kernels.enabled()`).
    """
    if policy.backward != "autodiff":
        return kernel_backward(q, k, v, doc_ids, variant, policy, scale, fused)
    if policy.attention == "online":
        return online_attention(q, k, v, doc_ids, variant, policy, scale, fused=fused)
    return dense_attention(q, k, v, doc_ids, variant, policy, scale, fused=fused)


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
