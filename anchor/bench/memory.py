"""What `anchor bench` will take in memory, estimated from the sizes before any work.

    need = step_memory(load_spec("default"), T=8192, layers=2, engine="varlen", device="cpu")
    need.total            # bytes: the peak resident size of a bench process running the step rows
    check_bench_memory(spec, model="default", seq_lens=[8192], engines=["varlen"], variants=["anchor"], windows=2,
                       attention=True, step=True, step_seq_len=None, step_layers=2, device="cpu",
                       dtype="float32")   # InputError naming the option and the estimate if too big

Legend: P parameters of the cut model (its first `layers` layers), P0 those of --model, T slots, h hidden
size, i MLP size, N query heads, K kv heads, D head dim, V vocabulary, L layers kept, e bytes per
activation element (4 fp32, 2 bf16).

The training-step rows (`anchor.bench.step`), phases that follow one another (the peak is the
largest, on top of the process):
  base         the process with torch, transformers and the trainer imported: `BASE_BYTES`, measured
  load         --model's weights read whole to cut them: `LOAD_BYTES_PER_PARAM` x P0 (fp32 state and the
               file's pages)
  pack         the packer's block at T: `anchor_core.data.pipeline.PACK_BYTES_PER_SLOT` x T
  train        weights, gradients and AdamW's two moments, 16 P (fp32, or bf16 weights and gradients with
               an fp32 master); the activations the backward reads, T e (7 h + 4 i + (3 N + 4 K) D)
               per layer for L + 1 layers (one for the backward's transients); the lm-head fused with
               the loss: `HEAD_BYTES` (at most a few chunks of logits, `torchtrain.model.loss`); the dense
               engines' T x T tensors
               (`torchtrain.attention.engines.dense_attention_bytes`)
On CUDA, `train` lies on the device (checked against its free memory) and the rest on the host.

The attention rows (`anchor.bench.timing`), per length: the windows of a distribution and each
variant's doc ids and pair counts, `SEG_BYTES_PER_SLOT` x --windows x T; then per window q, k, v, their
gradients, the output and its gradient and the engine's per-segment copies, `ATTENTION_COPIES` x
T D (N + 2 K) e; the masks of every variant, built before timing (dense engines: a bool T x T each),
and the dense engine's own T x T tensors of one layer; `ATTENTION_FIXED_BYTES` of workspace.

Checked against measured peaks (the whole process's VmHWM) by `benchmarks/bench_step_memory.py`
(`results/memory/step_memory_cpu.json`: estimate / peak beside every measured peak).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from anchor_core import limits
from anchor_core.data.pipeline import PACK_BYTES_PER_SLOT
from anchor_core.errors import InputError
from torchtrain.attention.engines import available_memory as device_memory
from torchtrain.attention.engines import dense_attention_bytes
from torchtrain.training.memory import BASE_PROCESS_BYTES, activation_bytes_per_slot, parameters  # shared with train's check

GiB = 2**30
BASE_BYTES = BASE_PROCESS_BYTES  # peak RSS of `python -c "import torch, transformers, torchtrain.training.trainer"`: 0.36
# GiB, 0.48 after the cut and the pack (SmolLM2, CPU)
LOAD_BYTES_PER_PARAM = 5  # measured 4.9: SmolLM2-135M's Q4_1 GGUF read to float32, 0.62 GiB over the imports
STATE_BYTES_PER_PARAM = 16  # fp32 weights 4 + gradients 4 + AdamW 8 (bf16: 2 + 4 master + 2 + 8)
HEAD_BYTES = 3 * (1 << 24) * 4  # torchtrain.model.loss: chunks of 2^24 logits (fp32), the chunk, its softmax and gradient
ATTENTION_COPIES = 10  # measured 8.8 (varlen, CPU, fp32, T = 4K-16K: 33.6 KB per slot at N, K, D = 9, 3, 64)
ATTENTION_FIXED_BYTES = int(0.15 * GiB)  # measured 0.14 GiB (the same runs, T -> 0)
SEG_BYTES_PER_SLOT = 64  # seg int32, make_batch's arrays and pairs' int64 ranks, for all windows at once


def _elem(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def _dense(engine: str, T: int, layers: int, heads: int, dtype: str) -> int:
    import torch


    return int(dense_attention_bytes(engine, seq_len=T, batch=1, layers=layers, heads=heads,
                                     dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32))


@dataclass(frozen=True)
class Need:
    """An estimate in bytes: `host` (resident memory of the process) and `device` (CUDA; 0 on the CPU),
    with the parts that make them up."""

    host: int
    device: int = 0
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.host + self.device

    def describe(self) -> str:
        return ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items() if v) + " GiB"


def train_parts(spec: Any, T: int, *, engine: str = "varlen", dtype: str = "float32") -> dict[str, int]:
    """The `train` phase of the module docstring for the cut model `spec` (its layers those kept)."""
    L = spec.num_layers
    return {"weights and optimizer": STATE_BYTES_PER_PARAM * parameters(spec),
            "activations": T * activation_bytes_per_slot(spec, _elem(dtype), layers=L + 1),
            "lm-head chunks": HEAD_BYTES,
            "dense T x T": _dense(engine, T, L, spec.num_heads, dtype)}


def step_memory(spec: Any, T: int, layers: int, *, engine: str = "varlen", dtype: str = "float32",
                device: str = "cpu") -> Need:
    """The step rows' peak (module docstring): --model's `spec`, cut to its first `layers` layers."""
    cut = spec.replace(num_layers=min(layers, spec.num_layers))
    train = train_parts(cut, T, engine=engine, dtype=dtype)
    load = LOAD_BYTES_PER_PARAM * parameters(spec)
    pack = PACK_BYTES_PER_SLOT * T
    if device == "cuda":
        return Need(BASE_BYTES + max(load, pack), sum(train.values()),
                    {"process": BASE_BYTES, "reading --model": load, "pack": pack, **train})
    phase = max(load, pack, sum(train.values()))
    parts = {"process": BASE_BYTES, **({"reading --model": load} if phase == load else
                                       {"pack": pack} if phase == pack else train)}
    return Need(BASE_BYTES + phase, 0, parts)


def attention_memory(spec: Any, T: int, engine: str, n_variants: int, *, windows: int = 2, dtype: str = "float32",
                     device: str = "cpu") -> Need:
    """The attention rows' peak at T on `engine` (module docstring): one layer of --model's head shape."""
    e = _elem(dtype)
    tensors = ATTENTION_COPIES * T * spec.head_dim * (spec.num_heads + 2 * spec.num_kv_heads) * e
    dense = _dense(engine, T, 1, spec.num_heads, dtype)
    masks = (n_variants - 1) * T * T if dense else 0  # dense_attention_bytes counts one bool mask
    work = {"q, k, v and gradients": tensors, "masks": masks, "dense T x T": dense, "workspace": ATTENTION_FIXED_BYTES}
    host = {"process": BASE_BYTES, "windows": SEG_BYTES_PER_SLOT * windows * T}
    pack = PACK_BYTES_PER_SLOT * T  # before the windows exist
    if device == "cuda":
        return Need(sum(host.values()) + pack, sum(work.values()), {**host, "pack": pack, **work})
    return Need(sum(host.values()) + max(pack, sum(work.values())), 0, {**host, **work})


def available(device: str) -> tuple[int, int | None]:
    """(bytes this process may still take on the host, counting what it holds now; bytes free on the CUDA
    device or None on the CPU). The host: `anchor_core.limits.available_memory` (MemAvailable, within a cgroup
    limit) plus this process's resident size, since the estimates count the process whole."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    device_free = None
    if device == "cuda":
        device_free = device_memory("cuda")
    return limits.available_memory() + rss, device_free


