"""Issue 15, Acceptance 3: our RULER against lm-evaluation-harness's own RULER tasks, same model and lengths.

    .venv/bin/python experiments/ruler_crosscheck/ruler_crosscheck.py [--name cpu] [--model default] [--samples 10]
        [--lengths 1024,2048] [--tasks ...] [--dtype float32] [--threads N] [--note TEXT] [--rescore]

Writes results/ruler_crosscheck_<name>.json beside it with the machine and every sample's prediction.

Both sides decode the same model greedily through `anchor.eval.generate.greedy_generate` (our RULER
via `anchor.eval.runner.run_eval`; lm-eval's tasks via `anchor.eval.harness.run_harness`, whose LM
wrapper runs the same call), with the same first token (BOS), dtype and engine; only the prompts
differ (each side generates its own: other keys, values and haystack lengths, and lm-eval's cwe
leaves out upstream's one-shot example), so the scores agree only up to sampling error.

Per task × length: both scores (0-100), the prompt lengths (tokens the model read, BOS included), the
binomial standard error of each, se = 100 sqrt(p (1 - p) / n), and
`agree` = |ours - harness| <= 2 sqrt(se_ours^2 + se_harness^2). (For cwe and fwe a sample scores the
fraction of its 10 or 3 words found; the binomial error is an upper bound on the standard error of
such a mean; beside the rule, for information, each cell also carries the empirical standard error of
the per-sample scores and `agree_emp`, the same rule with it.)

`--rescore` recomputes the comparison of a written result from its stored predictions (no model runs).

The work runs per length, ours then lm-eval's, and each part is kept in
`results/ruler_crosscheck_<name>.partial.json` as it finishes: a run stopped on a loaded
machine resumes from there with the same arguments (the partial file is removed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository

from anchor.eval import scoring  # noqa: E402
from anchor.eval.harness import HARNESS_RULER, binomial_se, run_harness  # noqa: E402
from anchor.eval.runner import run_eval  # noqa: E402
from anchor_core.machine import machine  # noqa: E402

TASKS = ("niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe")


def _part(side: str, args: argparse.Namespace, tasks: list[str], L: int) -> dict:
    """One side at one length: its rows and samples (the fields the comparison reads) and its runtime."""
    sources = [(args.model, args.model)]
    t0 = time.time()
    if side == "ours":
        res = run_eval(sources, tasks=tasks, lengths=[L], samples=args.samples, engine=args.engine,
                       dtype=args.dtype, batch_size=args.batch_size, perplexity_windows=0, progress=True)
        samples = [{"task": s["task"], "length": s["length"], "index": s["index"], "prompt_tokens": s["prompt_tokens"],
                    "answers": s["answers"], "prediction": s["prediction"]} for s in res["samples"]]
        version = None
    else:
        res = run_harness(sources, tasks=tasks, lengths=[L], limit=args.samples, engine=args.engine,
                          dtype=args.dtype, batch_size=args.batch_size, progress=True)
        samples = [{k: s[k] for k in ("task", "length", "index", "prompt_tokens", "answers", "prediction", "score")}
                   for s in res["samples"]]
        version = res["version"]
    return {"rows": res["rows"], "samples": samples, "runtime_s": round(time.time() - t0, 1), "version": version}


EMPIRICAL_NOTE = ("beside the rule, for information: se_emp = std of the per-sample scores (ddof 1) / sqrt(n), "
                  "the standard error of a mean of fractions (cwe, fwe, vt score each sample's fraction of its "
                  "words found), and agree_emp = |diff| <= 2 sqrt(se_emp_ours^2 + se_emp_harness^2)")


def compare(per_sample: list[dict], tasks: list[str], lengths: list[int],
            rows: dict[tuple[str, str, int], float] | None = None) -> list[dict]:
    """Per task × length: both scores from the per-sample predictions (RULER's string_match_all, which
    lm-eval's equals for these tasks; checked against each side's own row score when `rows` is given),
    their binomial and empirical standard errors, and the agreement rule (module docstring)."""
    cells = []
    for t in tasks:
        for L in lengths:
            sides = {}
            for side in ("ours", "harness"):
                ss = [x for x in per_sample if (x["side"], x["task"], x["length"]) == (side, t, L)]
                per = [scoring.score(t, [x["prediction"]], [x["answers"]]) for x in ss]
                mean = round(sum(per) / len(per), 2)
                if rows is not None and abs(mean - rows[(side, t, L)]) > 0.01:
                    raise AssertionError(f"{side} {t} {L}: rescored {mean} != its run's {rows[(side, t, L)]}")
                emp = statistics.stdev(per) / math.sqrt(len(per)) if len(per) > 1 else float("nan")
                sides[side] = (mean, len(per), emp, [x["prompt_tokens"] for x in ss])
            (a, na, ea, ta), (b, nb, eb, tb) = sides["ours"], sides["harness"]
            se_a, se_b = binomial_se(a, na), binomial_se(b, nb)
            tol, tol_emp, diff = 2.0 * math.hypot(se_a, se_b), 2.0 * math.hypot(ea, eb), a - b
            cells.append({"task": t, "harness_task": HARNESS_RULER[t], "length": L,
                          "ours": a, "ours_se": round(se_a, 2), "ours_samples": na,
                          "harness": b, "harness_se": round(se_b, 2), "harness_samples": nb,
                          "diff": round(diff, 2), "tolerance": round(tol, 2), "agree": abs(diff) <= tol + 1e-9,
                          "ours_se_emp": round(ea, 2), "harness_se_emp": round(eb, 2),
                          "tolerance_emp": round(tol_emp, 2), "agree_emp": abs(diff) <= tol_emp + 1e-9,
                          "ours_prompt_tokens": [min(ta), max(ta)], "harness_prompt_tokens": [min(tb), max(tb)]})
    return cells


def _print(cells: list[dict]) -> None:
    print(f"{'task':16s} {'len':>5s} {'ours':>12s} {'lm-eval':>12s} {'diff':>7s} {'tol':>6s} agree  "
          f"{'tol_emp':>7s} agree_emp  prompt tokens")
    for c in cells:
        print(f"{c['task']:16s} {c['length']:5d} {c['ours']:6.1f} ±{c['ours_se']:4.1f} {c['harness']:6.1f} "
              f"±{c['harness_se']:4.1f} {c['diff']:7.1f} {c['tolerance']:6.1f} {str(c['agree']):5s}  "
              f"{c['tolerance_emp']:7.1f} {str(c['agree_emp']):9s}  {c['ours_prompt_tokens']} vs {c['harness_prompt_tokens']}")


def rescore(out: Path) -> None:
    """Recompute the cells of a written result from its samples_detail (no model runs)."""
    result = json.loads(out.read_text())
    rows = {(side, c["task"], c["length"]): c[side] for c in result["cells"] for side in ("ours", "harness")}
    result["cells"] = compare(result["samples_detail"], result["tasks"], result["lengths"], rows)
    result["all_agree"] = all(c["agree"] for c in result["cells"])
    result["empirical_se"] = EMPIRICAL_NOTE
    _print(result["cells"])
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"all agree: {result['all_agree']}; rescored {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--samples", type=int, default=10, help="prompts per task and length on each side")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--engine", default="sdpa")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); on a machine shared with other jobs 1 is faster")
    ap.add_argument("--rescore", action="store_true",
                    help="only recompute the comparison of an existing result from its stored predictions")
    ap.add_argument("--note", default="2-core CPU shared with other jobs while it ran: runtimes are loaded-machine "
                                      "wall times; the scores do not depend on the load")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    out = HERE / "results" / f"ruler_crosscheck_{args.name}.json"
    if args.rescore:
        return rescore(out)
    partial = out.with_suffix(".partial.json")
    key = {k: getattr(args, k) for k in ("model", "samples", "dtype", "engine", "batch_size")} | {"tasks": tasks}
    parts: dict[str, dict] = {}
    if partial.is_file():
        saved = json.loads(partial.read_text())
        if saved.get("key") == key:
            parts = saved["parts"]
            print(f"resuming from {partial}: {', '.join(parts)} done")
    for L in lengths:
        for side in ("ours", "harness"):
            if f"{side}/{L}" in parts:
                continue
            parts[f"{side}/{L}"] = _part(side, args, tasks, L)
            partial.write_text(json.dumps({"key": key, "parts": parts}) + "\n")

    per_sample = []
    for t in tasks:
        for L in lengths:
            per_sample += [{"side": "ours", **x} for x in parts[f"ours/{L}"]["samples"] if x["task"] == t]
            per_sample += [{"side": "harness", **x} for x in parts[f"harness/{L}"]["samples"] if x["task"] == t]
    rows = {(side, r["task"], r["length"]): r["score"] for k, v in parts.items() for r in v["rows"]
            for side in [k.split("/")[0]]}
    cells = compare(per_sample, tasks, lengths, rows)
    _print(cells)
    import torch

    result = {
        "what": "issue 15 Acceptance 3: our RULER vs lm-eval's RULER tasks on the same model, lengths, decoding",
        "model": args.model, "samples": args.samples, "lengths": lengths, "tasks": tasks, "dtype": args.dtype,
        "engine": args.engine, "batch_size": args.batch_size, "torch_threads": torch.get_num_threads(),
        "agreement_rule": "|ours - harness| <= 2 * sqrt(se_ours^2 + se_harness^2), se = 100 * sqrt(p (1-p) / n)",
        "all_agree": all(c["agree"] for c in cells), "cells": cells,
        "empirical_se": EMPIRICAL_NOTE,
        "runtime_s": {k: v["runtime_s"] for k, v in parts.items()},
        "harness_version": next(v["version"] for k, v in parts.items() if k.startswith("harness/")),
        "machine": machine(), "note": args.note, "samples_detail": per_sample,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    partial.unlink(missing_ok=True)
    print(f"all agree: {result['all_agree']}; wrote {out}")


if __name__ == "__main__":
    main()
