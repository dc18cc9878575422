"""Time torchtrain's attention engines on packed documents and record JSON with the machine.

On CUDA: forward+backward of `flex` (and `sdpa`, `flash_varlen` where flash-attn imports) against
`eager`, at 8K and 32K slots in bfloat16. On CPU: the forward of every engine that runs here at a
moderate length in float32 (FlexAttention has no CPU backward). Each case times the attention of
one layer (q/k/v random, GQA) under the anchor variant; the per-step mask metadata is timed
separately (it is built once per step and shared by all layers). Out-of-memory is recorded, not
fatal (`eager` holds T×T scores per head).

    .venv/bin/python benchmarks/bench_engines.py                    # CUDA if present, else CPU
    .venv/bin/python benchmarks/bench_engines.py --seq-len 2048 --repeats 5 [--out results/speed]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from anchor_core.machine import machine  # noqa: E402
from torchtrain.attention.engines import attend, available_engines, prepare_meta  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 64


def packed_doc_ids(T: int, seed: int = 0) -> torch.Tensor:
    """Anchor layout: anchor at slot 0, documents of random lengths (mean T/8), the last one cut. [1, T]."""
    rng = np.random.default_rng(seed)
    doc = [0]
    d = 1
    while len(doc) < T:
        doc += [d] * int(rng.integers(1, T // 4))
        d += 1
    return torch.tensor([doc[:T]])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(engine: str, T: int, device: str, dtype: torch.dtype, backward: bool, repeats: int) -> dict:
    case = {"engine": engine, "seq_len": T, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "pass": "forward+backward" if backward else "forward", "variant": "anchor",
            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    try:
        doc = packed_doc_ids(T).to(device)
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, HEADS, T, HEAD_DIM, device=device, dtype=dtype, generator=g, requires_grad=backward)
        k = torch.randn(1, KV_HEADS, T, HEAD_DIM, device=device, dtype=dtype, generator=g, requires_grad=backward)
        v = torch.randn(1, KV_HEADS, T, HEAD_DIM, device=device, dtype=dtype, generator=g, requires_grad=backward)
        t0 = time.perf_counter()
        meta = prepare_meta(engine, doc, "anchor")
        _sync(device)
        case["meta_ms"] = round(1e3 * (time.perf_counter() - t0), 3)

        def step():
            with torch.set_grad_enabled(backward):
                out = attend(engine, q, k, v, meta, HEAD_DIM**-0.5)
                if backward:
                    out.float().sum().backward()

        step()  # warm-up (compiles flex)
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
        case.update(median_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3), repeats=repeats)
        if device == "cuda":
            case["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except torch.OutOfMemoryError:
        case["error"] = "out of memory"
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(json.dumps(case), flush=True)
    return case


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, nargs="+", help="slots per window (default: 8192 32768 on CUDA, 2048 on CPU)")
    ap.add_argument("--engines", nargs="+", help="engines to time (default: all that run here)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="(default: results/speed, results/gpu for cuda)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    seq_lens = args.seq_len or ([8192, 32768] if cuda else [2048])
    here = [e for e in available_engines() if e != "flash_varlen" or cuda]
    engines = args.engines or (["eager", "sdpa", "flex"] + [e for e in here if e == "flash_varlen"] if cuda else here)
    dtype = torch.bfloat16 if cuda else torch.float32
    results = [time_case(e, T, args.device, dtype, backward=cuda, repeats=args.repeats) for T in seq_lens for e in engines]
    report = {
        "benchmark": "torchtrain attention engines, one layer, anchor variant",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(torch_threads=torch.get_num_threads()),
        "results": results,
    }
    args.out = args.out or Path(__file__).resolve().parents[1] / "results" / ("gpu" if cuda else "speed")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engines_{args.device}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
