"""`jaxref.attention.kernel_backward`: a kernel's own attention backward, written out (policy `backward`).

In fp64 (every rounding a no-op) it is the gradient of the forward, to 1e-12, for every mask, GQA,
padding and a length that is not a multiple of its row block, in each of its arithmetics (fa2, flex, cpu;
parity_tests/test_fidelity.py holds `cpu` against torch's CPU kernel itself). In bf16 it is FlashAttention-2's
arithmetic, held against a plain numpy transcription of that arithmetic, and measurably not autodiff's
(dS rounded to bf16 before dQ and dK).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from anchor_core.errors import InputError
from jaxref.attention import attention
from jaxref.policy import ONE_BLOCK, get_policy

jax.config.update("jax_enable_x64", True)

B, N, K, D = 2, 6, 2, 16


def _inputs(T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, h, D)) for h in (N, K, K))
    doc = np.zeros((B, T), np.int32)  # slot 0 the anchor, two documents, padding at the end
    doc[:, 1:T // 3] = 1
    doc[:, T // 3:T - 5] = 2
    doc[:, T - 5:] = -1
    do = rng.standard_normal((B, T, N, D))
    return q, k, v, doc, do


def _grads(policy, variant, q, k, v, doc, do):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, jnp.asarray(doc), variant, policy, D ** -0.5, fused=False),
                       q, k, v)
    return out, vjp(jnp.asarray(do, out.dtype))


# anchor: the documents' mask and the shared column; full in make test-all (CI's 30 minutes)
@pytest.mark.parametrize("variant", ["anchor", pytest.param("full", marks=pytest.mark.slow)])
def test_fp64_kernel_backward_is_the_gradient(variant):
    """T = 97: not a multiple of the backward's row block (the padded rows) nor of the key block."""
    q, k, v, doc, do = (jnp.asarray(x) for x in _inputs(97))
    auto = get_policy({"base": "fp64", "attention": "online", "kv_block": 32})
    out_a, grads_a = _grads(auto, variant, q, k, v, doc, do)
    for backward in ("fa2", "flex", "cpu"):  # cpu: three query blocks of 32 (the 97 rows padded to 128)
        out_k, grads_k = _grads(dataclasses.replace(auto, backward=backward), variant, q, k, v, doc, do)
        assert np.array_equal(out_a, out_k)  # the same forward
        for a, b in zip(grads_a, grads_k):
            assert float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a))) < 1e-12, backward


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _numpy_fa2(q, k, v, do, mask, scale, backward):
    """FlashAttention-2's forward (one key block) and backward in numpy fp32 with its bf16 roundings, one
    window: q [T,N,D], k/v [T,K,D], do [T,N,D], mask bool [T,T]."""
    T, N, _ = q.shape
    G = N // k.shape[1]
    qh = q.transpose(1, 0, 2)
    kh, vh = (np.repeat(x.transpose(1, 0, 2), G, axis=0) for x in (k, v))
    doh = do.transpose(1, 0, 2)
    s = np.where(mask, (qh @ kh.transpose(0, 2, 1)) * np.float32(scale), -np.inf).astype(np.float32)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    o = _bf16((_bf16(p) @ vh) / l_)
    p = np.exp(s - (m + np.log(l_)))
    dv = _bf16(p).transpose(0, 2, 1) @ doh
    delta = (doh * o).sum(-1, keepdims=True)  # fp32 in both: FlexAttention's too (jaxref.attention.kernel_backward)
    ds = _bf16(p * (doh @ vh.transpose(0, 2, 1) - delta))
    dq = (ds @ kh) * np.float32(scale)
    dk = (ds.transpose(0, 2, 1) @ qh) * np.float32(scale)

    def group(x):
        if backward == "fa2":
            x = _bf16(x)
        return _bf16(x.reshape(k.shape[1], G, T, -1).sum(1)).transpose(1, 0, 2)

    return _bf16(dq).transpose(1, 0, 2), group(dk), group(dv)


@pytest.mark.parametrize("backward", ["fa2", pytest.param("flex", marks=pytest.mark.slow)])
def test_bf16_kernel_backward_is_flash_attention_2s_arithmetic(backward):
    """Against the numpy transcription: the same up to fp32 summation order; autodiff of the same forward
    is several times further off (its dS is not rounded)."""
    T = 61
    q, k, v, doc, do = _inputs(T, seed=3)
    q, k, v, do = (_bf16(x) for x in (q, k, v, do))
    base = get_policy({"base": "fa2_bf16", "kv_block": ONE_BLOCK})
    kern = dataclasses.replace(base, backward=backward)
    auto = dataclasses.replace(base, backward="autodiff")
    bf = jnp.bfloat16
    args = (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf))
    _, got = _grads(kern, "anchor", *args, doc, do)
    _, plain = _grads(auto, "anchor", *args, doc, do)
    from jaxref.variants import attention_mask

    for b in range(B):
        mask = np.asarray(attention_mask(doc[b], "anchor"))
        ref = _numpy_fa2(q[b], k[b], v[b], do[b], mask, D ** -0.5, backward)
        for name, g, a, r in zip("qkv", got, plain, ref):
            g, a = np.asarray(g[b], np.float32), np.asarray(a[b], np.float32)
            off = np.linalg.norm(g - r) / np.linalg.norm(r)
            assert off < 2e-3, (name, off)  # an ulp of bf16 here and there, from fp32 summation order
            if name != "v":  # dV has no dS in it
                assert np.linalg.norm(a - r) / np.linalg.norm(r) > 2 * off, name


def test_backward_field():
    assert get_policy({"base": "fa2_bf16", "backward": "flex"}).backward == "flex"
    p = get_policy({"base": "fa2_bf16", "backward": "fa2"})
    assert get_policy(p.to_dict()) == p
    with pytest.raises(InputError, match="unknown backward"):
        get_policy({"base": "fa2_bf16", "backward": "fa3"})
    with pytest.raises(InputError, match="online"):
        get_policy({"base": "hf_bf16", "backward": "fa2"})
