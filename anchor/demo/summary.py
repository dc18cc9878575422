"""The profile's summary JSON (`settings.summary_json`, e.g. `paper_gpu.json`) and the reset comparison.

`write_summary(out, record, settings)` gathers, once `train` and `eval` are done, what a result file in
`results/gpu/` keeps: the machine, the seconds, and per run its training (variant, dtype, engine,
steps, losses, step times, step time over full's beside its FLOP ratio) and per evaluation checkpoint its
RULER score per task and length with the standard error over samples, the task mean per length with its
standard error (pooled over the tasks' samples), and the held-out NLL per length with its position buckets;
then the same averaged over the checkpoints; and `reset_effect`. Beside it, `summary_markdown`'s tables (the
same name, `.md`): what the README shows of the result.

`reset_effect(train_runs, eval_runs)`: intra_doc_reset against intra_doc in each dtype the demo trained
both in (the main runs, and the `@fp32` ones): the training loss difference per step over the steps both
pairs trained (same seed, same windows, same learning rates there), the difference of RULER and of the
held-out NLL (mean over each run's evaluation checkpoints) and, where both dtypes are there, how many times
larger the bf16 difference is than the fp32 one. In exact arithmetic resetting positions inside an
intra-document mask changes nothing (RoPE is relative); fp32 keeps that to rounding, bf16 does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from anchor.demo.page import num, score_cell
from anchor.demo.settings import FP32_SUFFIX, PAPER_GPU_ROPE_THETA, PAPER_ROPE_THETA, DemoSettings
from anchor.eval.runner import standard_error
from anchor_core.atomic import write_text_atomic
from anchor_core.machine import machine

PAIR = ("intra_doc", "intra_doc_reset")


def _diffs(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: float(b[k] - a[k]) for k in a if k in b}


def reset_effect(train_runs: dict[str, Any], eval_runs: dict[str, Any]) -> dict[str, Any]:
    """intra_doc_reset − intra_doc per dtype (module docstring); {"pairs": []} when no pair was trained."""
    pairs = [(f"{PAIR[0]}{x}", f"{PAIR[1]}{x}") for x in ("", FP32_SUFFIX)
             if f"{PAIR[0]}{x}" in train_runs and f"{PAIR[1]}{x}" in train_runs]
    out: dict[str, Any] = {"what": "intra_doc_reset minus intra_doc, per dtype: training loss per step over the "
                                   "steps both dtypes trained, RULER and held-out NLL averaged over each run's "
                                   "evaluation checkpoints", "pairs": []}
    if not pairs:
        return out
    common = min(len(train_runs[x]["loss"]) for p in pairs for x in p)
    out["steps_compared"] = common
    for a, b in pairs:
        ta, tb = train_runs[a], train_runs[b]
        d = np.asarray(tb["loss"][:common], dtype=np.float64) - np.asarray(ta["loss"][:common], dtype=np.float64)
        n = min(len(ta["loss"]), len(tb["loss"]))
        d_all = np.asarray(tb["loss"][:n], dtype=np.float64) - np.asarray(ta["loss"][:n], dtype=np.float64)
        entry: dict[str, Any] = {
            "runs": [a, b], "dtype": ta.get("dtype", "float32" if a.endswith(FP32_SUFFIX) else None),
            "loss_diff": {"steps": common, "mean_abs": float(np.mean(np.abs(d))), "max_abs": float(np.max(np.abs(d))),
                          "mean": float(np.mean(d)), "per_step": [float(x) for x in d]},
            "loss_diff_all_steps": {"steps": n, "mean_abs": float(np.mean(np.abs(d_all))), "mean": float(np.mean(d_all)),
                                    "last": float(d_all[-1])}}
        ea, eb = eval_runs.get(a), eval_runs.get(b)
        if ea and eb:
            entry["ruler_diff"] = _diffs({L: x["mean"] for L, x in ea["scores"].items()},
                                         {L: x["mean"] for L, x in eb["scores"].items()})
            entry["ruler_se"] = {L: [ea["scores"][L].get("se"), eb["scores"][L].get("se")] for L in ea["scores"]
                                 if L in eb["scores"]}
            entry["heldout_nll_diff"] = _diffs(ea.get("nll", {}), eb.get("nll", {}))
            entry["bucket_nll_diff"] = {
                L: [{"start": x["start"], "end": x["end"], "diff": float(y["nll"] - x["nll"])}
                    for x, y in zip(cells, eb["buckets"][L]) if (x["start"], x["end"]) == (y["start"], y["end"])]
                for L, cells in ea.get("buckets", {}).items() if L in eb.get("buckets", {})}
            entry["checkpoints"] = {a: ea["checkpoints"], b: eb["checkpoints"]}
        out["pairs"].append(entry)
    by = {e["dtype"]: e for e in out["pairs"]}
    if "bfloat16" in by and "float32" in by:
        bf, fp = by["bfloat16"]["loss_diff"]["mean_abs"], by["float32"]["loss_diff"]["mean_abs"]
        out["bf16_over_fp32_loss_diff"] = bf / fp if fp > 0 else None
        out["size"] = (f"mean |loss difference| over the first {common} steps: bf16 {bf:.3g}, fp32 {fp:.3g}"
                       + (f" ({bf / fp:.3g}x)" if fp > 0 else " (fp32: none at all)"))
    return out


def _checkpoint_details(result: dict[str, Any], label: str) -> dict[str, Any]:
    """One evaluation checkpoint of eval.json: RULER per task and length (score, se, n), the task mean per
    length with the standard error over the pooled samples, the held-out NLL per length with its buckets."""
    rows = [r for r in result["rows"] if r["checkpoint"] == label]
    ruler: dict[str, dict[str, Any]] = {}
    mean: dict[str, dict[str, Any]] = {}
    for L in result["settings"]["lengths"]:
        mine = [r for r in rows if r["length"] == L]
        for r in mine:
            ruler.setdefault(r["task"], {})[str(L)] = {"score": r["score"], "se": r.get("se"), "n": r["samples"]}
        pooled = [x for r in mine for x in (r.get("sample_scores") or [])]
        complete = all(r.get("sample_scores") is not None for r in mine)
        mean[str(L)] = {"score": float(np.mean([r["score"] for r in mine])) if mine else None,
                        "se": standard_error(pooled) if complete and pooled else None, "n": len(pooled)}
    heldout = {str(r["length"]): {k: r.get(k) for k in ("nll", "ppl", "tokens", "windows", "bucket", "buckets")}
               for r in result["perplexity"] if r["checkpoint"] == label}
    return {"ruler": ruler, "ruler_mean_of_tasks": mean, "heldout": heldout}


def job_seconds_all_attempts(jobs: dict[str, Any]) -> dict[str, float]:
    """Each finished job's seconds over all its attempts (pipeline: the attempts a signal stopped, then the
    one that finished)."""
    return {st: rec.get("seconds_all_attempts", rec.get("seconds")) or 0.0 for st, rec in jobs.items()
            if rec.get("done")}


def build_summary(out: Path, record: dict[str, Any], s: DemoSettings) -> dict[str, Any]:
    """The summary JSON's content from the demo record and each run's eval.json (module docstring)."""
    jobs = record["jobs"]
    train, ev = jobs["train"]["summary"], jobs["eval"]["summary"]
    runs: dict[str, Any] = {}
    for v, t in train["runs"].items():
        e = ev["runs"].get(v) or {}
        try:
            result = json.loads((out / "eval" / v / "eval.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            result = None
        keep = ("variant", "dtype", "engine", "steps", "loss_first", "loss_last", "step_s_median", "tokens_per_s_median",
                "step_time_vs_full", "flop_ratio", "elapsed_s", "eval_checkpoints", "busy", "load_average", "loss",
                "step_s", "device", "part", "step_time_vs_full_why", "full_timing")
        runs[v] = {k: t.get(k) for k in keep}
        runs[v]["checkpoints"] = ({lb: _checkpoint_details(result, lb) for lb in e.get("checkpoints", [])}
                                  if result else {})
        runs[v]["mean_over_checkpoints"] = {
            "ruler_mean_of_tasks": e.get("scores"), "ruler_tasks": e.get("tasks"), "heldout_nll": e.get("nll"),
            "perplexity": e.get("perplexity"), "buckets": e.get("buckets")}
    job_s = {st: rec.get("seconds") for st, rec in jobs.items() if rec.get("done")}
    all_s = job_seconds_all_attempts(jobs)
    parts = record.get("merged_from") or []
    return {
        "what": ("`anchor demo` with these settings: per run its training (step times against full's beside the "
                 "FLOP ratio of its mask on the same windows) and, per evaluation checkpoint, RULER per task and "
                 "length with the standard error over samples and the held-out NLL by position bucket; then the "
                 "means over the checkpoints and the reset comparison (anchor/demo/summary.py)"),
        "model": record["model"], "settings": record["settings"], "left_out": record.get("left_out", []),
        "rope": {"theta": s.train_rope_theta, "seq_len": s.seq_len, "paper_rule": {str(k): v for k, v in PAPER_ROPE_THETA.items()},
                 "paper_gpu_16k": PAPER_GPU_ROPE_THETA},
        # a merged folder (anchor/demo/merge.py): the first part's machine, every part's in `parts`
        "machine": record["merged_from"][0]["machine"] if record.get("merged_from") else machine(),
        "parts": record.get("merged_from"),
        "seconds": {"this_invocation": record.get("seconds"), "jobs_last_attempt": job_s,
                    "jobs_total": round(sum(x for x in job_s.values() if x), 1),
                    # with the attempts a signal stopped (a part resumed after `timeout`); a merge: every part's
                    # jobs, corpus and packing included (each part ran them on its machine)
                    "jobs_all_attempts": all_s,
                    "on_machines": round(sum(p.get("jobs_s_all_attempts") or 0 for p in parts), 1) if parts
                    else round(sum(all_s.values()), 1),
                    "train_runs": {v: t.get("elapsed_s") for v, t in train["runs"].items()},
                    "eval_runs": {v: e.get("runtime_s") for v, e in ev["runs"].items()}},
        "ruler": {"tasks": ev.get("tasks"), "lengths": ev.get("lengths"), "samples": ev.get("samples"),
                  "dtype": ev.get("dtype"), "engine": ev.get("engine"),
                  "se_bound_of_task_mean": 50.0 / np.sqrt(len(ev.get("tasks") or [1]) * max(1, ev.get("samples") or 1))},
        "heldout": {"docs": ev.get("perplexity_docs"), "windows": ev.get("perplexity_windows"),
                    "bucket": ev.get("perplexity_bucket")},
        "runs": runs,
        "reset_effect": ev.get("reset") or reset_effect(train["runs"], ev["runs"]),
    }


def _md_table(header: list[str], rows: list[list[Any]]) -> str:
    return "\n".join(["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(map(str, r)) + " |" for r in rows)])


def summary_markdown(summary: dict[str, Any], figure: str | None = None) -> str:
    """The summary's tables in Markdown, for the README (`<summary_json>.md` beside the JSON): RULER per run and
    length, the held-out NLL at the longest length and by position bucket there, the step time against full's
    beside the FLOP ratio, and the reset comparison with its size; `figure`: the position-bucket plot's path."""
    runs, ruler = summary["runs"], summary["ruler"]
    Ls = [str(L) for L in ruler.get("lengths") or []]
    longest = Ls[-1] if Ls else None
    parts = summary.get("parts") or []
    devices = sorted({d for p in parts for d in p.get("devices", [])}
                     or {r.get("device") for r in runs.values() if r.get("device")})
    secs = (summary.get("seconds") or {}).get("on_machines")
    lines = [f"`{summary.get('model')}`, windows of {summary['rope']['seq_len']} tokens, RoPE base "
             f"{summary['rope']['theta']:g}; on {', '.join(devices) or '?'}"
             + (f" in {len(parts)} parts" if parts else "") + (f", {secs / 60:.1f} minutes there (every job and attempt)" if secs else "")
             + ". RULER " + ", ".join(ruler.get("tasks") or []) + f", {ruler.get('samples')} samples a task and "
             "length: the mean of the tasks, mean ± std over each run's evaluation checkpoints, (SE) the "
             "standard error over samples. Held-out NLL: nats per token on documents no run saw.", ""]
    rows = []
    for v, r in runs.items():
        m = r.get("mean_over_checkpoints") or {}
        sc = m.get("ruler_mean_of_tasks") or {}
        rows.append([v, r.get("dtype") or "—", *[score_cell(sc[L]) if sc.get(L) else "—" for L in Ls],
                     num((m.get("heldout_nll") or {}).get(longest), ".3f"),
                     num(r.get("step_time_vs_full"), ".2f"),
                     *[num((r.get("flop_ratio") or {}).get(k), ".2f") for k in ("step", "attention")]])
    lines += [_md_table(["run", "dtype", *[f"RULER {L}" for L in Ls], f"NLL {longest}", "step time / full",
                         "FLOPs / full: step", "attention"], rows), ""]
    spans = sorted({(c["start"], c["end"]) for r in runs.values()
                    for c in ((r.get("mean_over_checkpoints") or {}).get("buckets") or {}).get(longest, [])})
    if spans:
        lines += [f"Held-out NLL by position at {longest} (mean ± std over checkpoints):", ""]
        rows = []
        for v, r in runs.items():
            by = {(c["start"], c["end"]): c for c in ((r.get("mean_over_checkpoints") or {}).get("buckets")
                                                     or {}).get(longest, [])}
            rows.append([v, *[f"{by[k]['nll']:.3f} ± {by[k]['std']:.3f}" if k in by else "—" for k in spans]])
        lines += [_md_table(["run", *[f"{a}–{e}" for a, e in spans]], rows), ""]
    if figure:
        lines += [f"![held-out loss by position]({figure})", ""]
    reset = summary.get("reset_effect") or {}
    if reset.get("pairs"):
        lines += [f"The reset, intra_doc_reset − intra_doc (training loss over the first {reset.get('steps_compared')} "
                  "steps, same windows; RULER and NLL averaged over the checkpoints, with each run's standard "
                  "errors):", ""]
        rows = []
        for e in reset["pairs"]:
            ld, se = e["loss_diff"], e.get("ruler_se") or {}
            rows.append([e.get("dtype"), f"{ld['mean_abs']:.3g}", f"{ld['max_abs']:.3g}",
                         *[num((e.get("ruler_diff") or {}).get(L), "+.1f")
                           + (f" (SE {se[L][0]:.1f}, {se[L][1]:.1f})" if L in se and None not in se[L] else "")
                           for L in Ls],
                         num((e.get("heldout_nll_diff") or {}).get(longest), "+.3g")])
        lines += [_md_table(["dtype", "mean abs Δ loss", "max abs Δ loss", *[f"Δ RULER {L}" for L in Ls],
                             f"Δ NLL {longest}"], rows), ""]
        if reset.get("size"):
            lines += [reset["size"] + ".", ""]
    return "\n".join(lines)


def write_summary(out: Path, record: dict[str, Any], s: DemoSettings) -> Path | None:
    """`out/<settings.summary_json>` and its tables in Markdown beside it (`summary_markdown`: `.md`) when the
    profile names one and `train` and `eval` are done (else None)."""
    if not s.summary_json:
        return None
    jobs = record["jobs"]
    if not all(jobs.get(st, {}).get("done") for st in ("train", "eval")):
        return None
    path = out / s.summary_json
    summary = build_summary(out, record, s)
    write_text_atomic(path, json.dumps(summary, indent=1, ensure_ascii=False, default=str) + "\n")
    # for the README: the figure where `make paper-gpu` copies it (eval/position_loss.png)
    figure = f"results/gpu/{Path(s.summary_json).stem}_position_loss.png"
    write_text_atomic(path.with_suffix(".md"), summary_markdown(summary, figure))
    return path
