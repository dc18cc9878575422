"""`anchor demo`: the paper's experiment end to end on the embedded default, small enough for a CPU.

Stages, each in its own sub-folder of `--out`:
  top5     the oracle's next-token top-5 on a prompt next to transformers' own (GGUF loaded by
           transformers itself, eager attention, fp32)
  corpus   the embedded default corpus (`anchor corpus`)
  pack     tokenized, long-document-upsampled and packed windows (`anchor pack`)
  audit    a short RoPE/bf16 precision audit (`anchor audit`, quick settings)
  train    short continued pre-training runs, AnchorAttention against full attention, on the packed
           windows (`anchor train`, the `varlen` engine, evaluation checkpoints as the paper's)
  parity   the trained anchor checkpoint in the trainer held against the oracle, layer by layer,
           forward and gradients (`anchor parity --grads`)
  eval     RULER on every run, averaged over its evaluation checkpoints, perplexity beside it
           (`anchor eval --run`)
  bench    attention time of anchor against full on packed windows, with the FLOP ratio (`anchor bench`)
and `index.html`: one page, a section per stage, tables and figures inline, every link relative;
`summary.png`, four figures of the run side by side.

Stages run in that order; `--steps` selects some (their inputs come along: `eval` needs `train`,
which needs `pack`, which needs `corpus`). `--out` is a demo folder (anchor's marker, verb `demo`):
every stage publishes its own sub-folder atomically and is recorded in `demo.json` with a
fingerprint of its settings, its inputs' fingerprints and anchor's version. A second run reuses
every stage whose fingerprint still matches (`--fresh` redoes them); a killed demo keeps the stages
it finished, and a killed training run resumes from its newest checkpoint.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from anchor.atomic import write_text_atomic
from anchor.errors import InputError

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
STAGES = ("top5", "corpus", "pack", "audit", "train", "parity", "eval", "bench")
NEEDS = {"pack": ("corpus",), "audit": ("corpus",), "train": ("pack",), "parity": ("train",), "eval": ("train",),
         "bench": ("corpus",)}
TITLES = {"top5": "Next-token top-5: the oracle against transformers", "corpus": "The embedded corpus",
          "pack": "Packed windows", "audit": "Precision audit: RoPE in bf16",
          "train": "Training: AnchorAttention against full attention",
          "parity": "Parity of the trained checkpoint: the trainer against the oracle",
          "eval": "Evaluation: RULER averaged over the last checkpoints", "bench": "Speed: anchor against full"}
DEMO_JSON = "demo.json"


@dataclass(frozen=True)
class DemoSettings:
    """Everything a stage's result depends on (besides its inputs): the fingerprints hash these."""

    model: str = "default"
    prompt: str = DEFAULT_PROMPT
    policy: str = "fp32"
    seq_len: int = 1024                       # pack and train windows
    budget: int = 400_000                     # tokens drawn from the corpus for packing
    train_variants: tuple[str, ...] = ("anchor", "full")
    train_steps: int = 4
    global_batch: int = 1
    lr: float = 1e-4                          # higher than the paper's 2e-5: a short run should move
    train_engine: str = "varlen"              # costs what the mask says, trains on CPU
    train_dtype: str = "float32"
    eval_every: int = 2                       # evaluation checkpoints: every eval_every steps ...
    eval_window: int = 4                      # ... over the last eval_window (paper: 10 over 50)
    parity_seq_len: int = 97
    parity_policies: tuple[str, ...] = ("fp32", "bf16")   # forward cases on the whole trained model
    parity_grad_layers: int = 2               # gradient cases (fp32) on its first layers (0: all)
    eval_tasks: tuple[str, ...] = ("niah_single_1", "vt")
    eval_lengths: tuple[int, ...] = (1024, 2048)
    eval_samples: int = 4
    eval_dtype: str = "auto"                  # bf16 where it multiplies faster (CUDA, CPUs with bf16 units;
                                              # anchor_app.eval.dtype), else fp32: eval.json records which and why
    eval_engine: str = "varlen"               # the prefill's engine: fused per prompt (sdpa's padded batch
                                              # takes the masked path: 1.9x slower at 4K on this CPU)
    perplexity_windows: int = 1
    bench_seq_lens: tuple[int, ...] = (2048, 4096)
    bench_windows: int = 1
    bench_repeats: int = 2
    seed: int = 0


# `make paper-small`: the paper's comparison at small scale (four variants, RULER 1K-4K, five checkpoints).
PROFILES = {
    "demo": DemoSettings(),
    "paper-small": DemoSettings(
        seq_len=4096, budget=1_200_000, train_variants=("full", "intra_doc", "intra_doc_reset", "anchor"),
        train_steps=20, global_batch=1, eval_every=4, eval_window=20, parity_seq_len=515,
        eval_tasks=("niah_single_1", "niah_multikey_1", "vt"), eval_lengths=(1024, 2048, 4096),
        eval_samples=4, perplexity_windows=2, bench_seq_lens=(4096, 8192, 16384), bench_windows=2),
}


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    e = np.exp(x)
    return e / e.sum()


