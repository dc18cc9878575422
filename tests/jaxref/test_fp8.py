"""FP8 in the oracle (jaxref/fp8.py, the FP8 stages of jaxref.policy): casts and scales against ml_dtypes on
hand-made tensors, the linear products' forward and the torchao recipes' backward against a numpy spelling, every
FP8 stage run forward and backward in a decoder, and a planted scale applied twice caught.

The executor is held to the reference under the FP8 presets by tests/jaxref/test_reference.py (every preset)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxref
from anchor_core.errors import InputError
from jaxref import fp8
from jaxref.policy import PRESETS, STAGES, get_policy

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
SUB_E4M3 = 2.0 ** -9  # e4m3fn's smallest subnormal
SUB_E5M2 = 2.0 ** -16


def bits(a) -> np.ndarray:
    """The float8 bit patterns of a float8 array (JAX or ml_dtypes), as uint8."""
    return np.asarray(a).view(np.uint8)


# Hand cases: (value, e4m3fn, e5m2) with the expected float8 values written out (round to nearest even,
# saturation at ±fmax, NaN kept).
HAND = [
    (1.0625, 1.0, 1.0),            # e4m3's tie between 1 and 1.125: even mantissa
    (1.1875, 1.25, 1.25),          # e4m3's tie between 1.125 and 1.25: even; e5m2 rounds to 1.25
    (0.3952, 0.40625, 0.375),
    (448.0, 448.0, 448.0),
    (464.0, 448.0, 448.0),         # e4m3: past fmax (its tie to 480 would be NaN): saturated
    (1e6, 448.0, 57344.0),         # saturated
    (-np.inf, -448.0, -57344.0),   # saturated, not NaN
    (SUB_E4M3, SUB_E4M3, SUB_E4M3),
    (2.0 ** -10, 0.0, 2.0 ** -10),  # e4m3: the tie between 0 and the smallest subnormal: 0
    (3 * 2.0 ** -11, SUB_E4M3, 3 * 2.0 ** -11),  # e4m3: past the tie, the smallest subnormal
    (2.0 ** -17, 0.0, 0.0),        # below e5m2's half-subnormal: 0
    (1.5 * 2.0 ** -17, 0.0, SUB_E5M2),
    (-0.0, -0.0, -0.0),
]


@pytest.mark.parametrize("dtype,column", [(E4M3, 1), (E5M2, 2)])
def test_the_cast_is_ml_dtypes_saturating_cast_on_hand_cases(dtype, column):
    x = np.array([h[0] for h in HAND] + [np.nan], np.float32)
    want = np.array([h[column] for h in HAND], np.float32)
    ours = fp8.cast(jnp.asarray(x), dtype)
    ref = fp8.reference_cast(x, dtype)
    np.testing.assert_array_equal(bits(ours), bits(ref))  # bit for bit, NaN's pattern included
    np.testing.assert_array_equal(np.asarray(ours, np.float32)[:-1], want)
    assert np.isnan(np.asarray(ours, np.float32)[-1])
    assert fp8.fmax(dtype) == float(ml_dtypes.finfo(getattr(ml_dtypes, dtype)).max) == (448.0 if dtype == E4M3
                                                                                          else 57344.0)


def _numpy_scale(x: np.ndarray, dtype: str, scaling: str, axis: int) -> np.ndarray:
    """torchao's `amax_to_scale` in numpy: fmax / max(amax, 1e-12) in float64, to float32; rowwise: rounded down
    to a power of two (frexp: exact)."""
    axes = (axis % x.ndim,) if scaling == "rowwise" else tuple(range(x.ndim))
    amax = np.max(np.abs(x.astype(np.float32)), axis=axes, keepdims=True).astype(np.float64)
    s = (fp8.fmax(dtype) / np.maximum(amax, 1e-12)).astype(np.float32)
    if scaling == "rowwise":
        _, exp = np.frexp(s)  # s = m * 2**exp, m in [0.5, 1): 2**floor(log2 s) = 2**(exp - 1)
        s = np.ldexp(np.float32(1), exp - 1).astype(np.float32)
    return s


def _hand_tensor() -> np.ndarray:
    """Rows with a large value, subnormal-sized ones, an all-zero row and a row whose amax makes fmax/amax a
    power of two."""
    x = np.array([[3.0, -0.001, 1e-7, 2.5],
                  [0.0, 0.0, 0.0, 0.0],
                  [-448.0, 7.0, -1e-3, 1e-5],
                  [0.1, -0.2, 0.3, 0.05]], np.float32)
    return x


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_both_scalings_equal_ml_dtypes_on_a_hand_tensor(dtype, scaling, axis):
    x = _hand_tensor()
    s_ref = _numpy_scale(x, dtype, scaling, axis)
    q, s = fp8.quantize(jnp.asarray(x), dtype, scaling, axis)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    q_ref = fp8.reference_cast(x * s_ref, dtype)
    np.testing.assert_array_equal(bits(q), bits(q_ref))
    np.testing.assert_array_equal(np.asarray(fp8.fake_quant(jnp.asarray(x), dtype, scaling, axis)),
                                  q_ref.astype(np.float32) / s_ref)
    if scaling == "rowwise":
        assert np.all(np.frexp(np.asarray(s))[0] == 0.5)  # powers of two
        assert np.asarray(s).shape == tuple(1 if d == axis % 2 else 4 for d in range(2))
        zero = np.asarray(s)[1, 0] if axis == -1 else None
        if zero is not None:  # the all-zero row: amax floored at 1e-12, a finite scale, zeros out
            assert np.isfinite(zero) and not np.asarray(fp8.fake_quant(jnp.asarray(x), dtype, scaling, axis))[1].any()
    else:
        assert np.asarray(s).shape == (1, 1) and np.asarray(s)[0, 0] == np.float32(fp8.fmax(dtype) / 448.0)


def test_the_probabilities_are_scaled_by_their_bound():
    p = np.array([1.0, 0.3, 1e-3, 2e-5, 4e-6, 1e-7, 0.0], np.float32)
    for dtype in (E4M3, E5M2):
        m = fp8.fmax(dtype)
        want = fp8.reference_cast(p * m, dtype).astype(np.float32) / np.float32(m)
        np.testing.assert_array_equal(np.asarray(fp8.probs(jnp.asarray(p), dtype)), want)
    # e4m3 through the scale 448: 4e-6 survives (its smallest value is 2^-9 / 448), 1e-7 does not
    got = np.asarray(fp8.probs(jnp.asarray(p), E4M3))
    assert got[4] > 0 and got[5] == 0


def _numpy_linear(x, w, in_dtype, scaling):
    xq = fp8.reference_cast(x * _numpy_scale(x, in_dtype, scaling, -1), in_dtype).astype(np.float32)
    wq = fp8.reference_cast(w * _numpy_scale(w, in_dtype, scaling, -1), in_dtype).astype(np.float32)
    xd = xq / _numpy_scale(x, in_dtype, scaling, -1)
    wd = wq / _numpy_scale(w, in_dtype, scaling, -1)
    return xd.astype(np.float64) @ wd.T.astype(np.float64)


def _dq(x, dtype, scaling, axis):
    s = _numpy_scale(x, dtype, scaling, axis)
    return (fp8.reference_cast(x * s, dtype).astype(np.float32) / s).astype(np.float64)


@pytest.mark.parametrize("recipe", ["torchao_rowwise_bf16", "torchao_tensorwise_bf16"])
def test_the_linear_and_its_recipe_backward_are_torchaos(recipe):
    """Forward: both operands through FP8 (x per token, w per output row under rowwise), the product of the
    dequantized values. Backward (torchao's `matmul_with_hp_or_float8_args.backward`): grad_input from the
    gradient scaled along the outputs and w along its outputs (per input column); grad_weight from the gradient
    and x each scaled along the tokens. Each against numpy in float64 from the same float8 values: an fp32
    accumulation's error apart (operands in fp32 with 24 bits)."""
    pol = PRESETS[recipe]
    rng = np.random.default_rng(97)
    x = (rng.normal(size=(3, 5, 33)) * np.exp(rng.normal(size=(3, 5, 1)))).astype(np.float32)
    w = (rng.normal(size=(17, 33)) * 0.05).astype(np.float32)
    g = rng.normal(size=(3, 5, 17)).astype(np.float32)
    f32 = jnp.float32
    y, vjp = jax.vjp(lambda x, w: fp8.linear(x, w, None, f32, f32, pol.linear_in, pol.linear_grad, pol.scaling),
                     jnp.asarray(x), jnp.asarray(w))
    gx, gw = vjp(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(y), _numpy_linear(x.reshape(15, 33), w, pol.linear_in, pol.scaling)
                               .reshape(3, 5, 17), rtol=1e-5, atol=1e-5)
    g2, x2 = g.reshape(15, 17), x.reshape(15, 33)
    gx_ref = _dq(g2, pol.linear_grad, pol.scaling, -1) @ _dq(w, pol.linear_in, pol.scaling, 0)
    gw_ref = _dq(g2, pol.linear_grad, pol.scaling, 0).T @ _dq(x2, pol.linear_in, pol.scaling, 0)
    np.testing.assert_allclose(np.asarray(gx).reshape(15, 33), gx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), gw_ref, rtol=1e-5, atol=1e-5)
    # the backward casts its own way: straight-through gradients (no linear_grad) differ from the recipe's
    _, vjp_st = jax.vjp(lambda x, w: fp8.linear(x, w, None, f32, f32, pol.linear_in, None, pol.scaling),
                        jnp.asarray(x), jnp.asarray(w))
    assert not np.array_equal(np.asarray(vjp_st(jnp.asarray(g))[1]), np.asarray(gw))


