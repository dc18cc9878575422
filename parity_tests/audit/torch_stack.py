"""The precision audit of the real torch stack (`anchor audit --stack torch`), beside the oracle's emulation.

    result = audit_torch_stack("default", engine="eager", dtype="bfloat16", seq_len=512)

The same measurements as `parity_tests.audit` (docs/DESIGN.md §5: D(X, Δ1, Δ2), the per-token difference and
D_logit, on the same windows and shifts) taken on the torchtrain model itself: each forward runs a
batch of the same tokens under the reference shift and other shifts (`positions = slot + Δ`, variant
`full`), and a recorder hung on every attention module (the engines' tap hook, which receives q and
k after RoPE in the model's dtype) reduces each layer's maps at once to column sums
`Σ_i |P_ij(Δ) − P_ij(Δ_ref)|` and first-key logit differences; no T×T map outlives its layer.

The maps are those the engine's arithmetic forms: `eager` stores bf16 logits (q·kᵀ in bf16, then
× scale) and takes an fp32 softmax; the fused kernels (`sdpa`, `flex`, the varlen engines) keep the
logits in fp32. What differs between engines beyond that is what earlier layers' attention outputs
did to q and k. The oracle's emulation of each stack is `parity_tests.emulations.EMULATIONS[engine]`'s
policy (`ORACLE_POLICY` here, so jaxref never imports torch and torchtrain never imports the tests).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import torchtrain
from anchor_core.errors import InputError
from anchor_core.machine import machine
from anchor_core.progress import ProgressBar
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_spec, load_weights
from jaxref.policy import get_policy
from jaxref.reference import params_from_state
from parity_tests.audit import metrics
from parity_tests.audit.runner import (
    AuditSettings,
    length_curve,
    resolve_settings,
    restrict_vocab,
    shift_curve,
    shifts_per_call,
)
from parity_tests.audit.sequences import load_texts, make_windows
from parity_tests.emulations import EMULATIONS, emulation
from torchtrain.attention.engines import TAP_ATTR

ORACLE_POLICY: dict[str, str] = EMULATIONS  # the oracle policy whose arithmetic each engine follows
BF16_LOGITS = ("eager",)  # engines whose stored logits are in the model's dtype


def oracle_policy(engine: str, dtype: str, device: str) -> str:
    """The oracle policy the stack `engine` x `dtype` is audited beside on `device`: the engine's emulation
    in bf16 (parity_tests.emulations.emulation), fp32 in float32."""
    return emulation(engine, device) if dtype == "bfloat16" else "fp32"


class _PairRecorder:
    """Engine tap hook: per layer, column sums and first-key logit differences of each batch element
    against element 0 of its group (the reference shift), summed over heads. float64 [L, n, S, T]."""

    def __init__(self, group: int, logits_fp32: bool):
        self.group = group
        self.logits_fp32 = logits_fp32
        self.col: dict[int, np.ndarray] = {}
        self.first: dict[int, np.ndarray] = {}

    def put(self, name: str, layer: int, x: torch.Tensor) -> None:  # the taps' other hook: unused
        pass

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float, meta: Any) -> None:
        """q [B,N,T,D], k [B,K,T,D] after RoPE, as the engine received them."""
        B, N, T, _ = q.shape
        G = N // k.shape[1]
        kk = k.repeat_interleave(G, dim=1) if G > 1 else k
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        with torch.no_grad():
            if self.logits_fp32:
                s = torch.matmul(q.float(), kk.float().transpose(2, 3)) * scale
            else:  # Hugging Face eager: q·kᵀ in the model's dtype, then the scale (rounded once more)
                s = (torch.matmul(q, kk.transpose(2, 3)) * scale).float()
            p = F.softmax(s.masked_fill(~causal, float("-inf")), dim=-1, dtype=torch.float32).double()
            n = B // self.group
            p = p.reshape(n, self.group, N, T, T)
            a = s[..., 0].double().reshape(n, self.group, N, T)
            self.col[layer] = (p[:, 1:] - p[:, :1]).abs().sum(dim=(2, 3)).cpu().numpy()  # [n, S, T]
            self.first[layer] = (a[:, 1:] - a[:, :1]).abs().sum(dim=2).cpu().numpy()  # [n, S, T]

    def result(self) -> dict[str, np.ndarray]:
        L = sorted(self.col)
        return {"col": np.stack([self.col[i] for i in L]), "first": np.stack([self.first[i] for i in L])}


def run_pairs_torch(model, tokens_nT: np.ndarray, shifts: Sequence[int], ref_shift: int, engine: str
                    ) -> dict[str, np.ndarray]:
    """One forward of the n windows under `ref_shift` and every shift. Returns `col`, `first` [L, n, S, T]."""
    n, T = tokens_nT.shape
    group = len(shifts) + 1
    deltas = np.asarray([ref_shift, *shifts], dtype=np.int64)
    tokens = np.repeat(tokens_nT, group, axis=0)
    positions = np.arange(T, dtype=np.int64)[None, :] + np.tile(deltas, n)[:, None]
    rec = _PairRecorder(group, logits_fp32=engine not in BF16_LOGITS)
    layers = model.base_model.layers
    for layer in layers:
        setattr(layer.self_attn, TAP_ATTR, rec)
    try:
        with torch.no_grad():
            on = next(model.parameters()).device  # the model's device: CUDA where there is one
            model.model(input_ids=torch.from_numpy(tokens).to(on), position_ids=torch.from_numpy(positions).to(on),
                        doc_ids=torch.ones(tokens.shape, dtype=torch.int64, device=on), variant="full", use_cache=False)
    finally:
        for layer in layers:
            delattr(layer.self_attn, TAP_ATTR)
    return rec.result()


def shift_curve_torch(model, windows: np.ndarray, shifts: Sequence[int], ref_shift: int, engine: str,
                      per_call: int, tick: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """As `parity_tests.audit.runner.shift_curve`, on the torch model (same keys)."""
    n, T = windows.shape
    shifts = list(shifts)
    L = model.config.num_hidden_layers
    D = np.zeros((n, len(shifts)))
    d_logit = np.zeros((n, len(shifts)))
    per_token = np.zeros((n, T))
    by_layer = np.zeros((n, L))
    zero = shifts.index(0)
    for s in range(n):
        for c in range(0, len(shifts), per_call):
            chunk = shifts[c:c + per_call]
            r = run_pairs_torch(model, windows[s:s + 1], chunk, ref_shift, engine)
            for b, delta in enumerate(chunk):
                col = r["col"][:, 0, b]
                D[s, c + b] = metrics.d_from_colsums(col)
                d_logit[s, c + b] = metrics.d_logit_from_rows(r["first"][:, 0, b].sum(axis=0))
                if c + b == zero:
                    per_token[s] = metrics.per_token_from_colsums(col)
                    by_layer[s] = (col * metrics.column_norm(T)).sum(axis=1)
            tick(len(chunk) + 1)
    return {
        "shifts": [int(x) for x in shifts], "ref_shift": int(ref_shift), "seq_len": int(T), "num_seqs": int(n),
        "D": D.mean(axis=0).tolist(), "D_per_seq": D.tolist(), "D_logit": d_logit.mean(axis=0).tolist(),
        "_per_token": per_token.mean(axis=0), "_by_layer": by_layer.mean(axis=0),
    }


def length_curve_torch(model, windows: np.ndarray, lengths: Sequence[int], delta1: int, delta2: int, engine: str,
                       tick: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """As `parity_tests.audit.runner.length_curve`, on the torch model."""
    n, _ = windows.shape
    vals = np.zeros((n, len(lengths)))
    for s in range(n):
        r = run_pairs_torch(model, windows[s:s + 1], [delta1], delta2, engine)
        rows = r["first"][:, 0, 0].sum(axis=0)
        vals[s] = [metrics.d_logit_from_rows(rows, L) for L in lengths]
        tick(2)
    return {"lengths": [int(x) for x in lengths], "delta1": int(delta1), "delta2": int(delta2), "num_seqs": int(n),
            "D_logit": vals.mean(axis=0).tolist(), "D_logit_per_seq": vals.tolist()}


def stack_name(engine: str, dtype: str) -> str:
    """The key of the torch stack in audit.json's per-policy sections, e.g. "torch:eager:bfloat16"."""
    return f"torch:{engine}:{dtype}"


