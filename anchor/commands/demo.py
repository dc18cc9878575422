"""`anchor demo`: the whole pipeline on the embedded default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from anchor.cli import app


@app.command()
def demo(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when the demo completes; see README: "
                                                    "what --out may replace).")] = Path("runs/demo"),
    model: Annotated[str, typer.Option("--model", help="HF folder, .gguf file, 'default' or random:<preset>.")] = "default",
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt for the next-token comparison.")] = "",
    policy: Annotated[str, typer.Option("--policy", help="Oracle dtype policy: preset name or YAML file.")] = "fp32",
    steps: Annotated[str, typer.Option("--steps", help="Comma-separated: top5,corpus,pack,audit,parity.")] = "top5,corpus,pack,audit,parity",
    seq_len: Annotated[int, typer.Option("--seq-len", help="Window size for the pack step (at least 2).")] = 1024,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")] = True,
) -> None:
    """Run the pipeline on the embedded default (or --model) and write an index page under --out."""
    from anchor.demo import DEFAULT_PROMPT, check_steps, run_demo
    from anchor.data.pipeline import check_pack_size
    from anchor.limits import check_int
    from anchor.outdir import guard_out, out_lock

    step_list = check_steps(steps)
    check_int(seq_len, "--seq-len", lo=2, hi=1 << 31)
    check_pack_size(seq_len)
    out = guard_out(out, "demo", inputs=(model, policy if policy.endswith((".yaml", ".yml")) else None))
    with out_lock(out, "demo"):
        summary = run_demo(model, out, prompt=prompt or DEFAULT_PROMPT, policy=policy, steps=step_list,
                           seq_len=seq_len, progress=progress)
    typer.echo(f"demo finished in {summary['seconds']:.0f} s: open {out / 'index.html'}")
    if "parity" in summary and not summary["parity"]["pass"]:
        typer.echo(f"parity: {summary['parity']['cases'] - summary['parity']['passed']} case(s) failed", err=True)
        raise typer.Exit(1)
