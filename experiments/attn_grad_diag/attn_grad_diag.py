"""One attention layer's backward on the GPU's kernels against fp64 and three emulations of it (issue 28).

    .venv/bin/python experiments/attn_grad_diag/attn_grad_diag.py capture --out .devkit/attn_grad_inputs.npz      # here
    python3 experiments/attn_grad_diag/attn_grad_diag.py run .devkit/attn_grad_inputs.npz --out $OUT/attn_grad.json  # GPU

Why. On an H200 (2026-11-26) the varlen engine's anchor gradients missed the parity rule on two norm
weights by 1.4-1.6x, 2-3x the emulation's error in every summation order, where flex passed; the varlen
engines' segments around the kernel do not explain it (experiments/anchor_copies_grad/anchor_copies_grad.py). What is left is
the kernels' own backward arithmetic, which this measures in isolation, in about a minute of a GPU.

`capture` (CPU): SmolLM2 with its real weights in fp32 on the parity suite's anchor case (T = 1025,
`parity_tests.cases`), the inputs of every chosen layer's attention (q, k, v after RoPE) and the
gradient of the loss at its output (dO), each rounded to bf16 as a bf16 trainer would hold them, plus
the doc ids, of the case's first window; one compressed .npz of uint16 bf16 bits (no pickle), about 3 MB
a layer (4 layers by default: it travels beside the second part of the weights, under 64 MiB a call).

`run` (any device, CUDA for the kernels): per layer, the same bf16 q, k, v, dO through
  fp64          dense masked attention and its autograd on the bf16 values (the reference)
  varlen, flex  torchtrain's engines (`torchtrain.attention.engines.attend`): on CUDA torch's varlen kernel
                (FlashAttention-2) and compiled FlexAttention; off CUDA varlen's SDPA calls and sdpa (torch's
                fused CPU kernel on the whole window), flex skipped
  emu_autodiff  fp32 FA-2 forward arithmetic (bf16 probabilities before p·v, fp32 sums) and autograd
                through it: what the oracle's `fa2_bf16` gradient does
  emu_fa2       FlashAttention-2's backward written out: P from the forward's log-sum-exp, dV from bf16 P,
                D = rowsum(dO·O) in fp32 from the bf16 output, dS rounded to bf16 before dQ and dK, each
                query head's dK/dV rounded to bf16 before its GQA group's sum (`dk_expanded`)
  emu_flex      the same with FlexAttention's difference: the group's sum inside the kernel in fp32 (jaxref's
                `backward: flex`)
  emu_flex_d16  emu_flex with D rounded to bf16 (its `delta` is typed bf16 in inductor's lowering): what
                `backward: flex` was until the H100 of 2026-11-26 measured the kernel (below)
  emu_cpu       torch's CPU kernel's backward: FA-2's arithmetic with dQ, dK, dV added into bf16 gradients
                per block of queries and keys and per query head (the sdpa engine runs it off CUDA)
and records, for dq, dk, dv and for the anchor's row of dk and dv alone, each method's rel. L2 against
fp64 and each kernel's distance to each emulation (the nearest names the arithmetic the kernel does).

On the CPU (2 AMD EPYC cores, AVX2; varlen is torch's fused CPU kernel there, flex has no CPU backward):
emu_fa2's dq is 1.5-4x emu_autodiff's error (layer 11: 0.0102 against 0.0025; its anchor row of dk 0.012
against 0.0035), and the CPU kernel's dq lies 0.0011-0.0037 from emu_fa2 against 0.004-0.010 from
emu_autodiff: torch's CPU kernel rounds dS to bf16 too, an operation the oracle's gradient (autodiff of
the forward's arithmetic) did not do. The sdpa engine (the same kernel on the whole window) lies
0.0007-0.0016 from emu_cpu in dV, 0.0011-0.0035 in dK, against 0.003-0.005 from every other emulation;
emu_cpu's errors against fp64 are the kernel's (jaxref's `backward: cpu`: parity_tests/test_fidelity.py).

On an H100 (torch 2.11, 2026-11-26; experiments/attn_grad_diag/results/attn_grad_diag_h100.json, where its `emu_flex` is
the emu_flex_d16 here): the varlen kernel (FlashAttention-2) lies nearest emu_fa2 in dQ and dK at every
layer, 0.0004-0.0026 against 0.0036-0.0105 from emu_autodiff. FlexAttention's dQ lies 0.0009-0.0022 from
emu_fa2's, 0.0035-0.0118 from emu_flex_d16's, and dQ differs between those two only in D: the kernel keeps
D in fp32. Its dV lies within 1e-4 of emu_flex_d16's, whose dV is emu_flex's: the group's sum in fp32.
Run again with emu_flex as above (attn_grad_diag_h100_flex_fp32_d.json), FlexAttention lies nearest emu_flex
in dQ, dK and dV at every layer: dK 0.0007-0.0011 from it, 0.0025-0.0052 from emu_flex_d16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository

LAYERS = (10, 11, 13, 14)  # the anchor's massive activation forms in 9-11; 13 and 14: the norms varlen missed on
NAMES = ("q", "k", "v", "do")


def _bits(t) -> np.ndarray:
    """The batch's first window of a torch tensor, rounded to bf16, as its uint16 bit pattern."""
    import torch

    return t[:1].detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)


