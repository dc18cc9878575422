"""What a training run records (docs/DESIGN.md §8): RUN/metrics.jsonl and the gradient diagnostics.

    RUN/metrics.jsonl                 one JSON line per optimizer step (rank 0, flushed and fsynced):
                                      step, loss (mean over the counted targets of the global batch),
                                      tokens (their number), lr, grad_norm, tokens_per_s, elapsed_s,
                                      peak_memory_gib (`peak_memory`: the most rank 0 has held so far)
    RUN/tensorboard/                  loss, lr, grad_norm and tokens_per_s, when TensorBoard is installed
    RUN/grads/step-<N>.safetensors    the averaged gradient of step N, for the steps in `dump_grads`

On resume metrics.jsonl is cut back to the checkpoint's step: a killed run may have logged past it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anchor_core.atomic import write_text_atomic
from anchor_core.limits import peak_rss
from anchor_core.weights import readable_by_umask

if TYPE_CHECKING:
    from torchtrain.distributed import World

METRICS_FILE = "metrics.jsonl"
GRADS_DIR = "grads"

# The largest VmHWM read in this process (pid, bytes): the kernel computes VmHWM from approximate RSS counters
# (per-CPU batches), so a later reading can come out a few hundred KiB below an earlier one.
_cpu_peak: tuple[int, int] = (-1, 0)


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """The most memory this process has held so far, in GiB, what `anchor plan` predicts a step's peak against:
    on CUDA the caching allocator's peak of live tensors (`peak_memory_gib`, torch.cuda.max_memory_allocated)
    and of what it took from the device (`peak_reserved_gib`, which also holds its free blocks; the CUDA context
    is in neither); elsewhere the process's peak resident set (`peak_memory_gib`: Python, the libraries, the
    model and the work: the largest anchor_core.limits.peak_rss read so far, so that the logged peaks never
    decrease; None without procfs)."""
    global _cpu_peak
    if device.type == "cuda":
        return {"peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 4),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 4)}
    rss = peak_rss()
    if rss is None:
        return {"peak_memory_gib": None}
    pid, most = _cpu_peak
    _cpu_peak = (os.getpid(), max(rss, most if pid == os.getpid() else 0))  # a forked child starts its own
    return {"peak_memory_gib": round(_cpu_peak[1] / 2**30, 4)}


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """RUN/metrics.jsonl as one dict per logged step (docs/DESIGN.md §8)."""
    text = (Path(run) / METRICS_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _logged_lines(run: Path, upto: int) -> list[str]:
    """metrics.jsonl lines of steps 1..upto (a killed run may have logged steps past its checkpoint)."""
    path = run / METRICS_FILE
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by the kill
        if step <= upto:
            lines.append(line)
    return lines


class MetricsLog:
    """metrics.jsonl (rank 0): one flushed line per step; TensorBoard beside it when installed.

    Opened at step `start` (0 for a fresh run): the lines of later steps are dropped first.
    """

    def __init__(self, run: Path, start: int, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        lines = _logged_lines(run, start)
        write_text_atomic(run / METRICS_FILE, "".join(line + "\n" for line in lines))
        self.file = open(run / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run / "tensorboard"), purge_step=start + 1)
            except ImportError:
                self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", row[key], row["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def grad_norm(engine: Any) -> float | None:
    """The global gradient norm at an accumulation boundary, where DeepSpeed does not report it
    (ZeRO 0 in fp32 with a torch optimizer): the gradients are averaged and replicated by then."""
    import torch

    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def dump_grads(engine: Any, world: World, run: Path, step: int) -> None:
    """RUN/grads/step-<step>.safetensors: the averaged gradient of every parameter (Hugging Face
    names, float32) at an accumulation boundary, before clipping and the optimizer step; gathered
    under ZeRO 1-3 (all ranks call)."""
    from deepspeed.utils import safe_get_full_grad
    from safetensors.numpy import save_file

    path = run / GRADS_DIR / f"step-{step}.safetensors"
    grads = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if world.is_main and g is not None:
            grads[name] = g.detach().float().cpu().numpy().copy()
    if world.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(grads, str(tmp))
        readable_by_umask(tmp)
        os.replace(tmp, path)