def audit_inputs(model: str = "default", *, data: str | None = None, quick: bool = False, **overrides: Any):
    """What `audit_torch_stack` measures on: (settings, lengths, notes, spec, state, shift windows,
    length windows), the windows packed from `data` (default: the embedded corpus) with `model`'s
    tokenizer. A rerun of the oracle side alone
    (experiments/torch_stack_audit/torch_stack_audit.py --rerun-oracle) takes the same."""
    import dataclasses


    settings = AuditSettings.quick() if quick else AuditSettings()
    settings = dataclasses.replace(settings, budget=False, random_init=False,
                                   **{k: v for k, v in overrides.items() if v is not None})
    settings, lengths, notes = resolve_settings(load_spec(model), settings)
    spec, state = load_weights(model, seed=settings.seed)
    tok = load_tokenizer(model)
    T_max = max(settings.seq_len, settings.max_len)
    texts = load_texts(data, max_docs=max(64, settings.num_seqs), max_chars=16 * T_max)
    docs = tok.encode_batch(texts)
    shift_w = make_windows(docs, first_token=tok.first_token_id, eos=tok.eos_id, n=settings.num_seqs, T=settings.seq_len)
    length_w = make_windows(docs, first_token=tok.first_token_id, eos=tok.eos_id, n=settings.length_seqs,
                            T=settings.max_len)
    return settings, lengths, notes, spec, state, shift_w, length_w


