"""The dense path computes rows by blocks and skips keys after each block: same rows as one dense pass."""

from __future__ import annotations

import numpy as np
import pytest

import jaxref  # noqa: F401  (x64 and the XLA rounding flag)
import jax.numpy as jnp
from jaxref import attention as A
from jaxref.policy import get_policy
from jaxref.variants import VARIANTS
from tests.jaxref.layouts import random_layout
from tests.jaxref.numerics import jitted, rel


# T = 1025 runs in `make test-all` (the CI budget on 2 cores); `make test` keeps every variant at 5 and 97 (two row
# blocks of 64; tests/jaxref/test_fused_attention.py's bf16 case at 1025 holds the fused kernel to the online path
# for the anchor variant).
CASES = [pytest.param(T, v, marks=pytest.mark.slow) if T == 1025 else (T, v)
         for T in (5, 97, 1025) for v in VARIANTS]
# The one-dense-pass check (the dense path's row blocks) likewise.
DENSE_CASES = [pytest.param(T, v, marks=pytest.mark.slow) if T == 1025 else (T, v)
               for T in (5, 97, 1025) for v in VARIANTS]


def one_pass(q, k, v, doc_ids, variant, policy, scale):
    """The dense definition in one piece: every row against every key, the [T, S] mask whole."""
    T = q.shape[1]
    s = A.scores(q, k, policy, scale)
    p = A.softmax_probs(s, A._mask(doc_ids, jnp.arange(T), jnp.arange(T), variant), policy)
    return A._ungroup(A._pv(p, A._heads_first(v), policy.dtype("pv_in"), policy.dtype("pv_acc")))


@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 97, 130, 1025, 1100])
def test_plan_covers_every_row_once_and_every_visible_key(T):
    R, starts, classes = A._row_block_plan(T)
    assert R == min(A.ROW_BLOCK, T) and len(classes) <= A.KEY_CLASSES
    assert [b for c in classes for b in range(*c)] == list(range(len(starts)))
    # Rows as assembled: blocks 0..nb-2 whole, then the tail of the last (possibly overlapping) block.
    rows = [r for s in starts[:-1] for r in range(s, s + R)] + list(range((len(starts) - 1) * R, T))
    assert rows == list(range(T))
    for b0, b1 in classes:
        keys = starts[b1 - 1] + R
        assert keys <= T and all(s + R <= keys for s in starts[b0:b1])  # every row sees all keys <= itself
    if T >= 4 * A.ROW_BLOCK * A.KEY_CLASSES:
        # The point of the blocks: far fewer scores than T².
        work = sum((b1 - b0) * R * (starts[b1 - 1] + R) for b0, b1 in classes)
        assert work < 0.6 * T * T


@pytest.mark.parametrize("T,variant", DENSE_CASES)
def test_blocks_equal_one_dense_pass(variant, T):
    rng = np.random.default_rng(T)
    B, N, K, D = 2, 6, 2, 16
    doc = np.stack([random_layout(rng, T, variant), random_layout(rng, T, variant, pad=False)])
    q, k, v = (rng.standard_normal((B, T, n, D)) for n in (N, K, K))
    scale = D ** -0.5
    err = {}
    for name in ("fp64", "fp32", "hf_bf16"):
        pol = get_policy(name)
        args = [jnp.asarray(x, pol.dtype("act")) for x in (q, k, v)]
        blocked = jitted(A.blocked_dense_attention, variant, pol, scale)(*args, jnp.asarray(doc))
        whole = jitted(one_pass, variant, pol, scale)(*args, jnp.asarray(doc))
        assert blocked.shape == whole.shape == (B, T, N, D) and blocked.dtype == whole.dtype
        assert np.isfinite(np.asarray(blocked, np.float64)).all()
        err[name] = rel(blocked, whole)
    truth = jitted(one_pass, variant, get_policy("fp64"), scale)(*(jnp.asarray(x) for x in (q, k, v)), jnp.asarray(doc))
    bf16_err = rel(jitted(A.dense_attention, variant, get_policy("hf_bf16"), scale)(
        *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(doc)), truth)
    print(f"{variant} T={T}: blocked vs one pass: fp64 {err['fp64']:.1e}, fp32 {err['fp32']:.1e}, "
          f"hf_bf16 {err['hf_bf16']:.1e} (hf_bf16 vs fp64 truth {bf16_err:.1e})")
    assert err["fp64"] <= 1e-14
    assert err["fp32"] <= 1e-6
    # Only the summation order of a row's fp32 softmax may differ: far below bf16's own error.
    assert err["hf_bf16"] <= 0.05 * bf16_err