FIT = 0.9  # as anchor_core.limits.check_memory: an estimate above 90% of what is available is refused


def _check(need: Need, what: str, hint: str, avail: tuple[int, int | None]) -> None:
    host, dev = avail
    if need.host > FIT * host:
        raise InputError(f"{what} needs about {need.host / GiB:.1f} GiB of memory ({need.describe()}); "
                         f"{host / GiB:.1f} GiB is available here: {hint}")
    if dev is not None and need.device > FIT * dev:
        raise InputError(f"{what} needs about {need.device / GiB:.1f} GiB on the GPU ({need.describe()}); "
                         f"{dev / GiB:.1f} GiB is free there: {hint}")


def check_bench_memory(spec: Any, *, model: str, seq_lens: list[int], engines: list[str], variants: list[str],
                       windows: int, attention: bool, step: bool, step_seq_len: int | None, step_layers: int,
                       device: str, dtype: str) -> None:
    """Refuse, in one line naming the option and the estimate, sizes whose estimate exceeds the memory
    available here; before any work. Also refuses --step-layers beyond the model's layers."""
    avail = available(device)
    if attention:
        n = len(dict.fromkeys(["full", *variants]))
        runs = [e for e in engines if device == "cuda" or e not in ("flex", "flash_varlen")]  # else not run here
        for T in sorted(set(seq_lens), reverse=True):
            for engine in runs:
                _check(attention_memory(spec, T, engine, n, windows=windows, dtype=dtype, device=device),
                       f"--seq-len {T} (attention rows, engine {engine}, {spec.num_heads} heads of {spec.head_dim})",
                       "shorter --seq-len" + (", or the varlen engine (linear in T)" if engine in ("sdpa", "eager")
                                              else ""), avail)
    if step:
        if not 1 <= step_layers <= spec.num_layers:
            raise InputError(f"--step-layers must be in [1, {spec.num_layers}] for this model, got {step_layers}")
        engine = "varlen" if "varlen" in engines else engines[0]
        T = step_seq_len or min(8192, max(seq_lens))
        what = (f"--step-seq-len {T}" if step_seq_len else f"the step rows' length {T} (min(8192, longest --seq-len))")
        _check(step_memory(spec, T, step_layers, engine=engine, dtype=dtype, device=device),
               f"{what} (training steps of {model}, first {step_layers} layers, engine {engine})",
               "a shorter --step-seq-len, fewer --step-layers, or --no-step", avail)
