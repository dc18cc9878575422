"""`anchor demo`: the whole pipeline on the embedded default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from anchor.cli import app


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when the demo completes).")] = Path("runs/demo"),
    model: Annotated[str, typer.Option("--model", help="HF folder, .gguf file, 'default' or random:<preset>.")] = "default",
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt for the next-token comparison.")] = "",
    policy: Annotated[str, typer.Option("--policy", help="Oracle dtype policy: preset name or YAML file.")] = "fp32",
    steps: Annotated[str, typer.Option("--steps", help="Comma-separated: top5,corpus,pack,audit,parity.")] = "top5,corpus,pack,audit,parity",
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Window size for the pack step.")] = 1024,
) -> None:
    """Run the pipeline on the embedded default (or --model) and write an index page under --out."""
    from anchor.demo import DEFAULT_PROMPT, run_demo

    summary = run_demo(model, out, prompt=prompt or DEFAULT_PROMPT, policy=policy,
                       steps=tuple(s.strip() for s in steps.split(",") if s.strip()), seq_len=seq_len)
    typer.echo(f"demo finished in {summary['seconds']:.0f} s: open {out / 'index.html'}")
    if "parity" in summary and not summary["parity"]["pass"]:
        typer.echo(f"parity: {summary['parity']['cases'] - summary['parity']['passed']} case(s) failed", err=True)
        raise typer.Exit(1)
