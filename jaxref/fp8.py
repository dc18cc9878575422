"""FP8 as the training recipes use it: scaled, saturating casts to float8 and products of the dequantized values.

An FP8 stage of a policy (`jaxref.policy`: `linear_in`, `linear_grad`, `qk_in`, `pv_in`, `probs`) rounds a
tensor x to float8 through a scale s: q = saturate(x·s) cast to float8 (round to nearest even; saturation
first, as torchao's `to_fp8_saturated` and torch ≥ 2.12's casts do, since e4m3fn has no infinity and
its cast of a finite overflow is NaN), and the arithmetic after it reads q / s in float32 (the "carrier"
dtype of an FP8 stage, `CARRIER`). That is the product torchao's emulation forms (`mm` of
`a._data.float() / a._scale`) and the one `torch._scaled_mm` forms up to the order of one fp32 multiply.

Scales (`scale`), both from amax = max |x| over the scaled group, s = fmax / max(amax, 1e-12) formed in
float64 and rounded to float32 (torchao's `amax_to_scale`):
  tensorwise  one scale for the whole tensor (a micro-batch's activations, a weight): per-tensor current
              scaling, as TransformerEngine's `Float8CurrentScaling` and torchao's `tensorwise` recipe.
  rowwise     one scale per row along the product's contraction axis, rounded down to a power of two
              (2^floor(log2 s)): torchao's `rowwise` recipe (AXISWISE, round_scales_to_power_of_2; torchao
              forms the power with float32 log2 and exp2, which may land one power up within an ulp of one).
The probabilities of attention are scaled by fmax under either scaling: their bound, exp(s − m) ≤ 1, is
their amax before they are formed (what FP8 attention kernels scale P by).

The casts pass the gradient through unchanged (`fake_quant`'s VJP, as torchao's `_ToFloat8ConstrFunc`).
A linear layer with `linear_grad` set has the recipe's backward instead (`linear`): the incoming gradient
and the saved operands cast again along the backward products' own contraction axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
SCALINGS: tuple[str, ...] = ("tensorwise", "rowwise")
CARRIER = jnp.dtype(jnp.float32)
"""The dtype the arithmetic after an FP8 stage holds its dequantized values in."""
EPS = 1e-12
"""amax's floor in a scale (torchao's EPS): an all-zero group gets a finite scale."""


def is_fp8(dtype) -> bool:
    """Whether `dtype` (a name or a dtype, None allowed) is one of FP8_DTYPES."""
    return dtype is not None and jnp.dtype(dtype).name in FP8_DTYPES


def fmax(dtype) -> float:
    """The largest finite value of a float8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(ml_dtypes.finfo(jnp.dtype(dtype)).max)


def cast(x, dtype):
    """x (any float) → float8 `dtype`: multiplied out already, clamped to ±fmax (so ±inf and finite overflows
    saturate; NaN stays NaN), then rounded to nearest even. Returns a float8 array."""
    m = fmax(dtype)
    return jnp.clip(x, -m, m).astype(dtype)


def scale(x, dtype, scaling: str, axis: int = -1):
    """The float32 scale of x for a cast to `dtype` (module docstring): `tensorwise` one for the tensor,
    `rowwise` one per row along `axis` (the product's contraction axis), a power of two. Broadcastable
    against x (reduced axes kept)."""
    if scaling not in SCALINGS:
        raise ValueError(f"unknown FP8 scaling {scaling!r} (valid: {', '.join(SCALINGS)})")
    axes = (axis % x.ndim,) if scaling == "rowwise" else tuple(range(x.ndim))
    amax = jnp.max(jnp.abs(x.astype(CARRIER)), axis=axes, keepdims=True).astype(jnp.float64)
    s = (fmax(dtype) / jnp.maximum(amax, EPS)).astype(jnp.float32)
    if scaling == "rowwise":  # 2^floor(log2 s), exactly: XLA's exp2 is off by an ulp at some integers
        _, e = jnp.frexp(s)
        s = jnp.ldexp(jnp.ones_like(s), e - 1)
    return s


def quantize(x, dtype, scaling: str, axis: int = -1):
    """(q, s): x cast to float8 `dtype` through its scale (q = cast(x·s) in float8; s float32)."""
    s = scale(x, dtype, scaling, axis)
    return cast(x.astype(CARRIER) * s, dtype), s


