"""Rotary position embedding (docs/DESIGN.md §3) as pure functions with explicit dtypes.

Shapes: B batch, T slots, N heads, D head dim (even), F = D/2 frequencies.

The chain is `inv_freq -> angles -> table -> apply`, one dtype per step so a `DtypePolicy` can
place each in its own precision (stages `rope_angle`, `rope_table`, `rope_apply`):

    inv_freq  theta_i = base^(-2i/D), rescaled by the scaling kind             [F]
    angles    position * inv_freq                                             [..., T, F]
    table     cos/sin of the angles, times the attention factor, cast        [..., T, D] each
    apply     x*cos + rotate(x)*sin                                           [B, T, N, D]

Each scaling kind follows transformers 5.23 `modeling_rope_utils.ROPE_INIT_FUNCTIONS[kind]` for the
config `anchor_core.spec.to_hf_config` writes, operation by operation and in the same order, so that in
float32 it agrees with transformers and in float64 it is the same definition evaluated exactly.
`ntk` is `default` with the fixed base `anchor_core.spec.ntk_base`.

Layouts: `half` pairs dimension j with j + D/2 (Hugging Face `rotate_half`, table = concat(f, f));
`interleaved` pairs 2i with 2i+1 (GPT-J / original Meta, table = each frequency twice, adjacent;
transformers' Cohere model uses it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from anchor_core.errors import InputError
from anchor_core.spec import RopeLayout, RopeSpec, ntk_base

if TYPE_CHECKING:
    from jaxref.policy import DtypePolicy

DTypeLike = jnp.dtype | str | type


def _np_dtype(dtype: DTypeLike) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def _pow(base: float | np.ndarray, exponent: np.ndarray, dt: np.dtype) -> np.ndarray:
    """`base ** exponent` rounded once to `dt`, with `base` first rounded to `dt` as torch does.

    In float64 this is the libm `pow`. Below float64 it is evaluated in float64 and rounded once,
    i.e. correctly rounded: torch's float32 `pow` (Sleef, 1 ulp) agrees with that on about 98% of
    inputs and is 1 ulp off on the rest; XLA's float32 pow is up to ~7 ulp off, so it is not used.
    """
    b = np.asarray(base, dtype=dt)
    if dt == np.float64:
        return np.power(b, exponent)
    return np.power(b.astype(np.float64), exponent.astype(np.float64)).astype(dt)


def _default_inv_freq(base: float | np.ndarray, dim: int, dt: np.dtype) -> np.ndarray:
    # transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(dt) / dt.type(dim)
    return (dt.type(1.0) / _pow(base, exponent, dt)).astype(dt)


def _dynamic_base(rope: RopeSpec, dim: int, seq_len: int, original: int, dt: np.dtype) -> float | np.ndarray:
    """transformers' dynamic-NTK base `base * (factor*L/L0 - (factor-1))^(d/(d-2))` for L > L0.

    In the forward pass transformers gets `seq_len = max(position_ids) + 1` as a 0-d int64 tensor,
    so this expression is evaluated in the default float dtype (float32), each operation rounded,
    with the Python scalars rounded to float32 first (but for the exponent); we repeat that for every
    dtype below float64.
    """
    if dt == np.float64:
        return rope.base * ((rope.factor * seq_len / original) - (rope.factor - 1)) ** (dim / (dim - 2))
    f = dt.type
    scale = (f(rope.factor) * f(seq_len)) / f(original) - f(rope.factor - 1)
    # torch's `tensor ** python_float` keeps the exponent in double (it is not rounded to float32)
    scale = _pow(scale, np.asarray(dim / (dim - 2), dtype=np.float64), dt)
    return (f(rope.base) * scale).astype(dt)


def _yarn(rope: RopeSpec, dim: int, dt: np.dtype) -> tuple[np.ndarray, float]:
    """transformers `_compute_yarn_parameters` (truncate=True, no mscale/mscale_all_dim)."""
    base, factor, original = rope.base, rope.factor, rope.original_max_position
    assert original is not None  # RopeSpec enforces it for yarn
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    else:
        attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes `num_rotations` turns over the original context.
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers: "Prevent singularity"

    pos_freqs = _pow(base, np.arange(0, dim, 2, dtype=np.int64).astype(dt) / dt.type(dim), dt)
    inv_extrapolation = dt.type(1.0) / pos_freqs
    inv_interpolation = dt.type(1.0) / (dt.type(factor) * pos_freqs)
    # transformers evaluates the ramp in hard-coded float32; here in `dt` (float64 for truth).
    ramp = np.clip((np.arange(dim // 2, dtype=np.int64).astype(dt) - dt.type(low)) / dt.type(high - low), 0, 1)
    extrapolation_factor = dt.type(1) - ramp.astype(dt)
    inv = (inv_interpolation * (dt.type(1) - extrapolation_factor)
           + inv_extrapolation * extrapolation_factor)
    return inv.astype(dt), attention_factor


def _llama3(rope: RopeSpec, dim: int, dt: np.dtype) -> np.ndarray:
    """transformers `_compute_llama3_parameters`: long wavelengths / factor, a smooth band between."""
    f = dt.type
    inv = _default_inv_freq(rope.base, dim, dt)
    original = rope.original_max_position
    assert original is not None  # RopeSpec enforces it for llama3
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = (f(2 * math.pi) / inv).astype(dt)
    inv_llama = np.where(wavelen > f(low_wavelen), inv / f(rope.factor), inv).astype(dt)
    smooth = (f(original) / wavelen - f(rope.low_freq_factor)) / f(rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (f(1) - smooth) * inv_llama / f(rope.factor) + smooth * inv_llama
    is_medium = ~(wavelen < f(high_wavelen)) & ~(wavelen > f(low_wavelen))
    return np.where(is_medium, smoothed, inv_llama).astype(dt)


def inv_freq(rope: RopeSpec, head_dim: int, *, dtype: DTypeLike, seq_len: int | None = None) -> tuple[jax.Array, float]:
    """Inverse frequencies of `rope` and the attention factor that scales cos/sin.

    Matches transformers' `ROPE_INIT_FUNCTIONS[kind]` (default: `compute_default_rope_parameters`)
    for `anchor_core.spec.to_hf_config`'s config, computed in `dtype` in transformers' operation order.
    The frequencies depend only on the config, so they are computed on the host (numpy), where each
    operation is rounded once as in torch's eager kernels (XLA would fuse multiply-adds under jit).

    Args:
      rope: the RoPE spec.
      head_dim: D, even.
      dtype: the dtype of the computation and of the result (float64 is truth; transformers uses
        float32).
      seq_len: `dynamic` only: `max(position) + 1` of the batch, as transformers' dynamic update
        takes it. Up to the original length (`rope.original_max_position`, which transformers
        reads from `max_position_embeddings`) the frequencies are the default ones.

    Returns:
      (inv_freq [D/2] in `dtype`, attention_factor): the factor is 1 except for yarn.
    """
    if head_dim % 2 or head_dim < 4:
        raise InputError(f"RoPE head_dim must be even and >= 4, got {head_dim}")
    dt = _np_dtype(dtype)
    kind = rope.kind
    if kind == "default":
        return jnp.asarray(_default_inv_freq(rope.base, head_dim, dt)), 1.0
    if kind == "ntk":
        return jnp.asarray(_default_inv_freq(ntk_base(rope, head_dim), head_dim, dt)), 1.0
    if kind == "linear":
        return jnp.asarray((_default_inv_freq(rope.base, head_dim, dt) / dt.type(rope.factor)).astype(dt)), 1.0
    if kind == "dynamic":
        original = rope.original_max_position
        if original is None:
            raise InputError("RoPE dynamic scaling needs original_max_position (the pretraining length)")
        if seq_len is None or seq_len <= original:
            return jnp.asarray(_default_inv_freq(rope.base, head_dim, dt)), 1.0
        base = _dynamic_base(rope, head_dim, int(seq_len), original, dt)
        return jnp.asarray(_default_inv_freq(base, head_dim, dt)), 1.0
    if kind == "yarn":
        inv, attention_factor = _yarn(rope, head_dim, dt)
        return jnp.asarray(inv), attention_factor
    if kind == "llama3":
        return jnp.asarray(_llama3(rope, head_dim, dt)), 1.0
    raise AssertionError(kind)


def angles(positions: jax.Array | np.ndarray, inv_freq: jax.Array, dtype: DTypeLike, phase: str = "plain") -> jax.Array:
    """`position * inv_freq` in `dtype` (stage `rope_angle`).

    Args:
      positions: int [..., T], any values (shifted, reset per document, up to 2^24 exactly in fp32).
      inv_freq: [F].
      dtype: the dtype both operands are cast to and the product is computed in.
      phase: "plain", or "mod2pi": the product formed in float64 (exact for positions below 2^29 times a float32
        inv_freq: 24 + 29 bits) and reduced to [-π, π) there, then rounded to `dtype` (the remedy for long
        positions: the angle's rounding is then an ulp of π, not of position · inv_freq).

    Returns:
      [..., T, F] in `dtype`.
    """
    positions = jnp.asarray(positions)
    if phase == "mod2pi":
        a = positions[..., None].astype(jnp.float64) * jnp.asarray(inv_freq).astype(jnp.float64)
        return (jnp.remainder(a + np.pi, 2 * np.pi) - np.pi).astype(dtype)
    return positions[..., None].astype(dtype) * jnp.asarray(inv_freq).astype(dtype)


def table(angles: jax.Array, attention_factor: float, layout: RopeLayout, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables (stage `rope_table`), as transformers' rotary embedding forward builds them.

    cos/sin are computed in the angles' dtype, multiplied by `attention_factor`, then cast to
    `dtype` (transformers: fp32 cos/sin cast to the activation dtype).

    Args:
      angles: [..., T, F].
      attention_factor: scalar (yarn's mscale; 1 otherwise).
      layout: "half" -> concat(f, f); "interleaved" -> f0 f0 f1 f1 ...
      dtype: dtype of the returned tables.

    Returns:
      (cos, sin), each [..., T, D] in `dtype`.
    """
    cos = jnp.cos(angles) * attention_factor
    sin = jnp.sin(angles) * attention_factor
    if layout == "half":
        cos, sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
    elif layout == "interleaved":
        cos, sin = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    else:
        raise InputError(f"unknown RoPE layout {layout!r} (known: half, interleaved)")
    return cos.astype(dtype), sin.astype(dtype)


def rotate(x: jax.Array, layout: RopeLayout) -> jax.Array:
    """The quarter turn of each rotation pair: [..., D] -> [..., D].

    half: (x1, x2) -> (-x2, x1) over the two halves (transformers' Llama `rotate_half`);
    interleaved: (x_{2i}, x_{2i+1}) -> (-x_{2i+1}, x_{2i}) (transformers' Cohere `rotate_half`).
    """
    if layout == "half":
        x1, x2 = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([-x2, x1], axis=-1)
    if layout == "interleaved":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return jnp.stack([-x1, x0], axis=-1).reshape(x.shape)
    raise InputError(f"unknown RoPE layout {layout!r} (known: half, interleaved)")


def apply(x_BTND: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array, layout: RopeLayout, dtype: DTypeLike) -> jax.Array:
    """`x*cos + rotate(x)*sin` computed in `dtype` (stage `rope_apply`).

    Args:
      x_BTND: queries or keys [B, T, N, D].
      cos_BTD, sin_BTD: tables [B, T, D] (or broadcastable, e.g. [1, T, D]), shared by the heads.
      layout: "half" or "interleaved", as the tables were built.
      dtype: every operand is cast to it and the result is in it.

    Returns:
      [B, T, N, D] in `dtype`.
    """
    x = jnp.asarray(x_BTND).astype(dtype)
    cos = jnp.asarray(cos_BTD).astype(dtype)[..., None, :]
    sin = jnp.asarray(sin_BTD).astype(dtype)[..., None, :]
    return x * cos + rotate(x, layout) * sin


def rope_tables(
    rope: RopeSpec, head_dim: int, positions: jax.Array | np.ndarray, policy: DtypePolicy,
    *, seq_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """cos/sin for `positions` under `policy`: inv_freq -> angles (`rope_angle`) -> table (`rope_table`).

    inv_freq is computed in float64 when `rope_angle` is float64 and in float32 otherwise (as
    transformers does, whatever the activation dtype).

    Args:
      rope: the RoPE spec.
      head_dim: D.
      positions: int [..., T].
      policy: the dtype policy.
      seq_len: `dynamic` only; defaults to `max(positions) + 1` (needs concrete positions, so pass
        it explicitly under `jax.jit`).

    Returns:
      (cos, sin), each [..., T, D] in the policy's `rope_table` dtype.
    """
    angle_dtype = policy.dtype("rope_angle")
    freq_dtype = jnp.float64 if angle_dtype == jnp.float64 else jnp.float32
    if rope.kind == "dynamic" and seq_len is None:
        seq_len = int(np.max(np.asarray(positions))) + 1
    freqs, attention_factor = inv_freq(rope, head_dim, dtype=freq_dtype, seq_len=seq_len)
    return table(angles(positions, freqs, angle_dtype, policy.rope_phase), attention_factor, rope.layout,
                 policy.dtype("rope_table"))
