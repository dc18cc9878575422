"""Days per 1B training tokens for a model, context length, GPU count and variant.

    est = estimate(SHAPES["llama2-7b"], seq_len=65536, gpus=8, pairs_per_window=..., gpu=GPUS["a100-80gb"])

The model. A step of one window of T tokens on G GPUs (Ulysses over all G: each holds T / G slots
and, inside attention, N / G heads of the whole window) costs
  compute  (6 P T + L x 3.5 x 4 N D pairs) / (G x peak x MFU)   dense matmuls and attention, each at
           its own fraction of the GPU's peak (`mfu_dense`, `mfu_attention`)
  comms    Ulysses' all-to-alls: per layer q, k, v and the output forward and their gradients
           backward, each moving (G - 1) / G of the rank's T / G x (2 N + 2 K) D values in bf16,
           at `all_to_all_gbps` per GPU, not overlapped with compute (an upper bound)
and days per 1B tokens = 1e9 / (T / step time) / 86400. `pairs_per_window` comes from the FLOP model
(`anchor_core.flops.pairs`) on windows of the variant's document layout: this is where anchor
and full differ.

Calibration. Where steps were measured (`calibrate`: the same model at one length, full and anchor),
the two rates solve t = dense / R_dense + attention / R_attention; the estimate for that machine then
uses the measured rates (`mfu_*` = "measured"), and its prediction for each measured step is printed
beside the measurement. The GPU estimate uses the assumed MFUs below unless rates measured on that
GPU are given; every assumption is returned with the numbers. The shapes and GPUs are the registry's
(anchor_core.hardware), which `anchor plan` reads too.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from anchor_core.flops import BWD_FACTOR, matmul_params  # noqa: F401 (BWD_FACTOR re-exported)
from anchor_core.hardware import GPUS, SHAPES, Gpu, Shape  # noqa: F401 (the registry, re-exported)
from anchor_core.spec import ModelSpec


def shape_of(spec: ModelSpec, name: str | None = None) -> Shape:
    """A loaded model's sizes as an estimate's shape, named `name` (default: its family)."""
    return Shape(name or spec.family, spec)


def step_cost(shape: Shape, seq_len: int, pairs_per_window: float) -> dict[str, float]:
    """FLOPs of one window's training step and Ulysses' bytes per GPU-count-free unit."""
    m = shape.spec
    dense = 6.0 * matmul_params(m) * seq_len
    attention = m.num_layers * BWD_FACTOR * 4.0 * pairs_per_window * m.num_heads * m.head_dim
    return {"dense_flops": dense, "attention_flops": attention}


def estimate(shape: Shape, seq_len: int, gpus: int, pairs_per_window: float, gpu: Gpu, *,
             rates: dict[str, float] | None = None) -> dict[str, Any]:
    """Days per 1B tokens of one variant (its `pairs_per_window`). `rates`: measured FLOP/s of the
    whole machine for {"dense", "attention"} (then `gpus` and the GPU's peak are not used)."""
    c = step_cost(shape, seq_len, pairs_per_window)
    if rates is not None:
        compute_s = c["dense_flops"] / rates["dense"] + c["attention_flops"] / rates["attention"]
        comms_s = 0.0
    else:
        peak = gpu.peak_tflops * 1e12 * gpus
        compute_s = c["dense_flops"] / (peak * gpu.mfu_dense) + c["attention_flops"] / (peak * gpu.mfu_attention)
        m = shape.spec
        values = (seq_len / gpus) * (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        bytes_per_gpu = 2 * m.num_layers * (gpus - 1) / gpus * values * 2  # fwd + bwd, bf16
        comms_s = bytes_per_gpu / (gpu.all_to_all_gbps * 1e9) if gpus > 1 else 0.0
    step_s = compute_s + comms_s
    return {"model": shape.name, "seq_len": seq_len, "gpus": gpus, "gpu": gpu.name if rates is None else "measured",
            "pairs_per_window": float(pairs_per_window), **c, "compute_s": compute_s, "comms_s": comms_s,
            "step_s": step_s, "days_per_1b_tokens": 1e9 / (seq_len / step_s) / 86400.0}


def calibrate(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rates (FLOP/s) from measured steps [{dense_flops, attention_flops, step_s}, ...] of one machine.

    Two or more steps with different attention shares: least squares for 1/R_dense, 1/R_attention
    (both must come out positive); else one rate for all FLOPs. None without rows.
    """
    rows = [r for r in rows if r.get("step_s")]
    if not rows:
        return None
    A = np.array([[r["dense_flops"], r["attention_flops"]] for r in rows], dtype=np.float64)
    t = np.array([r["step_s"] for r in rows], dtype=np.float64)
    how = "one rate (the steps do not separate dense from attention)"
    if len(rows) >= 2 and np.linalg.matrix_rank(A / A.max(axis=0)) == 2:
        inv, *_ = np.linalg.lstsq(A, t, rcond=None)
        if (inv > 0).all():
            rates = {"dense": 1.0 / inv[0], "attention": 1.0 / inv[1]}
            how = "least squares over the measured steps"
        else:
            inv = None
    else:
        inv = None
    if inv is None or (inv <= 0).any():
        r = A.sum(axis=1).sum() / t.sum()
        rates = {"dense": r, "attention": r}
    pred = A @ np.array([1 / rates["dense"], 1 / rates["attention"]])
    return {"rates_flops_per_s": rates, "how": how,
            "fit": [{"step_s": float(m), "predicted_s": float(p)} for m, p in zip(t, pred)]}


def assumptions(gpu: Gpu) -> dict[str, Any]:
    return {**asdict(gpu), "bwd_factor": BWD_FACTOR,
            "note": "compute at mfu x peak per GPU, Ulysses all-to-alls over all GPUs not overlapped with compute"}
