"""Emulation fidelity: the oracle's bf16 emulation lands close to what torch computes in bf16.

Per layer and tap: the distance between the trainer in bf16 and the oracle's emulation of its stack,
against each one's distance from fp64. Two independent roundings of the same size would be about
sqrt(2) times their own error apart (ratio ≈ 1.4); an emulation that models the stack is closer.
"""

from __future__ import annotations

import pytest

from parity_tests.cases import BF16, Case, case_inputs
from parity_tests.runners import get_runner, oracle_taps
from parity_tests.core import compare
from parity_tests.suite import run_case


def _table(result) -> str:
    lines = [f"{result['id']} vs oracle {result['policy']}: trainer-vs-emulation / trainer-vs-fp64 / emulation-vs-fp64 (ratio)"]
    for row in result["fidelity"]:
        cells = [f"{n}={f['trainer_vs_emulation']:.1e}/{f['trainer_vs_fp64']:.1e}/{f['emulation_vs_fp64']:.1e} ({f['ratio']:.2f})"
                 for n, f in row["taps"].items()]
        lines.append(f"  {row['layer']}: " + "  ".join(cells))
    return "\n".join(lines)


@pytest.mark.parametrize("model,engine,bound", [
    ("random:mistral", "eager", 0.5),
    ("random:mistral", "flash_varlen_emulated", 0.5),
    ("random:qwen2", "eager", 0.5),
])
def test_emulation_is_closer_to_torch_than_either_is_to_fp64(model, engine, bound):
    layout = "interleave" if model == "random:qwen2" else "tags"
    result = run_case(Case(model, "anchor", layout, BF16, engine, 97))
    print(_table(result))
    ratios = {(row["layer"], n): f["ratio"] for row in result["fidelity"] for n, f in row["taps"].items()}
    # embeddings, RoPE and the projections of layer 0 are emulated bit for bit
    assert ratios[("embed", "embed")] == 0 and ratios[(0, "q")] == 0 and ratios[(0, "k")] == 0
    worst = max(ratios.items(), key=lambda kv: kv[1])
    assert worst[1] < bound, worst


def test_each_engine_is_closest_to_its_own_emulation():
    """eager bf16 follows hf_bf16 (bf16 logits, dense softmax); torch's CPU SDPA and the varlen
    emulation follow FlashAttention-style arithmetic (fp32 logits, unnormalised bf16 probabilities)."""
    case = Case("random:mistral", "anchor", "tags", BF16, "eager", 97)
    inputs = case_inputs(case)
    hf, fa2 = oracle_taps(case, inputs, "hf_bf16"), oracle_taps(case, inputs, "fa2_bf16")
    sdpa_cpu = oracle_taps(case, inputs, "sdpa_cpu_bf16")
    # sdpa: torch's kernel rounds ~1 % of its bf16 probabilities the other way (test_matrix.py's note),
    # so it is only several times closer to its own emulation, not bit for bit
    for engine, own, other, bound in (("eager", hf, fa2, 0.01), ("flash_varlen_emulated", fa2, hf, 0.01),
                                      ("sdpa", sdpa_cpu, hf, 0.5)):
        taps = get_runner(engine).run(case, inputs, "bfloat16")
        d_own = compare(taps, own, inputs)[1]["taps"]["attn_out"]["rel_l2"]
        d_other = compare(taps, other, inputs)[1]["taps"]["attn_out"]["rel_l2"]
        print(f"{engine}: layer-0 attn_out {d_own:.2e} from its own emulation, {d_other:.2e} from the other")
        assert d_own <= bound * d_other


def test_hf_bf16_scales_the_logits_as_torch_does():
    """head_dim 14: 14**-0.5 is not a bf16 number. torch multiplies the bf16 q·kᵀ by the Python-float
    scale in fp32 and rounds once; an emulation that rounds the scale to bf16 first drifts from layer 0
    on."""
    result = run_case(Case("random:qwen2", "anchor", "interleave", BF16, "eager", 97))
    layer0 = result["fidelity"][1]["taps"]
    print({n: f["trainer_vs_emulation"] for n, f in layer0.items()})
    assert layer0["scores"]["trainer_vs_emulation"] == 0


