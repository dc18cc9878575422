"""What each training step reports, in one place: its metrics.jsonl line (torchtrain.training.metrics), the same
numbers to the trackers (torchtrain.training.trackers) and the progress bar.

    report = StepReport(cfg, run, world, start=..., elapsed0=..., logged=..., peak=..., built=..., progress=True)
    row = report.step(step, phase, loss=..., tokens=..., lr=..., grad_norm=..., flops=..., seconds=..., extra={})
    report.close(finished=True)

Every rank builds the row (the first line gathers every rank's memory peaks: a collective); rank 0 writes it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from anchor_core.limits import peak_rss
from anchor_core.progress import ProgressBar
from torchtrain.config import TrainConfig
from torchtrain.parallel.distributed import World
from torchtrain.training.metrics import Logged, MetricsLog, peak_memory
from torchtrain.training.throughput import Peak
from torchtrain.training.trackers import Trackers

if TYPE_CHECKING:
    from torchtrain.training.phases import Phase


def gathered(world: World, value: Any) -> list[Any]:
    """`value` of every rank, on every rank."""
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def rank_peaks(world: World) -> list[float | None]:
    """Every rank's host memory high-water mark so far (VmHWM, GiB; None without procfs), gathered on every rank."""
    rss = peak_rss()
    return gathered(world, None if rss is None else round(rss / 2**30, 4))


class StepReport:
    """The reporting of a run from step `start` on (`elapsed0`: the seconds its earlier attempts trained; `built`,
    `engine_built`: each rank's memory peak after the model's and the engine's build, reported with the first
    step this process trains)."""

    def __init__(self, cfg: TrainConfig, run: Path, world: World, *, start: int, elapsed0: float,
                 logged: Logged | None, peak: Peak, built: list[float | None],
                 engine_built: list[float | None], progress: bool):
        self.cfg, self.world, self.start, self.elapsed0, self.peak = cfg, world, start, elapsed0, peak
        self.built, self.engine_built = built, engine_built
        self.metrics = MetricsLog(run, start, world.is_main, logged=logged)
        # once metrics.jsonl holds steps 1..start: a tracker that lacks some of them is sent them from it
        self.trackers = Trackers(cfg, run, start) if world.is_main and cfg.logging.report_to else None
        self.bar = ProgressBar("train", cfg.schedule.steps, progress and world.is_main, unit="steps")
        if start:
            self.bar.advance(start)
        self.t_start = time.perf_counter() - elapsed0

    def step(self, step: int, phase: Phase, *, loss: float, tokens: int, lr: float, grad_norm: float | None,
             flops: float, seconds: float, extra: dict[str, Any]) -> dict[str, Any]:
        """Report one step (`seconds`: its time; `extra`: more numbers of its line, such as the held-out loss);
        returns its line."""
        cfg, world, peak = self.cfg, self.world, self.peak
        row = {"step": step, "loss": loss, "tokens": tokens, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": cfg.data.global_batch * phase.seq_len / seconds, "flops": flops,
               "flops_per_s": flops / seconds, "mfu": flops / seconds / (peak.flops_per_s * world.size),
               "elapsed_s": time.perf_counter() - self.t_start, **peak_memory(world.device)}
        if cfg.schedule.phases:
            row.update(phase=phase.index, seq_len=phase.seq_len)
        row.update(extra)
        if step == self.start + 1:  # this process's first line: what building the engine and the first step held
            row.update(peak_flops_per_s=peak.flops_per_s, build_peak_gib=self.built[0],
                       engine_peak_gib=self.engine_built[0], ranks_build_peak_gib=self.built,
                       ranks_engine_peak_gib=self.engine_built,
                       ranks_peak_memory_gib=gathered(world, row["peak_memory_gib"]))
        self.metrics.write(row)
        if self.trackers is not None:
            self.trackers.log(row)
        if cfg.logging.every and step % cfg.logging.every == 0:
            eta = (cfg.schedule.steps - step) * (row["elapsed_s"] - self.elapsed0) / max(1, step - self.start)
            self.bar.advance(1, note=f"step {step} loss {loss:.4f} {row['tokens_per_s']:.0f} tok/s eta {eta:.0f} s")
        else:
            self.bar.advance(1)
        return row

    def close(self, finished: bool) -> None:
        self.bar.close()
        self.metrics.close()
        if self.trackers is not None:
            self.trackers.close(finished=finished)
