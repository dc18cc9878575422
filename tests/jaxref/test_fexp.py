"""`sdpa_cpu_bf16` follows torch's CPU flash kernel in bf16, down to its fast exponential.

For bf16/fp16 inputs torch's fused CPU attention (ATen/native/cpu/FlashAttentionKernel.cpp) takes the
probabilities' exponential from `Vectorized<float>::fexp_u20`, not exp. The policy field
`exp: fexp_u20` computes that function (jaxref.attention.fexp_u20). These tests read the function
off torch itself and hold the oracle's attention against the kernel's, with the exact exponential as
the baseline that must be worse.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxref
from jaxref.attention import fexp_u20, online_attention
from jaxref.policy import PRESETS, get_policy


def _kernel(q, k, v, mask, scale):
    """torch's CPU flash kernel on [1, N, T, D] bf16 q/k/v with an additive bf16 mask: (out, logsumexp)."""
    add = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(torch.from_numpy(~mask), float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=add,
                                                                          scale=scale)[:2]
    return out, lse


def test_fexp_is_torchs_exponential_at_zero():
    """A row that sees one key has logsumexp = s + log(fexp(0)): torch's offset is the oracle's. The
    9th key of a 9-key block is past the kernel's last 8-lane vector: its exponential is exp."""
    T, D = 9, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, D, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = np.eye(T, dtype=bool)  # every row sees itself only
    _, lse = _kernel(q, k, v, mask, D ** -0.5)
    s = (q.double() * k.double()).sum(-1) * D ** -0.5  # the exact diagonal score
    offset = (lse.double() - s).numpy()
    ours = float(np.log(np.float64(np.asarray(fexp_u20(jnp.zeros((), jnp.float32))))))
    print(f"torch logsumexp - s: {offset.min():.4e}..{offset.max():.4e}; log(fexp_u20(0)) = {ours:.4e}")
    assert abs(ours - np.log(0.99994659)) < 1e-8  # exp(0) is not 1 in the kernel
    np.testing.assert_allclose(offset[..., :8], ours, atol=2e-6)  # fp32 rounding of s around the offset
    np.testing.assert_allclose(offset[..., 8], 0.0, atol=2e-6)


def test_fexp_is_within_a_bf16_ulp_of_exp_and_differentiable():
    x = jnp.linspace(-80.0, 0.0, 100_001, dtype=jnp.float32)
    y = np.asarray(fexp_u20(x), np.float64)
    rel = np.abs(y / np.exp(np.asarray(x, np.float64)) - 1)
    print(f"fexp_u20 relative error: max {rel.max():.2e} (one bf16 ulp: {2.0 ** -8:.2e})")
    assert rel.max() < 2.0 ** -8
    assert float(np.asarray(fexp_u20(jnp.float32(-np.inf)))) == 0.0
    import jax

    grad = jax.grad(lambda t: fexp_u20(t))(jnp.float32(-1.5))
    assert np.isclose(float(grad), float(fexp_u20(jnp.float32(-1.5))))


@pytest.mark.parametrize("T,N,K,D", [(97, 4, 2, 64), (515, 3, 1, 64), (1025, 2, 2, 32)])
def test_sdpa_cpu_bf16_follows_the_kernel(T, N, K, D):
    """Given the same bf16 q/k/v and an anchor mask: the oracle's attention equals the kernel's in all but
    a few outputs (fp32 summation order), where the exact exponential misses 1-4 % of them."""
    g = torch.Generator().manual_seed(T)
    q = (torch.randn(1, T, N, D, generator=g) * 1.5).to(torch.bfloat16)
    k = (torch.randn(1, T, K, D, generator=g) * 1.5).to(torch.bfloat16)
    v = torch.randn(1, T, K, D, generator=g).to(torch.bfloat16)
    doc = np.zeros(T, np.int64)
    for b in (T // 5, T // 2, T - T // 7):
        doc[b:] += 1
    mask = np.asarray(jaxref.attention_mask(doc, "anchor"))
    G = N // K
    out, _ = _kernel(q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2),
                     v.repeat_interleave(G, 2).transpose(1, 2), mask, D ** -0.5)
    want = out.transpose(1, 2).float().numpy()
    qj, kj, vj = (jnp.asarray(t.float().numpy(), jnp.bfloat16) for t in (q, k, v))
    policy = get_policy("sdpa_cpu_bf16")
    assert policy.exp == "fexp_u20"
    differ = {}
    for name, pol in (("fexp_u20", policy), ("exact", dataclasses.replace(policy, exp="exact"))):
        ctx = online_attention(qj, kj, vj, jnp.asarray(doc[None]), "anchor", pol, D ** -0.5)
        got = np.asarray(ctx.astype(jnp.bfloat16).astype(jnp.float32))
        differ[name] = float((got != want).mean())
    print(f"T={T}: outputs that differ from the kernel's: {differ}")
    assert differ["exact"] > 1e-2  # the baseline: without torch's exponential
    assert differ["fexp_u20"] < differ["exact"] / 50


def test_policy_exp_field_round_trips_and_is_checked(tmp_path):
    p = PRESETS["sdpa_cpu_bf16"]
    assert jaxref.get_policy(p.to_dict()) == p
    f = tmp_path / "pol.yaml"
    f.write_text("base: sdpa_cpu_bf16\nexp: exact\n")
    assert jaxref.get_policy(str(f)).exp == "exact"
    f.write_text("base: fa2_bf16\nexp: fast\n")
    from anchor.errors import InputError

    with pytest.raises(InputError, match="unknown exp 'fast'"):
        jaxref.get_policy(str(f))