def test_a_scale_applied_twice_is_caught(monkeypatch):
    """The checks above fail on an FP8 cast whose scale is applied twice (a planted defect)."""
    x = _hand_tensor()
    s_ref = _numpy_scale(x, E4M3, "rowwise", -1)
    want = fp8.reference_cast(x * s_ref, E4M3).astype(np.float32) / s_ref
    monkeypatch.setattr(fp8, "dequantize", lambda q, s: q.astype(fp8.CARRIER) / s / s)
    planted = np.asarray(fp8.fake_quant(jnp.asarray(x), E4M3, "rowwise", -1))
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(planted, want)


# One policy per FP8 stage on fp32's arithmetic (linear_grad with linear_in), and the presets.
ONE_STAGE = {
    "linear_in": {"linear_in": E4M3},
    "linear_grad": {"linear_in": E4M3, "linear_grad": E5M2},
    "qk_in": {"qk_in": E4M3},
    "pv_in": {"pv_in": E4M3},
    "probs": {"probs": E4M3},
}


@functools.lru_cache(maxsize=1)
def _fp32_and_truth():
    """random:llama at T = 97 (anchor): params, spec, tokens, fp32's and fp64's logits, fp32's loss and gradients."""
    params, spec = jaxref.load_model("random:llama")
    tokens = np.random.default_rng(3).integers(3, spec.vocab_size, (1, 97))
    base = np.asarray(jaxref.forward(params, spec, tokens, variant="anchor", policy="fp32"), np.float64)
    truth = np.asarray(jaxref.forward(params, spec, tokens, variant="anchor", policy="fp64"))
    loss32, grads32 = jaxref.value_and_grad(params, spec, tokens, variant="anchor", policy="fp32")
    return params, spec, tokens, base, truth, loss32, grads32


