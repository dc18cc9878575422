"""Attention forward + backward per engine x variant on given windows, and peak memory.

One layer's attention of the model's head shape on random q, k, v (RoPE does not change the
cost), window by window (B = 1), through `torchtrain.attention.engines` exactly as a model layer calls it:
the mask metadata is built once per window (`prepare_meta`, timed apart: a model builds it once per
step for all its layers) and `attend` runs forward, then backward from a random output gradient.
The variants of one length are timed in alternation, repeat by repeat, so slow drift of a shared
machine hits all of them alike; the time of a window is the median over repeats after one warm-up, and
every repeat is kept beside it (`ms_repeats`), so a reader can compute any other statistic.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from anchor_core.data.batch import make_batch
from anchor_core.errors import InputError, UnavailableError
from anchor_core.limits import peak_rss
from torchtrain.attention.engines import attend, check_engine, prepare_meta

_CLEAR_REFS = Path("/proc/self/clear_refs")


@contextlib.contextmanager
def peak_memory(device: str) -> Iterator[dict[str, Any]]:
    """Peak memory inside the block: {"peak_cuda_gib": max allocated} on CUDA, else {"peak_rss_gib": the
    process's resident high-water mark after resetting it (Linux), or None where it cannot be reset}."""
    import torch

    out: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        yield out
        torch.cuda.synchronize()
        out["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        return
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
        ok = True
    except OSError:
        ok = False
    yield out
    hwm = peak_rss()
    out["peak_rss_gib"] = round(hwm / 2**30, 3) if ok and hwm is not None else None


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_variants(engine: str, variants: list[str], seg: np.ndarray, shape: Heads, *, device: str, dtype: str,
                  backward: bool = True, repeats: int = 3, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Time `engine` on every variant over the windows `seg` int [n, T]; -> variant -> row fields.

    Row fields: ms (sum over windows of each window's median), ms_windows, ms_repeats (every timed
    repeat, window by window), meta_ms (summed), peak memory, and `error` instead where the engine
    cannot run (unavailable here, out of memory).
    """
    import torch


    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    rows: dict[str, dict[str, Any]] = {v: {"ms_windows": [], "ms_repeats": [], "meta_ms": 0.0}
                                          for v in variants}
    try:
        check_engine(engine, tdtype)
        if engine == "flex" and backward and device != "cuda":
            raise UnavailableError("FlexAttention has no backward on the CPU")
        if engine == "flash_varlen" and device != "cuda":
            raise UnavailableError("flash_varlen runs on CUDA")
    except (InputError, UnavailableError) as e:
        return {v: {"error": str(e)} for v in variants}
    n, T = seg.shape
    scale = shape.head_dim ** -0.5
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(1, h, T, shape.head_dim, generator=g, device=device, dtype=tdtype)

    for w in range(n):
        q, k, v = rand(shape.heads), rand(shape.kv_heads), rand(shape.kv_heads)
        grad_out = torch.randn(1, T, shape.heads, shape.head_dim, generator=g, device=device, dtype=tdtype)
        metas = {}
        for var in variants:
            if "error" in rows[var]:
                continue
            doc = torch.as_tensor(make_batch(seg[w:w + 1], seg[w:w + 1], np.zeros_like(seg[w:w + 1]), var).doc_ids,
                                  dtype=torch.long, device=device)
            _sync(device)
            t0 = time.perf_counter()
            metas[var] = prepare_meta(engine, doc, var)
            _sync(device)
            rows[var]["meta_ms"] += 1e3 * (time.perf_counter() - t0)

        def once(var: str) -> float:
            qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))
            _sync(device)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward):
                out = attend(engine, qq, kk, vv, metas[var], scale)
                if backward:
                    out.backward(grad_out)
            _sync(device)
            return 1e3 * (time.perf_counter() - t0)

        times: dict[str, list[float]] = {var: [] for var in metas}
        for r in range(repeats + 1):  # the first round warms up (and compiles flex)
            for var in list(times):
                try:
                    with peak_memory(device) if r == 0 else contextlib.nullcontext({}) as mem:
                        t = once(var)
                except torch.OutOfMemoryError:
                    rows[var]["error"] = f"out of memory at T={T}"
                    del times[var]
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                if r == 0:
                    for key, val in mem.items():
                        rows[var][key] = max(rows[var].get(key) or 0.0, val or 0.0) if val is not None else None
                else:
                    times[var].append(t)
        for var, ts in times.items():
            rows[var]["ms_windows"].append(round(statistics.median(ts), 3))
            rows[var]["ms_repeats"].append([round(t, 3) for t in ts])
    for var, row in rows.items():
        if "error" not in row:
            row["ms"] = round(sum(row["ms_windows"]), 3)
            row["meta_ms"] = round(row["meta_ms"], 3)
    return rows