def _transformers_model(name: str):
    """transformers' own model for `name`, fp32, eager: its own GGUF/folder loading where it has one."""
    import torch
    from transformers import AutoModelForCausalLM

    from anchor.paths import resolve_model_name

    path = Path(resolve_model_name(name))
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    from torchtrain import build_model

    return build_model(name, engine="eager", dtype="float32").eval()


def top5(model: str, prompt: str, policy: str, out: Path) -> dict[str, Any]:
    """Next-token top-5 of the oracle (under `policy`) and of transformers (fp32 eager)."""
    import jaxref
    from anchor.tokenizer import load_tokenizer

    pol = jaxref.get_policy(policy)  # bad policies fail before any model is read
    params, spec = jaxref.load_model(model)
    tok = load_tokenizer(model)
    if tok.vocab_size > spec.vocab_size:
        raise InputError(f"the tokenizer has {tok.vocab_size} tokens, the model {spec.vocab_size}", path=model)
    ids = [tok.first_token_id] + tok.encode_batch([prompt])[0]
    oracle = _softmax(np.asarray(jaxref.forward(params, spec, np.asarray(ids)[None], policy=pol), np.float64)[0, -1])

    import torch

    hf_model = _transformers_model(model)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].double().numpy()
    hf = _softmax(hf_logits)

    def top(p: np.ndarray) -> list[dict[str, Any]]:
        idx = np.argsort(-p)[:5]
        return [{"id": int(i), "token": tok.decode([int(i)]), "prob": float(p[i])} for i in idx]

    result = {
        "model": model, "prompt": prompt, "policy": pol.name, "tokens": len(ids),
        "oracle": top(oracle), "transformers": top(hf),
        "same_top5": [t["id"] for t in top(oracle)] == [t["id"] for t in top(hf)],
        "max_prob_diff_top5": float(np.abs(oracle[np.argsort(-hf)[:5]] - hf[np.argsort(-hf)[:5]]).max()),
    }
    lines = [f"# Next-token top-5: oracle ({pol.name}) vs transformers (fp32 eager)", "",
             f"Model `{model}`, prompt: `{prompt}` ({len(ids)} tokens with the first token).", "",
             "| rank | oracle token | oracle p | transformers token | transformers p |", "|---|---|---|---|---|"]
    for r, (a, b) in enumerate(zip(result["oracle"], result["transformers"]), 1):
        lines.append(f"| {r} | `{a['token']!r}` | {a['prob']:.6f} | `{b['token']!r}` | {b['prob']:.6f} |")
    lines += ["", f"Same top-5 in the same order: **{result['same_top5']}**; largest probability difference "
              f"among transformers' top-5: {result['max_prob_diff_top5']:.2e}."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "top5.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    (out / "top5.md").write_text("\n".join(lines) + "\n")
    return result


def print_top5(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"next token after the prompt — oracle ({result['policy']}) vs transformers (fp32)")
    for col in ("rank", "oracle", "p", "transformers", "p "):
        table.add_column(col)
    for r, (a, b) in enumerate(zip(result["oracle"], result["transformers"]), 1):
        table.add_row(str(r), repr(a["token"]), f"{a['prob']:.6f}", repr(b["token"]), f"{b['prob']:.6f}")
    console = Console()
    console.print(table)
    console.print(f"same top-5: {result['same_top5']}; max |Δp| over the top-5: {result['max_prob_diff_top5']:.2e}")


# ---------------------------------------------------------------------------------------------
# Stages. Each takes the stage context and returns a small JSON summary (kept in demo.json).


@dataclass
class _Ctx:
    out: Path
    settings: DemoSettings
    progress: bool
    say: Callable[[str], None]
    records: dict[str, Any] = field(default_factory=dict)

    def stage(self, name: str) -> Path:
        return self.out / name


def _save_figure(fig, path: Path, dpi: int = 110) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)


def _container(path: Path) -> None:
    """A stage folder holding several anchor outputs (runs, evaluations): made and marked as the demo's."""
    from anchor.outdir import read_marker, write_marker

    path.mkdir(parents=True, exist_ok=True)
    if read_marker(path) is None:
        write_marker(path, "demo")


def stage_top5(ctx: _Ctx) -> dict[str, Any]:
    from anchor.atomic import publish, staging_dir

    s = ctx.settings
    with staging_dir(ctx.stage("top5"), "demo") as tmp:
        result = top5(s.model, s.prompt, s.policy, tmp / "top5")
        publish(tmp / "top5", ctx.stage("top5"), "demo")
    print_top5(result)
    return result


def stage_corpus(ctx: _Ctx) -> dict[str, Any]:
    from anchor.data.corpus import write_default_corpus

    return write_default_corpus(ctx.stage("corpus"), progress=ctx.progress)


