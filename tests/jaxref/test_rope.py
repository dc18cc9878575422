"""jaxref.rope against transformers' own RoPE, for every scaling kind and both layouts.

References (transformers 5.23, built from `anchor_core.spec.to_hf_config(spec)`):
  half         `LlamaRotaryEmbedding` + `modeling_llama.apply_rotary_pos_emb` (rotate_half over halves)
  interleaved  `CohereRotaryEmbedding` + `modeling_cohere.apply_rotary_pos_emb`: Cohere builds its table
               with `repeat_interleave(freqs, 2)` and its `rotate_half` pairs (x[2i], x[2i+1]), i.e. the
               GPT-J / original-Meta layout; its frequencies come from the same `ROPE_INIT_FUNCTIONS`.
               `to_hf_config` refuses `interleaved` (Llama has no such layout), so the config is that of
               the same spec with `layout="half"`, read by `CohereConfig`.

float64 reference: transformers computes RoPE in float32 whatever the model dtype (`.float()`,
`dtype=torch.float`, `torch.float32` in the yarn ramp, and the default dtype for the dynamic base).
We run its own code unchanged with those four spellings redirected to float64 (`torch.float`,
`torch.float32`, `Tensor.float` and the default dtype), so the reference is transformers' definition
evaluated in float64; the test checks the buffers really are float64.

Tolerances. One rounding per operation on both sides, so the only unavoidable difference is `pow`:
torch's float32/float64 `pow` (Sleef, 1 ulp) is not correctly rounded, ours is, so a few inv_freq
entries differ by 1 ulp. At position p that moves the angle by p*|Δinv|, which is not a cos/sin error
but a different frequency; the tolerance adds exactly that first-order term (|d cos/dθ| <= 1), and is
the bare 2 ulp (fp32) or 1e-12 (fp64) wherever inv_freq agrees bit for bit (printed).
Errors of cos/sin are in ulps of the reference value; errors of rotated q/k in ulps of the scale of
the sum, |x|·|cos| + |rotate(x)|·|sin| (the sum cancels; its own rounding is relative to that scale).
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.models.cohere import modeling_cohere  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from anchor_core.spec import ModelSpec, RopeSpec, to_hf_config  # noqa: E402
from jaxref import rope as R  # noqa: E402
from jaxref.policy import PRESETS  # noqa: E402
from tests.jaxref.numerics import torch_float_is_float64  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

HEAD_DIM = 46  # 23 frequencies: odd on purpose
N_HEADS = 3

# One spec per kind; sizes chosen so every regime of the kind is exercised at HEAD_DIM
# (yarn ramp over dims 5..11, llama3 has low/medium/high bands, dynamic grows past 4096).
ROPES: dict[str, tuple[RopeSpec, int]] = {  # kind -> (rope, ModelSpec.max_position)
    "default": (RopeSpec(base=10000.0), 4096),
    "linear": (RopeSpec(base=10000.0, kind="linear", factor=4.0), 16384),
    # transformers' dynamic reads the original length from max_position_embeddings
    "dynamic": (RopeSpec(base=10000.0, kind="dynamic", factor=4.0, original_max_position=4096), 4096),
    "yarn": (RopeSpec(base=1e6, kind="yarn", factor=8.0, original_max_position=4096), 32768),
    "llama3": (RopeSpec(base=500000.0, kind="llama3", factor=8.0, original_max_position=8192,
                        low_freq_factor=1.0, high_freq_factor=4.0), 65536),
    "ntk": (RopeSpec(base=10000.0, kind="ntk", factor=8.0), 4096),
}

_LONG = [0, 1, 2, 3, 5, 7, 11, 97, 1025, 4095, 4096, 4097, 8191, 8193, 32767, 65537, 99999, 131071, 131072]
POSITIONS: dict[str, np.ndarray] = {
    # row 1 is row 0 shifted by 1000 (the audit's shift); max + 1 = 132073 drives dynamic.
    "long": np.stack([np.array(_LONG), np.array(_LONG) + 1000]),
    # below every original length; row 1 resets at a document start (intra_doc_reset)
    "short": np.stack([np.arange(0, 41), np.concatenate([np.arange(0, 19), np.arange(0, 22)])]),
}


def _spec(kind: str, layout: str) -> ModelSpec:
    rope, max_position = ROPES[kind]
    return ModelSpec(
        family="llama", vocab_size=97, hidden_size=N_HEADS * HEAD_DIM, num_layers=1, num_heads=N_HEADS,
        num_kv_heads=N_HEADS, head_dim=HEAD_DIM, intermediate_size=97, max_position=max_position,
        rope=rope if layout == "half" else RopeSpec(**{**rope.__dict__, "layout": "interleaved"}),
    )


def _hf_rope(spec: ModelSpec, positions: np.ndarray, x_BTND: np.ndarray, fp64: bool):
    """transformers' (inv_freq, cos, sin, rotated x) for `spec`, a fresh rotary module per call."""
    half = spec.rope.layout == "half"
    d = to_hf_config(spec if half else spec.replace(rope=RopeSpec(**{**spec.rope.__dict__, "layout": "half"})))
    if half:
        config, module = AutoConfig.for_model(**d), modeling_llama
        rotary_cls = modeling_llama.LlamaRotaryEmbedding
    else:
        config, module = AutoConfig.for_model(**{**d, "model_type": "cohere"}), modeling_cohere
        rotary_cls = modeling_cohere.CohereRotaryEmbedding
    dtype = torch.float64 if fp64 else torch.float32
    with torch_float_is_float64() if fp64 else contextlib.nullcontext():
        rotary = rotary_cls(config)
        x = torch.tensor(x_BTND, dtype=dtype).transpose(1, 2)  # [B, N, T, D] as transformers holds q/k
        cos, sin = rotary(x, torch.tensor(positions, dtype=torch.int64))
        q, _ = module.apply_rotary_pos_emb(x, x, cos, sin)
        inv = rotary.inv_freq  # after the dynamic update of this forward
    assert inv.dtype == dtype and cos.dtype == dtype and q.dtype == dtype
    return inv.numpy(), float(rotary.attention_scaling), cos.numpy(), sin.numpy(), q.transpose(1, 2).numpy()