def online_all_rows(q, k, v, doc_ids, variant, policy, scale):
    """FlashAttention-2's arithmetic with every query row in every key-block step (no skipping)."""
    B, T, N, D = q.shape
    K, blk = k.shape[2], policy.kv_block
    nblk = -(-T // blk)
    pad = nblk * blk - T
    sm, acc_t, pv, qk_in = (policy.dtype(s) for s in ("softmax", "pv_acc", "pv_in", "qk_in"))
    kp = jnp.pad(k.astype(qk_in), ((0, 0), (0, pad), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    docs = jnp.pad(doc_ids, ((0, 0), (0, pad)), constant_values=-1)
    qg = A._group_queries(q.astype(qk_in), K)
    m = jnp.full((B, K, N // K, T), -jnp.inf, sm)
    l = jnp.zeros((B, K, N // K, T), sm)
    acc = jnp.zeros((B, K, N // K, T, D), acc_t)
    for b in range(nblk):
        sl = slice(b * blk, (b + 1) * blk)
        mask = A._mask(docs, jnp.arange(T), jnp.arange(b * blk, (b + 1) * blk), variant)
        s = jnp.where(mask, A._qk(qg, A._heads_first(kp[:, sl]), policy, scale).astype(sm), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None].astype(acc_t) + A._pv(p, A._heads_first(vp[:, sl]), pv, acc_t)
        m = m_new
    return A._ungroup(acc / l[..., None].astype(acc_t))


@pytest.mark.parametrize("T,variant", CASES)
def test_online_blocks_equal_all_rows(variant, T):
    """Skipping the key blocks after a row block is a no-op in exact arithmetic (p = 0, correction
    exp(0) = 1); only the matmul kernels' summation order, which depends on the row count, may move
    an ulp: far below the emulated kernel's own error."""
    rng = np.random.default_rng(T + 1)
    B, N, K, D = 2, 6, 2, 16
    doc = np.stack([random_layout(rng, T, variant), random_layout(rng, T, variant, pad=False)])
    q, k, v = (rng.standard_normal((B, T, n, D)) for n in (N, K, K))
    scale = D ** -0.5
    truth = jitted(one_pass, variant, get_policy("fp64"), scale)(*(jnp.asarray(x) for x in (q, k, v)), jnp.asarray(doc))
    for name in ("fa2_bf16", "paper_bf16"):
        pol = get_policy({"base": name, "kv_block": 32})
        args = [jnp.asarray(x, pol.dtype("act")) for x in (q, k, v)]
        blocked = jitted(A.blocked_online_attention, variant, pol, scale)(*args, jnp.asarray(doc))
        whole = jitted(online_all_rows, variant, pol, scale)(*args, jnp.asarray(doc))
        assert blocked.shape == whole.shape == (B, T, N, D) and blocked.dtype == whole.dtype
        assert np.isfinite(np.asarray(blocked, np.float64)).all()
        err, own = rel(blocked, whole), rel(blocked, truth)
        print(f"{variant} T={T} {name}: blocked vs all rows {err:.1e} ({int((np.asarray(blocked) != np.asarray(whole)).sum())}"
              f" of {blocked.size} values differ); vs fp64 truth {own:.1e}")
        assert err <= 0.05 * own