def stage_pack(ctx: _Ctx) -> dict[str, Any]:
    from anchor.data.mixture import MixtureSpec
    from anchor.data.pipeline import PackConfig, pack_corpus

    s = ctx.settings
    cfg = PackConfig(seq_len=s.seq_len, mixture=MixtureSpec(kind="upsample_long", budget=s.budget,
                                                            long_threshold=s.seq_len))
    stats = pack_corpus(s.model, ctx.stage("corpus") / "corpus.jsonl", ctx.stage("pack"), cfg, progress=ctx.progress)
    return {k: stats[k] for k in ("windows", "tokens", "documents", "seq_len") if k in stats}


def stage_audit(ctx: _Ctx) -> dict[str, Any]:
    from jaxref.audit.report import write_audit
    from jaxref.audit.runner import run_audit

    result = run_audit(ctx.settings.model, data=str(ctx.stage("corpus") / "corpus.jsonl"), quick=True,
                       progress=ctx.progress)
    write_audit(result, ctx.stage("audit"))
    return {"runtime_s": result.get("runtime_s"), "policies": sorted(result.get("shift_curve", {}))}


def _train_overrides(s: DemoSettings, data: Path, variant: str) -> list[str]:
    return [f"model={s.model}", f"data={data}", f"seq_len={s.seq_len}", f"variant={variant}",
            f"steps={s.train_steps}", f"global_batch={s.global_batch}", "micro_batch=1", f"lr={s.lr}",
            "warmup_steps=1", "schedule=constant", f"dtype={s.train_dtype}", f"engine={s.train_engine}",
            "zero_stage=0", "save_every=0", "keep_last=1", f"eval_every={s.eval_every}",
            f"eval_window={s.eval_window}", f"seed={s.seed}"]


def stage_train(ctx: _Ctx) -> dict[str, Any]:
    """One run per variant on the packed windows (resumed where a killed demo left it)."""
    from torchtrain import checkpoint as ckpt
    from torchtrain.config import load_train_config
    from torchtrain.trainer import read_metrics, train

    s = ctx.settings
    root = ctx.stage("train")
    _container(root)
    runs: dict[str, Any] = {}
    for i, v in enumerate(s.train_variants, 1):
        ctx.say(f"    run {i}/{len(s.train_variants)}: variant {v}, {s.train_steps} steps of "
                f"{s.global_batch} x {s.seq_len} slots, engine {s.train_engine}")
        cfg = load_train_config(None, _train_overrides(s, ctx.stage("pack").resolve(), v))
        train(cfg, root / v, progress=ctx.progress)
        m = read_metrics(root / v)
        step_s = [s.global_batch * s.seq_len / r["tokens_per_s"] for r in m]
        last = max(ckpt.list_steps(root / v))
        runs[v] = {"steps": len(m), "loss_first": m[0]["loss"], "loss_last": m[-1]["loss"],
                   "loss": [r["loss"] for r in m],
                   "step_s_median": float(np.median(step_s[1:] if len(step_s) > 1 else step_s)),
                   "tokens_per_s_median": float(np.median([r["tokens_per_s"] for r in m[1:] or m])),
                   "elapsed_s": m[-1]["elapsed_s"], "last_checkpoint": f"{v}/checkpoints/step-{last}/hf",
                   "eval_checkpoints": [f"step-{k}" for k in sorted(ckpt.list_steps(root / v)) if cfg.is_eval_step(k)]}
    if "full" in runs:
        for v, r in runs.items():
            r["step_time_vs_full"] = r["step_s_median"] / runs["full"]["step_s_median"]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for v, r in runs.items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], marker="o", label=v)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over counted targets)")
    ax.set_title(f"{s.model}: continued pre-training at T={s.seq_len}")
    ax.legend()
    fig.tight_layout()
    _save_figure(fig, root / "loss.png")
    plt.close(fig)
    return {"runs": runs, "model": s.model, "seq_len": s.seq_len, "engine": s.train_engine, "dtype": s.train_dtype}