def _report(what: str, err: np.ndarray, tol: np.ndarray) -> None:
    print(f"  {what:8s} max err {err.max():.3g}  mean err {err.mean():.3g}  max err/tol {(err / tol).max():.3g}")


@pytest.mark.parametrize("pos_name", list(POSITIONS))
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("kind", list(ROPES))
@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_rope_matches_transformers(kind: str, layout: str, pos_name: str, precision: str) -> None:
    spec = _spec(kind, layout)
    positions = POSITIONS[pos_name]
    x = np.random.default_rng(0).standard_normal((*positions.shape, N_HEADS, HEAD_DIM))
    fp64 = precision == "fp64"
    ref_inv, ref_af, ref_cos, ref_sin, ref_q = _hf_rope(spec, positions, x, fp64)

    policy = PRESETS[precision]
    dt = policy.dtype("rope_apply")
    seq_len = int(positions.max()) + 1
    inv, af = R.inv_freq(spec.rope, HEAD_DIM, dtype=dt, seq_len=seq_len)
    cos, sin = (np.asarray(t) for t in R.rope_tables(spec.rope, HEAD_DIM, positions, policy))
    q = np.asarray(R.apply(jnp.asarray(x, dtype=dt), cos, sin, spec.rope.layout, dt))
    inv = np.asarray(inv)
    assert cos.dtype == sin.dtype == q.dtype == inv.dtype == np.dtype(dt)
    assert af == pytest.approx(ref_af, rel=1e-15)

    # inv_freq: at most 2 ulp apart (torch's pow is within 1 ulp of exact, ours is exact; dynamic
    # chains two pows: the base's error carries into the second).
    inv_ulps = np.abs(inv - ref_inv) / np.spacing(np.abs(ref_inv))
    print(f"\n{kind}/{layout}/{pos_name}/{precision}: attention factor {af:.6g}; inv_freq equal in "
          f"{int((inv_ulps == 0).sum())}/{inv.size}, max {inv_ulps.max():.0f} ulp")
    assert inv_ulps.max() <= 2

    # Where inv_freq differs, the angles differ by p*|Δinv| plus their own rounding (1 ulp of the
    # angle, half on each side); elsewhere they are bit-identical (one correctly rounded product).
    d_inv = np.abs(inv - ref_inv)
    d_inv = np.concatenate([d_inv, d_inv]) if layout == "half" else np.repeat(d_inv, 2)
    ref_inv_d = np.concatenate([ref_inv, ref_inv]) if layout == "half" else np.repeat(ref_inv, 2)
    angle = positions[..., None].astype(dt) * ref_inv_d.astype(dt)
    d_angle = np.where(d_inv > 0, positions[..., None] * d_inv + np.spacing(angle), 0) * af * (1 + 1e-6)

    err_cos = np.abs(cos.astype(np.float64) - ref_cos)
    err_sin = np.abs(sin.astype(np.float64) - ref_sin)
    if fp64:
        tol_cos = tol_sin = 1e-12 * af + d_angle
    else:
        tol_cos = 2 * np.spacing(np.abs(ref_cos).astype(np.float32)) + d_angle
        tol_sin = 2 * np.spacing(np.abs(ref_sin).astype(np.float32)) + d_angle
    _report("cos", err_cos, tol_cos)
    _report("sin", err_sin, tol_sin)
    assert (err_cos <= tol_cos).all() and (err_sin <= tol_sin).all()

    # Rotated q: scale of the sum, and the table differences propagated through it.
    rot = np.asarray(R.rotate(jnp.asarray(x), layout))
    c, s = np.abs(ref_cos)[..., None, :], np.abs(ref_sin)[..., None, :]
    scale = np.abs(x) * c + np.abs(rot) * s
    d_tab = np.abs(x) * np.abs(cos - ref_cos)[..., None, :] + np.abs(rot) * np.abs(sin - ref_sin)[..., None, :]
    err_q = np.abs(q.astype(np.float64) - ref_q)
    tol = (1e-12 * scale if fp64 else 2 * np.spacing(scale.astype(np.float32))) + d_tab * (1 + 1e-6)
    _report("q", err_q, tol)
    assert (err_q <= tol).all()


