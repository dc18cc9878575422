"""The demo's jobs: each takes the job context and returns a small JSON summary (kept in demo.json).

`RUNNERS` maps each job name of `JOBS` to its function; `anchor.demo.pipeline` runs them in order.

The jobs that take long, with their summaries and figures, have modules of their own beside this one:
`train_job` (`job_train`) and `eval_job` (`job_eval`); the context every job reads is
`job_context`'s. Their names that other code imports from here are imported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from anchor.bench.report import write_bench
from anchor.bench.run import run_bench
from anchor.bench.step import cut_model
from anchor.demo.documents import pack_pieces, pack_windows
from anchor.demo.eval_job import (  # noqa: F401 (re-exported)
    _run_scores,
    eval_figures,
    job_eval,
)
from anchor.demo.job_context import JobContext
from anchor.demo.next_token import print_top5, top5
from anchor.demo.settings import FP32_SUFFIX
from anchor.demo.train_job import (  # noqa: F401 (re-exported)
    TIMING_RUN,
    LoadSampler,
    _train_overrides,
    busy_machine,
    device_name,
    flop_ratios,
    job_train,
    step_time_ratios,
    train_figures,
)
from anchor_core.atomic import publish, staging_dir
from anchor_core.data.corpus import write_default_corpus
from anchor_core.data.mixture import MixtureSpec
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.weights import load_spec
from parity_tests.audit.report import write_audit
from parity_tests.audit.runner import run_audit
from parity_tests.report import write_report
from parity_tests.suite import build_cases, run_parity


def job_top5(ctx: JobContext) -> dict[str, Any]:
    s = ctx.settings
    with staging_dir(ctx.folder("top5"), "demo") as tmp:
        result = top5(s.model, s.prompt, s.policy, tmp / "top5")
        publish(tmp / "top5", ctx.folder("top5"), "demo")
    print_top5(result)
    return result


def job_corpus(ctx: JobContext) -> dict[str, Any]:
    return write_default_corpus(ctx.folder("corpus"), progress=ctx.progress)


def job_pack(ctx: JobContext) -> dict[str, Any]:
    s = ctx.settings
    if s.pack_docs == "pieces":  # the files cut at their functions and sections: several documents a window
        return pack_pieces(s.model, ctx.folder("corpus"), ctx.folder("pack"), s.seq_len, s.budget,
                           progress=ctx.progress)
    cfg = PackConfig(seq_len=s.seq_len, mixture=MixtureSpec(kind="upsample_long", budget=s.budget,
                                                            long_threshold=s.seq_len))
    stats = pack_corpus(s.model, ctx.folder("corpus") / "corpus.jsonl", ctx.folder("pack"), cfg, progress=ctx.progress)
    return {**{k: stats[k] for k in ("windows", "tokens", "documents", "seq_len") if k in stats},
            **pack_windows(ctx.folder("pack"))}


def job_audit(ctx: JobContext) -> dict[str, Any]:
    result = run_audit(ctx.settings.model, data=str(ctx.folder("corpus") / "corpus.jsonl"), quick=True,
                       progress=ctx.progress)
    write_audit(result, ctx.folder("audit"))
    return {"runtime_s": result.get("runtime_s"), "policies": sorted(result.get("shift_curve", {}))}


def job_parity(ctx: JobContext) -> dict[str, Any]:
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
    write_report(result, ctx.folder("parity"))
    grads = result["grad_cases"]
    return {"model": rel, "grad_model": label, "trained_dtype": trained_dtype, "policies": policies,
            "cases": len(result["cases"]),
            "passed": sum(c["pass"] for c in result["cases"]), "grad_cases": len(grads),
            "grad_passed": sum(c["pass"] for c in grads), "pass": bool(result["pass"]),
            "ids": [[c["id"], bool(c["pass"])] for c in result["cases"] + grads]}


def job_bench(ctx: JobContext) -> dict[str, Any]:
    s = ctx.settings
    result = run_bench(model=s.model, seq_lens=list(s.bench_seq_lens), variants=["full", "anchor"],
                       distributions=["corpus"], data=str(ctx.folder("corpus") / "corpus.jsonl"),
                       windows=s.bench_windows, repeats=s.bench_repeats, step=False, seed=s.seed,
                       progress=ctx.progress)
    write_bench(result, ctx.folder("bench"))
    rows = [{k: r.get(k) for k in ("engine", "variant", "seq_len", "ms", "flop_ratio", "time_ratio")}
            for r in result["attention"]]
    paper = [{k: e.get(k) for k in ("model", "seq_len", "gpus", "variant", "distribution", "days_per_1b_tokens",
                                    "saving_vs_full")} for e in result["estimate"] if e.get("saving_vs_full") is not None]
    return {"attention": rows, "estimate": paper, "machine": result["machine"].get("cpu"),
            "runtime_s": result["runtime_s"]}


RUNNERS: dict[str, Callable[[JobContext], dict[str, Any]]] = {
    "top5": job_top5, "corpus": job_corpus, "pack": job_pack, "audit": job_audit, "train": job_train,
    "parity": job_parity, "eval": job_eval, "bench": job_bench}