def stage_parity(ctx: _Ctx) -> dict[str, Any]:
    """The trained checkpoint forward (whole model, fp32 and bf16) and its gradients and AdamW steps (fp32,
    on its first `parity_grad_layers` layers: the gradient cases of a 135M model hold some twenty copies of
    its parameters in fp64, 22 GB)."""
    import tempfile

    from anchor_app.bench.step import cut_model
    from anchor.weights import load_spec
    from parity_tests.report import write_report
    from parity_tests.suite import build_cases, run_parity

    s = ctx.settings
    first = "anchor" if "anchor" in s.train_variants else s.train_variants[0]
    rel = f"train/{ctx.records['train']['summary']['runs'][first]['last_checkpoint']}"
    model = str((ctx.out / rel).resolve())
    T = s.parity_seq_len
    cases = build_cases(model, variants=["full", "anchor"], layouts=["plain"], policies=list(s.parity_policies),
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
    return {"model": rel, "grad_model": label, "cases": len(result["cases"]),
            "passed": sum(c["pass"] for c in result["cases"]), "grad_cases": len(grads),
            "grad_passed": sum(c["pass"] for c in grads), "pass": bool(result["pass"]),
            "ids": [[c["id"], bool(c["pass"])] for c in result["cases"] + grads]}


def _run_scores(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per length: the task-averaged score of each checkpoint, then mean and std over checkpoints."""
    out = {}
    for L in result["settings"]["lengths"]:
        per_ckpt = {}
        for r in result["rows"]:
            if r["length"] == L:
                per_ckpt.setdefault(r["checkpoint"], []).append(r["score"])
        vals = [float(np.mean(v)) for v in per_ckpt.values()]
        out[L] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                  "checkpoints": len(vals)}
    return out


def _finished_eval(folder: Path, s: DemoSettings, sources: list[tuple[str, str]]) -> dict[str, Any] | None:
    """The evaluation a stopped demo published for one run (`eval.json`, written whole by write_eval), when
    it evaluated these checkpoints with these settings; None otherwise (it is then run again).

    Only read when the stage resumes, i.e. its fingerprint (settings and the training it reads) is the
    unfinished stage's: within a run, finished checkpoints come back from their parts (`run_eval(parts=...)`)."""
    from anchor_app.eval.runner import resolve_dtype
    from anchor.outdir import read_marker

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
                and got["perplexity_windows"] == s.perplexity_windows)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return r if same else None


def stage_eval(ctx: _Ctx) -> dict[str, Any]:
    from anchor_app.eval.runner import checkpoints_of_run, parts_dir, run_eval, write_eval

    s = ctx.settings
    root = ctx.stage("eval")
    _container(root)
    runs: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    for i, v in enumerate(s.train_variants, 1):
        sources = checkpoints_of_run(ctx.stage("train") / v)
        result = _finished_eval(root / v, s, sources)
        if result is not None:
            ctx.say(f"    run {i}/{len(s.train_variants)}: {v}: evaluated before the demo stopped, reused")
        else:
            ctx.say(f"    run {i}/{len(s.train_variants)}: {v}, checkpoints {', '.join(lb for lb, _ in sources)}")
            result = run_eval(sources, tasks=list(s.eval_tasks), lengths=list(s.eval_lengths),
                              samples=s.eval_samples, seed=s.seed, dtype=s.eval_dtype,
                              engine=s.eval_engine, perplexity_windows=s.perplexity_windows, progress=ctx.progress,
                              parts=parts_dir(root / v))  # a stopped demo resumes at the checkpoint
            write_eval(result, root / v)
        choice = result.get("dtype_choice") or {"dtype": result["settings"]["dtype"]}
        ppl = {}
        for r in result["perplexity"]:
            ppl.setdefault(r["length"], []).append(r["ppl"])
        runs[v] = {"checkpoints": [c["label"] for c in result["checkpoints"]],
                   "scores": {str(L): x for L, x in _run_scores(result).items()},
                   "tasks": [{k: r[k] for k in ("task", "length", "mean", "std")} for r in result["summary"]],
                   "perplexity": {str(L): float(np.mean(p)) for L, p in ppl.items()},
                   "runtime_s": result["runtime_s"]}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for v, r in runs.items():
        Ls = [int(L) for L in r["scores"]]
        ax.errorbar(Ls, [r["scores"][str(L)]["mean"] for L in Ls], yerr=[r["scores"][str(L)]["std"] for L in Ls],
                    marker="o", capsize=3, label=v)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(s.eval_lengths), [str(L) for L in s.eval_lengths])
    ax.set_ylim(-5, 105)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score (mean of tasks)")
    ax.set_title(f"RULER ({', '.join(s.eval_tasks)}), mean ± std over checkpoints", fontsize=9)
    ax.legend()
    fig.tight_layout()
    _save_figure(fig, root / "ruler.png")
    plt.close(fig)
    return {"runs": runs, "tasks": list(s.eval_tasks), "lengths": list(s.eval_lengths), "samples": s.eval_samples,
            "dtype": choice.get("dtype", s.eval_dtype), "dtype_choice": choice, "engine": s.eval_engine}


def stage_bench(ctx: _Ctx) -> dict[str, Any]:
    from anchor_app.bench.report import write_bench
    from anchor_app.bench.run import run_bench

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


RUNNERS: dict[str, Callable[[_Ctx], dict[str, Any]]] = {
    "top5": stage_top5, "corpus": stage_corpus, "pack": stage_pack, "audit": stage_audit, "train": stage_train,
    "parity": stage_parity, "eval": stage_eval, "bench": stage_bench}

# Stages that a stopped demo continues (the same fingerprint): training from each run's newest checkpoint,
# evaluation from the checkpoint it was on (finished runs whole, finished checkpoints from their parts).
RESUMABLE = ("train", "eval")