@pytest.mark.parametrize("kind", list(ROPES))
def test_fp32_tables_exact_given_transformers_inv_freq(kind: str) -> None:
    """With transformers' own inv_freq, angles/table/apply reproduce its fp32 forward to 2 ulp."""
    spec = _spec(kind, "half")
    positions = POSITIONS["long"]
    x = np.random.default_rng(1).standard_normal((*positions.shape, N_HEADS, HEAD_DIM))
    ref_inv, af, ref_cos, ref_sin, ref_q = _hf_rope(spec, positions, x, fp64=False)
    cos, sin = R.table(R.angles(positions, jnp.asarray(ref_inv), jnp.float32), af, "half", jnp.float32)
    q = np.asarray(R.apply(jnp.asarray(x, jnp.float32), cos, sin, "half", jnp.float32))
    u_cos = np.abs(np.asarray(cos, np.float64) - ref_cos) / np.spacing(np.abs(ref_cos))
    u_sin = np.abs(np.asarray(sin, np.float64) - ref_sin) / np.spacing(np.abs(ref_sin))
    rot = np.asarray(R.rotate(jnp.asarray(x, jnp.float32), "half"))
    scale = (np.abs(x) * np.abs(ref_cos)[..., None, :] + np.abs(rot) * np.abs(ref_sin)[..., None, :])
    u_q = np.abs(q.astype(np.float64) - ref_q) / np.spacing(scale.astype(np.float32))
    print(f"\n{kind}: ulps cos max {u_cos.max():.0f} mean {u_cos.mean():.3g}; sin max {u_sin.max():.0f} "
          f"mean {u_sin.mean():.3g}; q max {u_q.max():.2g} mean {u_q.mean():.3g}")
    assert u_cos.max() <= 2 and u_sin.max() <= 2 and u_q.max() <= 2


