"""The demo's stages: each takes the stage context and returns a small JSON summary (kept in demo.json).

`RUNNERS` maps each stage name of `STAGES` to its function; `anchor.demo.planning` runs them in order.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from anchor_core import flops
from anchor.bench.report import write_bench
from anchor.bench.run import run_bench
from anchor.bench.step import cut_model
from anchor.demo.documents import pack_pieces, pack_windows
from anchor.demo.next_token import print_top5, top5
from anchor.demo.page import save_figure
from anchor.demo.settings import FP32_SUFFIX, DemoSettings, parse_run, run_names, times_full
from anchor.demo.summary import reset_effect
from anchor.eval.runner import checkpoints_of_run, parts_dir, resolve_dtype, run_eval, standard_error, write_eval
from anchor_core.atomic import publish, staging_dir
from anchor_core.data.corpus import write_default_corpus
from anchor_core.data.mixture import MixtureSpec
from anchor_core.data.packed import Loader, PackedData
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.machine import cpu_model
from anchor_core.outdir import read_marker, write_marker
from anchor_core.weights import load_spec, model_identity
from parity_tests.audit.report import write_audit
from parity_tests.audit.runner import run_audit
from parity_tests.report import write_report
from parity_tests.suite import build_cases, run_parity
from torchtrain.training import checkpoint as ckpt
from torchtrain.config import load_train_config
from torchtrain.training.metrics import read_metrics
from torchtrain.training.run_folder import load_run_config
from torchtrain.training.trainer import release_memory, train


@dataclass
class StageContext:
    """What a stage reads: the demo folder, the settings, how to report, and the records of earlier stages."""

    out: Path
    settings: DemoSettings
    progress: bool
    say: Callable[[str], None]
    records: dict[str, Any] = field(default_factory=dict)

    def stage(self, name: str) -> Path:
        return self.out / name


def _container(path: Path) -> None:
    """A stage folder holding several anchor outputs (runs, evaluations): made and marked as the demo's."""
    path.mkdir(parents=True, exist_ok=True)
    if read_marker(path) is None:
        write_marker(path, "demo")


def stage_top5(ctx: StageContext) -> dict[str, Any]:
    s = ctx.settings
    with staging_dir(ctx.stage("top5"), "demo") as tmp:
        result = top5(s.model, s.prompt, s.policy, tmp / "top5")
        publish(tmp / "top5", ctx.stage("top5"), "demo")
    print_top5(result)
    return result


def stage_corpus(ctx: StageContext) -> dict[str, Any]:
    return write_default_corpus(ctx.stage("corpus"), progress=ctx.progress)


def stage_pack(ctx: StageContext) -> dict[str, Any]:
    s = ctx.settings
    if s.pack_docs == "pieces":  # the files cut at their functions and sections: several documents a window
        return pack_pieces(s.model, ctx.stage("corpus"), ctx.stage("pack"), s.seq_len, s.budget, progress=ctx.progress)
    cfg = PackConfig(seq_len=s.seq_len, mixture=MixtureSpec(kind="upsample_long", budget=s.budget,
                                                            long_threshold=s.seq_len))
    stats = pack_corpus(s.model, ctx.stage("corpus") / "corpus.jsonl", ctx.stage("pack"), cfg, progress=ctx.progress)
    return {**{k: stats[k] for k in ("windows", "tokens", "documents", "seq_len") if k in stats},
            **pack_windows(ctx.stage("pack"))}


def stage_audit(ctx: StageContext) -> dict[str, Any]:
    result = run_audit(ctx.settings.model, data=str(ctx.stage("corpus") / "corpus.jsonl"), quick=True,
                       progress=ctx.progress)
    write_audit(result, ctx.stage("audit"))
    return {"runtime_s": result.get("runtime_s"), "policies": sorted(result.get("shift_curve", {}))}


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