# The settings each stage's result depends on (besides its inputs' fingerprints and the model file).
_KEYS = {"top5": ("model", "prompt", "policy"), "corpus": (), "pack": ("model", "seq_len", "budget"),
         "audit": ("model",),
         "train": ("model", "seq_len", "train_variants", "train_steps", "global_batch", "lr", "train_engine",
                   "train_dtype", "eval_every", "eval_window", "seed"),
         "parity": ("parity_seq_len", "parity_policies", "parity_grad_layers"),
         "eval": ("eval_tasks", "eval_lengths", "eval_samples", "eval_dtype", "eval_engine", "perplexity_windows",
                  "seed"),
         "bench": ("model", "bench_seq_lens", "bench_windows", "bench_repeats", "seed")}


# ---------------------------------------------------------------------------------------------
# Planning, fingerprints, the record


def check_steps(steps: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`--steps` as a tuple of known stage names, in the pipeline's order; none or an unknown one is an InputError."""
    items = [x.strip() for x in steps.split(",")] if isinstance(steps, str) else [str(x).strip() for x in steps]
    items = [x for x in items if x]
    if not items:
        raise InputError(f"--steps: no step given: select at least one stage ({', '.join(STAGES)})")
    unknown = [x for x in items if x not in STAGES]
    if unknown:
        raise InputError(f"--steps: unknown demo stage {unknown[0]!r} (stages: {', '.join(STAGES)})")
    return tuple(x for x in STAGES if x in items)


def plan(steps: tuple[str, ...]) -> tuple[str, ...]:
    """The selected stages and every stage they need, in the pipeline's order."""
    want: set[str] = set()

    def add(x: str) -> None:
        if x not in want:
            want.add(x)
            for y in NEEDS.get(x, ()):
                add(y)

    for x in steps:
        add(x)
    return tuple(x for x in STAGES if x in want)


def _model_identity(model: str) -> dict[str, Any]:
    from anchor.paths import resolve_model_name

    try:
        path = Path(resolve_model_name(model))
    except Exception:  # noqa: BLE001 - the stages report a bad model themselves
        return {"name": model}
    if path.is_file():
        st = path.stat()
        return {"name": model, "path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"name": model, "path": str(path.resolve()),
                "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    return {"name": model}


def fingerprints(settings: DemoSettings) -> dict[str, str]:
    """sha256 (16 hex) per stage of its settings, its inputs' fingerprints, the model file and anchor's version."""
    from anchor import __version__

    d = asdict(settings)
    ident = _model_identity(settings.model)
    fps: dict[str, str] = {}
    for stage in STAGES:
        blob = {"stage": stage, "version": __version__, "settings": {k: d[k] for k in _KEYS[stage]},
                "needs": {x: fps[x] for x in NEEDS.get(stage, ())}}
        if "model" in _KEYS[stage]:
            blob["model"] = ident
        text = json.dumps(blob, sort_keys=True, default=list)
        fps[stage] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return fps


def read_record(out: Path) -> dict[str, Any]:
    """demo.json of an earlier demo in `out` ({} when none or unreadable)."""
    try:
        d = json.loads((out / DEMO_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) and isinstance(d.get("stages"), dict) else {}


def _stage_done(out: Path, stage: str, rec: dict[str, Any] | None, fp: str) -> bool:
    from anchor.outdir import read_marker

    return bool(rec and rec.get("done") and rec.get("fingerprint") == fp and read_marker(out / stage) is not None)


def _clear(out: Path, stage: str) -> None:
    """Remove a stage folder before it is redone: only one anchor wrote (its marker)."""
    from anchor.outdir import MARKER, rmtree, read_marker

    path = out / stage
    if not path.exists():
        return
    if read_marker(path) is None and any(path.iterdir()):
        raise InputError(f"the demo's stage folder holds files anchor did not write (no {MARKER}); "
                         "move them away or name another --out", path=path)
    rmtree(path)


# ---------------------------------------------------------------------------------------------
# The demo


def run_demo(model: str = "default", out: str | Path = "runs/demo", *, steps: tuple[str, ...] = STAGES,
             settings: DemoSettings | None = None, fresh: bool = False, say: Callable[[str], None] = print,
             progress: bool = True, **overrides: Any) -> dict[str, Any]:
    """Run (or reuse) the selected stages into the demo folder `out`. Returns the record written to demo.json.

    `overrides` replace fields of `settings` (default: the `demo` profile), e.g. seq_len=512."""
    from anchor.outdir import guard_out, out_lock

    steps = check_steps(steps)
    s = replace(settings or PROFILES["demo"], model=model, **overrides)
    pol_file = s.policy if s.policy.endswith((".yaml", ".yml")) else None
    out = guard_out(out, "demo", inputs=(model, pol_file), replace=False)
    todo = plan(steps)
    fps = fingerprints(s)
    t0 = time.time()
    _check_model(s.model)  # a bad model fails before the folder exists
    created = not out.exists() or not any(out.iterdir())
    with out_lock(out, "demo"):
        try:
            return _run_stages(out, s, steps, todo, fps, fresh, say, progress, t0)
        except BaseException:
            from anchor.outdir import rmtree

            if created and not any(r.get("done") for r in read_record(out).get("stages", {}).values()):
                rmtree(out)  # nothing finished: leave no half-written demo folder behind
            raise


def _check_model(model: str) -> None:
    """The model exists and its config reads (weights and tokenizer are checked by the first stage that loads
    them; a failure before any stage finished removes the folder it created)."""
    from anchor.weights import load_spec

    load_spec(model)


def _run_stages(out: Path, s: DemoSettings, steps: tuple[str, ...], todo: tuple[str, ...], fps: dict[str, str],
                fresh: bool, say: Callable[[str], None], progress: bool, t0: float) -> dict[str, Any]:
    from anchor.outdir import remove_stale_staging, write_marker

    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "demo")
    for stage in STAGES:
        remove_stale_staging(out / stage)
    for tmp in out.glob(".parity-model-*"):  # the cut model of a killed parity stage
        shutil.rmtree(tmp, ignore_errors=True)
    old = read_record(out)
    record: dict[str, Any] = {"model": s.model, "settings": asdict(s), "stages": dict(old.get("stages", {})),
                              "ran": [], "reused": [], "selected": list(steps)}
    ctx = _Ctx(out, s, progress, say, record["stages"])
    for i, stage in enumerate(todo, 1):
        rec = record["stages"].get(stage)
        if not fresh and _stage_done(out, stage, rec, fps[stage]):
            say(f"[{i}/{len(todo)}] {stage}: reused (finished {rec['finished']}, settings unchanged)")
            record["reused"].append(stage)
            continue
        resumable = stage in RESUMABLE and not fresh and rec is not None and rec.get("fingerprint") == fps[stage]
        if not resumable:
            _clear(out, stage)
        say(f"[{i}/{len(todo)}] {stage}: {TITLES[stage]}")
        record["stages"][stage] = {"fingerprint": fps[stage], "done": False, "started": _now()}
        _write_record(out, record, t0)
        t = time.time()
        summary = RUNNERS[stage](ctx)
        record["stages"][stage] = {"fingerprint": fps[stage], "done": True, "started": record["stages"][stage]["started"],
                                   "finished": _now(), "seconds": round(time.time() - t, 1), "summary": summary}
        record["ran"].append(stage)
        _write_record(out, record, t0)
        index_page(out, record, fps)
    record["seconds"] = round(time.time() - t0, 1)
    _write_record(out, record, t0)
    summary_figure(out, record)
    index_page(out, record, fps)
    return record


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _write_record(out: Path, record: dict[str, Any], t0: float) -> None:
    record["seconds"] = round(time.time() - t0, 1)
    record["finished"] = _now()
    write_text_atomic(out / DEMO_JSON, json.dumps(record, indent=1, ensure_ascii=False, default=str))


# ---------------------------------------------------------------------------------------------
# The page and the summary figure


SUMMARY_PANELS = (("audit", "figure1.png", "precision audit"), ("train", "loss.png", "training loss"),
                  ("eval", "ruler.png", "RULER"), ("bench", "time_ratio_vs_flop_ratio.png", "attention time"))


def summary_figure(out: Path, record: dict[str, Any]) -> Path | None:
    """`summary.png`: the audit, the loss curves, RULER and the speed figure side by side (those that exist)."""
    panels = [(out / st / name, title) for st, name, title in SUMMARY_PANELS
              if record["stages"].get(st, {}).get("done") and (out / st / name).is_file()]
    target = out / "summary.png"
    if not panels:
        target.unlink(missing_ok=True)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (path, title) in zip(axes.flat, panels):
        ax.imshow(mpimg.imread(path))
    fig.suptitle(f"anchor demo — {record['model']}", fontsize=14)
    fig.tight_layout()
    _save_figure(fig, target, dpi=90)
    plt.close(fig)
    return target


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _f(x: Any, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


class _Page:
    def __init__(self, out: Path):
        self.out, self.parts = out, []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def link(self, rel: str, text: str | None = None) -> str:
        """A relative link to `rel` when the file exists (else its name, unlinked)."""
        if (self.out / rel).exists():
            return f"<a href='{_esc(rel)}'>{_esc(text or rel)}</a>"
        return _esc(text or rel)

    def img(self, rel: str, alt: str) -> None:
        self.figs([(rel, alt)], grid=False)

    def figs(self, items: list[tuple[str, str]], grid: bool = True) -> None:
        """Figures that exist, inline; two to a row when `grid`."""
        cells = [f"<figure><img src='{_esc(rel)}' alt='{_esc(alt)}'><figcaption>{_esc(alt)}</figcaption></figure>"
                 for rel, alt in items if (self.out / rel).is_file()]
        if cells:
            self.add(f"<div class='{'figs' if grid and len(cells) > 1 else 'fig'}'>" + "".join(cells) + "</div>")


def _section_top5(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Prompt <code>{_esc(s['prompt'])}</code> ({s['tokens']} tokens), oracle policy {_esc(s['policy'])}. "
          f"Same top-5 in the same order: <b>{s['same_top5']}</b>; largest probability difference "
          f"{s['max_prob_diff_top5']:.2e}. {p.link('top5/top5.md', 'top5.md')}</p>")
    p.add(_table(["rank", "oracle", "p", "transformers", "p"],
                 [[r, repr(a["token"]), f"{a['prob']:.5f}", repr(b["token"]), f"{b['prob']:.5f}"]
                  for r, (a, b) in enumerate(zip(s["oracle"], s["transformers"]), 1)]))


def _section_corpus(p: _Page, s: dict[str, Any]) -> None:
    flat = [[k, v if not isinstance(v, (dict, list)) else json.dumps(v)[:120]] for k, v in s.items()]
    p.add(_table(["key", "value"], flat))
    p.add(f"<p>{p.link('corpus/corpus.json', 'corpus.json')}</p>")


def _section_pack(p: _Page, s: dict[str, Any]) -> None:
    p.add(_table(["key", "value"], [[k, v] for k, v in s.items()]))
    p.add(f"<p>{p.link('pack/stats.md', 'stats.md')} · {p.link('pack/stats.json', 'stats.json')}</p>")


def _section_audit(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Policies {', '.join(map(_esc, s.get('policies', [])))}: attention difference D under a shift of every "
          f"position, per token and per length (quick settings). {p.link('audit/report.md', 'report.md')} · "
          f"{p.link('audit/audit.json', 'audit.json')}</p>")
    p.img("audit/figure1.png", "figure 1: the paper's panels on this model")
    p.figs([(f"audit/{name}.png", name.replace("_", " "))
            for name in ("shift_curve", "per_token", "length_curve", "error_budget")])


def _section_train(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>{_esc(s['model'])}, windows of {s['seq_len']} slots, engine {_esc(s['engine'])}, {_esc(s['dtype'])}. "
          "Step time: median over the steps after the first.</p>")
    p.add(_table(["variant", "steps", "loss: first", "last", "step s (median)", "tokens/s", "step time / full",
                  "evaluation checkpoints"],
                 [[v, r["steps"], _f(r["loss_first"]), _f(r["loss_last"]), _f(r["step_s_median"], ".3g"),
                   _f(r["tokens_per_s_median"], ".4g"), _f(r.get("step_time_vs_full"), ".3f"),
                   ", ".join(r["eval_checkpoints"])] for v, r in s["runs"].items()]))
    p.img("train/loss.png", "loss per step")
    p.add("<p>" + " · ".join(f"{v}: {p.link(f'train/{v}/metrics.jsonl', 'metrics.jsonl')}, "
                              f"{p.link(f'train/{v}/config.yaml', 'config.yaml')}" for v in s["runs"]) + "</p>")


def _section_parity(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Model: the trained checkpoint <code>{_esc(s['model'])}</code>. Forward, layer by layer: "
          f"<b>{s['passed']}/{s['cases']}</b> cases pass; gradients of every parameter and AdamW steps (fp32, "
          f"<code>{_esc(s.get('grad_model', s['model']))}</code>): <b>{s['grad_passed']}/{s['grad_cases']}</b>. "
          f"{p.link('parity/index.html', 'layer-wise report')} · {p.link('parity/summary.md', 'summary.md')}</p>")
    p.add(_table(["case", "pass"], s["ids"]))
    p.figs([(f"parity/figures/{fig.name}", fig.stem.split("_", 2)[-1] + ": per-parameter errors")
            for fig in sorted((p.out / "parity" / "figures").glob("grads_*.png"))[:4]])


def _section_eval(p: _Page, s: dict[str, Any]) -> None:
    Ls = [str(L) for L in s["lengths"]]
    p.add(f"<p>RULER tasks {', '.join(map(_esc, s['tasks']))}, {s['samples']} samples per task and length, greedy, "
          f"{_esc(s['dtype'])}, prefill engine {_esc(s.get('engine', 'sdpa'))}; each cell: the mean of the tasks, "
          "mean ± std over the run's evaluation checkpoints (the paper's table).</p>")
    if s.get("dtype_choice", {}).get("reason"):
        p.add(f"<p>dtype: {_esc(s['dtype_choice']['reason'])}.</p>")
    p.add(_table(["run", "checkpoints", *Ls],
                 [[v, ", ".join(r["checkpoints"]), *[f"{r['scores'][L]['mean']:.1f} ± {r['scores'][L]['std']:.1f}"
                                                    for L in Ls]] for v, r in s["runs"].items()]))
    p.img("eval/ruler.png", "RULER score against length")
    rows = []
    for v, r in s["runs"].items():
        for t in r["tasks"]:
            rows.append([v, t["task"], t["length"], f"{t['mean']:.1f} ± {t['std']:.1f}"])
    p.add("<h3>Per task</h3>" + _table(["run", "task", "length", "score"], rows))
    if any(r["perplexity"] for r in s["runs"].values()):
        p.add("<h3>Perplexity on held-out windows (mean over checkpoints)</h3>")
        p.add(_table(["run", *Ls], [[v, *[_f(r["perplexity"].get(L), ".4g") for L in Ls]] for v, r in s["runs"].items()]))
    p.add("<p>" + " · ".join(f"{v}: {p.link(f'eval/{v}/report.md', 'report.md')}, "
                              f"{p.link(f'eval/{v}/samples.jsonl', 'samples.jsonl')}" for v in s["runs"]) + "</p>")


def _section_bench(p: _Page, s: dict[str, Any]) -> None:
    p.add(f"<p>Attention alone, forward + backward, on windows packed from the corpus ({_esc(s.get('machine'))}); "
          "ratios against full measured in the same run on the same windows.</p>")
    p.add(_table(["engine", "variant", "T", "ms", "time / full", "FLOPs / full"],
                 [[r["engine"], r["variant"], r["seq_len"], _f(r["ms"], ".4g"), _f(r["time_ratio"], ".3f"),
                   _f(r["flop_ratio"], ".3f")] for r in s["attention"]]))
    p.figs([(f"bench/{name}.png", name.replace("_", " ")) for name in ("time_ratio_vs_flop_ratio", "time_vs_length")])
    est = [e for e in s.get("estimate", []) if e.get("variant") == "anchor"]
    if est:
        p.add("<h3>Estimate for the paper's setting (assumed GPU rates)</h3>")
        p.add(_table(["model", "T", "GPUs", "distribution", "days / 1B tokens", "saving vs full"],
                     [[e.get("model"), e.get("seq_len"), e.get("gpus"), e.get("distribution"),
                       _f(e.get("days_per_1b_tokens"), ".3g"), _f(e.get("saving_vs_full"), ".1%")] for e in est]))
    p.add(f"<p>{p.link('bench/report.md', 'report.md')} · {p.link('bench/bench.json', 'bench.json')}</p>")


SECTIONS = {"top5": _section_top5, "corpus": _section_corpus, "pack": _section_pack, "audit": _section_audit,
            "train": _section_train, "parity": _section_parity, "eval": _section_eval, "bench": _section_bench}

_CSS = ("body{font:15px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
        "img{max-width:100%}figure{margin:1em 0}figcaption{font-size:12px;color:#666}"
        "table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 8px;border-bottom:1px solid #ddd;"
        "text-align:left;font-size:13px}code{background:#f4f4f4;padding:0 3px}.note{color:#a60}"
        ".figs{display:grid;grid-template-columns:1fr 1fr;gap:10px}.fig img{max-width:720px}")


def index_page(out: Path, record: dict[str, Any], fps: dict[str, str] | None = None) -> None:
    """`index.html`: a section per finished stage, tables and figures inline, every link relative."""
    p = _Page(out)
    done = [st for st in STAGES if record["stages"].get(st, {}).get("done")]
    p.add(f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>anchor demo — {_esc(record['model'])}"
          f"</title><style>{_CSS}</style></head><body>")
    p.add(f"<h1>anchor demo — {_esc(record['model'])}</h1>")
    p.add(f"<p>The paper's experiment end to end: {', '.join(done) or 'no stage finished yet'}. "
          f"This run: {record.get('seconds', 0):.0f} s; ran {', '.join(record.get('ran', [])) or 'nothing'}; "
          f"reused {', '.join(record.get('reused', [])) or 'nothing'}. {p.link(DEMO_JSON, DEMO_JSON)}</p>")
    p.img("summary.png", "summary: audit, training loss, RULER, attention time")
    p.add("<ul>" + "".join(f"<li><a href='#{st}'>{_esc(TITLES[st])}</a></li>" for st in done) + "</ul>")
    for st in done:
        rec = record["stages"][st]
        p.add(f"<h2 id='{st}'>{_esc(TITLES[st])}</h2>")
        stale = fps is not None and rec.get("fingerprint") != fps.get(st)
        p.add(f"<p>Finished {_esc(rec.get('finished'))} in {_f(rec.get('seconds'), '.0f')} s"
              + (" <span class='note'>(from an earlier demo with other settings)</span>" if stale else "") + ".</p>")
        try:
            SECTIONS[st](p, rec["summary"])
        except (KeyError, TypeError) as e:  # a record from an older demo: link the folder
            p.add(f"<p class='note'>No summary in this record ({_esc(e)}).</p>")
    p.add("</body></html>")
    write_text_atomic(out / "index.html", "\n".join(p.parts) + "\n")
