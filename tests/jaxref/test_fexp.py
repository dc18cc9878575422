"""`sdpa_cpu_bf16` follows torch's CPU flash kernel in bf16, down to its fast exponential, on every
capability of torch's CPU kernels this CPU can run.

For bf16/fp16 inputs torch's fused CPU attention (ATen/native/cpu/FlashAttentionKernel.cpp) takes the
probabilities' exponential from `Vectorized<float>::fexp_u20`, not exp, on the whole float32 vectors
of a key block: 8 lanes under AVX2, 16 under AVX512; the rest of the block goes through a scalar loop
with exp, and under DEFAULT `fexp_u20` is exp. One preset per capability emulates that
(jaxref.policy.CPU_KERNEL_POLICIES; `sdpa_cpu_bf16` names this process's). These tests run the
kernel under each capability (tests/capability.py: a subprocess with ATEN_CPU_CAPABILITY set), hold
the emulation of that capability against it, and check that the emulation of another capability,
and the exact exponential, would fail.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxref
from jaxref.attention import fexp_u20, online_attention
from jaxref.policy import CPU_KERNEL_POLICIES, PRESETS, NoEmulation, cpu_kernel_policy, get_policy
from tests import capability as cap
from tests.spread import on_the_diagonal


def kernel(q, k, v, mask, scale):
    """torch's CPU flash kernel on [1, N, T, D] q/k/v (bf16 values in float32 arrays) with an additive
    bf16 mask from bool `mask` [T, T]: (out float32, logsumexp float32). Runs in tests.capability's worker."""
    import torch

    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    add = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(torch.from_numpy(~mask), float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=add,
                                                                          scale=float(scale))[:2]
    return out.float().numpy(), lse.float().numpy()


def _bf16(rng, shape, std=1.0) -> np.ndarray:
    """Random values that bf16 holds exactly, as float32."""
    return np.asarray(jnp.asarray(rng.standard_normal(shape) * std, jnp.bfloat16).astype(jnp.float32))


