"""The decoder's projections in BLAS (`jaxref.kernels.matmul`, jaxref.executor.linear with `fused`).

The kernel runs a private, single-threaded copy of numpy's OpenBLAS on XLA's threads. What it
promises: a row's result independent of the batch around it (the audit compares one window under two
shifts in one batch, and the batched pass with a batch of one), on every CPU; numpy's `x @ w.T` to the
bit where the BLAS is position-exact (`kernels.blas_position_exact`: OpenBLAS's AVX-512 kernels), and
within 2x numpy's own error against the exact sum elsewhere (its Haswell kernels, on AVX2 CPUs, where
numpy's one call over the whole batch sums some rows in another order); numpy's own BLAS left as it
was; the forward within its own rounding of XLA's matmuls.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxref
from jaxref import kernels

pytestmark = pytest.mark.skipif(not kernels.blas_available(), reason="no C++ compiler or no OpenBLAS in numpy")

matmul = jax.jit(kernels.matmul)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B,T,K,N", [(1, 97, 64, 160), (3, 515, 576, 192), (20, 256, 576, 576), (2, 1025, 576, 1536)])
def test_matmul_is_numpy_and_independent_of_the_batch(dtype, B, T, K, N):
    rng = np.random.default_rng(B * T + K)
    x = rng.standard_normal((B, T, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    x[-1] = x[0]  # the same window twice in one batch
    y = np.asarray(matmul(jnp.asarray(x), jnp.asarray(w)))
    assert y.dtype == dtype and y.shape == (B, T, N)
    if kernels.blas_position_exact():
        np.testing.assert_array_equal(y, x @ w.T)
    else:
        rows = np.s_[:, ::7]  # every 7th row of each window: the exact sum in long double is slow
        exact = x[rows].astype(np.longdouble) @ w.T.astype(np.longdouble)
        err, err_numpy = (float(np.abs(a[rows] - exact).max() / np.abs(exact).max()) for a in (y, x @ w.T))
        print(f"max error / max |y| against the exact sum: kernel {err:.3g}, numpy {err_numpy:.3g}")
        assert 0 < err <= 2 * err_numpy
    np.testing.assert_array_equal(y[-1], y[0])
    one = np.asarray(matmul(jnp.asarray(x[:1]), jnp.asarray(w)))
    np.testing.assert_array_equal(one[0], y[0])


@pytest.mark.parametrize("B,T", [(3, 23), (5, 37), (1, 7)])
def test_tiny_calls_keep_identical_rows_identical(B, T):
    """Small calls get the BLAS's small-matrix kernels, whose rows depend on the call's shape: every
    element is still cut alike, so the same window twice gives the same rows (the audit's Δ = Δ_ref)."""
    rng = np.random.default_rng(T)
    x = rng.standard_normal((B, T, 84)).astype(np.float32)
    x[-1] = x[0]
    w = rng.standard_normal((97, 84)).astype(np.float32)
    y = np.asarray(matmul(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_array_equal(y[-1], y[0])
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)


def test_rank_two_and_empty_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((515, 33)).astype(np.float32)
    w = rng.standard_normal((7, 33)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), jnp.asarray(w))), x @ w.T, rtol=1e-5, atol=1e-5)
    assert np.asarray(matmul(jnp.zeros((2, 0, 33)), jnp.asarray(w))).shape == (2, 0, 7)
    np.testing.assert_array_equal(np.asarray(matmul(jnp.ones((3, 5, 0)), jnp.ones((4, 0)))), np.zeros((3, 5, 4)))


def _numpy_openblas_threads() -> int | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "numpy.libs" in path and "openblas" in path and "-private-" not in path:
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
                if hasattr(lib, name):
                    return int(getattr(lib, name)())
    return None


def test_numpy_keeps_its_blas_threads():
    """The kernel's BLAS is a private instance: numpy's thread count is what it was (OpenBLAS's count is
    one global per instance; setting numpy's to 1 left numpy's matmuls on one core)."""
    before = _numpy_openblas_threads()
    if before is None:
        pytest.skip("numpy's BLAS is not the wheel's OpenBLAS")
    x = jnp.ones((4, 256, 576), jnp.float32)
    jax.block_until_ready(matmul(x, jnp.ones((576, 576), jnp.float32)))
    assert _numpy_openblas_threads() == before