def stage_train(ctx: StageContext) -> dict[str, Any]:
    """One run per variant on the packed windows, then the float32 runs (resumed where a killed demo left them)."""
    s = ctx.settings
    root = ctx.stage("train")
    _container(root)
    runs: dict[str, Any] = {}
    names = run_names(s)
    device = device_name()
    for i, v in enumerate(names, 1):
        r = parse_run(s, v)
        ctx.say(f"    run {i}/{len(names)}: {v}: variant {r['variant']}, {r['steps']} steps of "
                f"{s.global_batch} x {s.seq_len} slots, {r['dtype']}, engine {s.train_engine}")
        cfg = load_train_config(None, _train_overrides(s, ctx.stage("pack").resolve(), v))
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
                   "flop_ratio": flop_ratios(ctx.stage("pack"), s.model, r["variant"], r["steps"], s.global_batch,
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


def _time_full(ctx: StageContext) -> dict[str, Any]:
    """`full` for `timing_steps` steps on the same windows, dtype, engine and machine as the part's runs, no
    evaluation checkpoint (resumed like them): its median step time after the first."""
    s = ctx.settings
    cfg = load_train_config(None, _train_overrides(replace(s, train_steps=s.timing_steps, eval_window=0),
                                                   ctx.stage("pack").resolve(), "full"))
    folder = ctx.stage("train") / TIMING_RUN
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


def stage_parity(ctx: StageContext) -> dict[str, Any]:
    """The trained checkpoint forward (whole model, fp32 and bf16) and its gradients and AdamW steps (fp32,
    on its first `parity_grad_layers` layers: the gradient cases of a 135M model hold some twenty copies of
    its parameters in fp64, 22 GB)."""
    import tempfile


    s = ctx.settings
    # anchor's checkpoint, else the first run this folder trained (a part, `--runs`, may hold any of them)
    trained = ctx.records["train"]["summary"]["runs"]
    main = [v for v in trained if not v.endswith(FP32_SUFFIX)]
    first = "anchor" if "anchor" in trained else (main or list(trained))[0]
    rel = f"train/{trained[first]['last_checkpoint']}"
    model = str((ctx.out / rel).resolve())
    T = s.parity_seq_len
    trained_dtype = trained[first].get("dtype", s.train_dtype)
    own = "bf16" if trained_dtype == "bfloat16" else "fp32"  # the checkpoint is held in the dtype it trained in, too
    policies = list(s.parity_policies) + ([own] if own not in s.parity_policies else [])
    cases = build_cases(model, variants=["full", "anchor"], layouts=["plain"], policies=policies,
                        engines=["sdpa"], seq_lens=[T])
    result = run_parity(cases, progress=ctx.progress)
    layers = load_spec(model).num_layers
    cut = min(s.parity_grad_layers or layers, layers)
    label = rel if cut == layers else f"{rel} (first {cut} of {layers} layers)"
    with tempfile.TemporaryDirectory(prefix=".parity-model-", dir=ctx.out) as tmp:
        grad_model = model if cut == layers else str(cut_model(model, cut, T, Path(tmp) / "model")[0])
        grad = run_parity(build_cases(grad_model, variants=["full", "anchor"], layouts=["plain"], policies=["fp32"],
                                      engines=["sdpa"], seq_lens=[T]), progress=ctx.progress, grads=True)
    for c in grad["cases"] + grad["grad_cases"]:
        c["id"] = c["id"].replace(grad_model, label)
    for c in result["cases"]:
        c["id"] = c["id"].replace(model, rel)
    result["cases"] += [c for c in grad["cases"] if grad_model != model]
    result.update(grad_cases=grad["grad_cases"], optimizer=grad["optimizer"], model=model, grad_model=label,
                  runtime_s=round(result["runtime_s"] + grad["runtime_s"], 2),
                  **{"pass": bool(result["pass"] and grad["pass"])})
    write_report(result, ctx.stage("parity"))
    grads = result["grad_cases"]
    return {"model": rel, "grad_model": label, "trained_dtype": trained_dtype, "policies": policies,
            "cases": len(result["cases"]),
            "passed": sum(c["pass"] for c in result["cases"]), "grad_cases": len(grads),
            "grad_passed": sum(c["pass"] for c in grads), "pass": bool(result["pass"]),
            "ids": [[c["id"], bool(c["pass"])] for c in result["cases"] + grads]}


def _run_scores(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per length: the task-averaged score of each checkpoint, then mean and std over checkpoints, and the
    standard error over samples of that mean (`se`: each (task, sample)'s score averaged over the checkpoints,
    which read the same prompts; None where eval.json has no per-sample scores)."""
    out = {}
    for L in result["settings"]["lengths"]:
        per_ckpt: dict[str, list[float]] = {}
        units: dict[str, list[list[float]]] = {}  # task -> per checkpoint, the samples' scores
        for r in result["rows"]:
            if r["length"] == L:
                per_ckpt.setdefault(r["checkpoint"], []).append(r["score"])
                units.setdefault(r["task"], []).append(r.get("sample_scores"))
        vals = [float(np.mean(v)) for v in per_ckpt.values()]
        se = None
        if all(x is not None for xs in units.values() for x in xs):
            pooled = [m for xs in units.values() for m in np.mean(np.asarray(xs, dtype=np.float64), axis=0)]
            se = standard_error(pooled)
        out[L] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                  "se": se, "checkpoints": len(vals)}
    return out


def _bucket_means(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per length: the held-out NLL of each position bucket, mean and std over the checkpoints."""
    out: dict[str, list[dict[str, Any]]] = {}
    for L in result["settings"]["lengths"]:
        rows = [r for r in result["perplexity"] if r["length"] == L and r.get("buckets")]
        if not rows:
            continue
        spans = sorted({(b["start"], b["end"]) for r in rows for b in r["buckets"]})
        cells = []
        for a, e in spans:
            vals = [b["nll"] for r in rows for b in r["buckets"] if (b["start"], b["end"]) == (a, e)]
            cells.append({"start": a, "end": e, "nll": float(np.mean(vals)),
                          "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, "checkpoints": len(vals),
                          "tokens": int(sum(b["tokens"] for r in rows for b in r["buckets"]
                                            if (b["start"], b["end"]) == (a, e)) // len(vals))})
        out[str(L)] = cells
    return out


def _finished_eval(folder: Path, s: DemoSettings, sources: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The evaluation a stopped demo published for one run (`eval.json`, written whole by write_eval), when
    it evaluated these checkpoints with these settings; None otherwise (it is then run again).

    Only read when the stage resumes, i.e. its fingerprint (settings and the training it reads) is the
    unfinished stage's: within a run, finished checkpoints come back from their parts (`run_eval(parts=...)`)."""
    if read_marker(folder) is None:
        return None
    try:
        r = json.loads((folder / "eval.json").read_text(encoding="utf-8"))
        got = r["settings"]
        same = ([c["label"] for c in r["checkpoints"]] == [lb for lb, _ in sources]
                and [c["source"] for c in r["checkpoints"]] == [str(src) for _, src in sources]
                and got["tasks"] == list(s.eval_tasks) and got["lengths"] == list(s.eval_lengths)
                and got["samples"] == s.eval_samples and got["seed"] == s.seed and got["dtype"] == resolve_dtype(s.eval_dtype)
                and got["engine"] == s.eval_engine
                and got["perplexity_windows"] == s.perplexity_windows and got["batch_size"] == s.eval_batch_size
                and got.get("group_by_budget", False) == s.eval_group_by_budget
                and got.get("perplexity_docs") == s.perplexity_docs
                and got.get("perplexity_bucket") == s.perplexity_bucket
                and got.get("perplexity_data") == (s.perplexity_data or "stdlib test suites"))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return r if same else None


def stage_eval(ctx: StageContext) -> dict[str, Any]:
    s = ctx.settings
    root = ctx.stage("eval")
    _container(root)
    runs: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    names = run_names(s)
    for i, v in enumerate(names, 1):
        sources = checkpoints_of_run(ctx.stage("train") / v)
        result = _finished_eval(root / v, s, sources)
        if result is not None:
            ctx.say(f"    run {i}/{len(names)}: {v}: evaluated before the demo stopped, reused")
        else:
            ctx.say(f"    run {i}/{len(names)}: {v}, checkpoints {', '.join(lb for lb, _ in sources)}")
            release_memory()
            result = run_eval(sources, tasks=list(s.eval_tasks), lengths=list(s.eval_lengths),
                              samples=s.eval_samples, seed=s.seed, dtype=s.eval_dtype, engine=s.eval_engine,
                              batch_size=s.eval_batch_size, perplexity_windows=s.perplexity_windows,
                              perplexity_docs=s.perplexity_docs, perplexity_bucket=s.perplexity_bucket,
                              perplexity_data=s.perplexity_data or None,
                              group_by_budget=s.eval_group_by_budget, progress=ctx.progress,
                              parts=parts_dir(root / v))  # a stopped demo resumes at the checkpoint
            write_eval(result, root / v)
        choice = result.get("dtype_choice") or {"dtype": result["settings"]["dtype"]}
        ppl: dict[int, list[float]] = {}
        nll: dict[int, list[float]] = {}
        for r in result["perplexity"]:
            ppl.setdefault(r["length"], []).append(r["ppl"])
            nll.setdefault(r["length"], []).append(r["nll"])
        runs[v] = {"checkpoints": [c["label"] for c in result["checkpoints"]],
                   "scores": {str(L): x for L, x in _run_scores(result).items()},
                   "tasks": [{k: r.get(k) for k in ("task", "length", "mean", "std", "se")} for r in result["summary"]],
                   "perplexity": {str(L): float(np.mean(p)) for L, p in ppl.items()},
                   "nll": {str(L): float(np.mean(p)) for L, p in nll.items()},
                   "buckets": _bucket_means(result),
                   "runtime_s": result["runtime_s"]}
    eval_figures(runs, root, s)
    out = {"runs": runs, "tasks": list(s.eval_tasks), "lengths": list(s.eval_lengths), "samples": s.eval_samples,
           "dtype": choice.get("dtype", s.eval_dtype), "dtype_choice": choice, "engine": s.eval_engine,
           "perplexity_docs": s.perplexity_docs, "perplexity_windows": s.perplexity_windows,
           "perplexity_bucket": s.perplexity_bucket}
    train = (ctx.records.get("train") or {}).get("summary")
    if train and s.fp32_variants:
        out["reset"] = reset_effect(train["runs"], runs)
    return out


def eval_figures(runs: dict[str, Any], root: Path, s: DemoSettings) -> None:
    """`ruler.png` (each run's task mean per length, ± std over checkpoints) and, where the held-out NLL has
    position buckets, `position_loss.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for v, r in runs.items():
        Ls = [int(L) for L in r["scores"]]
        ax.errorbar(Ls, [r["scores"][str(L)]["mean"] for L in Ls], yerr=[r["scores"][str(L)]["std"] for L in Ls],
                    marker="o", capsize=3, ls="--" if v.endswith("@fp32") else "-", label=v)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(s.eval_lengths), [str(L) for L in s.eval_lengths])
    ax.set_ylim(-5, 105)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score (mean of tasks)")
    ax.set_title(f"RULER ({', '.join(s.eval_tasks)}), mean ± std over checkpoints", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, root / "ruler.png")
    plt.close(fig)
    if any(r["buckets"] for r in runs.values()):
        _plot_position_loss(runs, root / "position_loss.png")


def _plot_position_loss(runs: dict[str, Any], path: Path) -> None:
    """Held-out NLL by position bucket at the longest length (mean over checkpoints), and each run's
    difference to full's (the run named `full`, else none)."""
    import matplotlib.pyplot as plt

    L = max(int(x) for r in runs.values() for x in r["buckets"])
    both = ("full" in runs and str(L) in runs["full"]["buckets"]
            and any(v != "full" and not v.endswith(FP32_SUFFIX) and str(L) in r["buckets"] for v, r in runs.items()))
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(11 if both else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    for v, r in runs.items():
        cells = r["buckets"].get(str(L))
        if cells:
            mid = [(c["start"] + c["end"]) / 2 for c in cells]
            ax.errorbar(mid, [c["nll"] for c in cells], yerr=[c["std"] for c in cells], marker="o", ms=3, capsize=2,
                        ls="--" if v.endswith("@fp32") else "-", label=v)
    ax.set_xlabel("position in the held-out document (bucket middle)")
    ax.set_ylabel("NLL (nats per token)")
    ax.set_title(f"held-out loss by position at {L}, mean ± std over checkpoints", fontsize=9)
    ax.legend(fontsize=7)
    if both:
        ax = axes[0][1]
        base = {(c["start"], c["end"]): c["nll"] for c in runs["full"]["buckets"][str(L)]}
        ax.axhline(0, color="grey", lw=0.8)
        for v, r in runs.items():
            cells = [c for c in r["buckets"].get(str(L), []) if (c["start"], c["end"]) in base]
            if v != "full" and not v.endswith("@fp32") and cells:  # full's dtype only
                ax.plot([(c["start"] + c["end"]) / 2 for c in cells],
                        [c["nll"] - base[(c["start"], c["end"])] for c in cells], marker="o", ms=3,
                        ls="--" if v.endswith("@fp32") else "-", label=v)
        ax.set_xlabel("position in the held-out document (bucket middle)")
        ax.set_ylabel("NLL − full's NLL")
        ax.set_title("against full attention (below 0: better)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def stage_bench(ctx: StageContext) -> dict[str, Any]:
    s = ctx.settings
    result = run_bench(model=s.model, seq_lens=list(s.bench_seq_lens), variants=["full", "anchor"],
                       distributions=["corpus"], data=str(ctx.stage("corpus") / "corpus.jsonl"),
                       windows=s.bench_windows, repeats=s.bench_repeats, step=False, seed=s.seed,
                       progress=ctx.progress)
    write_bench(result, ctx.stage("bench"))
    rows = [{k: r.get(k) for k in ("engine", "variant", "seq_len", "ms", "flop_ratio", "time_ratio")}
            for r in result["attention"]]
    paper = [{k: e.get(k) for k in ("model", "seq_len", "gpus", "variant", "distribution", "days_per_1b_tokens",
                                    "saving_vs_full")} for e in result["estimate"] if e.get("saving_vs_full") is not None]
    return {"attention": rows, "estimate": paper, "machine": result["machine"].get("cpu"),
            "runtime_s": result["runtime_s"]}


RUNNERS: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "top5": stage_top5, "corpus": stage_corpus, "pack": stage_pack, "audit": stage_audit, "train": stage_train,
    "parity": stage_parity, "eval": stage_eval, "bench": stage_bench}
