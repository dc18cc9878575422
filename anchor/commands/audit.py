"""`anchor audit`: the RoPE/BF16 precision audit of a model (paper §2, Figure 1; CONTRACT §5)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


@app.command()
def audit(
    out: Annotated[Path, typer.Option("--out", help="Output folder (replaced when complete).")],
    model: Annotated[str, typer.Option(
        "--model", help="HF folder, .gguf file, random:<preset> or default.")] = "default",
    policies: Annotated[str, typer.Option(
        "--policies", help="Comma-separated dtype policies: presets (fp64, fp32, hf_bf16, fa2_bf16, paper_bf16) "
                           "or YAML files.")] = "fp32,hf_bf16,fa2_bf16,paper_bf16",
    random_init: Annotated[bool, typer.Option(
        "--random-init", help="Also audit the architecture with PyTorch's default init (the paper's green line).")
    ] = False,
    data: Annotated[Optional[str], typer.Option(
        "--data", help="JSONL (or any `anchor pack` source) with a `text` field; default: the embedded corpus.")
    ] = None,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", help="Window length of the shift curve (default 256, quick 64; the paper: 4096).")] = None,
    num_seqs: Annotated[Optional[int], typer.Option(
        "--num-seqs", help="Windows averaged over (default 2, quick 1; the paper: 50).")] = None,
    max_len: Annotated[Optional[int], typer.Option(
        "--max-len", help="Longest length of the length curve (default 1024, quick 256; the paper: 8192).")
    ] = None,
    length_seqs: Annotated[Optional[int], typer.Option(
        "--length-seqs", help="Windows of --max-len the length curve averages over (default 1; the paper: 50).")
    ] = None,
    budget_policy: Annotated[Optional[str], typer.Option(
        "--budget-policy", help="Policy of the error budget (default: the first bf16 policy).")] = None,
    budget: Annotated[Optional[bool], typer.Option(
        "--budget/--no-budget", help="Run the stage-by-stage error budget (default yes, quick no).")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A short audit: 1 window of 64 tokens, six shifts, lengths up to 256, no error budget.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --random-init (and of random:<preset> weights).")] = 0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Measure how a position shift changes the attention maps under each dtype policy (RoPE should make
    it zero), which key token carries the change, how it grows with length, and which numerical stage
    causes it. Writes audit.json, report.md and PNG figures to --out."""
    from anchor.limits import check_seed
    from anchor.outdir import guard_out, out_lock

    check_seed(seed)
    policy_files = [p.strip() for p in policies.split(",") if p.strip().endswith((".yaml", ".yml"))]
    out = guard_out(out, "audit", inputs=(data, model, *policy_files))

    from jaxref.audit import run_audit, write_audit

    overrides = {"seq_len": seq_len, "num_seqs": num_seqs, "max_len": max_len, "length_seqs": length_seqs,
                 "budget_policy": budget_policy,
                 "random_init": random_init, "seed": seed}
    if budget is not None or budget_policy is not None:
        overrides["budget"] = budget if budget is not None else True
    with out_lock(out, "audit"):
        result = run_audit(model, policies, data=data, quick=quick, progress=progress, **overrides)
        path = write_audit(result, out)
    typer.echo(f"wrote {path / 'audit.json'}, {path / 'report.md'} ({result['runtime_s']:.0f} s)")