# make test: the attention operands, one under each scaling (the linears' FP8 is held in make test by the linear's
# own test and test_reference's FP8 presets); make test-all: every stage under every scaling
_STAGE_FAST = {("qk_in", "tensorwise"), ("pv_in", "rowwise")}


@pytest.mark.parametrize("stage,scaling", [
    pytest.param(st, sc, id=f"{st}-{sc}", marks=[] if (st, sc) in _STAGE_FAST else [pytest.mark.slow])
    for st in ONE_STAGE for sc in ("tensorwise", "rowwise")])
def test_each_fp8_stage_runs_forward_and_backward_and_moves_the_numbers(stage, scaling):
    params, spec, tokens, base, truth, loss32, grads32 = _fp32_and_truth()
    pol = get_policy({"base": "fp32", "scaling": scaling, **ONE_STAGE[stage]})
    assert pol.fp8 and getattr(pol, stage) in fp8.FP8_DTYPES
    logits = np.asarray(jaxref.forward(params, spec, tokens, variant="anchor", policy=pol), np.float64)
    assert np.isfinite(logits).all()
    err = np.linalg.norm(logits - truth) / np.linalg.norm(truth)
    err32 = np.linalg.norm(base - truth) / np.linalg.norm(truth)
    print(f"\n{stage} {scaling}: error vs fp64 {err:.3e}; fp32's {err32:.3e}")
    assert err > 100 * err32  # the stage rounds to 8 bits, not 24
    loss, grads = jaxref.value_and_grad(params, spec, tokens, variant="anchor", policy=pol)
    assert np.isfinite(float(loss)) and abs(float(loss) - float(loss32)) < 0.1 * abs(float(loss32))
    for name, g in grads.items():
        g, g32 = np.asarray(g, np.float64), np.asarray(grads32[name], np.float64)
        assert np.isfinite(g).all(), name
        assert np.linalg.norm(g - g32) <= 0.5 * np.linalg.norm(g32) + 1e-12, name  # close to fp32's, not garbage
    moved = [n for n in grads if not np.array_equal(np.asarray(grads[n]), np.asarray(grads32[n]))]
    assert moved, "the FP8 stage changed no gradient"