def _from_bits(a: np.ndarray, device):
    import torch

    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)


def capture(out: str, layers: tuple[int, ...], model: str = "default", seq_len: int = 1025) -> dict:
    """The chosen layers' attention inputs and output gradients of SmolLM2 in fp32 (module docstring)."""
    import torch

    import torchtrain
    from parity_tests.cases import BF16, Case, case_inputs
    from torchtrain.attention import engines

    case = Case(model, "anchor", "plain", BF16, "sdpa", seq_len)
    inputs = case_inputs(case)
    model = torchtrain.build_model(case.model, engine="sdpa", dtype="float32").train()
    seen: dict[int, dict] = {}
    original = engines.attend

    def recording(engine, q, k, v, meta, scale):
        i = len(seen)
        out = original(engine, q, k, v, meta, scale)
        if i in layers:
            seen[i] = {"q": _bits(q), "k": _bits(k), "v": _bits(v)}
            out.register_hook(lambda g, i=i: seen[i].__setitem__("do", _bits(g.transpose(1, 2))))
        else:
            seen[i] = {}
        return out

    engines.attend = recording
    try:
        feed = {"input_ids": torch.from_numpy(inputs.tokens), "position_ids": torch.from_numpy(inputs.positions),
                "doc_ids": torch.from_numpy(inputs.doc_ids), "variant": case.variant}
        loss, _ = torchtrain.next_token_loss(model(**feed, use_cache=False).logits, feed["input_ids"],
                                             torch.from_numpy(inputs.loss_mask))
        loss.backward()
    finally:
        engines.attend = original
    arrays = {f"l{i}_{n}": seen[i][n] for i in layers for n in NAMES}
    arrays["doc_ids"] = inputs.doc_ids[:1].astype(np.int32)
    arrays["layers"] = np.asarray(layers, np.int32)
    tmp = Path(out).with_name(f".{Path(out).name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, out)
    return {"file": out, "bytes": Path(out).stat().st_size, "layers": list(layers), "loss": float(loss.detach())}


def _expand(x, G: int):
    return x.repeat_interleave(G, dim=0)


def _emu_forward(q, k, v, mask, scale):
    """fp32 FA-2 forward arithmetic on [N,T,D] q and [K,T,D] k/v (bf16 values): (O in bf16, O fp32, lse)."""
    import torch

    G = q.shape[0] // k.shape[0]
    kh, vh = _expand(k.float(), G), _expand(v.float(), G)
    s = (q.float() @ kh.transpose(1, 2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = (p.to(torch.bfloat16).float() @ vh) / l
    return o.to(torch.bfloat16), o, (m + torch.log(l))


def emu_autodiff(q, k, v, do, mask, scale):
    """Autograd through `_emu_forward` (fp32), gradients rounded to bf16 once, as the oracle's are."""
    import torch

    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    _, o, _ = _emu_forward(q, k, v, mask, scale)
    o.backward(do.float())
    return tuple(x.grad.to(torch.bfloat16) for x in (q, k, v))


def emu_explicit(q, k, v, do, mask, scale, *, delta_bf16: bool, per_head: bool):
    """A FlashAttention-style backward written out (module docstring: emu_fa2, emu_flex)."""
    import torch

    bf = torch.bfloat16
    N, K = q.shape[0], k.shape[0]
    G = N // K
    o_bf, _, lse = _emu_forward(q, k, v, mask, scale)
    qf, kh, vh, dof = q.float(), _expand(k.float(), G), _expand(v.float(), G), do.float()
    s = (qf @ kh.transpose(1, 2)) * scale
    p = torch.exp(s.masked_fill(~mask, float("-inf")) - lse)
    dv_h = p.to(bf).float().transpose(1, 2) @ dof
    dp = dof @ vh.transpose(1, 2)
    delta = (dof * o_bf.float()).sum(dim=-1, keepdim=True)
    if delta_bf16:
        delta = delta.to(bf).float()
    ds = (p * (dp - delta)).to(bf).float()
    dq = ((ds @ kh) * scale).to(bf)
    dk_h = (ds.transpose(1, 2) @ qf) * scale

    def group(x):
        if per_head:
            x = x.to(bf).float()
        return x.view(K, G, *x.shape[1:]).sum(dim=1).to(bf)

    return dq, group(dk_h), group(dv_h)


def cpu_splits(T: int) -> tuple[int, int]:
    """The query and key blocks of torch's CPU flash backward at T queries (flash_attention_backward_kernel_impl)."""
    return (256 if T >= 768 else 64 if T >= 192 else 32), 512


def emu_cpu(q, k, v, do, mask, scale):
    """torch's CPU flash backward (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) written out: for each
    query head of a kv head's group in turn, each block of query rows, each block of keys: P from the
    log-sum-exp, dS = P·(dP − D) rounded to bf16, and dV, dQ, dK each added into a bf16 gradient (a gemm
    with beta = 1 on bf16 output: a rounding per block and per head)."""
    import torch

    bf = torch.bfloat16
    N, T, _ = q.shape
    K = k.shape[0]
    G = N // K
    qs, ks = cpu_splits(T)
    o_bf, _, lse = _emu_forward(q, k, v, mask, scale)
    dq, dk, dv = torch.zeros_like(q, dtype=bf), torch.zeros_like(k, dtype=bf), torch.zeros_like(v, dtype=bf)
    for r in range(G):
        heads = torch.arange(K) * G + r
        for m in range(0, T, qs):
            qb, dob, ob = (x[heads, m:m + qs].float() for x in (q, do, o_bf))
            delta = (dob * ob).sum(-1, keepdim=True)
            for n in range(0, T, ks):
                kb, vb = k[:, n:n + ks].float(), v[:, n:n + ks].float()
                sb = (qb @ kb.transpose(1, 2)) * scale
                p = torch.exp(sb.masked_fill(~mask[:, m:m + qs, n:n + ks], float("-inf")) - lse[heads, m:m + qs])
                dv[:, n:n + ks] = (dv[:, n:n + ks].float() + p.to(bf).float().transpose(1, 2) @ dob).to(bf)
                ds = (p * (dob @ vb.transpose(1, 2) - delta)).to(bf).float()
                dq[heads, m:m + qs] = (dq[heads, m:m + qs].float() + scale * (ds @ kb)).to(bf)
                dk[:, n:n + ks] = (dk[:, n:n + ks].float() + scale * (ds.transpose(1, 2) @ qb)).to(bf)
    return dq, dk, dv


def reference(q, k, v, do, mask, scale):
    """fp64 dense masked attention's gradients on the bf16 values."""
    import torch

    G = q.shape[0] // k.shape[0]
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    s = (q @ _expand(k, G).transpose(1, 2)) * scale
    o = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ _expand(v, G)
    o.backward(do.double())
    return q.grad, k.grad, v.grad


def kernel(engine: str, q, k, v, do, doc_ids, scale):
    """torchtrain's engine on [N,T,D]/[K,T,D] inputs: its dq, dk, dv."""
    from torchtrain.attention import engines

    meta = engines.prepare_meta(engine, doc_ids, "anchor")
    qb, kb, vb = (x[None].clone().requires_grad_() for x in (q, k, v))
    out = engines.attend(engine, qb, kb, vb, meta, scale)  # [1,T,N,D]
    out.backward(do.transpose(0, 1)[None])
    return qb.grad[0], kb.grad[0], vb.grad[0]


def _rel(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def run(path: str, device: str) -> dict:
    import torch

    from torchtrain.attention.variants import dense_mask

    z = np.load(path, allow_pickle=False)
    layers = [int(i) for i in z["layers"]]
    doc_ids = torch.from_numpy(z["doc_ids"].astype(np.int64)).to(device)
    mask = dense_mask(doc_ids, "anchor")[0][None]  # [1,T,T]
    engines = ["varlen", "flex"] if device.startswith("cuda") else ["varlen", "sdpa"]
    out: dict = {"layers": {}, "engines": engines, "seconds": {}}
    t0 = time.perf_counter()
    for i in layers:
        q, k, v, do = (_from_bits(z[f"l{i}_{n}"], device)[0] for n in NAMES)  # [N|K, T, D]
        scale = q.shape[-1] ** -0.5
        ref = reference(q, k, v, do, mask, scale)
        got = {"emu_autodiff": emu_autodiff(q, k, v, do, mask, scale),
               "emu_fa2": emu_explicit(q, k, v, do, mask, scale, delta_bf16=False, per_head=True),
               "emu_flex": emu_explicit(q, k, v, do, mask, scale, delta_bf16=False, per_head=False),
               "emu_flex_d16": emu_explicit(q, k, v, do, mask, scale, delta_bf16=True, per_head=False),
               "emu_cpu": emu_cpu(q, k, v, do, mask, scale)}
        for e in engines:
            t1 = time.perf_counter()
            got[e] = kernel(e, q, k, v, do, doc_ids, scale)
            out["seconds"][f"{e}_l{i}"] = round(time.perf_counter() - t1, 2)
        row: dict = {"vs_fp64": {}, "kernel_to_emulation": {}}
        for name, (dq, dk, dv) in got.items():
            row["vs_fp64"][name] = {"dq": _rel(dq, ref[0]), "dk": _rel(dk, ref[1]), "dv": _rel(dv, ref[2]),
                                    "dk_anchor": _rel(dk[:, 0], ref[1][:, 0]),
                                    "dv_anchor": _rel(dv[:, 0], ref[2][:, 0])}
        for e in engines:
            row["kernel_to_emulation"][e] = {
                em: {g: round(float((got[e][j].double() - got[em][j].double()).norm() / ref[j].norm()), 6)
                     for j, g in enumerate(("dq", "dk", "dv"))}
                for em in ("emu_autodiff", "emu_fa2", "emu_flex", "emu_flex_d16", "emu_cpu")}
        out["layers"][str(i)] = row
        print(i, json.dumps({n: {g: round(x, 4) for g, x in r.items()} for n, r in row["vs_fp64"].items()}), flush=True)
    out["seconds"]["all"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", required=True)
    c.add_argument("--layers", default=",".join(map(str, LAYERS)))
    c.add_argument("--model", default="default", help="default: SmolLM2; random:llama for a dry run")
    c.add_argument("--seq-len", type=int, default=1025)
    r = sub.add_parser("run")
    r.add_argument("inputs")
    r.add_argument("--out", required=True)
    r.add_argument("--device", default=None, help="default: cuda where torch sees one, else cpu")
    args = ap.parse_args(argv)
    from anchor_core.atomic import write_text_atomic
    from anchor_core.machine import machine

    if args.cmd == "capture":
        print(json.dumps(capture(args.out, tuple(int(x) for x in args.layers.split(",")), args.model, args.seq_len)))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = {"what": __doc__.split("\n")[0], "inputs": args.inputs, "device": device, "machine": machine(),
              **run(args.inputs, device)}
    write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
