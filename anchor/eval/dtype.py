"""The evaluation dtype `auto`: bf16 where this machine multiplies it faster than fp32, and why.

On CUDA it is bf16 (the paper's). On a CPU it depends on the CPU: one with bf16 instructions
(avx512_bf16, AMX) multiplied a 2048² bf16 matrix 4.3x faster than fp32 (975 against 224 GFLOP/s),
one with AVX2 only 3-6x slower. So the choice is measured: an n x n matmul in each dtype on the
threads torch uses, once per machine (CPU model, capability, torch version, threads), kept in
`<cache>/machine/matmul-*.json` so every evaluation on the machine makes the same choice.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.machine import cpu_capability, cpu_model
from anchor_core.paths import cache_dir

DTYPES = ("auto", "bfloat16", "float32")
N = 1024  # 2 GFLOP a product: ~10 ms in fp32 on 2 cores, long enough to time, short enough to do once


def matmul_rates(n: int = N, repeats: int = 5) -> dict[str, Any]:
    """GFLOP/s of an n x n matmul in float32 and in bfloat16 on the CPU (best of `repeats`, after a warm-up)."""
    import torch

    rates = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=g).to(dt) for _ in range(2))
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        rates[name] = 2 * n**3 / best / 1e9
    return rates


def _cache_key() -> tuple[dict[str, Any], str]:
    import torch


    ident = {"cpu": cpu_model(), "capability": cpu_capability(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "n": N}
    return ident, hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cpu_matmul_rates() -> dict[str, Any]:
    """`matmul_rates()` of this machine, measured once and cached (cache folder's machine/): the rates,
    what identifies the machine, and when they were measured."""
    ident, key = _cache_key()
    path = cache_dir() / "machine" / f"matmul-{key}.json"
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
        if got.get("machine") == ident:
            return got
    except (OSError, ValueError):
        pass
    rates = matmul_rates()
    record = {"machine": ident, "gflops": {k: round(v, 1) for k, v in rates.items()},
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(record, indent=1))
    except OSError:  # a read-only cache: measure again next time
        pass
    return record


def dtype_choice(dtype: str) -> dict[str, Any]:
    """{"dtype": the evaluation dtype, "reason": why, "gflops"?: the measured rates} for `--dtype`.

    `auto`: bfloat16 on CUDA; on a CPU, bfloat16 where its measured matmul rate beats float32's, else
    float32. `bfloat16` and `float32` as given."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if dtype != "auto":
        return {"dtype": dtype, "reason": "asked for"}
    import torch

    if torch.cuda.is_available():
        return {"dtype": "bfloat16", "reason": "auto: CUDA (the paper's dtype)"}
    record = cpu_matmul_rates()
    fp32, bf16 = record["gflops"]["float32"], record["gflops"]["bfloat16"]
    faster = bf16 > fp32
    cap = record["machine"]["capability"]
    reason = (f"auto: a {N}x{N} bf16 matmul ran at {bf16:g} GFLOP/s against {fp32:g} in fp32 on this CPU "
              f"({cap}, {bf16 / fp32:.2g}x): {'bfloat16' if faster else 'float32'} is faster")
    return {"dtype": "bfloat16" if faster else "float32", "reason": reason, "gflops": record["gflops"],
            "measured_at": record["measured_at"]}