def test_forward_uses_blas_and_stays_within_rounding():
    """`fused` puts every projection of the forward in the kernel (the lowered program calls it), and
    the fp32 logits stay within 2x the XLA path's own error against fp64 (odd T = 97)."""
    params, spec = jaxref.load_model("random:llama")
    rng = np.random.default_rng(1)
    toks = rng.integers(3, 259, size=(2, 97)).astype(np.int32)
    fp64 = np.asarray(jaxref.forward(params, spec, toks, policy="fp64"), np.float64)
    xla = np.asarray(jaxref.forward(params, spec, toks, policy="fp32", fused=False), np.float64)
    blas = np.asarray(jaxref.forward(params, spec, toks, policy="fp32", fused=True), np.float64)
    assert not np.array_equal(xla, blas)  # another summation order: the kernel did run
    err_xla, err_blas = (np.linalg.norm(a - fp64) / np.linalg.norm(fp64) for a in (xla, blas))
    print(f"fp32 logits vs fp64: XLA {err_xla:.3g}, BLAS {err_blas:.3g}")
    assert err_blas <= 2 * err_xla
    from jaxref.executor import _forward_jit
    hlo = _forward_jit.lower(params, jnp.asarray(toks), jnp.asarray(np.tile(np.arange(97), (2, 1))),
                             jnp.ones((2, 97), jnp.int32), spec=spec, policy=jaxref.get_policy("fp32"),
                             variant="full", tap=False, tap_rows=None, probe=None, seq_len=None,
                             fused=True).as_text()
    # q|k|v, o, gate|up, down (in the layer scan) and the head; each its own where calls are not shared
    assert hlo.count("jaxref_matmul_f32") == (5 if kernels.blas_position_exact() else 8)


def test_linear_many_shares_a_weight_and_gives_each_requests_own_product():
    """Requests that read the same weight in the same dtypes run as one BLAS call (one custom call in the
    program) and each gets, bitwise, what `linear` alone gives it; a request with another accumulator
    (fp64 activations), another weight dtype or another weight runs on its own."""
    from jaxref.executor import linear, linear_many

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((192, 97)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((192, 97)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(192), jnp.float32)
    xs = [jnp.asarray(rng.standard_normal((2, 129, 97)), jnp.float32) for _ in range(6)]
    reqs = lambda xs, w, w2, b: [(xs[0], w, None, jnp.bfloat16, jnp.bfloat16),  # noqa: E731
                                 (xs[1], w, b, jnp.float32, jnp.bfloat16),      # the same weight and accumulator
                                 (xs[2], w, None, jnp.bfloat16, jnp.bfloat16),
                                 (xs[3], w, None, jnp.float64, jnp.bfloat16),   # fp64 accumulator
                                 (xs[4], w, None, jnp.bfloat16, jnp.float32),   # another weight dtype
                                 (xs[5], w2, None, jnp.bfloat16, jnp.bfloat16)]  # another weight
    together = jax.jit(lambda xs, w, w2, b: linear_many(reqs(xs, w, w2, b), True))
    alone = jax.jit(lambda xs, w, w2, b: [linear(*r, True) for r in reqs(xs, w, w2, b)])
    got, want = together(xs, w, w2, b), alone(xs, w, w2, b)
    for g, e, r in zip(got, want, reqs(xs, w, w2, b)):
        assert g.dtype == e.dtype == jnp.dtype(r[3]) and g.shape == e.shape
        np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(e, np.float64))
    calls = lambda f: f.lower(xs, w, w2, b).as_text().count(kernels.MATMUL_TARGETS[jnp.dtype(jnp.float32)])  # noqa: E731
    # requests 0-2 share one call; 4 and 5 run alone; where calls are not shared, each runs alone
    assert calls(alone) == 5 and calls(together) == (3 if kernels.blas_position_exact() else 5)