def _divide(a, s):
    """a / s, each element correctly rounded: XLA rewrites a division by a broadcast (a scalar, a row) into a
    product with its reciprocal, off by an ulp in about half of the elements; a divisor of a's shape behind
    an optimization barrier stays a division, as torch's is."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(s, a.shape))


def dequantize(q, s):
    """q / s in float32: the values the products read."""
    return _divide(q.astype(CARRIER), s)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def fake_quant(x, dtype, scaling: str, axis: int = -1):
    """x rounded to float8 `dtype` through its scale and read back in float32 (`dequantize(*quantize(x))`);
    its gradient passes through unchanged (cast to x's dtype)."""
    return dequantize(*quantize(x, dtype, scaling, axis))


def _fake_quant_fwd(x, dtype, scaling, axis):
    return fake_quant(x, dtype, scaling, axis), jnp.zeros((), x.dtype)


def _passed_through(*nondiff_and_res_g):
    res, g = nondiff_and_res_g[-2:]
    return (g.astype(res.dtype),)


fake_quant.defvjp(_fake_quant_fwd, _passed_through)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def probs(p, dtype):
    """Probabilities p ∈ [0, 1] rounded to float8 `dtype` through the scale fmax (their bound as their amax)
    and read back in float32; the gradient passes through unchanged."""
    m = jnp.asarray(fmax(dtype), CARRIER)
    return _divide(cast(p.astype(CARRIER) * m, dtype).astype(CARRIER), m)


probs.defvjp(lambda p, dtype: (probs(p, dtype), jnp.zeros((), p.dtype)), _passed_through)


def _dot(a, b, subscripts: str):
    return jnp.einsum(subscripts, a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=CARRIER)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _linear8_recipe(x, w, in_dtype, grad_dtype, scaling: str, act):
    return _linear8_forward(x, w, in_dtype, scaling, act)


def _linear8_forward(x, w, in_dtype, scaling, act):
    xq = fake_quant(x, in_dtype, scaling, -1)
    wq = fake_quant(w, in_dtype, scaling, -1)
    return _dot(xq, wq, "...I,OI->...O").astype(act)


def _linear8_fwd(x, w, in_dtype, grad_dtype, scaling, act):
    return _linear8_forward(x, w, in_dtype, scaling, act), (x, w)


def _linear8_bwd(in_dtype, grad_dtype, scaling, act, res, g):
    """torchao's `matmul_with_hp_or_float8_args.backward`: grad_input = g (rowwise over the outputs) · w
    (rowwise over the outputs, i.e. per input column); grad_weight = gᵀ (rowwise over the tokens) · x
    (rowwise over the tokens); each product in float32, rounded to its operand's dtype."""
    x, w = res
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, I]: every token of the batch a row, as torchao reshapes
    g2 = g.reshape(-1, g.shape[-1])  # [M, O]
    gx = _dot(fake_quant(g2, grad_dtype, scaling, -1), fake_quant(w, in_dtype, scaling, 0), "MO,OI->MI")
    gw = _dot(fake_quant(g2, grad_dtype, scaling, 0), fake_quant(x2, in_dtype, scaling, 0), "MO,MI->OI")
    return gx.reshape(*lead, x.shape[-1]).astype(x.dtype), gw.astype(w.dtype)


_linear8_recipe.defvjp(_linear8_fwd, _linear8_bwd)


def linear(x_BTI, w_OI, b_O, act, param, in_dtype, grad_dtype, scaling: str):
    """`x @ wᵀ (+ b)` with FP8 operands: x (in `act`) and w (in `param`) cast to `in_dtype` with `scaling`
    (per tensor, or per row along the input features: x per token, w per output), the product of the
    dequantized values in float32, the bias added there, the result rounded to `act`.

    Backward: with `grad_dtype` None, autodiff through the casts (straight-through: the gradients are the
    float32 products of the incoming gradient with the dequantized operands); with a float8 `grad_dtype`,
    the recipe's (`_linear8_bwd`). The bias's gradient is the sum of the incoming gradient as usual."""
    x, w = x_BTI.astype(act), w_OI.astype(param)
    if grad_dtype is None:
        y = _linear8_forward(x, w, in_dtype, scaling, CARRIER)
    else:
        y = _linear8_recipe(x, w, in_dtype, grad_dtype, scaling, CARRIER)
    if b_O is not None:
        y = y + b_O.astype(param).astype(CARRIER)
    return y.astype(act)


@dataclass(frozen=True)
class Linear8:
    """A policy's FP8 linear layers as one callable (`linear` with the policy's `param`, `linear_in`,
    `linear_grad` and `scaling`): what `jaxref.executor` hands its projections in place of the weight dtype."""

    param: object
    in_dtype: str
    grad_dtype: str | None
    scaling: str

    def __call__(self, x_BTI, w_OI, b_O, act):
        return linear(x_BTI, w_OI, b_O, act, self.param, self.in_dtype, self.grad_dtype, self.scaling)


def reference_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """numpy/ml_dtypes' saturating cast of float32 values (the tests' independent spelling of `cast`)."""
    d = getattr(ml_dtypes, dtype)
    m = float(ml_dtypes.finfo(d).max)
    return np.clip(np.asarray(x, np.float32), -m, m).astype(d)
