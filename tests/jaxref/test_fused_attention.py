"""The fused CPU kernel (jaxref/kernels) against the JAX paths, both measured against fp64.

fp32: the kernel must be the fp32 policy's dense attention up to rounding: its error against fp64
truth is held to a small multiple of the JAX fp32 path's own error on the same inputs.
online bf16 policies (fa2_bf16, paper_bf16): the kernel must round where the policy rounds (logits,
probabilities before p·v, the softmax's key blocks), so it stays far closer to the policy's JAX path
than that path is to fp64: a kernel that skipped or moved one rounding would not. hf_bf16's dense
softmax stays on the JAX path (bit for bit torch's eager attention, parity_tests/test_fidelity.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jaxref  # noqa: F401  (x64 and the XLA rounding flag)
import jax
import jax.numpy as jnp
from jaxref import attention as A
from jaxref import kernels
from jaxref.policy import get_policy
from jaxref.variants import VARIANTS
from tests.jaxref.layouts import doc_ids_from_lengths, random_layout
from tests.jaxref.numerics import jitted, rel

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler: the fused kernel is not built")

FP32, FP64 = get_policy("fp32"), get_policy("fp64")


def inputs(rng, B, T, N, K, D, variant, scale_qk=2.0):
    if T == 1:
        doc = np.stack([doc_ids_from_lengths([], 1, variant)] * B)
    else:
        doc = np.stack([random_layout(rng, T, variant), random_layout(rng, T, variant, pad=False)])[:B]
    q = rng.standard_normal((B, T, N, D)) * scale_qk
    k = rng.standard_normal((B, T, K, D)) * scale_qk
    v = rng.standard_normal((B, T, K, D))
    return q, k, v, doc


def fused(q, k, v, doc, variant, scale):
    f = jax.jit(lambda q, k, v, d: kernels.causal_attention(q, k, v, d, variant, scale))
    return np.asarray(f(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(doc)))


# (B, T, N, K, D): one token; odd lengths around the row blocks (16 rows x 3 heads = 48 packed rows)
# and the 16-key panels; MHA, GQA 3 and 4; head dims that are not multiples of 16.
SHAPES = [(1, 1, 2, 1, 16), (2, 5, 4, 2, 24), (2, 97, 9, 3, 64), (1, 515, 8, 2, 40), (2, 1025, 4, 4, 80),
          (1, 1025, 6, 6, 17)]


# At T = 1025 all but anchor at B = 2 run in `make test-all` (the CI budget on 2 cores); `make test` keeps 1025
# for anchor at B = 2, and every variant up to 515.
DENSE_CASES = [pytest.param(s, v, id="B{}_T{}_N{}_K{}_D{}-{}".format(*s, v),
                            marks=[pytest.mark.slow] if s[1] == 1025 and (v != "anchor" or s[0] == 1) else [])
               for s in SHAPES for v in VARIANTS]


@pytest.mark.parametrize("shape,variant", DENSE_CASES)
def test_fused_equals_dense_up_to_fp32_rounding(variant, shape):
    B, T, N, K, D = shape
    rng = np.random.default_rng(T * 31 + N)
    q, k, v, doc = inputs(rng, B, T, N, K, D, variant)
    scale = D ** -0.5
    truth = np.asarray(jitted(A.blocked_dense_attention, variant, FP64, scale)(*(jnp.asarray(x) for x in (q, k, v)),
                                                                               jnp.asarray(doc)))
    dense32 = np.asarray(jitted(A.blocked_dense_attention, variant, FP32, scale)(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(doc)))
    out = fused(q, k, v, doc, variant, scale)
    assert out.shape == (B, T, N, D) and out.dtype == np.float32 and np.isfinite(out).all()
    e_fused, e_dense = rel(out, truth), rel(dense32, truth)
    m_fused, m_dense = np.abs(out - truth).max(), np.abs(dense32 - truth).max()
    print(f"{variant} {shape}: vs fp64 rel L2 fused {e_fused:.2e} / JAX fp32 {e_dense:.2e}; "
          f"max |err| {m_fused:.2e} / {m_dense:.2e}")
    assert e_fused <= 2 * e_dense + 1e-12
    assert m_fused <= 4 * m_dense + 1e-12


@pytest.mark.parametrize("variant", ["intra_doc", "anchor"])
def test_fused_rows_see_only_their_documents(variant):
    """Changing a document's keys/values moves no other document's rows (bit for bit) and, in
    `anchor`, slot 0 is seen by every row: a mask slip in the panel shortcuts would show here."""
    rng = np.random.default_rng(7)
    T, N, K, D = 515, 4, 2, 32
    q, k, v, _ = inputs(rng, 1, T, N, K, D, variant)
    doc = np.zeros((1, T), np.int32)
    doc[0, :] = np.repeat(np.arange(1, 6), [103] * 5)
    if variant == "anchor":
        doc[0, 0] = 0
    base = fused(q, k, v, doc, variant, D ** -0.5)
    hit = doc[0] == 3
    k2, v2 = k.copy(), v.copy()
    k2[0, hit] += 1.0
    v2[0, hit] -= 3.0
    moved = fused(q, k2, v2, doc, variant, D ** -0.5)
    same = ~hit
    np.testing.assert_array_equal(moved[0, same], base[0, same])
    assert np.abs(moved[0, hit] - base[0, hit]).max() > 1e-2
    if variant == "anchor":
        v3 = v.copy()
        v3[0, 0] += 5.0
        assert (np.abs(fused(q, k, v3, doc, variant, D ** -0.5) - base).max(axis=(2, 3)) > 0).all()


def test_fused_nan_rows_match_dense():
    """A NaN query poisons its own row only; a NaN key poisons exactly the rows that see it."""
    rng = np.random.default_rng(3)
    T, N, K, D = 97, 4, 2, 16
    q, k, v, doc = inputs(rng, 1, T, N, K, D, "intra_doc")
    q[0, 40, 1, 3] = np.nan
    k[0, 60, 0, 5] = np.nan
    dense = np.asarray(A.blocked_dense_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(doc),
                                                 "intra_doc", FP32, D ** -0.5))
    out = fused(q, k, v, doc, "intra_doc", D ** -0.5)
    assert np.isnan(dense).any() and np.isnan(dense).all(axis=-1).sum() > 1
    np.testing.assert_array_equal(np.isnan(out), np.isnan(dense))


KERNEL_POLICIES = ["fa2_bf16", "paper_bf16", "fa2_bf16_1pass", {"base": "fa2_bf16", "kv_block": 32},
                   {"base": "fa2_bf16", "logits": "bfloat16"}]
BF16_SHAPES = [(2, 97, 9, 3, 64), (1, 515, 8, 2, 40), (2, 1025, 4, 4, 80)]


def _bf16_case(name, variant, shape):
    """(kernel output, the policy's JAX path, fp64 truth) on the same bf16 inputs."""
    pol = get_policy(name)
    B, T, N, K, D = shape
    rng = np.random.default_rng(T * 7 + N)
    q, k, v, doc = inputs(rng, B, T, N, K, D, variant)
    args = [jnp.asarray(x, pol.dtype("act")) for x in (q, k, v)]
    d, scale = jnp.asarray(doc), D ** -0.5
    ref = np.asarray(jitted(A.blocked_online_attention, variant, pol, scale)(*args, d))
    f = jax.jit(lambda q, k, v, d: A.attention(q, k, v, d, variant, pol, scale, fused=True))
    assert kernels.TARGET in f.lower(*args, d).as_text()
    out = np.asarray(f(*args, d))
    truth = np.asarray(jitted(A.blocked_dense_attention, variant, FP64, scale)(
        *(jnp.asarray(x, jnp.float64) for x in args), d))
    return out, ref, truth, (pol, args, d, scale)


def _policy_id(n) -> str:
    return n if isinstance(n, str) else "_".join(map(str, n.values()))


def _bf16_in_make_test(i: int, variant: str, T: int) -> bool:
    """`make test` (the CI budget on 2 cores) keeps fa2_bf16 (policy 0) at every variant up to 515 and anchor at 1025;
    each other policy at T = 97 under one variant (a diagonal: every variant is met), and the 32-key blocks again
    for anchor at 515 (several blocks a row); the rest runs in `make test-all`."""
    if i == 0:
        return T < 1025 or variant == "anchor"
    if T == 97:
        return VARIANTS.index(variant) == i % len(VARIANTS)
    policy = KERNEL_POLICIES[i]
    return T == 515 and variant == "anchor" and isinstance(policy, dict) and "kv_block" in policy


BF16_CASES = [pytest.param(n, s, v, id="{}-B{}_T{}_N{}_K{}_D{}-{}".format(_policy_id(n), *s, v),
                           marks=[] if _bf16_in_make_test(i, v, s[1]) else [pytest.mark.slow])
              for i, n in enumerate(KERNEL_POLICIES) for s in BF16_SHAPES for v in VARIANTS]


@pytest.mark.parametrize("name,shape,variant", BF16_CASES)
def test_kernel_rounds_where_the_policy_rounds(name, variant, shape):
    out, ref, truth, _ = _bf16_case(name, variant, shape)
    assert out.shape == ref.shape and out.dtype == np.float32 and np.isfinite(out).all()
    err, own = rel(out, ref), rel(ref, truth)
    print(f"{name} {variant} {shape}: kernel vs JAX path {err:.2e}, JAX path vs fp64 {own:.2e} "
          f"({int((out != np.asarray(ref, np.float32)).sum())} of {out.size} values differ)")
    assert err <= 0.05 * own


@pytest.mark.parametrize("planted", ["logits_bf16", "pv_bf16", "kv_block"])
def test_a_kernel_that_skips_a_rounding_fails_that_bound(planted):
    """The bound above can fail: the kernel with one of the policy's roundings changed (logits kept
    in fp32, probabilities not rounded, one key block instead of blocks of 32) is far outside it."""
    name = {"logits_bf16": {"base": "fa2_bf16", "logits": "bfloat16"}, "pv_bf16": "fa2_bf16",
            "kv_block": {"base": "fa2_bf16", "kv_block": 32}}[planted]
    out, ref, truth, (pol, args, d, scale) = _bf16_case(name, "intra_doc", (2, 515, 9, 3, 64))
    right = A.kernel_args(args[0], args[1], pol, True)
    wrong = {**right, planted: (1 << 30) if planted == "kv_block" else not right[planted]}
    qk_in, pv_in = pol.dtype("qk_in"), pol.dtype("pv_in")
    bad = np.asarray(jax.jit(lambda q, k, v, d: kernels.causal_attention(
        q.astype(qk_in), k.astype(qk_in), v.astype(pv_in), d, "intra_doc", scale, **wrong))(*args, d))
    own = rel(ref, truth)
    assert rel(out, ref) <= 0.05 * own < rel(bad, ref)


def _lowered(policy, T=33):
    q = jnp.zeros((1, T, 4, 16), policy.dtype("qk_in"))
    k = jnp.zeros((1, T, 2, 16), policy.dtype("qk_in"))
    doc = jnp.ones((1, T), jnp.int32)
    f = jax.jit(lambda q, k, v, d: A.attention(q, k, v, d, "anchor", policy, 0.25))
    return f.lower(q, k, k, doc).as_text()


def test_dispatch_to_the_policies_the_kernel_covers():
    """fp32, fa2_bf16 and paper_bf16 lower to the kernel; policies that round where it does not (fp64 or
    fp16 stages, torch's fexp_u20, a key block that is not a multiple of 16) keep the JAX path, and so
    does hf_bf16's dense softmax (its JAX path is torch's eager attention bit for bit)."""
    for name in ("fp32", "fa2_bf16", "paper_bf16", "fa2_bf16_1pass"):
        assert kernels.TARGET in _lowered(get_policy(name)), name
    for pol in (get_policy("fp64"), get_policy("hf_bf16"), FP32.with_stages(softmax="float64"),
                get_policy("fa2_bf16").with_stages(pv_acc="float64"), get_policy("sdpa_cpu_bf16_avx512"),
                get_policy({"base": "fa2_bf16", "kv_block": 20}), get_policy("fa2_bf16").with_stages(qk_in="float16")):
        assert kernels.TARGET not in _lowered(pol, T=97), pol.name
    assert kernels.TARGET in _lowered(get_policy({"base": "fa2_bf16", "kv_block": 20}), T=17)  # one block


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


LOWER = """
import jaxref, jax, jax.numpy as jnp
from jaxref import attention as A, kernels
from jaxref.policy import get_policy
q = jnp.ones((1, 9, 2, 16), jnp.float32)
f = jax.jit(lambda q: A.dense_attention(q, q, q, jnp.ones((1, 9), jnp.int32), "full", get_policy("fp32"), 0.25))
print("KERNEL" if kernels.TARGET in f.lower(q).as_text() else "JAX", float(f(q).sum()))
"""


def test_switch_off_and_missing_compiler_fall_back(tmp_path):
    off = _run(LOWER, JAXREF_FUSED_ATTENTION="0")
    assert off.returncode == 0 and off.stdout.startswith("JAX"), off.stderr
    # A fresh cache and no compiler: one warning naming the problem, then the JAX path.
    nocxx = _run(LOWER, ANCHOR_CACHE=str(tmp_path), CXX=str(tmp_path / "no-such-c++"))
    assert nocxx.returncode == 0 and nocxx.stdout.startswith("JAX"), nocxx.stderr
    assert "fused attention kernel unavailable" in nocxx.stderr and "no C++ compiler" in nocxx.stderr
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind
    on = _run(LOWER)
    assert on.returncode == 0 and on.stdout.startswith("KERNEL"), on.stderr
    assert float(on.stdout.split()[1]) == pytest.approx(float(off.stdout.split()[1]), rel=1e-6)


def test_switch_is_an_argument(monkeypatch):
    """`fused` travels as an argument: it overrides the user's default (JAXREF_FUSED_ATTENTION), which
    only fills in `fused=None`."""
    q = jnp.ones((1, 9, 2, 16), jnp.float32)
    doc = jnp.ones((1, 9), jnp.int32)

    def lowered(**kw):
        return jax.jit(lambda q: A.attention(q, q, q, doc, "full", FP32, 0.25, **kw)).lower(q).as_text()

    monkeypatch.delenv("JAXREF_FUSED_ATTENTION", raising=False)
    assert kernels.TARGET in lowered() and kernels.TARGET in lowered(fused=True)
    assert kernels.TARGET not in lowered(fused=False)
    monkeypatch.setenv("JAXREF_FUSED_ATTENTION", "0")
    assert kernels.TARGET not in lowered() and kernels.TARGET in lowered(fused=True)


def test_gradients_trace_the_jax_path_without_the_environment(monkeypatch):
    """value_and_grad passes fused=False down (the kernel has no VJP): it neither reads the user's
    switch nor sets any environment variable while tracing."""
    monkeypatch.setattr(kernels, "enabled", lambda: pytest.fail("the gradient consulted the user's default switch"))
    params, config = jaxref.load_model("random:llama")
    env = dict(os.environ)
    loss, grads = jaxref.value_and_grad(params, config, np.arange(3, 20)[None], policy="fp32")
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values())
    assert dict(os.environ) == env