def test_linear_many_puts_one_x_against_several_weights_in_one_call():
    """The q, k and v projections of one x (and those of several policies' x, in step) run as one call
    against the weights concatenated on the output axis, and each request gets, bitwise, what `linear`
    alone gives it (odd sizes: the columns of each weight land anywhere in the BLAS's blocks); requests
    that are not every x with every weight share only what reads the same weight."""
    from jaxref.executor import linear, linear_many

    rng = np.random.default_rng(11)
    wq, wk, wv = (jnp.asarray(rng.standard_normal((n, 97)), jnp.float32) for n in (97, 35, 35))
    bk = jnp.asarray(rng.standard_normal(35), jnp.float32)
    xs = [jnp.asarray(rng.standard_normal((3, 129, 97)), jnp.float32) for _ in range(3)]

    def full(xs, wq, wk, wv, bk):  # x0 and x1 (two policies) each against q, k, v: one call
        return [(x, w, b, act, jnp.bfloat16) for x, act in ((xs[0], jnp.bfloat16), (xs[1], jnp.float32))
                for w, b in ((wq, None), (wk, bk), (wv, None))]

    def partial(xs, wq, wk, wv, bk):  # x2 against wq only: wq's call holds x0, x1, x2; wk's and wv's x0, x1
        return full(xs, wq, wk, wv, bk) + [(xs[2], wq, None, jnp.bfloat16, jnp.bfloat16)]

    shared = kernels.blas_position_exact()
    for reqs, n_calls in ((full, 1 if shared else 6), (partial, 3 if shared else 7)):
        together = jax.jit(lambda *a: linear_many(reqs(*a), True))
        alone = jax.jit(lambda *a: [linear(*r, True) for r in reqs(*a)])
        args = (xs, wq, wk, wv, bk)
        got, want = together(*args), alone(*args)
        assert len(got) == len(want) == len(reqs(*args))
        for g, e, r in zip(got, want, reqs(*args)):
            assert g.dtype == e.dtype == jnp.dtype(r[3]) and g.shape == e.shape == (3, 129, r[1].shape[0])
            np.testing.assert_array_equal(np.asarray(g, np.float64), np.asarray(e, np.float64))
        assert together.lower(*args).as_text().count(kernels.MATMUL_TARGETS[jnp.dtype(jnp.float32)]) == n_calls


def _fake_gemm(dtype, bump_rows_after: int | None = None, bump_cols_after: int | None = None):
    """A cblas_?gemm (64-bit integers) computing x·wᵀ by numpy's einsum loops (a row and a column the same
    whatever the call holds), or with the last bit of every row from `bump_rows_after` on, or of every
    column, changed: a BLAS whose results depend on their place in the call. Returns (callback, address)."""
    scalar = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    i64 = ctypes.c_int64

    def gemm(order, ta, tb, m, n, k, alpha, x, lda, w, ldb, beta, y, ldc):
        as_array = lambda p, shape: np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(scalar)), shape)  # noqa: E731
        out = np.einsum("mk,nk->mn", as_array(x, (m, k)), as_array(w, (n, k)), optimize=False)
        if bump_rows_after is not None:
            out[bump_rows_after:] = np.nextafter(out[bump_rows_after:], np.inf)
        if bump_cols_after is not None:
            out[:, bump_cols_after:] = np.nextafter(out[:, bump_cols_after:], np.inf)
        as_array(y, (m, n))[:] = out

    cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, scalar, ctypes.c_void_p,
                          i64, ctypes.c_void_p, i64, scalar, ctypes.c_void_p, i64)(gemm)
    return cb, ctypes.cast(cb, ctypes.c_void_p).value


@pytest.mark.parametrize("bump", [None, "rows", "cols"])
def test_the_position_check_tells_a_blas_whose_results_move_with_the_call(bump, monkeypatch):
    """`_position_exact` passes a BLAS whose rows and columns are computed alike in any call, and fails
    one whose rows past the first call's, or columns past the first 35, change in their last bit (the
    kernel shares calls only where this machine's BLAS passes it: the tests above hold the batch rows
    bitwise either way)."""
    monkeypatch.setattr(kernels, "_POSITION_SHAPES", ((129, 97, 97), (97, 64, 160)))
    fakes = [_fake_gemm(dt, 129 if bump == "rows" else None, 35 if bump == "cols" else None)
             for dt in (np.float32, np.float64)]
    assert kernels._position_exact(fakes[0][1], fakes[1][1], True) is (bump is None)
    print("this machine's BLAS position-exact:", kernels.blas_position_exact())
