"""The arithmetic every attention path of the oracle shares: matmuls, scores, the mask, the softmax, row blocks.

Legend as in `jaxref.attention`: B batch, T query slots, S key slots, N query heads, K kv heads, G = N // K,
D head dim. `wide_einsum` accumulates 16-bit operands as torch's matmuls do (widened to fp32), `scale_logits`
rounds q·kᵀ and its product with the scale where torch rounds them, and the query heads are grouped per kv head
(`_group_queries`) so that q·kᵀ is one matmul per kv head. `_by_row_blocks` runs a causal attention by blocks
of query rows, each against the keys up to the end of its class, so that the keys after a block are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxref import fp8
from jaxref.policy import DtypePolicy
from jaxref.variants import Variant, allowed


def wide(dtype) -> jnp.dtype:
    """The dtype torch computes 16-bit elementwise ops and matmul accumulations in: fp32 for 16-bit, else itself."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype).itemsize < 4 else jnp.dtype(dtype)


def wide_einsum(subscripts: str, a, b, acc):
    """`einsum(a, b)` accumulated in `acc`, as torch's CPU and GPU matmuls compute 16-bit operands:
    widened to fp32, products exact (8+8 or 11+11 significand bits fit fp32's 24), fp32 sums.

    16-bit operands with an fp32 accumulator are widened before the dot, so XLA runs its fp32
    matmul: the same products as a bf16 dot with `preferred_element_type=fp32`, summed in another
    order (an fp32 ulp); a bf16 forward of SmolLM2 runs 1.4x faster on the CPU, where XLA has no fast
    16-bit matmul. The gradient flows back through the widening, so a 16-bit operand's cotangent is
    the fp32 dot rounded once to 16 bits, as torch's backward matmuls give it.
    """
    acc = jnp.dtype(acc)
    if acc == jnp.float32 and (a.dtype.itemsize < 4 or b.dtype.itemsize < 4):
        return jnp.einsum(subscripts, a.astype(acc), b.astype(acc), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum(subscripts, a, b, preferred_element_type=acc)


def scale_logits(s, logits_dtype, scale: float):
    """Round q·kᵀ to the logits dtype, then multiply by the (unrounded) scale and round once more.

    This is torch's `bf16_tensor * python_float`: the product is formed in fp32 and rounded, the
    scale itself is never rounded to bf16.
    """
    s = s.astype(logits_dtype)
    w = wide(logits_dtype)
    return (s.astype(w) * jnp.asarray(scale, w)).astype(logits_dtype)


def _group_queries(q, K: int):
    """q [B,T,N,D] → [B,K,G,T,D]: the G query heads of each kv head side by side, so q·kᵀ is one
    matmul per kv head over G*T rows whose [.., G*T, S] result is [B,K,G,T,S] for free (a layout
    with T before G would cost a transpose of the whole score tensor)."""
    B, T, N, D = q.shape
    return jnp.transpose(q.reshape(B, T, K, N // K, D), (0, 2, 3, 1, 4))


def _heads_first(x):
    """k or v [B,S,K,D] → [B,K,S,D]."""
    return jnp.transpose(x, (0, 2, 1, 3))


def _ungroup(ctx):
    """ctx [B,K,G,T,D] → [B,T,K*G,D] (query head n = kv head n // G, as in transformers' GQA)."""
    B, K, G, T, D = ctx.shape
    return jnp.transpose(ctx, (0, 3, 1, 2, 4)).reshape(B, T, K * G, D)


def _qk(qg, kh, policy: DtypePolicy, scale: float):
    """qg [B,K,G,R,D] (qk_in), kh [B,K,S,D] (qk_in) → scaled logits [B,K,G,R,S] in the `logits` dtype."""
    B, K, G, R, D = qg.shape
    s = wide_einsum("BKMD,BKSD->BKMS", qg.reshape(B, K, G * R, D), kh, policy.dtype("qk_acc"))
    return scale_logits(s.reshape(B, K, G, R, kh.shape[2]), policy.dtype("logits"), scale)


def _pv(p, vh, pv_dtype, acc_dtype):
    """p [B,K,G,R,S] · vh [B,K,S,D] → ctx [B,K,G,R,D] (operands in pv_dtype, accumulation in acc_dtype)."""
    B, K, G, R, S = p.shape
    ctx = wide_einsum("BKMS,BKSD->BKMD", p.reshape(B, K, G * R, S).astype(pv_dtype), vh.astype(pv_dtype), acc_dtype)
    return ctx.reshape(B, K, G, R, vh.shape[-1])


def scores(q, k, policy: DtypePolicy, scale: float):
    """Scaled attention logits. q [B,T,N,D], k [B,S,K,D] → [B,K,G,T,S] in the `logits` dtype."""
    qk_in = policy.dtype("qk_in")
    return _qk(_group_queries(q.astype(qk_in), k.shape[2]), _heads_first(k.astype(qk_in)), policy, scale)


def fp8_operands(q, k, v, policy: DtypePolicy):
    """q and k rounded through FP8 where `qk_in` is FP8, v where `pv_in` is (`jaxref.fp8.fake_quant` with the
    policy's scaling: rowwise along each product's contraction axis, D for q and k, the keys for v), read
    back in float32; the others as they are. Done once per layer, before any attention path or probe reads them."""
    if fp8.is_fp8(policy.qk_in):
        q, k = (fp8.fake_quant(x, policy.qk_in, policy.scaling, -1) for x in (q, k))
    if fp8.is_fp8(policy.pv_in):
        v = fp8.fake_quant(v, policy.pv_in, policy.scaling, 1)
    return q, k, v


def round_probs(p, policy: DtypePolicy):
    """The probabilities as p·v reads them: through FP8 where `probs` (or, unset, `pv_in`) is FP8
    (`jaxref.fp8.probs`), else rounded to `pv_in`."""
    d = policy.probs_dtype()
    return fp8.probs(p, d) if fp8.is_fp8(d) else p.astype(policy.dtype("pv_in"))


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


ROW_BLOCK = 64
"""Query rows per block: a block's scores stay in cache."""
KEY_CLASSES = 16
"""Key lengths compiled per call (one scan each): finer skips more masked work, compiles more."""


def _row_block_plan(T: int) -> tuple[int, np.ndarray, list[tuple[int, int]]]:
    """(R, starts, classes).

    The T query rows are cut into blocks of R rows starting at `starts` (the last block is moved
    back to end at row T, overlapping its neighbour, so every block has R rows). Consecutive blocks
    are grouped into at most KEY_CLASSES classes [b0, b1); a class runs one `lax.scan` against the
    keys up to its last block's last row.
    """
    R = min(ROW_BLOCK, T)
    nb = -(-T // R)
    starts = np.minimum(np.arange(nb) * R, T - R)
    bounds = np.linspace(0, nb, min(KEY_CLASSES, nb) + 1).round().astype(int)
    return R, starts, [(int(b0), int(b1)) for b0, b1 in zip(bounds[:-1], bounds[1:])]


def _by_row_blocks(T: int, make_block):
    """Causal attention by blocks of query rows: ctx [B,K,G,T,D] from per-block results.

    Every variant is causal, so the keys after a block's last row are masked for the whole block.
    `make_block(R, e)` prepares what the blocks of one class share (keys 0..e-1) and returns
    `block(r0) -> ctx [B,K,G,R,D]` for rows r0..r0+R-1. The blocks of a class share one
    `lax.scan`, so their scores reuse one buffer (unrolled, every block's scores stayed alive:
    450 MB at T=4096).
    """
    R, starts, classes = _row_block_plan(T)
    blocks = []
    for b0, b1 in classes:
        block = make_block(R, int(starts[b1 - 1]) + R)
        blocks.append(jax.lax.scan(lambda _, r0, block=block: (None, block(r0)), None, jnp.asarray(starts[b0:b1]))[1])
    ctx = jnp.moveaxis(jnp.concatenate(blocks, axis=0), 0, 3)  # [B,K,G,nb,R,D]
    B, K, G, nb, _, D = ctx.shape
    head = ctx[:, :, :, :-1].reshape(B, K, G, (nb - 1) * R, D)
    tail = ctx[:, :, :, -1, (nb - 1) * R - int(starts[-1]):]
    return jnp.concatenate([head, tail], axis=3)
