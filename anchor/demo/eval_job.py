"""The demo's `eval` job: RULER and held-out perplexity on every run, averaged over its evaluation checkpoints.

Each run's checkpoints are evaluated with `anchor eval` (an evaluation a stopped demo already published with
the same settings is reused: `_finished_eval`), and summarised per length: the task-averaged score with its
spread over checkpoints and its standard error over samples (`_run_scores`), perplexity and NLL, and the NLL
per position bucket (`_bucket_means`). `eval_figures` draws the RULER scores and the loss by position; with
float32 runs beside the main ones, the summary also holds the reset comparison (`reset_effect`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from anchor.demo.figures import save_figure
from anchor.demo.job_context import JobContext, _container
from anchor.demo.settings import FP32_SUFFIX, DemoSettings, run_names
from anchor.demo.summary import reset_effect
from anchor.eval.runner import checkpoints_of_run, parts_dir, resolve_dtype, run_eval, standard_error, write_eval
from anchor_core.outdir import read_marker
from torchtrain.training.trainer import release_memory


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

    Only read when the job resumes, i.e. its fingerprint (settings and the training it reads) is the
    unfinished job's: within a run, finished checkpoints come back from their parts (`run_eval(parts=...)`)."""
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


def job_eval(ctx: JobContext) -> dict[str, Any]:
    s = ctx.settings
    root = ctx.folder("eval")
    _container(root)
    runs: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    names = run_names(s)
    for i, v in enumerate(names, 1):
        sources = checkpoints_of_run(ctx.folder("train") / v)
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
