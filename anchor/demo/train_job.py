"""The demo's `train` job: one `anchor train` run per name of `run_names`, with what its step times mean.

Each run is trained on the packed windows (resumed where a killed demo left it) and summarised from its
metrics: loss, median step time and tokens/s, the evaluation checkpoints, its FLOP ratio to full attention
(`flop_ratios`), and the machine's load while it trained (`LoadSampler`, `busy_machine`), since step times
measured on a busy machine are not comparable. `step_time_ratios` sets each run's step time against full's
where both were timed in one sitting, and `train_figures` draws the loss curves and step time against FLOPs.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from anchor.demo.figures import save_figure
from anchor.demo.job_context import JobContext, _container
from anchor.demo.settings import FP32_SUFFIX, DemoSettings, parse_run, run_names, times_full
from anchor_core import flops
from anchor_core.data.packed import Loader, PackedData
from anchor_core.machine import cpu_model
from anchor_core.weights import load_spec, model_identity
from torchtrain.config import load_train_config
from torchtrain.training import checkpoint as ckpt
from torchtrain.training.metrics import read_metrics
from torchtrain.training.resume import load_run_config
from torchtrain.training.trainer import release_memory, train


def _train_overrides(s: DemoSettings, data: Path, run: str) -> list[str]:
    """The `anchor train` config of one run of `run_names(s)` (its variant, dtype, steps, evaluation window)."""
    r = parse_run(s, run)
    out = [f"model.name={s.model}", f"model.variant={r['variant']}", f"model.dtype={r['dtype']}",
           f"model.engine={s.train_engine}", f"data.path={data}", f"data.seq_len={s.seq_len}",
           f"data.global_batch={s.global_batch}", "data.micro_batch=1", f"data.seed={s.seed}", f"optim.lr={s.lr}",
           f"schedule.steps={r['steps']}", f"schedule.warmup_steps={s.train_warmup_steps}", "schedule.kind=constant",
           f"parallel.zero_stage={s.zero_stage}", "checkpoint.save_every=0", "checkpoint.keep_last=1",
           f"eval.every={s.eval_every}", f"eval.window={r['eval_window']}",
           "logging.report_to=[]"]  # the demo's page draws its runs from metrics.jsonl: no tracker files
    if s.train_rope_theta is not None:
        out.append(f"model.rope.theta={float(s.train_rope_theta)!r}")
    return out


def flop_ratios(pack: Path, model: str, variant: str, steps: int, global_batch: int, seed: int) -> dict[str, float]:
    """`variant`'s FLOPs against full attention's on the windows a run of `steps` steps trains on (the
    trainer's order on one process: anchor_core.data.packed.Loader with the run's seed and batch): `attention`,
    the query-key pairs its mask allows; `step`, the whole training step (anchor_core.flops: 6 FLOPs
    per matmul parameter and token, plus attention)."""
    loader = Loader(PackedData.open(pack), batch_size=global_batch, variant=variant, seed=seed)
    mine = full = tokens = 0
    for _ in range(steps):
        b = next(loader)
        mine += int(flops.pairs(b.doc_ids, variant).sum())
        full += int(flops.pairs(b.doc_ids, "full").sum())  # padding reads the same under every variant
        tokens += int(b.tokens.size)
    spec = load_spec(model)
    return {"attention": mine / full,
            "step": flops.step_flops(spec, mine, tokens)["total"] / flops.step_flops(spec, full, tokens)["total"]}


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


class LoadSampler:
    """The 1-minute load average sampled every `every_s` seconds while a run trains (a thread), so its step
    times come with how busy the machine was meanwhile: `summary()` is mean, min and max over the samples."""

    def __init__(self, every_s: float = 5.0):
        import threading

        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            x = _load_average()
            if x is not None:
                self.samples.append(x)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, Any]:
        x = self.samples
        return {"samples": len(x), "every_s": self.every_s, "mean": round(float(np.mean(x)), 2) if x else None,
                "min": min(x) if x else None, "max": max(x) if x else None}


def busy_machine(load_before: float | None) -> bool:
    """Whether other work held the machine when a timed run started: a 1-minute load average above half
    the cores (the run's own processes are not counted yet), so its step times are not comparable."""
    return load_before is not None and load_before > 0.5 * (os.cpu_count() or 1)


def job_train(ctx: JobContext) -> dict[str, Any]:
    """One run per variant on the packed windows, then the float32 runs (resumed where a killed demo left them)."""
    s = ctx.settings
    root = ctx.folder("train")
    _container(root)
    runs: dict[str, Any] = {}
    names = run_names(s)
    device = device_name()
    for i, v in enumerate(names, 1):
        r = parse_run(s, v)
        ctx.say(f"    run {i}/{len(names)}: {v}: variant {r['variant']}, {r['steps']} steps of "
                f"{s.global_batch} x {s.seq_len} slots, {r['dtype']}, engine {s.train_engine}")
        cfg = load_train_config(None, _train_overrides(s, ctx.folder("pack").resolve(), v))
        load_before = _load_average()  # other work on the machine, before this run adds its own
        with LoadSampler() as load:
            train(cfg, root / v, progress=ctx.progress)
        release_memory()
        load_after = _load_average()
        m = read_metrics(root / v)
        step_s, step_s_median = _step_times(m, s)
        last = max(ckpt.list_steps(root / v))
        runs[v] = {"steps": len(m), "loss_first": m[0]["loss"], "loss_last": m[-1]["loss"],
                   "loss": [x["loss"] for x in m], "step_s_median": step_s_median,
                   "tokens_per_s_median": float(np.median([x["tokens_per_s"] for x in m[1:] or m])),
                   "elapsed_s": m[-1]["elapsed_s"], "last_checkpoint": f"{v}/checkpoints/step-{last}/hf",
                   "eval_checkpoints": [f"step-{k}" for k in sorted(ckpt.list_steps(root / v)) if cfg.is_eval_step(k)],
                   "load_average": {"before": load_before, "after": load_after, "cores": os.cpu_count(),
                                    "during": load.summary()},
                   "busy": busy_machine(load_before), "variant": r["variant"], "dtype": r["dtype"],
                   "device": device,
                   "step_s": [round(x, 5) for x in step_s],
                   "engine": load_run_config(root / v).model.engine,
                   "flop_ratio": flop_ratios(ctx.folder("pack"), s.model, r["variant"], r["steps"], s.global_batch,
                                             s.seed)}
    timing = None
    if times_full(s):
        ctx.say(f"    full, timed only: {s.timing_steps} steps (the step time this part's runs are set against)")
        timing = _time_full(ctx)
        for v, r in runs.items():
            if not v.endswith(FP32_SUFFIX):
                r["full_timing"] = {k: timing[k] for k in ("steps", "step_s_median", "device")}
    step_time_ratios(runs)
    train_figures(runs, root, s)

    # the bytes the runs started from (`default` resolves to a file): parts merge only where these are the same
    return {"runs": runs, "model": s.model, "seq_len": s.seq_len, "engine": s.train_engine, "dtype": s.train_dtype,
            "rope_theta": s.train_rope_theta, "zero_stage": s.zero_stage, "full_timing": timing,
            "model_identity": model_identity(s.model)}


TIMING_RUN = "full-timing"  # train/<this>: no run of a profile has this name (variants have no '-')


def _time_full(ctx: JobContext) -> dict[str, Any]:
    """`full` for `timing_steps` steps on the same windows, dtype, engine and machine as the part's runs, no
    evaluation checkpoint (resumed like them): its median step time after the first."""
    s = ctx.settings
    cfg = load_train_config(None, _train_overrides(replace(s, train_steps=s.timing_steps, eval_window=0),
                                                   ctx.folder("pack").resolve(), "full"))
    folder = ctx.folder("train") / TIMING_RUN
    load_before = _load_average()
    train(cfg, folder, progress=ctx.progress)
    release_memory()
    m = read_metrics(folder)
    step_s, step_s_median = _step_times(m, s)
    return {"steps": len(m), "step_s_median": step_s_median, "step_s": [round(x, 5) for x in step_s],
            "device": device_name(), "busy": busy_machine(load_before)}


def _step_times(metrics: list[dict[str, Any]], s: DemoSettings) -> tuple[list[float], float]:
    """A run's seconds per step (from its tokens/s) and their median after the first step (compiles, warm-up)."""
    step_s = [s.global_batch * s.seq_len / x["tokens_per_s"] for x in metrics]
    return step_s, float(np.median(step_s[1:] if len(step_s) > 1 else step_s))


def device_name() -> str:
    """What a run's step times were measured on: the GPU's name where torch sees one, else the CPU's model."""
    import torch


    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else cpu_model()


def step_time_ratios(runs: dict[str, Any]) -> None:
    """Each run's median step time over that of `full` of the same dtype (`step_time_vs_full`), where both
    were timed in one sitting: a demo's runs always are; of the parts `anchor demo --merge` joins (`part`,
    their index) only runs of the same part are, and a ratio across sittings or machines is left out with
    the reason (speed is compared in one run, on one machine)."""
    for v, r in runs.items():
        base = runs.get("full@fp32" if v.endswith(FP32_SUFFIX) else "full")
        r.pop("step_time_vs_full", None)
        r.pop("step_time_vs_full_why", None)
        if base is not None and (r.get("part"), r.get("device")) == (base.get("part"), base.get("device")):
            r["step_time_vs_full"] = r["step_s_median"] / base["step_s_median"]
        elif r.get("full_timing"):  # a part without full: full's steps timed beside it (`timing_steps`)
            t = r["full_timing"]
            r["step_time_vs_full"] = r["step_s_median"] / t["step_s_median"]
            r["step_time_vs_full_why"] = f"against full's first {t['steps']} steps, timed in this run's part"
        elif base is not None:
            r["step_time_vs_full"] = None
            r["step_time_vs_full_why"] = (f"not compared: full was timed in another part of the demo "
                                          f"(on {base.get('device')}; this run on {r.get('device')})")


def train_figures(runs: dict[str, Any], root: Path, s: DemoSettings) -> None:
    """`loss.png` (every run's loss per step) and, where step time ratios exist, `step_time_vs_flops.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for v, r in runs.items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], marker="o" if len(r["loss"]) < 40 else None,
                ls="--" if v.endswith("@fp32") else "-", label=v)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over counted targets)")
    ax.set_title(f"{s.model}: continued pre-training at T={s.seq_len}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, root / "loss.png")
    plt.close(fig)
    if any("flop_ratio" in r and r.get("step_time_vs_full") is not None for r in runs.values()):
        _plot_step_time_vs_flops(runs, root / "step_time_vs_flops.png", s)


def _plot_step_time_vs_flops(runs: dict[str, Any], path: Path, s: DemoSettings) -> None:
    """Each run's median step time over full's (same dtype) against its FLOP ratio: the whole step (filled)
    and attention alone (open); on the diagonal a step costs what its FLOPs say."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    ax.plot([0, 1.05], [0, 1.05], color="grey", lw=0.8, ls=":", label="time = FLOPs")
    for k, (v, r) in enumerate((v, r) for v, r in runs.items() if "flop_ratio" in r and r.get("step_time_vs_full")):
        color = f"C{k}"
        ax.plot(r["flop_ratio"]["step"], r["step_time_vs_full"], "o", color=color, label=f"{v}: step")
        ax.plot(r["flop_ratio"]["attention"], r["step_time_vs_full"], "o", mfc="none", color=color)
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, max(1.2, *(r.get("step_time_vs_full") or 0 for r in runs.values())) * 1.05)
    ax.set_xlabel("FLOP ratio to full (filled: whole step, open: attention)")
    ax.set_ylabel("median step time / full's")
    ax.set_title(f"step time against FLOPs at T={s.seq_len}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