def _one_key_offsets(policy, T: int) -> np.ndarray:
    """logsumexp - s of each row of a T-key block whose row j sees key j only, as `policy` computes it:
    log(fexp_u20(0)) where key j lies in a whole vector of `policy.lanes`, 0 where it takes exp."""
    if policy.exp != "fexp_u20":
        return np.zeros(T)
    log_fexp0 = float(np.log(np.float64(np.asarray(fexp_u20(jnp.zeros((), jnp.float32))))))
    return np.where(np.arange(T) < T // policy.lanes * policy.lanes, log_fexp0, 0.0)


@pytest.mark.parametrize("capability", cap.params())
def test_fexp_is_torchs_exponential_at_zero(capability):
    """A row that sees one key has logsumexp = s + log(fexp(0)) where that key lies in one of the
    kernel's whole vectors, s where it lies past them: at T = 25, keys 0-23 under AVX2 (8 lanes),
    0-15 under AVX512 (16 lanes), none under DEFAULT. The emulation of the capability torch runs
    predicts each row's offset; every other capability's emulation misses some."""
    T, D = 25, 64
    rng = np.random.default_rng(0)
    q, k, v = (_bf16(rng, (1, 2, T, D)) for _ in range(3))
    _, lse = cap.run_under(capability, "tests.jaxref.test_fexp:kernel", q, k, v, np.eye(T, dtype=bool),
                           np.float64(D ** -0.5))
    s = (q.astype(np.float64) * k.astype(np.float64)).sum(-1) * D ** -0.5  # the exact diagonal score
    offset = lse.astype(np.float64) - s  # [1, 2, T]
    own = cpu_kernel_policy(capability)
    print(f"{capability}: torch logsumexp - s by key (x1e5): {np.round(offset[0, 0] * 1e5, 2)}")
    assert abs(float(np.log(np.float64(np.asarray(fexp_u20(jnp.zeros((), jnp.float32)))))) -
               np.log(0.99994659)) < 1e-8  # exp(0) is not 1 in the kernel
    np.testing.assert_allclose(offset, np.broadcast_to(_one_key_offsets(own, T), offset.shape),
                               atol=2e-6)  # fp32 rounding of s around the offset
    for other in sorted(set(CPU_KERNEL_POLICIES.values()) - {own.name}):
        miss = np.abs(offset - _one_key_offsets(PRESETS[other], T)).max()
        print(f"  {other} misses by {miss:.2e}")
        assert miss > 4e-5, f"{other} would pass for {capability}: the test cannot tell them apart"


@functools.cache
def _attention_case(T: int, N: int, K: int, D: int):
    """bf16 q [1,T,N,D], k/v [1,T,K,D] (as float32) and an anchor layout's doc ids [T]."""
    rng = np.random.default_rng(T)
    q, k = _bf16(rng, (1, T, N, D), 1.5), _bf16(rng, (1, T, K, D), 1.5)
    v = _bf16(rng, (1, T, K, D))
    doc = np.zeros(T, np.int64)
    for b in (T // 5, T // 2, T // 16 * 16):  # the last document starts where the capabilities part
        doc[b:] += 1
    return q, k, v, doc


@functools.cache
def _oracle(T: int, N: int, K: int, D: int, policy_name: str) -> np.ndarray:
    q, k, v, doc = _attention_case(T, N, K, D)
    policy = PRESETS[policy_name] if policy_name in PRESETS else \
        dataclasses.replace(PRESETS["sdpa_cpu_bf16_avx2"], exp="exact", name="exact")
    ctx = online_attention(*(jnp.asarray(t, jnp.bfloat16) for t in (q, k, v)), jnp.asarray(doc[None]), "anchor",
                           policy, D ** -0.5)
    return np.asarray(ctx.astype(jnp.bfloat16).astype(jnp.float32))


# Sizes whose last key block ends 13 keys past a multiple of 16: keys 8-12 of that stretch are in a
# whole AVX2 vector but past the last AVX512 one, so the capabilities' kernels differ there. T = 1037 runs in
# `make test-all` (the CI budget on 2 cores), and so do the pairs of capability and size off a diagonal through
# them (tests/spread.py: each capability and each size at least once in make test).
_FOLLOW_SIZES = [(109, 4, 2, 64), (525, 3, 1, 64), (1037, 2, 2, 32)]
_FOLLOW_FAST = on_the_diagonal([[c.values[0] for c in cap.params()], _FOLLOW_SIZES[:2]])
FOLLOW_CASES = [pytest.param(c.values[0], *size, id=f"{c.values[0]}-{'-'.join(map(str, size))}",
                             marks=[*c.marks, *([] if (c.values[0], size) in _FOLLOW_FAST else [pytest.mark.slow])])
                for size in _FOLLOW_SIZES for c in cap.params()]


@pytest.mark.parametrize("capability,T,N,K,D", FOLLOW_CASES)
def test_sdpa_cpu_bf16_follows_the_kernel(capability, T, N, K, D):
    """Given the same bf16 q/k/v and an anchor mask: the emulation of the capability torch runs equals
    the kernel's attention in all but a few outputs (fp32 summation order); another exponential misses
    20x more of them. Lanes alone move few bf16 outputs (fexp_u20 is within 6e-5 of exp, a bf16 ulp
    is 4e-3): the other lane count misses more in the last document's rows, the only ones whose keys
    reach past a whole vector (the logsumexp test above tells the lane counts apart at every row)."""
    q, k, v, doc = _attention_case(T, N, K, D)
    mask = np.asarray(jaxref.attention_mask(doc, "anchor"))
    G = N // K
    heads_first = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    args = (heads_first(q), heads_first(np.repeat(k, G, axis=2)), heads_first(np.repeat(v, G, axis=2)), mask,
            np.float64(D ** -0.5))
    cannot = cap.bf16_flash_cannot_run(capability)
    if cannot:
        with pytest.raises(AssertionError, match=cap.BF16_FLASH_PACK_ERROR):
            cap.run_under(capability, "tests.jaxref.test_fexp:kernel", *args)
        pytest.skip(cannot)
    out, _ = cap.run_under(capability, "tests.jaxref.test_fexp:kernel", *args)
    want = out.transpose(0, 2, 1, 3)
    own = cpu_kernel_policy(capability).name
    names = (*sorted(set(CPU_KERNEL_POLICIES.values())), "exact")
    differ = {name: float((_oracle(T, N, K, D, name) != want).mean()) for name in names}
    # The last document's rows: the only ones whose keys reach past the last whole 16-lane vector.
    tail = {name: float((_oracle(T, N, K, D, name) != want)[:, T // 16 * 16:].mean()) for name in names}
    print(f"{capability} T={T}: outputs that differ from the kernel's: {differ}; in the last document: {tail}")
    assert differ[own] <= 2e-3
    exp_of = {**{n: PRESETS[n].exp for n in CPU_KERNEL_POLICIES.values()}, "exact": "exact"}
    for name in names:
        if name == own or (name == "exact" and capability == "default"):  # the same function
            continue
        if exp_of[name] != exp_of[own]:  # another exponential: 20x more outputs differ
            assert differ[name] > 20 * max(differ[own], 1e-5), f"{name} is as close to the {capability} kernel"
        else:  # the same exponential on other lanes: only the last document's rows can tell
            assert differ[name] >= differ[own] and tail[name] > tail[own], f"{name} is as close to the {capability} kernel"


def test_sdpa_cpu_bf16_names_this_processs_capability():
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    policy = get_policy("sdpa_cpu_bf16")
    print(f"torch dispatches to {capability}; sdpa_cpu_bf16 -> {policy.name}")
    assert policy.name == CPU_KERNEL_POLICIES[capability]
    with pytest.raises(NoEmulation, match="no emulation of torch's CPU attention kernel is known for capability 'NEON'"):
        cpu_kernel_policy("NEON")


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


def test_policy_exp_field_round_trips_and_is_checked(tmp_path):
    for name in CPU_KERNEL_POLICIES.values():
        p = PRESETS[name]
        assert jaxref.get_policy(p.to_dict()) == p
    f = tmp_path / "pol.yaml"
    f.write_text("base: sdpa_cpu_bf16\nexp: exact\n")
    assert jaxref.get_policy(str(f)).exp == "exact"
    f.write_text("base: sdpa_cpu_bf16_avx2\nlanes: 16\n")
    assert jaxref.get_policy(str(f)).lanes == 16
    f.write_text("base: fa2_bf16\nlanes: 0\n")
    from anchor_core.errors import InputError

    with pytest.raises(InputError, match="lanes must be a positive integer"):
        jaxref.get_policy(str(f))
    f.write_text("base: fa2_bf16\nexp: fast\n")
    with pytest.raises(InputError, match="unknown exp 'fast'"):
        jaxref.get_policy(str(f))
