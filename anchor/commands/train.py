"""`anchor train`: continued pre-training on DeepSpeed with any attention variant (docs/DESIGN.md §8)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from anchor.cli import app


SUMMARY = "Train (or resume) a run: checkpoints and metrics under --out."


@app.command(context_settings={"allow_extra_args": False}, short_help=SUMMARY)
def train(
    out: Annotated[Path, typer.Option("--out", help="The run folder; running again with the same --out resumes it.")],
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="YAML run config, or a shipped one by name: tiny, smollm2_2k, paper/<name> "
                         "(configs/train/*.yaml); key=value arguments override it.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="section.key=value overrides (optim.lr=1e-5, model.rope.theta=5e6, data.pack.budget=20000).",
        show_default=False)] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Train (or resume) a run: checkpoints under RUN/checkpoints/step-N (with a Hugging Face hf/ folder),
    metrics.jsonl, config.yaml and the generated DeepSpeed JSON in RUN."""
    from anchor_core.extras import require

    require("train", "deepspeed", "matplotlib")  # the engine and the pack's figure, before --out is packed into
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train as run_training

    from anchor_core.outdir import guard_out

    cfg = load_train_config(config, overrides or [])
    guard_out(out, "train", inputs=[config, cfg.data.path, cfg.model.name], replace=False)  # --config counts as an input
    step = run_training(cfg, out, progress=progress)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this command
        typer.echo(f"trained to step {step}: {out / 'metrics.jsonl'}, {out / 'checkpoints'}")
