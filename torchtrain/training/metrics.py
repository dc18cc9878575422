"""What a training run records (docs/DESIGN.md §8): RUN/metrics.jsonl and the gradient diagnostics.

    RUN/metrics.jsonl                 one JSON line per optimizer step (rank 0, flushed and fsynced):
                                      step, loss (mean over the counted targets of the global batch),
                                      tokens (their number), lr, grad_norm, tokens_per_s, flops (the step's
                                      model FLOPs), flops_per_s and mfu (torchtrain.training.throughput), elapsed_s,
                                      every eval.every steps heldout_loss, heldout_loss_by_position,
                                      heldout_tokens and heldout_s (torchtrain.training.heldout),
                                      peak_memory_gib (`peak_memory`: the most rank 0 has held so far);
                                      a number that is not finite is written as null (`finite`), and a
                                      step whose loss or gradient norm is not finite stops the run before
                                      it is logged (torchtrain.training.trainer.check_step)
    RUN/grads/step-<N>.safetensors    the averaged gradient of step N, for the steps in `dump_grads`

On resume metrics.jsonl is read strictly (`read_log`): a line that is not UTF-8, not JSON (but for a last line
cut mid-write by a kill, dropped) or whose `step` is not the integer that follows the line before is refused in
one line naming the file and the line, before the run folder changes. The run resumes from a checkpoint no later
than the last step logged whole (torchtrain.training.checkpoint.newest_valid's `upto`), so the file never has a gap, and
the lines it drops (a cut one, the steps logged past that checkpoint) are named on stderr (`MetricsLog`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.limits import peak_rss
from anchor_core.weights import readable_by_umask

if TYPE_CHECKING:
    from torchtrain.parallel.distributed import World

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
    """RUN/metrics.jsonl as one dict per logged step (docs/DESIGN.md §8); a line that is not one (not UTF-8, not
    a JSON object with an integer `step`, cut) is an InputError naming the file and the line."""
    path = Path(run) / METRICS_FILE
    return [row for _, _, row in _rows(path, _read_bytes(path), cut_ok=False)]


@dataclass(frozen=True)
class Logged:
    """What a resumed run finds in metrics.jsonl (`read_log`): the whole lines of steps 1..`last`, in order, and
    the number of a last line cut mid-write (None when there is none)."""

    lines: list[str] = field(default_factory=list)
    cut: int | None = None

    @property
    def last(self) -> int:
        """The last step logged whole (0: none)."""
        return len(self.lines)


def read_log(run: str | Path) -> Logged:
    """RUN/metrics.jsonl as a resume reads it: steps 1, 2, 3, ... one per line. A last line that is not JSON is
    a write a kill cut short: left out (`Logged.cut`). Anything else that is not a logged step (bytes that are not
    UTF-8, a line that is not JSON before the last, a `step` that is not an integer, a step out of order) is an
    InputError naming the file and the line: resuming over it would lose or mix up lines without a word."""
    path = Path(run) / METRICS_FILE
    if not (path.exists() or path.is_symlink()):
        return Logged()
    lines: list[str] = []
    cut = None
    for number, text, row in _rows(path, _read_bytes(path), cut_ok=True):
        if row is None:
            cut = number
            break
        if row["step"] != len(lines) + 1:
            want = len(lines) + 1
            raise InputError(f"line {number}: step {row['step']} where step {want} belongs (metrics.jsonl logs steps "
                             f"1, 2, 3, ... in order); fix the line or choose another --out", path=path)
        lines.append(text)  # written back as it was
    return Logged(lines, cut)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=path) from None


def _rows(path: Path, raw: bytes, *, cut_ok: bool):
    """(line number, text, row) for each non-blank line of `raw`; with `cut_ok`, a last line that is not JSON
    comes as (its number, its text, None)."""
    entries = [(i + 1, part) for i, part in enumerate(raw.split(b"\n")) if part.strip()]
    for k, (number, part) in enumerate(entries):
        try:
            text = part.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"line {number}: byte 0x{part[e.start]:02x} at column {e.start + 1} is not UTF-8 text "
                             "(anchor writes JSON lines); fix the line or choose another --out", path=path) from None
        try:
            row = json.loads(text)
        except ValueError as e:
            if cut_ok and k == len(entries) - 1:
                yield number, text, None
                return
            where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            what = "the last line, cut mid-write" if k == len(entries) - 1 else "not a JSON line"
            raise InputError(f"line {number}: {what} ({getattr(e, 'msg', e)}{where}); fix the line or choose "
                             "another --out", path=path) from None
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(step, int) or isinstance(step, bool) or step < 1:
            shown = "no 'step'" if not isinstance(row, dict) or "step" not in row else \
                f"'step' is {json.dumps(step)[:40]} ({type(step).__name__})"
            raise InputError(f"line {number}: {shown}, not a step number (an integer from 1); fix the line or "
                             "choose another --out", path=path)
        yield number, text, row


def _span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}-{last}"


class MetricsLog:
    """metrics.jsonl (rank 0): one flushed line per step (TensorBoard and the other trackers: torchtrain.training.trackers).

    Opened at step `start` (0 for a fresh run) over what the file held (`logged`, read_log's; read here when
    None): the lines of steps 1..start are kept, the rest dropped, and what is dropped (a cut last line, the
    steps logged past `start`) is named in one line on stderr. `start` is never past `logged.last` (the run
    resumes from a checkpoint no later than it: torchtrain.training.checkpoint.newest_valid's `upto`), so no step is missing.
    """

    def __init__(self, run: Path, start: int, enabled: bool, logged: Logged | None = None):
        self.enabled = enabled
        if not enabled:
            return
        logged = read_log(run) if logged is None else logged
        if start > logged.last:  # the resume's checkpoint must be no later than the log (newest_valid's upto)
            raise InputError(f"the run resumes after step {start} but metrics.jsonl holds steps up to {logged.last} "
                             "only", path=run / METRICS_FILE)
        dropped = dropped_lines(logged, start)
        if dropped:
            print(f"{run / METRICS_FILE}: dropping {dropped}; steps {start + 1} on are logged anew",
                  file=sys.stderr, flush=True)
        write_text_atomic(run / METRICS_FILE, "".join(line + "\n" for line in logged.lines[:start]))
        self.file = open(run / METRICS_FILE, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(finite(row), allow_nan=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.enabled:
            self.file.close()


def finite(x: Any) -> Any:
    """`x` with every float that is not finite (NaN, an infinity) as None: JSON has no such numbers, and a line
    holding one (Python writes a bare NaN) is not JSON. Mappings and lists walked."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def dropped_lines(logged: Logged, start: int) -> str:
    """What a resume from step `start` drops of `logged`, in words ("" when nothing): the steps logged past it and
    a cut last line."""
    parts = []
    if logged.last > start:
        why = f"logged past step {start}, where this run resumes" if start else "this run starts from scratch"
        parts.append(f"step{'s' if logged.last > start + 1 else ''} {_span(start + 1, logged.last)} ({why})")
    if logged.cut is not None:
        parts.append(f"line {logged.cut} (cut mid-write: a run killed while logging)")
    return " and ".join(parts)


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
