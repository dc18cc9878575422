"""What a training step achieves against what the device could do: model FLOPs, FLOP/s and MFU per step.

    peak = device_peak(device, dtype)          # Peak(flops_per_s, source), once per run
    f = batch_flops(spec, doc_ids, variant)    # model FLOPs of windows, anchor_core.flops (anchor bench's model)
    mfu = f / seconds / (peak.flops_per_s * processes)

Counted (anchor_core.flops): 6 FLOPs per matmul parameter and slot (forward 2, backward 4; attention and MLP
weights and the lm-head, not the embeddings) and the attention over the query-key pairs the variant's mask
allows for the step's actual documents (forward 4 N D per pair, forward + backward 3.5x that), never the full
T x T square. These are model FLOPs: a layer recomputed under activation checkpointing is not counted again, so
MFU says how much of the device went into the model's arithmetic.

The peak of one process's device: on a GPU training in bf16 the dense bf16 rate its vendor states
(anchor_core.hardware.GPUS, matched by the device's name); on a CPU, in float32, or on a GPU the table does not
know, measured once in the run's compute
dtype by square matmuls on that process's threads (the best of a few rounds). Each process counts one device's
peak: on the CPU, processes of one thread each share the cores (parallel.nproc), as they train.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anchor_core.flops import pairs, step_flops
from anchor_core.hardware import GPUS

MATMUL_N = 512  # the measured matmul: N x N by N x N
MEASURE_S = 0.05  # the shortest round; the best of ROUNDS
ROUNDS = 3


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str  # in words, for the run log


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """One process's peak FLOP/s on `device` computing in `dtype` (module docstring)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):  # the table's rates are bf16's
        name = torch.cuda.get_device_name(device)
        for gpu in GPUS.values():
            if gpu.name.split("-")[0].upper() in name.upper():
                return Peak(gpu.peak_tflops * 1e12, f"{name}: {gpu.name}'s dense bf16 peak as its vendor states it "
                                                    f"({gpu.peak_tflops:g} TFLOP/s, anchor_core.hardware.GPUS)")
    rate = measured_matmul_rate(device, dtype)
    return Peak(rate, f"{rate / 1e12:.3g} TFLOP/s, measured here: a {MATMUL_N}^3 {str(dtype).removeprefix('torch.')} "
                      f"matmul on {torch.get_num_threads()} thread(s) of {device}, best of {ROUNDS} rounds")


def measured_matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of N x N matmuls in `dtype` on `device` (the best round of ROUNDS of at least MEASURE_S each)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(MATMUL_N, MATMUL_N, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up: kernels chosen, memory touched
    best = 0.0
    for _ in range(ROUNDS):
        n, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            n += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if dt >= MEASURE_S:
                break
        best = max(best, 2.0 * MATMUL_N**3 * n / dt)
    return best


def batch_flops(spec: Any, doc_ids: np.ndarray, variant: str) -> float:
    """Model FLOPs of a forward and backward over windows `doc_ids` [B, T] (module docstring)."""
    doc = np.asarray(doc_ids)
    return step_flops(spec, int(pairs(doc, variant).sum()), int(doc.size))["total"]
