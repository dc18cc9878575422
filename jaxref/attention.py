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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxref import kernels
from jaxref.policy import ONE_BLOCK, DtypePolicy
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


ATTENTION_STAGES = ("qk_in", "qk_acc", "logits", "softmax", "pv_in", "pv_acc")
_KERNEL_DTYPES = {"qk_in": ("float32", "bfloat16"), "qk_acc": ("float32",), "logits": ("float32", "bfloat16"),
                  "softmax": ("float32",), "pv_in": ("float32", "bfloat16"), "pv_acc": ("float32",)}


def kernel_args(q, k, policy: DtypePolicy, fused: bool | None = None) -> dict | None:
    """The fused C++ kernel's arguments for this attention on the CPU, or None where it does not apply.

    It applies when `fused` allows it (None: the user's default, `kernels.enabled()`), the kernel is
    built, the attention is self-attention (as many keys as queries), and either the attention is
    dense with every attention stage fp32, or online with every stage one the kernel rounds to (fp32
    softmax and accumulators; operands and logits fp32 or bf16), the exact exponential and a key
    block that is a multiple of 16 or the whole window. Returns {logits_bf16, pv_bf16, kv_block}
    (kv_block 0: dense).
    """
    if fused is None:
        fused = kernels.enabled()
    if not (fused and q.shape[1] == k.shape[1]
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
            return _pv(p, vc, pv_in, pv_acc)

        return block

    return _ungroup(_by_row_blocks(q.shape[1], make_block))


# torch's fast float32 exponential for probabilities that are rounded to 16 bits
# (ATen/cpu/vec/vec256/vec256_float.h and vec512/vec512_float.h, Vectorized<float>::fexp_u20: the same
# arithmetic on 8 lanes under AVX2 and 16 under AVX512; std::exp under DEFAULT): 2^(x log2 e) with the
# fraction's correction a cubic in float32 FMAs, assembled in the bits of a float32 by one more FMA
# and a truncating conversion. Within one bf16 ulp of exp, but not exp: exp(0) = 0.99994659.
_FEXP_C = (0.00010703434948458272, 0.30354260500649682, -0.22433836478672356, -0.079204240219773236)
_LOG2E = np.array([0x3FB8AA3B], np.uint32).view(np.float32)[0]
_LN_FLT_MIN = np.array([0xC2AEAC50], np.uint32).view(np.float32)[0]
_LN_FLT_MAX = np.array([0x42B17218], np.uint32).view(np.float32)[0]


def _fma32(a, b, c):
    """float32 fused multiply-add: the product is exact in float64, the sum rounded once to float64 and
    then to float32 (a double rounding that differs from one rounding only when the float64 sum lands
    exactly between two float32 values)."""
    f64 = jnp.float64
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(jnp.float32)


@jax.custom_jvp
def fexp_u20(x):
    """torch's `fexp_u20` on float32 `x`, bit for bit (derivative: its own value, as exp's)."""
    x = x.astype(jnp.float32)
    c0, c1, c2, c3 = (jnp.float32(c) for c in _FEXP_C)
    src = x * jnp.float32(_LOG2E)
    frac = src - jnp.floor(src)
    res = _fma32(frac, c3, c2)
    res = _fma32(frac, res, c1)
    res = _fma32(frac, res, c0)
    tmp = _fma32(jnp.float32(2.0 ** 23), src - res, jnp.float32(2.0 ** 23 * 127))
    finite = jnp.isfinite(tmp)
    bits = jnp.trunc(jnp.where(finite, tmp, 0.0)).astype(jnp.int32)  # cvttps: toward zero
    out = jax.lax.bitcast_convert_type(bits, jnp.float32)
    out = jnp.where(x < _LN_FLT_MIN, 0.0, out)
    return jnp.where(x > _LN_FLT_MAX, jnp.inf, out).astype(jnp.float32)


@fexp_u20.defjvp
def _fexp_u20_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = fexp_u20(x)
    return y, y * t.astype(y.dtype)


def _softmax_exp(x, policy: DtypePolicy, block_len=None):
    """exp of the online softmax's shifted scores x [..., blk] under `policy.exp`, in the softmax dtype.

    `fexp_u20` is a float32 function (a softmax raised to float64, as in the error budget, takes the
    exact exp); as in torch's kernel it covers the keys of the block's whole vectors of `policy.lanes`
    float32 lanes (8 under AVX2, 16 under AVX512), the first `block_len // lanes * lanes` of the
    `block_len` real keys, and the rest go through the kernel's scalar loop: exp.
    """
    if policy.exp == "fexp_u20" and x.dtype == jnp.float32:
        n = x.shape[-1] if block_len is None else block_len
        vector = jnp.arange(x.shape[-1]) < (n // policy.lanes) * policy.lanes
        return jnp.where(vector, fexp_u20(x), jnp.exp(x)).astype(x.dtype)
    return jnp.exp(x)


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
                acc = acc * corr[..., None].astype(acc_t) + _pv(p, vb, pv, acc_t)
                return (m_new, l, acc), None

            G = N // K
            m0 = jnp.full((B, K, G, R), -jnp.inf, dtype=sm)
            l0 = jnp.zeros((B, K, G, R), dtype=sm)
            a0 = jnp.zeros((B, K, G, R, D), dtype=acc_t)
            (m, l, acc), _ = jax.lax.scan(step, (m0, l0, a0), xs)
            return acc / l[..., None].astype(acc_t)

        return block

    return _ungroup(_by_row_blocks(T, make_block))


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