def test_fp8_presets_are_their_recipes():
    fa2 = PRESETS["fa2_bf16"]
    for name, scaling, grad in (("torchao_rowwise_bf16", "rowwise", E4M3), ("torchao_tensorwise_bf16", "tensorwise",
                                                                            E5M2)):
        p = PRESETS[name]
        assert {s: getattr(p, s) for s in STAGES} == {s: getattr(fa2, s) for s in STAGES}  # attention as today
        assert (p.linear_in, p.linear_grad, p.probs, p.scaling, p.attention, p.backward) == (
            E4M3, grad, None, scaling, "online", "fa2")
        assert not p.fp8_attention
    te = PRESETS["te_fp8"]
    assert (te.qk_in, te.pv_in, te.probs_dtype(), te.linear_in, te.linear_grad, te.scaling) == (
        E4M3, E4M3, E4M3, E4M3, E5M2, "tensorwise")
    assert te.dtype("qk_in") == jnp.float32 and te.backward == "autodiff" and te.fp8_attention
    for p in (PRESETS[n] for n in ("torchao_rowwise_bf16", "torchao_tensorwise_bf16", "te_fp8")):
        assert get_policy(p.to_dict()) == p


@pytest.mark.parametrize("mapping,message", [
    ({"base": "fp32", "act": "e4m3"}, "stage 'act' cannot be float8_e4m3fn: FP8 goes on the stages"),
    ({"base": "fp32", "linear_in": "bfloat16"}, "unknown dtype 'bfloat16' for stage 'linear_in'"),
    ({"base": "fp32", "linear_grad": "e5m2"}, "linear_grad (the FP8 backward of the linear products) needs linear_in"),
    ({"base": "fp32", "linear_in": "e4m3", "scaling": "blockwise"}, "unknown scaling 'blockwise'"),
    ({"base": "fa2_bf16", "qk_in": "e4m3"}, "backward 'fa2' is a bf16 kernel's; FP8 attention stages (qk_in)"),
])
def test_bad_fp8_policies_are_one_line_errors(mapping, message):
    with pytest.raises(InputError) as e:
        get_policy(mapping)
    assert message in str(e.value) and "\n" not in str(e.value)
    # the same base with backward: autodiff is accepted where only the backward was wrong
    if mapping.get("base") == "fa2_bf16":
        assert get_policy({**mapping, "backward": "autodiff"}).fp8_attention
