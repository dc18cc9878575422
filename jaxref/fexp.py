"""torch's fast float32 exponential (`fexp_u20`), bit for bit, and where the online softmax uses it.

torch's CPU flash kernel takes the exponential of probabilities that are rounded to 16 bits from
`Vectorized<float>::fexp_u20`, within one bf16 ulp of exp but not exp; `fexp_u20` reproduces its float32
arithmetic exactly (its derivative is its own value, as exp's). `_softmax_exp` is the exponential of the online
softmax under `policy.exp`: `fexp_u20` on the keys of a block's whole vectors of `policy.lanes` lanes, as the
kernel's vector loop covers them, and exp on the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxref.policy import DtypePolicy

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