def audit_torch_stack(model: str = "default", engine: str = "eager", dtype: str = "bfloat16", *,
                      data: str | None = None, quick: bool = False, progress: bool = False,
                      oracle: bool = True, **overrides: Any) -> dict[str, Any]:
    """The audit of the torch stack `engine` × `dtype` and, with `oracle`, the oracle's emulation of it
    on the same windows and shifts. Returns audit.json's content (as `parity_tests.audit.run_audit`, with the
    torch stack as one more "policy" named `stack_name(engine, dtype)`, "stack" describing it and
    "comparison" the shift-by-shift ratio D_torch / D_oracle)."""
    import dataclasses


    t0 = time.time()
    if engine not in ORACLE_POLICY:
        raise InputError(f"--engine: unknown engine {engine!r} (known: {', '.join(ORACLE_POLICY)})")
    torchtrain.check_engine(engine, torchtrain.model.torch_dtype(dtype))
    if engine == "flash_varlen" and not torch.cuda.is_available():
        raise InputError("--engine flash_varlen runs on CUDA; on the CPU audit flash_varlen_emulated")
    settings, lengths, notes, spec, state, shift_w, length_w = audit_inputs(model, data=data, quick=quick, **overrides)
    name = stack_name(engine, dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the stack as it trains: the GPU's kernels there
    # the emulation of the kernel the model runs on that device (parity_tests.emulations: varlen and sdpa run
    # other kernels on CUDA; on a CPU `sdpa_cpu_bf16` resolves by its capability)
    policy = get_policy(oracle_policy(engine, dtype, device)) if oracle else None
    S = len(settings.shifts)
    per_call = max(1, min(S, shifts_per_call(spec, settings.seq_len, S)))
    calls = settings.num_seqs * math.ceil(S / per_call)
    total = (calls + settings.num_seqs * S + 2 * settings.length_seqs) * (2 if oracle else 1)
    bar = ProgressBar("audit", total, progress, unit="forward passes")
    out: dict[str, Any] = {"shift_curve": {}, "per_token": {}, "length_curve": {}}

    def record(key: str, sc: dict[str, Any], lc: dict[str, Any]) -> None:
        pt, by_layer = sc.pop("_per_token"), sc.pop("_by_layer")
        out["shift_curve"][key] = sc
        out["per_token"][key] = {"delta1": 0, "delta2": settings.ref_shift, "seq_len": settings.seq_len,
                                 "values": pt.tolist(), "by_layer": by_layer.tolist(),
                                 "first_token_share": float(pt[0] / pt.sum()) if pt.sum() > 0 else 0.0}
        out["length_curve"][key] = lc

    try:
        torch_model = torchtrain.model_from_weights(spec, state, engine, dtype).eval().to(device)
        bar.describe(f"{name}: shift curve (T={settings.seq_len})")
        sc = shift_curve_torch(torch_model, shift_w, settings.shifts, settings.ref_shift, engine, per_call, bar.advance)
        bar.describe(f"{name}: length curve (T={settings.max_len})")
        lc = length_curve_torch(torch_model, length_w, lengths, 0, settings.ref_shift, engine, bar.advance)
        record(name, sc, lc)
        del torch_model
        if oracle:
            params, remap = restrict_vocab(params_from_state(spec, state), spec, [shift_w, length_w])
            bar.describe(f"oracle {policy.name}: shift curve")
            sc = shift_curve(params, spec, remap(shift_w), policy, settings.shifts, settings.ref_shift, bar.advance)
            bar.describe(f"oracle {policy.name}: length curve")
            lc = length_curve(params, spec, remap(length_w), policy, lengths, 0, settings.ref_shift, bar.advance)
            record(policy.name, sc, lc)
    finally:
        bar.close()
    comparison = None
    if oracle:
        dt, do = out["shift_curve"][name]["D"], out["shift_curve"][policy.name]["D"]
        ratio = [a / b if b > 0 else float("inf") for a, b in zip(dt, do)]
        comparison = {"torch": name, "oracle": policy.name, "shifts": out["shift_curve"][name]["shifts"],
                      "D_torch": dt, "D_oracle": do, "ratio": ratio,
                      "max_rel_diff": max(abs(r - 1) for r in ratio)}
    settings_d = dataclasses.asdict(settings)
    settings_d.update(shifts=list(settings.shifts), lengths=lengths, budget_policy=None, variant="full",
                      data=str(data) if data is not None else "default corpus")
    return {
        "model": model, "spec": dataclasses.asdict(spec), "settings": settings_d,
        "machine": machine(torch_threads=torch.get_num_threads()),
        "stack": {"kind": "torch", "engine": engine, "dtype": dtype, "name": name,
                  "logits": "model dtype (Hugging Face eager)" if engine in BF16_LOGITS else "float32 (fused kernel)",
                  "oracle_policy": policy.name if oracle else None},
        "policies": {name: {"name": name, "stack": "torch", "engine": engine, "dtype": dtype},
                     **({policy.name: policy.to_dict()} if oracle else {})},
        **out, "error_budget": {}, "comparison": comparison,
        "angle_error": metrics.angle_error(spec.rope, spec.head_dim, (1024, 65536, 1_000_000), shift=settings.ref_shift),
        "notes": notes, "runtime_s": time.time() - t0,
    }