def test_layouts_are_permutations_of_each_other() -> None:
    """interleaved == half after moving pair (2i, 2i+1) to (i, i + D/2), in float64."""
    rope = RopeSpec(base=10000.0)
    positions = POSITIONS["long"]
    x = np.random.default_rng(2).standard_normal((*positions.shape, N_HEADS, HEAD_DIM))
    perm = np.concatenate([np.arange(0, HEAD_DIM, 2), np.arange(1, HEAD_DIM, 2)])
    inv, af = R.inv_freq(rope, HEAD_DIM, dtype=jnp.float64)
    ang = R.angles(positions, inv, jnp.float64)
    half = R.apply(x[..., perm], *R.table(ang, af, "half", jnp.float64), "half", jnp.float64)
    inter = R.apply(x, *R.table(ang, af, "interleaved", jnp.float64), "interleaved", jnp.float64)
    err = np.abs(np.asarray(half) - np.asarray(inter)[..., perm])
    print(f"\nmax {err.max():.3g} mean {err.mean():.3g}")
    assert err.max() == 0


@pytest.mark.parametrize("policy_name", ["hf_bf16", "paper_bf16", "fp32"])
def test_rope_tables_follow_policy_dtypes(policy_name: str) -> None:
    policy = PRESETS[policy_name]
    cos, sin = R.rope_tables(RopeSpec(base=1e6), HEAD_DIM, np.arange(0, 37) + 1048576, policy)
    assert cos.shape == sin.shape == (37, HEAD_DIM)
    assert cos.dtype == sin.dtype == policy.dtype("rope_table")
    truth, _ = R.rope_tables(RopeSpec(base=1e6), HEAD_DIM, np.arange(0, 37) + 1048576, PRESETS["fp64"])
    err = np.abs(np.asarray(cos, np.float64) - np.asarray(truth))
    print(f"\n{policy_name}: cos error vs fp64 at positions ~2^20: max {err.max():.3g} mean {err.mean():.3g}")
    # fp32 angles at 2^20 carry up to ulp(2^20)/2 = 0.0625 rad of error; bf16 tables add 2^-9.
    assert err.max() <= 0.0625 + (2**-9 if policy.rope_table == "bfloat16" else 1e-6)


def test_dynamic_needs_original_length() -> None:
    from anchor_core.errors import InputError

    with pytest.raises(InputError, match="original_max_position"):
        R.inv_freq(RopeSpec(kind="dynamic", factor=2.0), HEAD_DIM, dtype=jnp.float64, seq_len=10)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bf16_apply_is_transformers_bit_for_bit(jit: bool) -> None:
    """hf_bf16's rope_apply: bf16 q*cos, bf16 rotate(q)*sin, bf16 sum, as transformers' Llama in bf16."""
    import jax

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 97, N_HEADS, HEAD_DIM)).astype(np.float32)
    ang = rng.uniform(-20, 20, (2, 97, HEAD_DIM)).astype(np.float32)
    cos_t, sin_t = torch.tensor(np.cos(ang)).bfloat16(), torch.tensor(np.sin(ang)).bfloat16()
    q_t = torch.tensor(x).bfloat16().transpose(1, 2)
    ref = modeling_llama.apply_rotary_pos_emb(q_t, q_t, cos_t, sin_t)[0].transpose(1, 2).float().numpy()
    bf16 = PRESETS["hf_bf16"].dtype("rope_apply")
    fn = lambda a, c, s: R.apply(a, c, s, "half", bf16)  # noqa: E731
    fn = jax.jit(fn) if jit else fn
    out = fn(jnp.asarray(x).astype(bf16), jnp.asarray(np.cos(ang)).astype(bf16), jnp.asarray(np.sin(ang)).astype(bf16))
    err = np.abs(np.asarray(out.astype(jnp.float32)) - ref)
    print(f"\nbf16 apply ({'jit' if jit else 'eager'}): max {err.max():.3g} mean {err.mean():.3g}, "
          f"{int((err > 0).sum())}/{err.size} differ")
    assert out.dtype == bf16 and err.max() == 0
