"""`anchor demo`: the whole pipeline on the embedded default, small enough for a laptop CPU.

Steps, each in its own sub-folder of `--out` (the folder is assembled in a temporary place and
renamed at the end, so a killed demo leaves the previous one intact):
  top5     the oracle's next-token top-5 on a prompt next to transformers' own (GGUF loaded by
           transformers itself, eager attention, fp32)
  corpus   the embedded default corpus (`anchor corpus`)
  pack     tokenized, mixed and packed windows (`anchor pack`)
  audit    a short RoPE/bf16 precision audit (`anchor audit`, quick settings)
  parity   the trainer (sdpa engine, fp32 and bf16) held against the oracle layer by layer for the
           `full` and `anchor` variants (`anchor parity`, T = 97)
and an `index.html` page linking every report.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from anchor.errors import InputError

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"
STEPS = ("top5", "corpus", "pack", "audit", "parity")


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


def corpus(out: Path, progress: bool = True) -> dict[str, Any]:
    from anchor.data.corpus import write_default_corpus

    return write_default_corpus(out, progress=progress)


def pack(model: str, corpus_dir: Path, out: Path, seq_len: int, budget: int, progress: bool = True) -> dict[str, Any]:
    from anchor.data.mixture import MixtureSpec
    from anchor.data.pipeline import PackConfig, pack_corpus

    cfg = PackConfig(seq_len=seq_len, mixture=MixtureSpec(kind="upsample_long", budget=budget, long_threshold=seq_len))
    return pack_corpus(model, corpus_dir / "corpus.jsonl", out, cfg, progress=progress)


def audit(model: str, corpus_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    from jaxref.audit.report import write_audit
    from jaxref.audit.runner import run_audit

    result = run_audit(model, data=str(corpus_dir / "corpus.jsonl"), quick=True, progress=progress)
    write_audit(result, out)
    return result


def parity(model: str, out: Path, progress: bool = True) -> dict[str, Any]:
    from parity_tests.report import write_report
    from parity_tests.suite import build_cases, run_parity

    cases = build_cases(model, variants=["full", "anchor"], layouts=["plain"], policies=["fp32", "bf16"],
                        engines=["sdpa"], seq_lens=[97])
    result = run_parity(cases, progress=progress)
    result["model"] = model
    write_report(result, out)
    return result


def index_page(out: Path, summary: dict[str, Any]) -> None:
    """A static page linking every step's report, with the audit's figures inline."""
    parts = ["<!doctype html><meta charset='utf-8'><title>anchor demo</title>",
             "<style>body{font:15px system-ui;max-width:960px;margin:2em auto}img{max-width:100%}"
             "td,th{padding:2px 8px;border-bottom:1px solid #ddd}</style>",
             f"<h1>anchor demo — {html.escape(summary['model'])}</h1>",
             f"<p>Finished {html.escape(summary['finished'])} in {summary['seconds']:.0f} s.</p><ul>"]
    links = {"top5": "top5/top5.md", "corpus": "corpus/corpus.json", "pack": "pack/stats.md",
             "audit": "audit/report.md", "parity": "parity/index.html"}
    for step in summary["steps"]:
        parts.append(f"<li><a href='{links[step]}'>{step}</a></li>")
    parts.append("</ul>")
    t5 = summary.get("top5")
    if t5:
        parts.append("<h2>Next-token top-5</h2><table><tr><th>oracle</th><th>p</th><th>transformers</th><th>p</th></tr>")
        for a, b in zip(t5["oracle"], t5["transformers"]):
            parts.append(f"<tr><td>{html.escape(repr(a['token']))}</td><td>{a['prob']:.5f}</td>"
                         f"<td>{html.escape(repr(b['token']))}</td><td>{b['prob']:.5f}</td></tr>")
        parts.append("</table>")
    if "parity" in summary:
        p = summary["parity"]
        parts.append(f"<h2>Parity</h2><p>{p['passed']} of {p['cases']} cases pass — "
                     "<a href='parity/index.html'>layer-wise report</a>.</p>")
    if (out / "audit").is_dir():
        parts.append("<h2>Precision audit</h2>")
        for png in sorted((out / "audit").glob("*.png")):
            parts.append(f"<img src='audit/{png.name}' alt='{png.stem}'>")
    (out / "index.html").write_text("\n".join(parts))


def check_steps(steps: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`--steps` as a tuple of known step names, in the pipeline's order; none or an unknown one is an InputError."""
    items = [s.strip() for s in steps.split(",")] if isinstance(steps, str) else [str(s).strip() for s in steps]
    items = [s for s in items if s]
    if not items:
        raise InputError(f"--steps: no step given (steps: {', '.join(STEPS)})")
    unknown = [s for s in items if s not in STEPS]
    if unknown:
        raise InputError(f"--steps: unknown demo step {unknown[0]!r} (steps: {', '.join(STEPS)})")
    return tuple(s for s in STEPS if s in items)


def run_demo(model: str, out: Path, *, prompt: str = DEFAULT_PROMPT, policy: str = "fp32",
             steps: tuple[str, ...] = STEPS, seq_len: int = 1024, budget: int = 400_000,
             say: Callable[[str], None] = print, progress: bool = True) -> dict[str, Any]:
    """Run the chosen steps into `out` (atomically replaced). Returns the summary written to demo.json."""
    from anchor.atomic import publish, staging_dir

    steps = check_steps(steps)
    out = Path(out)
    t0 = time.time()
    summary: dict[str, Any] = {"model": model, "steps": list(steps)}
    with staging_dir(out, "demo", inputs=(model,)) as tmp:
        work = tmp / "demo"
        work.mkdir()
        if "top5" in steps:
            say("[1/5] oracle vs transformers: next-token top-5")
            summary["top5"] = top5(model, prompt, policy, work / "top5")
            print_top5(summary["top5"])
        if "corpus" in steps or "pack" in steps or "audit" in steps:
            say("[2/5] the embedded default corpus")
            summary["corpus"] = corpus(work / "corpus", progress)
        if "pack" in steps:
            say(f"[3/5] packing windows of {seq_len} slots")
            stats = pack(model, work / "corpus", work / "pack", seq_len, budget, progress)
            summary["pack"] = {k: stats[k] for k in ("windows", "tokens") if k in stats}
        if "audit" in steps:
            say("[4/5] precision audit (quick settings)")
            result = audit(model, work / "corpus", work / "audit", progress)
            summary["audit"] = {"runtime_s": result.get("runtime_s")}
        if "parity" in steps:
            say("[5/5] parity: the trainer against the oracle, layer by layer")
            result = parity(model, work / "parity", progress)
            summary["parity"] = {"cases": len(result["cases"]), "passed": sum(c["pass"] for c in result["cases"]),
                                 "pass": result["pass"]}
        summary["seconds"] = time.time() - t0
        summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        (work / "demo.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False, default=str))
        index_page(work, summary)
        publish(work, out, "demo")
    return summary