def test_sdpa_cpu_key_blocks_are_followed():
    """At T=1025 torch's CPU SDPA kernel runs two key blocks of 512 (and a tail): its bf16 output is
    several times closer to the oracle with those blocks than with FA-2's blocks of 128, and at least
    as close as with one block (measured: 2.3 %, 9.6 % and 2.6 % of outputs differ by an ulp)."""
    import jaxref
    import numpy as np
    from jax import numpy as jnp

    from jaxref.attention import attention
    import torch

    rng = np.random.default_rng(0)
    T, N, K, D = 1025, 4, 2, 32
    q, k, v = (rng.standard_normal((1, T, h, D)).astype(np.float32) * s for h, s in ((N, 2.0), (K, 2.0), (K, 1.0)))
    q, k, v = (torch.from_numpy(x).bfloat16() for x in (q, k, v))
    doc = np.ones((1, T), np.int32)
    doc[0, 0] = 0
    doc[0, 600:] = 2
    m = torch.from_numpy(((doc[0][:, None] == doc[0][None, :]) | (doc[0][None, :] == 0))
                         & (np.arange(T)[None, :] <= np.arange(T)[:, None]))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=D ** -0.5, enable_gqa=True
    ).transpose(1, 2).float().numpy()
    J = lambda x: jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)  # noqa: E731
    differ = {}
    for name in ("sdpa_cpu_bf16", "fa2_bf16", "fa2_bf16_1pass"):
        ctx = attention(J(q), J(k), J(v), jnp.asarray(doc), "anchor", jaxref.get_policy(name), D ** -0.5)
        differ[name] = float((np.asarray(ctx.astype(jnp.bfloat16).astype(jnp.float32)) != out).mean())
    print(differ)
    assert differ["sdpa_cpu_bf16"] < 0.5 * differ["fa2_bf16"]
    assert differ["sdpa_cpu_bf16"] <= differ["fa2_bf16_1pass"]


def test_the_cpu_kernels_backward_is_followed():
    """The attention backward of torch's fused CPU kernel (the sdpa engine, bf16) against the oracle's
    `backward: cpu` (jaxref.attention.kernel_backward: dS rounded to bf16, dQ/dK/dV added into bf16
    gradients per block and per head) and against autodiff of the same forward: the written-out backward
    lands several times nearer the kernel. T = 300: five query blocks of 64 (GQA, anchor, padding)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jaxref
    from torchtrain.attention import engines

    T, N, K, D = 300, 6, 2, 16
    rng = np.random.default_rng(7)
    q, k, v, do = (torch.from_numpy(rng.standard_normal((1, h, T, D)) * s).to(torch.bfloat16)
                   for h, s in ((N, 2.0), (K, 2.0), (K, 1.0), (N, 1.0)))
    doc = np.zeros((1, T), np.int64)
    doc[0, 1:90], doc[0, 90:290], doc[0, 290:] = 1, 2, -1
    scale = D ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = engines.attend("sdpa", *leaves, engines.prepare_meta("sdpa", torch.from_numpy(doc), "anchor"), scale)
    out.backward(do.transpose(1, 2))
    kernel = [x.grad[0].float().numpy() for x in leaves]  # [H,T,D]
    ref = [x.float() for x in (q, k, v)]
    ref = [x.double().requires_grad_() for x in ref]
    mask = torch.from_numpy(np.asarray(jaxref.attention_mask(doc[0], "anchor")))
    s_ = (ref[0] @ ref[1].repeat_interleave(N // K, 1).transpose(2, 3)) * scale
    o = torch.softmax(s_.masked_fill(~mask, float("-inf")), -1) @ ref[2].repeat_interleave(N // K, 1)
    o.backward(do.double())
    truth = [x.grad[0].numpy() for x in ref]
    as_jax = lambda x: jnp.asarray(x.float().numpy()).astype(jnp.bfloat16).transpose(0, 2, 1, 3)  # noqa: E731
    base = jaxref.get_policy("sdpa_cpu_bf16")
    assert base.backward == "cpu"  # the preset the sdpa engine is held against takes it
    near = {}
    for backward in ("autodiff", "cpu"):
        pol = dataclasses.replace(base, backward=backward)
        _, vjp = jax.vjp(lambda q, k, v: jaxref.attention.attention(q, k, v, jnp.asarray(doc, jnp.int32), "anchor", pol,
                                                                     scale, fused=False), *map(as_jax, (q, k, v)))
        got = vjp(jnp.asarray(do.float().numpy()).transpose(0, 2, 1, 3))
        near[backward] = [float(np.linalg.norm(np.asarray(g, np.float32)[0].transpose(1, 0, 2) - kg) / np.linalg.norm(t))
                          for g, kg, t in zip(got, kernel, truth)]
    print(near)
    assert all(3 * c < a for c, a in zip(near["cpu"], near["autodiff"])), near
