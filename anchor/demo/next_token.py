"""The top-5 check: the oracle's next-token top-5 on a prompt next to transformers' own (GGUF loaded by
transformers itself, eager attention, fp32): the demo's `top5` job."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import jaxref
from anchor_core.errors import InputError
from anchor_core.paths import resolve_model_name
from anchor_core.tokenizer import load_tokenizer
from torchtrain import build_model


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max()
    e = np.exp(x)
    return e / e.sum()


def _transformers_model(name: str):
    """transformers' own model for `name`, fp32, eager: its own GGUF/folder loading where it has one."""
    import torch
    from transformers import AutoModelForCausalLM


    path = Path(resolve_model_name(name))
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()

    return build_model(name, engine="eager", dtype="float32").eval()


def top5(model: str, prompt: str, policy: str, out: Path) -> dict[str, Any]:
    """Next-token top-5 of the oracle (under `policy`) and of transformers (fp32 eager)."""
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

